// The in-process server the service fuzz targets talk to. It uses only the public
// surface of server/service.h (DecodeServiceImpl's constructor) and the wire protocol,
// so it does not depend on how the service is implemented inside.
#include "fuzz/service_harness.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "engine/layer/testing/random_layer.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "server/service.h"

namespace latentd::fuzz {

void Fail(const std::string& what) {
  std::fprintf(stderr, "service fuzzer: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string Rows(const std::string& seed, int rows, int64_t row_bytes) {
  std::string out(static_cast<size_t>(rows * row_bytes), '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    // A small ramp keeps values finite when the seed is empty or short.
    out[i] = seed.empty() ? static_cast<char>((i * 7) & 0x3f) : seed[i % seed.size()];
  }
  return out;
}

Harness& Harness::Get() {
  static Harness* harness = new Harness();  // lives for the whole process
  return *harness;
}

Harness::Harness() {
  engine::EngineOptions eo;
  eo.model.num_layers = kLayers;
  eo.model.num_heads_q = kHeadsQ;
  eo.model.num_heads_kv = kHeadsKv;
  eo.backend = engine::BackendKind::kCpu;
  eo.kv_pages = 256;
  // A host tier (128 pages' worth), so a full pool and the fuzzer's offloads below take
  // the offload and restore paths.
  eo.host_kv_bytes = int64_t{kLayers} * kHeadsKv * 1152 * 64 * 128;
  eo.max_queue = 256;
  eo.max_s_q = 4;
  eo.cpu_threads = 1;
  eo.batch_window = absl::Microseconds(20);
  // The layer API too (random weights of engine/layer's small test layer, hidden
  // kHidden), so fuzzed hidden states and positions reach the layer stage.
  {
    namespace lt = engine::layer::testing;
    auto config = std::make_shared<engine::model::ModelConfig>(lt::SmallConfig(kernels::DType::kBF16, std::nullopt));
    config->num_hidden_layers = kLayers;
    auto weights = std::make_shared<engine::model::AttentionWeights>();
    weights->dtype = kernels::DType::kBF16;
    weights->num_heads = kHeadsQ;
    std::mt19937_64 rng(7);
    for (int l = 0; l < kLayers; ++l) {
      weights->layers.push_back(lt::RandomWeights(*config, rng));
      weights->layers.back().layer = l;
    }
    eo.layer_config = std::move(config);
    eo.layer_weights = std::move(weights);
    eo.layer_max_positions = kMaxPositions;
  }
  auto engine = engine::Engine::Create(eo);
  if (!engine.ok()) Fail(absl::StrCat("Engine::Create: ", engine.status().ToString()));
  engine_ = *std::move(engine);

  server::ServiceOptions so;
  so.max_s_q = eo.max_s_q;
  so.max_message_bytes = 1 << 20;
  so.max_stream_inflight = 64;
  so.version = "fuzz";
  service_ = std::make_unique<server::DecodeServiceImpl>(engine_.get(), so);

  grpc::ServerBuilder builder;
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(1 << 20);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) Fail("grpc server did not start");
  channel_ = server_->InProcessChannel(grpc::ChannelArguments());
  stub_ = v1::DecodeService::NewStub(channel_);
  generic_ = std::make_unique<grpc::GenericStub>(channel_);

  // The base sequence: kBaseTokens rows on every layer, so forks share a full page and
  // copy a partial one.
  auto id = engine_->CreateSequence("base");
  if (!id.ok()) Fail(id.status().ToString());
  for (int l = 0; l < kLayers; ++l) {
    auto st = engine_->AppendKv("base", l, Rows("", kBaseTokens, kKvRowBytes));
    if (!st.ok()) Fail(st.status().ToString());
  }
}

std::vector<std::string> Harness::BeginInput(int n) {
  ++inputs_;
  live_.clear();
  for (int i = 0; i < n; ++i) {
    auto id = engine_->ForkSequence("base", absl::StrCat("in", inputs_, "-", i));
    if (!id.ok()) Fail(absl::StrCat("fork of the base sequence: ", id.status().ToString()));
    live_.push_back(*id);
  }
  return live_;
}

void Harness::EndInput() {
  for (const auto& id : live_) {
    auto st = engine_->ReleaseSequence(id);
    if (!st.ok()) Fail(absl::StrCat("release ", id, ": ", st.status().ToString()));
  }
  live_.clear();
  // Only the base sequence is left, so most of the pool must be free again; steps of a
  // call the server ended early may still hold a page or two for a moment, hence the
  // margin. A leak shows up as a pool that keeps shrinking.
  const engine::EngineInfo info = engine_->Info();
  if (info.free_pages < info.total_pages / 2) {
    Fail(absl::StrCat("pages leak: ", info.free_pages, " of ", info.total_pages, " free"));
  }
}

namespace {

// Tags for the completion queue.
enum Op : intptr_t { kStart = 1, kWrite, kWritesDone, kRead, kFinish };

void* Tag(Op op) { return reinterpret_cast<void*>(static_cast<intptr_t>(op)); }

}  // namespace

Harness::CallResult Harness::StreamingCall(const std::string& method,
                                           const std::vector<std::string>& messages) {
  CallResult result;
  grpc::ClientContext ctx;
  // A server that stops answering is a bug too; generous for sanitizer builds.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::CompletionQueue cq;
  auto call = generic_->PrepareCall(&ctx, method, &cq);
  call->StartCall(Tag(kStart));

  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || tag != Tag(kStart)) Fail("generic call did not start");

