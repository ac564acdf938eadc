// Test helper: a fresh self-signed certificate (EC P-256, CN and SAN localhost and
// 127.0.0.1, valid for a day) made in-process with OpenSSL, so TLS tests need no
// openssl command-line tool.
#pragma once

#include <string>

namespace latentd::testing {

// PEM certificate and private key; false (with a message in *error) on failure.
bool MakeSelfSignedCertificate(std::string* cert_pem, std::string* key_pem, std::string* error);

}  // namespace latentd::testing
