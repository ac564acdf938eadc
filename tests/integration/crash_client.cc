// Test helper: a client that is killed mid-stream. It creates sequences with prefixes,
// prints their ids, floods a Decode stream with steps, prints READY once results flow,
// and then waits to be SIGKILLed with most of its steps still in flight.
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"

ABSL_FLAG(std::string, target, "", "daemon address");
ABSL_FLAG(int, sequences, 3, "sequences to create");
ABSL_FLAG(int, prefix_len, 1000, "prefix rows per sequence (layer 0)");
ABSL_FLAG(int, steps, 300, "steps to send before waiting");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  latentd::client::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_target);
  auto c = latentd::client::Client::Connect(o);
  if (!c.ok()) {
    std::printf("ERROR %s\n", c.status().ToString().c_str());
    return 1;
  }
  latentd::client::Client& client = **c;
  const auto dtype = latentd::client::DTypeOf(client.info());
  std::mt19937_64 rng(7);
  std::vector<std::string> ids;
  for (int i = 0; i < absl::GetFlag(FLAGS_sequences); ++i) {
    auto id = client.CreateSequence();
    if (!id.ok()) return 1;
    std::printf("SEQ %s\n", id->c_str());
    const std::string rows = latentd::client::RandomHalves(
        rng, size_t(absl::GetFlag(FLAGS_prefix_len)) * client.shape().kv_row_bytes / 2, dtype);
    if (!client.AppendKv(*id, 0, rows).ok()) return 1;
    ids.push_back(*id);
  }
  std::fflush(stdout);
  auto stream = client.OpenDecodeStream();
  latentd::v1::DecodeRequest req;
  const std::string q = latentd::client::RandomHalves(rng, size_t(client.shape().QBytes(1) / 2), dtype);
  const std::string kv = latentd::client::RandomHalves(rng, size_t(client.shape().KvBytes(1) / 2), dtype);
  for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    auto* s = req.add_steps();
    s->set_request_id(i);
    s->set_sequence_id(ids[i % ids.size()]);
    s->set_q(q);
    s->set_kv(kv);
    if (req.steps_size() == 10) {
      if (!stream->Write(req)) return 1;
      req.Clear();
    }
  }
  latentd::v1::DecodeResponse resp;
  if (!stream->Read(&resp)) return 1;
  std::printf("READY\n");
  std::fflush(stdout);
  for (;;) pause();
}