  size_t next = 0;
  bool writing = false, reading = false, writes_over = false, reads_over = false;
  grpc::ByteBuffer in_buf;
  auto write_next = [&] {
    if (next < messages.size()) {
      grpc::Slice slice(messages[next]);
      grpc::ByteBuffer buf(&slice, 1);
      ++next;
      call->Write(buf, Tag(kWrite));
    } else {
      call->WritesDone(Tag(kWritesDone));
    }
    writing = true;
  };
  if (!ok) {
    writes_over = reads_over = true;
  } else {
    write_next();
    call->Read(&in_buf, Tag(kRead));
    reading = true;
  }
  while (writing || reading) {
    if (!cq.Next(&tag, &ok)) Fail("completion queue shut down");
    switch (reinterpret_cast<intptr_t>(tag)) {
      case kWrite:
        writing = false;
        if (ok) {
          ++result.written;
          write_next();
        } else {
          writes_over = true;  // the server ended the call
        }
        break;
      case kWritesDone:
        writing = false;
        writes_over = true;
        break;
      case kRead:
        reading = false;
        if (ok) {
          std::vector<grpc::Slice> slices;
          (void)in_buf.Dump(&slices);
          std::string bytes;
          for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
          result.responses.push_back(std::move(bytes));
          call->Read(&in_buf, Tag(kRead));
          reading = true;
        } else {
          reads_over = true;
        }
        break;
      default:
        Fail("unexpected completion tag");
    }
  }
  (void)writes_over;
  (void)reads_over;
  call->Finish(&result.status, Tag(kFinish));
  if (!cq.Next(&tag, &ok) || tag != Tag(kFinish)) Fail("generic call did not finish");
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return result;
}

void Harness::CheckHealthy(const std::string& sequence_id) {
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetInfoRequest req;
    v1::ServerInfo info;
    const grpc::Status st = stub_->GetInfo(&ctx, req, &info);
    if (!st.ok()) Fail(absl::StrCat("GetInfo after the input: ", st.error_message()));
    if (info.num_layers() != kLayers || info.num_heads_q() != kHeadsQ) {
      Fail("GetInfo after the input: wrong model shape");
    }
  }
  v1::DecodeRequest req;
  v1::DecodeStep* step = req.add_steps();
  step->set_request_id(77);
  step->set_sequence_id(sequence_id);
  step->set_layer(kLayers - 1);
  step->set_q(Rows("", 1, kQRowBytes));
  step->set_kv(Rows("", 1, kKvRowBytes));
  CallResult r = StreamingCall("/latentd.v1.DecodeService/Decode", {req.SerializeAsString()});
  if (!r.status.ok()) {
    Fail(absl::StrCat("known-good Decode: status ", r.status.error_code(), " ",
                      r.status.error_message()));
  }
  int results = 0;
  for (const auto& bytes : r.responses) {
    v1::DecodeResponse resp;
    if (!resp.ParseFromString(bytes)) Fail("known-good Decode: unparsable response");
    for (const auto& res : resp.results()) {
      ++results;
      if (res.request_id() != 77 || res.code() != 0) {
        Fail(absl::StrCat("known-good Decode: request ", res.request_id(), " code ", res.code(),
                          " ", res.message()));
      }
      if (static_cast<int64_t>(res.out().size()) != kOutRowBytes ||
          res.lse().size() != kHeadsQ * sizeof(float)) {
        Fail(absl::StrCat("known-good Decode: out ", res.out().size(), " lse ", res.lse().size()));
      }
    }
  }
  if (results != 1) Fail(absl::StrCat("known-good Decode: ", results, " results"));
}

}  // namespace latentd::fuzz
