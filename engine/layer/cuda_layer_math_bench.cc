// Times CudaLayerMath's calls at DeepSeek-V3's attention shapes (hidden 7168, q_lora_rank 1536,
// kv_lora_rank 512, heads 128 or a TP8 rank's 16) with random weights: per-call microseconds
// from CUDA events over many iterations, enqueued directly and replayed from a CUDA graph, and
// the bandwidth over the weight bytes each call reads.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/layer/cuda_layer_math.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/cpu/half.h"
#include "kernels/params.h"

ABSL_FLAG(std::string, heads, "16,128", "comma-separated head counts (this rank's heads)");
ABSL_FLAG(int, tokens, 64, "tokens per call (n)");
ABSL_FLAG(int, iters, 200, "timed iterations per call");
ABSL_FLAG(int, warmup, 20, "untimed iterations first");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp16");
ABSL_FLAG(int, device, 0, "CUDA device");
ABSL_FLAG(int, max_positions, 163840, "rotary table size (DeepSeek-V3's context)");

namespace latentd::engine::layer {
namespace {

using kernels::DType;

#define CHECK_CUDA(call)                                                                               \
  do {                                                                                                 \
    const cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

#define CHECK_OK(expr)                                                                                 \
  do {                                                                                                 \
    const absl::Status s_ = (expr);                                                                    \
    if (!s_.ok()) {                                                                                    \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str());                 \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

model::ModelConfig DeepSeekV3(DType dtype) {
  model::ModelConfig c;
  c.path = "deepseek-v3 (bench)";
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.num_hidden_layers = 61;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000;
  c.rope_interleave = true;
  model::YarnScaling y;
  y.factor = 40;
  y.original_max_position_embeddings = 4096;
  y.beta_fast = 32;
  y.beta_slow = 1;
  y.mscale = 1;
  y.mscale_all_dim = 1;
  c.yarn = y;
  c.dtype = dtype;
  return c;
}

// xorshift64*: fast enough for ~190M values; uniform in [mean - a, mean + a] with the
// standard deviation sigma.
class Fill {
 public:
  explicit Fill(uint64_t seed) : s_(seed | 1) {}
  model::HostTensor Tensor(const char* name, std::vector<int64_t> shape, double mean, double sigma, DType dt) {
    model::HostTensor t;
    t.name = name;
    t.shape = shape;
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    t.values.resize(count);
    const float a = static_cast<float>(sigma * std::sqrt(3.0)), m = static_cast<float>(mean);
    for (uint16_t& v : t.values) v = kernels::FloatToHalf(dt, m + a * (2 * Uniform() - 1));
    return t;
  }
  float Uniform() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return static_cast<float>((s_ * 2685821657736338717ull) >> 40) * 0x1p-24f;
  }

 private:
  uint64_t s_;
};

model::AttentionLayerWeights RandomWeights(const model::ModelConfig& c, int h, Fill& fill) {
  const DType dt = c.dtype;
  const int64_t H = c.hidden_size, rq = *c.q_lora_rank, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim,
                v = c.v_head_dim, r = c.kv_lora_rank;
  model::AttentionLayerWeights w;
  w.q_a_proj = fill.Tensor("q_a_proj.weight", {rq, H}, 0, 1 / std::sqrt(double(H)), dt);
  w.q_a_layernorm = fill.Tensor("q_a_layernorm.weight", {rq}, 1, 0.1, dt);
  w.q_b_proj = fill.Tensor("q_b_proj.weight", {h * (nope + rope), rq}, 0, 1 / std::sqrt(double(rq)), dt);
  w.kv_a_proj_with_mqa = fill.Tensor("kv_a_proj_with_mqa.weight", {r + rope, H}, 0, 1 / std::sqrt(double(H)), dt);
  w.kv_a_layernorm = fill.Tensor("kv_a_layernorm.weight", {r}, 1, 0.1, dt);
  w.kv_b_proj = fill.Tensor("kv_b_proj.weight", {h * (nope + v), r}, 0, 1 / std::sqrt(double(r)), dt);
  w.o_proj = fill.Tensor("o_proj.weight", {H, h * v}, 0, 1 / std::sqrt(double(h * v)), dt);
  return w;
}

template <typename T>
T* DeviceAlloc(size_t count) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, count * sizeof(T)));
  return static_cast<T*>(p);
}

