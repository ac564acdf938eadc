// Test helper: see tls_cert.h.
#include "tests/integration/tls_cert.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>
#include <random>

namespace latentd::testing {
namespace {

std::string BioString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

bool AddExtension(X509* cert, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, cert, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext == nullptr) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

}  // namespace

bool MakeSelfSignedCertificate(std::string* cert_pem, std::string* key_pem, std::string* error) {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  if (key == nullptr || cert == nullptr) {
    *error = "key or certificate allocation failed";
    return false;
  }
  X509* x = cert.get();
  bool ok = X509_set_version(x, 2) == 1;
  ok = ok && ASN1_INTEGER_set(X509_get_serialNumber(x), static_cast<long>(std::random_device{}() & 0x7fffffff)) == 1;
  ok = ok && X509_gmtime_adj(X509_getm_notBefore(x), -60) != nullptr;
  ok = ok && X509_gmtime_adj(X509_getm_notAfter(x), 24 * 3600) != nullptr;
  ok = ok && X509_set_pubkey(x, key.get()) == 1;
  X509_NAME* name = X509_get_subject_name(x);
  ok = ok && X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("localhost"),
                                        -1, -1, 0) == 1;
  ok = ok && X509_set_issuer_name(x, name) == 1;
  // Its own trust anchor: a CA certificate naming the loopback host both ways.
  ok = ok && AddExtension(x, NID_basic_constraints, "critical,CA:TRUE");
  ok = ok && AddExtension(x, NID_subject_alt_name, "DNS:localhost,IP:127.0.0.1");
  ok = ok && X509_sign(x, key.get(), EVP_sha256()) > 0;
  if (!ok) {
    char buf[256];
    ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
    *error = buf;
    return false;
  }
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(BIO_new(BIO_s_mem()), BIO_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new(BIO_s_mem()), BIO_free);
  if (PEM_write_bio_X509(cert_bio.get(), x) != 1 ||
      PEM_write_bio_PrivateKey(key_bio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    *error = "PEM encoding failed";
    return false;
  }
  *cert_pem = BioString(cert_bio.get());
  *key_pem = BioString(key_bio.get());
  return true;
}

}  // namespace latentd::testing
