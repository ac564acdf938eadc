// Shared by the AppendKv and Decode fuzz targets: one in-process gRPC server running
// DecodeServiceImpl over a small CPU engine (started once), generic streaming calls
// that carry raw message bytes, and the health check every input ends with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "fuzz/input.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/latentd.grpc.pb.h"

namespace latentd::fuzz {

// The model the fuzzed server runs: small enough that every step is quick.
inline constexpr int kLayers = 2;
inline constexpr int kHeadsQ = 4;
inline constexpr int kHeadsKv = 1;
inline constexpr int kRowValues = 576;  // per head: 512 latent + 64 rope
inline constexpr int kOutValues = 512;
inline constexpr int64_t kQRowBytes = int64_t{kHeadsQ} * kRowValues * 2;
inline constexpr int64_t kKvRowBytes = int64_t{kHeadsKv} * kRowValues * 2;
inline constexpr int64_t kOutRowBytes = int64_t{kHeadsQ} * kOutValues * 2;
// The layer API: hidden states of this size per token (engine/layer's small test layer).
inline constexpr int kHidden = 256;
inline constexpr int64_t kHiddenRowBytes = int64_t{kHidden} * 2;
inline constexpr int kMaxPositions = 4096;
// Tokens in the base sequence every input forks its sequences from.
inline constexpr int kBaseTokens = 100;

class Harness {
 public:
  // The process-wide instance; the first call starts the engine and the server.
  static Harness& Get();

  engine::Engine* engine() { return engine_.get(); }
  v1::DecodeService::Stub* stub() { return stub_.get(); }
  grpc::GenericStub* generic() { return generic_.get(); }

  // Sequences for one input: forks of the base sequence, released by EndInput.
  std::vector<std::string> BeginInput(int n);
  void EndInput();

  // One streaming call to `method` ("/latentd.v1.DecodeService/Decode"): writes every
  // message (raw serialized bytes), half-closes, reads every response. The server may
  // end the call early; writes after that fail and are skipped.
  struct CallResult {
    grpc::Status status;
    std::vector<std::string> responses;  // raw serialized response messages
    int written = 0;
  };
  CallResult StreamingCall(const std::string& method, const std::vector<std::string>& messages);

  // Aborts unless the server still answers: GetInfo, then one well-formed decode step
  // on `sequence_id` (which must exist) returning OK with results of the right size.
  void CheckHealthy(const std::string& sequence_id);

 private:
  Harness();

  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<v1::DecodeService::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;
  uint64_t inputs_ = 0;
  std::vector<std::string> live_;
};

// Bytes for `rows` rows of `row_bytes` each, cycled from `seed` (any bytes are valid
// bf16 values, NaNs included, which the server must survive).
std::string Rows(const std::string& seed, int rows, int64_t row_bytes);

// Aborts with a message: a broken invariant is a crash for libFuzzer.
[[noreturn]] void Fail(const std::string& what);

}  // namespace latentd::fuzz