// Model-dtype values uniform in [-1, 1].
uint16_t* DeviceRandom(size_t count, DType dt, Fill& fill) {
  std::vector<uint16_t> host(count);
  for (uint16_t& v : host) v = kernels::FloatToHalf(dt, 2 * fill.Uniform() - 1);
  uint16_t* d = DeviceAlloc<uint16_t>(count);
  CHECK_CUDA(cudaMemcpy(d, host.data(), count * sizeof(uint16_t), cudaMemcpyHostToDevice));
  return d;
}

void Run(int h, DType dt, int n, int iters, int warmup, int device, int max_positions) {
  const model::ModelConfig config = DeepSeekV3(dt);
  Fill fill(0x9e3779b97f4a7c15ull + h);
  const model::AttentionLayerWeights w = RandomWeights(config, h, fill);
  const LayerMathOptions options{.num_heads = h, .max_positions = max_positions, .rope = nullptr};

  // Enough copies of the layer that its weights cannot stay in L2 between calls, as in a model
  // whose 61 layers run in turn: every timed call reads its weights from device memory.
  int l2 = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  absl::StatusOr<std::shared_ptr<CublasHandle>> blas = CublasHandle::Create(device);
  CHECK_OK(blas.status());
  absl::StatusOr<std::shared_ptr<const CudaRopeTable>> rope =
      CudaRopeTable::Create(RopeConfig::FromModel(config), max_positions, device);
  CHECK_OK(rope.status());
  std::vector<std::unique_ptr<CudaLayerMath>> layers;
  do {
    absl::StatusOr<std::unique_ptr<CudaLayerMath>> m =
        CudaLayerMath::Create(config, w, options, n, device, {*blas, *rope});
    CHECK_OK(m.status());
    layers.push_back(*std::move(m));
  } while (layers.size() * layers[0]->weight_bytes() < 4 * static_cast<int64_t>(l2));
  const CudaLayerMath& m0 = *layers[0];

  // Weight bytes each call reads.
  const int64_t e = sizeof(uint16_t);
  const int64_t nope = config.qk_nope_head_dim, v = config.v_head_dim, r = config.kv_lora_rank;
  const int64_t q_bytes = w.q_a_proj.bytes() + w.q_a_layernorm.bytes() + w.q_b_proj.bytes() + h * nope * r * e;
  const int64_t rows_bytes = w.kv_a_proj_with_mqa.bytes() + w.kv_a_layernorm.bytes();
  const int64_t out_bytes = h * v * r * e + w.o_proj.bytes();

  const int H = config.hidden_size;
  uint16_t* x = DeviceRandom(static_cast<size_t>(n) * H, dt, fill);
  uint16_t* latent = DeviceRandom(static_cast<size_t>(n) * h * r, dt, fill);
  std::vector<int32_t> host_positions(n);
  for (int t = 0; t < n; ++t) host_positions[t] = static_cast<int32_t>(fill.Uniform() * (max_positions - 1));
  int32_t* positions = DeviceAlloc<int32_t>(n);
  CHECK_CUDA(cudaMemcpy(positions, host_positions.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
  uint16_t* q = DeviceAlloc<uint16_t>(static_cast<size_t>(n) * h * kernels::kHeadDimQK);
  uint16_t* rows = DeviceAlloc<uint16_t>(static_cast<size_t>(n) * kernels::kHeadDimQK);
  uint16_t* out = DeviceAlloc<uint16_t>(static_cast<size_t>(n) * H);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  enum Call { kQueries = 1, kRows = 2, kOutput = 4 };
  auto enqueue = [&](int calls, int i) -> absl::Status {
    CudaLayerMath& m = *layers[i % layers.size()];
    absl::Status s;
    if (s.ok() && (calls & kQueries)) s = m.Queries(x, positions, n, q, stream);
    if (s.ok() && (calls & kRows)) s = m.LatentRows(x, positions, n, rows, stream);
    if (s.ok() && (calls & kOutput)) s = m.Output(latent, n, out, stream);
    return s;
  };
  auto elapsed_us = [&](auto&& launch) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    launch();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return 1000.0 * ms / iters;
  };
  // Calls enqueued one after another: what a caller pays, host launch costs included.
  auto time_stream_us = [&](int calls) {
    for (int i = 0; i < warmup; ++i) CHECK_OK(enqueue(calls, i));
    return elapsed_us([&] {
      for (int i = 0; i < iters; ++i) CHECK_OK(enqueue(calls, i));
    });
  };
  // The same iterations captured once into a CUDA graph and replayed: the device's time
  // alone. Capture also fails if a call synchronizes. Negative when capture fails.
  auto time_graph_us = [&](int calls) -> double {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1;
    absl::Status captured;
    for (int i = 0; i < iters && captured.ok(); ++i) captured = enqueue(calls, i);
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    if (!captured.ok() || end != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
      std::fprintf(stderr, "graph capture failed: %s / %s\n", captured.ToString().c_str(), cudaGetErrorString(end));
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();
      return -1;
    }
    CHECK_CUDA(cudaGraphLaunch(exec, stream));  // warm-up
    const double us = elapsed_us([&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return us;
  };

  std::printf("h=%d n=%d %s: weights %.1fM params (%.1f MB), device bytes %.1f MB per layer (rope table %.1f MB of "
              "it, shared), %zu copies cycled (L2 %.0f MB)\n",
              h, n, kernels::DTypeName(dt), m0.weight_bytes() / 2 / 1e6, m0.weight_bytes() / 1e6,
              m0.device_bytes() / 1e6, (*rope)->device_bytes() / 1e6, layers.size(), l2 / 1e6);
  std::printf("  %-10s %12s %10s   %12s %10s   %s\n", "call", "stream us", "GB/s", "graph us", "GB/s",
              "weight bytes read");
  struct Row {
    const char* name;
    int calls;
    int64_t bytes;
  };
  for (const Row& row : {Row{"Queries", kQueries, q_bytes}, Row{"LatentRows", kRows, rows_bytes},
                         Row{"Output", kOutput, out_bytes},
                         Row{"all three", kQueries | kRows | kOutput, q_bytes + rows_bytes + out_bytes}}) {
    const double us = time_stream_us(row.calls), graph_us = time_graph_us(row.calls);
    std::printf("  %-10s %12.1f %10.1f   %12.1f %10.1f   %.1f MB\n", row.name, us, row.bytes / (us * 1e3), graph_us,
                graph_us > 0 ? row.bytes / (graph_us * 1e3) : 0.0, row.bytes / 1e6);
  }
  CHECK_CUDA(cudaGetLastError());

  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(latent), static_cast<void*>(positions),
                  static_cast<void*>(q), static_cast<void*>(rows), static_cast<void*>(out)}) {
    cudaFree(p);
  }
}

}  // namespace
}  // namespace latentd::engine::layer

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using latentd::kernels::DType;
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "bf16" && dtype != "fp16") {
    std::fprintf(stderr, "--dtype: expected bf16 or fp16, got %s\n", dtype.c_str());
    return 2;
  }
  const int device = absl::GetFlag(FLAGS_device);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  if (device < 0 || device >= count || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "--device: expected [0, %d), got %d\n", count, device);
    return 2;
  }
  CHECK_CUDA(cudaSetDevice(device));
  std::printf("device %d: %s (sm_%d%d, %d SMs)\n", device, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  const int n = absl::GetFlag(FLAGS_tokens), iters = absl::GetFlag(FLAGS_iters);
  if (n < 1 || iters < 1 || absl::GetFlag(FLAGS_warmup) < 0) {
    std::fprintf(stderr, "--tokens and --iters: expected >= 1, --warmup >= 0\n");
    return 2;
  }
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_heads), ',')) {
    int h = 0;
    if (!absl::SimpleAtoi(part, &h) || h < 1 || h > 128) {
      std::fprintf(stderr, "--heads: expected numbers in [1, 128], got %s\n", std::string(part).c_str());
      return 2;
    }
    latentd::engine::layer::Run(h, dtype == "bf16" ? DType::kBF16 : DType::kFP16, n, iters,
                                absl::GetFlag(FLAGS_warmup), device, absl::GetFlag(FLAGS_max_positions));
  }
  return 0;
}
