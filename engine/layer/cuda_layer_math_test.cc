// CudaLayerMath against CpuLayerMath on the same random layers and inputs: Queries, LatentRows,
// Output and OutputFloat for 1, 3 and 64 tokens at varied positions, both dtypes, with and
// without q_lora_rank and YaRN, both RoPE layouts; and the argument errors. Needs a GPU; skips
// when no CUDA device is visible.
#include "engine/layer/cuda_layer_math.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/layer/layer_math.h"
#include "engine/layer/testing/random_layer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/half.h"
#include "kernels/params.h"

namespace latentd::engine::layer {
namespace {

using kernels::DType;
using testing::kHeads;
using testing::kHidden;
using testing::kNope;
using testing::kRank;
using testing::kRope;
using testing::kV;
using testing::RandomWeights;
using testing::SmallConfig;

constexpr int kRow = kernels::kHeadDimQK;  // 576
constexpr int kMaxPositions = 8192;
constexpr int kMaxTokens = 64;
constexpr int kQRank = 96;

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device visible"

// A device array that frees itself.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
    data_ = static_cast<T*>(p);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Upload(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count_);
    ASSERT_EQ(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }
  void Sync() const { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
};

// One unit in the last place of the dtype at 1.0: errors below are measured in units of
// unit(dtype) x the tensor's RMS, i.e. about one ulp of a value of RMS size (up to 2x).
double Unit(DType dt) { return dt == DType::kBF16 ? 0x1p-7 : 0x1p-10; }

struct Diff {
  double max_units = 0;   // max |gpu - cpu| / (rms(cpu) x unit)
  double rms_units = 0;   // rms(gpu - cpu) / (rms(cpu) x unit)
  double differ = 0;      // share of values that are not equal
  size_t non_finite = 0;  // gpu values that are NaN or infinite where cpu's are finite
};

Diff Compare(const std::vector<double>& cpu, const std::vector<double>& gpu, DType dt) {
  double ref_sq = 0, err_sq = 0, err_max = 0;
  size_t differ = 0;
  Diff d;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) {
      ++d.non_finite;
      continue;
    }
    const double e = gpu[i] - cpu[i];
    ref_sq += cpu[i] * cpu[i];
    err_sq += e * e;
    err_max = std::max(err_max, std::fabs(e));
    if (e != 0) ++differ;
  }
  const double rms = std::sqrt(ref_sq / cpu.size());
  d.max_units = err_max / (rms * Unit(dt));
  d.rms_units = std::sqrt(err_sq / cpu.size()) / (rms * Unit(dt));
  d.differ = static_cast<double>(differ) / cpu.size();
  return d;
}

// Limits, in the units above. A GEMM that sums in another order moves a rounding by one ulp
// here and there, and that ulp moves later roundings: most values stay bit-equal, the rest are
// one or two ulps off. The same layers computed twice on the CPU with every reduction
// dimension permuted (the same math in another summation order) gave at most 2.8 units max,
// 0.09 rms, and up to 7% of the values different (fp16; bf16, 8x coarser, far fewer). A
// rounding point missing or added (an fp32 intermediate where CpuLayerMath rounds) would
// move nearly every value by a fraction of an ulp: ~0.5 units rms and a third or more of the
// values different.
constexpr double kMaxUnits = 8;
constexpr double kRmsUnits = 0.25;
constexpr double kMaxDiffer = 0.3;

// check_differ: whether most values must be bit-equal, true of model-dtype tensors (float
// sums in another order differ in nearly every bit pattern).
void ExpectClose(const char* what, const std::vector<double>& cpu, const std::vector<double>& gpu, DType dt,
                 const std::string& label, bool check_differ = true) {
  ASSERT_EQ(cpu.size(), gpu.size());
  const Diff d = Compare(cpu, gpu, dt);
  std::printf("%s %-10s max %.3f, rms %.4f units of the rms ulp; %.2f%% of %zu values differ\n", label.c_str(), what,
              d.max_units, d.rms_units, 100 * d.differ, cpu.size());
  EXPECT_EQ(d.non_finite, 0u) << label << " " << what;
  EXPECT_LE(d.max_units, kMaxUnits) << label << " " << what;
  EXPECT_LE(d.rms_units, kRmsUnits) << label << " " << what;
  if (check_differ) {
    EXPECT_LE(d.differ, kMaxDiffer) << label << " " << what;
  }
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(field), absl::string_view::npos) << "expected '" << field << "' in: " << s;
}

std::vector<double> Values(const std::vector<uint16_t>& bits, DType dt) {
  std::vector<double> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = kernels::HalfToFloat(dt, bits[i]);
  return v;
}

// Values [begin, end) of each `width`-value row.
std::vector<double> Columns(const std::vector<double>& v, int width, int begin, int end) {
  std::vector<double> out;
  for (size_t row = 0; row < v.size() / width; ++row) {
    out.insert(out.end(), v.begin() + row * width + begin, v.begin() + row * width + end);
  }
  return out;
}

std::vector<uint16_t> RandomBits(size_t count, DType dt, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0, 1);
  std::vector<uint16_t> v(count);
  for (uint16_t& b : v) {
    double x = normal(rng);
    while (std::fabs(x) < 1e-3) x = normal(rng);  // never zero
    b = kernels::FloatToHalf(dt, static_cast<float>(x));
  }
  return v;
}

// Positions spread over the table: its ends, YaRN's original context boundary, random others.
std::vector<int64_t> Positions(int n, std::mt19937_64& rng) {
  const int64_t special[] = {kMaxPositions - 1, 0, 4095, 4096, 1, 5000};
  std::uniform_int_distribution<int64_t> any(0, kMaxPositions - 1);
  std::vector<int64_t> p(n);
  for (int t = 0; t < n; ++t) p[t] = t < 6 ? special[t] : any(rng);
  return p;
}

std::vector<int32_t> AsInt32(const std::vector<int64_t>& p) { return std::vector<int32_t>(p.begin(), p.end()); }

struct Layer {
  model::ModelConfig config;
  model::AttentionLayerWeights weights;
  std::unique_ptr<CpuLayerMath> cpu;
  std::unique_ptr<CudaLayerMath> gpu;
};

Layer MakeLayer(DType dt, bool q_lora, bool yarn, bool interleave, std::mt19937_64& rng,
                CudaLayerMath::Shared shared = {}) {
  Layer l;
  l.config = SmallConfig(dt, q_lora ? std::optional<int>(kQRank) : std::nullopt, interleave, yarn);
  l.weights = RandomWeights(l.config, rng);
  const LayerMathOptions options{.num_heads = kHeads, .max_positions = kMaxPositions};
  absl::StatusOr<std::unique_ptr<CpuLayerMath>> cpu = CpuLayerMath::Create(l.config, l.weights, options);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (cpu.ok()) l.cpu = *std::move(cpu);
  absl::StatusOr<std::unique_ptr<CudaLayerMath>> gpu =
      CudaLayerMath::Create(l.config, l.weights, options, kMaxTokens, 0, std::move(shared));
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (gpu.ok()) l.gpu = *std::move(gpu);
  return l;
}

// Runs every call on both implementations for n tokens and compares.
void CompareCalls(Layer& l, int n, std::mt19937_64& rng, cudaStream_t stream, const std::string& label) {
  const DType dt = l.config.dtype;
  const std::vector<uint16_t> x = RandomBits(static_cast<size_t>(n) * kHidden, dt, rng);
  const std::vector<int64_t> positions = Positions(n, rng);
  const std::vector<uint16_t> latent = RandomBits(static_cast<size_t>(n) * kHeads * kRank, dt, rng);

  std::vector<uint16_t> q(static_cast<size_t>(n) * kHeads * kRow), rows(static_cast<size_t>(n) * kRow),
      out(static_cast<size_t>(n) * kHidden);
  std::vector<float> out_f(out.size());
  ASSERT_TRUE(l.cpu->Queries(x, positions, absl::MakeSpan(q)).ok());
  ASSERT_TRUE(l.cpu->LatentRows(x, positions, absl::MakeSpan(rows)).ok());
  ASSERT_TRUE(l.cpu->Output(n, latent, absl::MakeSpan(out)).ok());
  ASSERT_TRUE(l.cpu->OutputFloat(n, latent, absl::MakeSpan(out_f)).ok());

  DeviceArray<uint16_t> d_x(x), d_latent(latent), d_q(q.size()), d_rows(rows.size()), d_out(out.size());
  DeviceArray<int32_t> d_positions(AsInt32(positions));
  DeviceArray<float> d_out_f(out_f.size());
  ASSERT_TRUE(l.gpu->Queries(d_x.get(), d_positions.get(), n, d_q.get(), stream).ok());
  ASSERT_TRUE(l.gpu->LatentRows(d_x.get(), d_positions.get(), n, d_rows.get(), stream).ok());
  ASSERT_TRUE(l.gpu->Output(d_latent.get(), n, d_out.get(), stream).ok());
  ASSERT_TRUE(l.gpu->OutputFloat(d_latent.get(), n, d_out_f.get(), stream).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

  const std::vector<double> q_cpu = Values(q, dt), q_gpu = Values(d_q.Download(), dt);
  const std::vector<double> rows_cpu = Values(rows, dt), rows_gpu = Values(d_rows.Download(), dt);
  const std::string at = label + " n=" + std::to_string(n);
  ExpectClose("q_lat", Columns(q_cpu, kRow, 0, kRank), Columns(q_gpu, kRow, 0, kRank), dt, at);
  ExpectClose("q_pe", Columns(q_cpu, kRow, kRank, kRow), Columns(q_gpu, kRow, kRank, kRow), dt, at);
  ExpectClose("rows c", Columns(rows_cpu, kRow, 0, kRank), Columns(rows_gpu, kRow, 0, kRank), dt, at);
  ExpectClose("rows k_pe", Columns(rows_cpu, kRow, kRank, kRow), Columns(rows_gpu, kRow, kRank, kRow), dt, at);
  ExpectClose("out", Values(out, dt), Values(d_out.Download(), dt), dt, at);
  const std::vector<float> out_f_gpu = d_out_f.Download();
  ExpectClose("out float", std::vector<double>(out_f.begin(), out_f.end()),
              std::vector<double>(out_f_gpu.begin(), out_f_gpu.end()), dt, at, /*check_differ=*/false);
}

class CudaVsCpuTest : public ::testing::TestWithParam<std::tuple<DType, bool, bool, bool>> {};

TEST_P(CudaVsCpuTest, MatchesCpuLayerMath) {
  SKIP_WITHOUT_DEVICE();
  const auto [dt, q_lora, yarn, interleave] = GetParam();
  std::mt19937_64 rng(31 + (dt == DType::kFP16 ? 1 : 0) + (q_lora ? 2 : 0) + (yarn ? 4 : 0) + (interleave ? 8 : 0));
  Layer l = MakeLayer(dt, q_lora, yarn, interleave, rng);
  ASSERT_NE(l.cpu, nullptr);
  ASSERT_NE(l.gpu, nullptr);
  const std::string label = std::string(kernels::DTypeName(dt)) + " q_lora=" + std::to_string(q_lora) +
                            " yarn=" + std::to_string(yarn) + " interleave=" + std::to_string(interleave);
  Stream stream;
  for (int n : {1, 3, 64}) CompareCalls(l, n, rng, stream.get(), label);
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaVsCpuTest,
                         ::testing::Combine(::testing::Values(DType::kBF16, DType::kFP16), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool()));

// Two layers sharing one CublasHandle and one rope table, used from two streams one after the
// other (the handle is re-pointed, its workspace set again), still match the CPU; the bytes
// held are the ones Create laid out.
TEST(CudaLayerMathTest, SharedHandleRopeAndBytes) {
  SKIP_WITHOUT_DEVICE();
  absl::StatusOr<std::shared_ptr<CublasHandle>> blas = CublasHandle::Create(0);
  ASSERT_TRUE(blas.ok()) << blas.status();
  EXPECT_EQ((*blas)->workspace_bytes(), CublasHandle::kDefaultWorkspaceBytes);
  const model::ModelConfig config = SmallConfig(DType::kBF16, kQRank);
  absl::StatusOr<std::shared_ptr<const CudaRopeTable>> rope =
      CudaRopeTable::Create(RopeConfig::FromModel(config), kMaxPositions, 0);
  ASSERT_TRUE(rope.ok()) << rope.status();
  const int64_t table = 2 * int64_t{kMaxPositions} * (kRope / 2) * sizeof(float);
  EXPECT_EQ((*rope)->device_bytes(), table);
  std::mt19937_64 rng(8);
  const CudaLayerMath::Shared shared{*blas, *rope};
  Layer a = MakeLayer(DType::kBF16, true, true, true, rng, shared);
  Layer b = MakeLayer(DType::kBF16, false, true, true, rng, shared);
  ASSERT_NE(a.gpu, nullptr);
  ASSERT_NE(b.gpu, nullptr);
  EXPECT_EQ(a.gpu->blas(), b.gpu->blas());
  EXPECT_EQ(a.gpu->rope(), b.gpu->rope());
  Stream s1, s2;
  CompareCalls(a, 3, rng, s1.get(), "shared, layer a, stream 1");
  CompareCalls(b, 3, rng, s2.get(), "shared, layer b, stream 2");
  CompareCalls(a, 64, rng, s2.get(), "shared, layer a, stream 2");

  // Weights as the checkpoint holds them (16-bit), scratch, and the table (counted in full).
  int64_t weights = 0;
  for (const model::HostTensor* t : {&a.weights.q_a_proj, &a.weights.q_a_layernorm, &a.weights.q_b_proj,
                                     &a.weights.kv_a_proj_with_mqa, &a.weights.kv_a_layernorm, &a.weights.kv_b_proj,
                                     &a.weights.o_proj}) {
    weights += t->bytes();
  }
  EXPECT_EQ(a.gpu->weight_bytes(), weights);
  const int64_t scratch = int64_t{kMaxTokens} * (kQRank + kHeads * (kNope + kRope) + kHeads * kV) * 2;
  EXPECT_GE(a.gpu->device_bytes(), weights + table + scratch);
  EXPECT_LE(a.gpu->device_bytes(), weights + table + scratch + 16 * 256);  // alignment padding only
  std::printf("device bytes: %lld (weights %lld, rope table %lld)\n", static_cast<long long>(a.gpu->device_bytes()),
              static_cast<long long>(a.gpu->weight_bytes()), static_cast<long long>(table));

  // A shared table must be this config's.
  const LayerMathOptions options{.num_heads = kHeads, .max_positions = kMaxPositions};
  model::ModelConfig other = config;
  other.yarn.reset();
  ExpectInvalid(CudaLayerMath::Create(other, a.weights, options, kMaxTokens, 0, shared).status(), "rope");
  other = config;
  other.rope_interleave = false;
  ExpectInvalid(CudaLayerMath::Create(other, a.weights, options, kMaxTokens, 0, shared).status(), "rope");
  ExpectInvalid(CudaLayerMath::Create(config, a.weights, {.num_heads = kHeads, .max_positions = 64}, kMaxTokens, 0,
                                      shared)
                    .status(),
                "rope");
}

// Positions live on the device, so the host cannot check them: one outside the table makes
// its token's rope values NaN (every head's in q) and leaves everything else as it would be.
TEST(CudaLayerMathTest, PositionOutsideTheTableGivesNan) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(11);
  Layer l = MakeLayer(DType::kFP16, true, true, false, rng);
  ASSERT_NE(l.gpu, nullptr);
  const DType dt = l.config.dtype;
  const int n = 3;
  const std::vector<uint16_t> x = RandomBits(n * kHidden, dt, rng);
  const std::vector<int32_t> bad = {kMaxPositions, -1, 77};
  const std::vector<int64_t> good = {0, 0, 77};  // q_lat and c do not depend on the position
  std::vector<uint16_t> q(n * kHeads * kRow), rows(n * kRow);
  ASSERT_TRUE(l.cpu->Queries(x, good, absl::MakeSpan(q)).ok());
  ASSERT_TRUE(l.cpu->LatentRows(x, good, absl::MakeSpan(rows)).ok());
  DeviceArray<uint16_t> d_x(x), d_q(q.size()), d_rows(rows.size());
  DeviceArray<int32_t> d_positions(bad);
  Stream stream;
  ASSERT_TRUE(l.gpu->Queries(d_x.get(), d_positions.get(), n, d_q.get(), stream.get()).ok());
  ASSERT_TRUE(l.gpu->LatentRows(d_x.get(), d_positions.get(), n, d_rows.get(), stream.get()).ok());
  stream.Sync();
  const std::vector<double> q_gpu = Values(d_q.Download(), dt), rows_gpu = Values(d_rows.Download(), dt);
  for (int t = 0; t < 2; ++t) {
    for (int i = kRank; i < kRow; ++i) EXPECT_TRUE(std::isnan(rows_gpu[t * kRow + i])) << t << " " << i;
    for (int j = 0; j < kHeads; ++j) {
      for (int i = kRank; i < kRow; ++i) EXPECT_TRUE(std::isnan(q_gpu[(t * kHeads + j) * kRow + i])) << t;
    }
  }
  const std::vector<double> q_cpu = Values(q, dt), rows_cpu = Values(rows, dt);
  ExpectClose("q_lat", Columns(q_cpu, kRow, 0, kRank), Columns(q_gpu, kRow, 0, kRank), dt, "bad positions");
  ExpectClose("rows c", Columns(rows_cpu, kRow, 0, kRank), Columns(rows_gpu, kRow, 0, kRank), dt, "bad positions");
  // The valid token is untouched by the others.
  ExpectClose("q token 2", std::vector<double>(q_cpu.begin() + 2 * kHeads * kRow, q_cpu.end()),
              std::vector<double>(q_gpu.begin() + 2 * kHeads * kRow, q_gpu.end()), dt, "bad positions");
  ExpectClose("rows tok 2", std::vector<double>(rows_cpu.begin() + 2 * kRow, rows_cpu.end()),
              std::vector<double>(rows_gpu.begin() + 2 * kRow, rows_gpu.end()), dt, "bad positions");
}

TEST(CudaLayerMathTest, ArgumentErrors) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(9);
  const model::ModelConfig good = SmallConfig(DType::kBF16, kQRank);
  const model::AttentionLayerWeights w = RandomWeights(good, rng);
  const LayerMathOptions options{.num_heads = kHeads, .max_positions = 64};
  absl::StatusOr<std::unique_ptr<CudaLayerMath>> made = CudaLayerMath::Create(good, w, options, kMaxTokens, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<CudaLayerMath> m = *std::move(made);
  EXPECT_EQ(m->max_tokens(), kMaxTokens);
  EXPECT_EQ(m->max_positions(), 64);

  // Create: CpuLayerMath's checks, then its own.
  model::ModelConfig c = good;
  c.kv_lora_rank = 256;
  ExpectInvalid(CudaLayerMath::Create(c, w, options, kMaxTokens, 0).status(), "kv_lora_rank");
  ExpectInvalid(CudaLayerMath::Create(good, w, {.num_heads = 0, .max_positions = 64}, kMaxTokens, 0).status(),
                "num_heads");
  ExpectInvalid(CudaLayerMath::Create(good, w, {.num_heads = kHeads, .max_positions = 0}, kMaxTokens, 0).status(),
                "max_positions");
  model::AttentionLayerWeights bad = w;
  bad.kv_b_proj.shape = {kHeads * (kNope + kV) - 1, kRank};
  ExpectInvalid(CudaLayerMath::Create(good, bad, options, kMaxTokens, 0).status(), "kv_b_proj");
  ExpectInvalid(CudaLayerMath::Create(good, w, options, 0, 0).status(), "max_tokens");
  ExpectInvalid(CudaLayerMath::Create(good, w, options, CudaLayerMath::kMaxTokens + 1, 0).status(), "max_tokens");
  ExpectInvalid(CudaLayerMath::Create(good, w, options, kMaxTokens, -1).status(), "device");
  ExpectInvalid(CudaLayerMath::Create(good, w, options, kMaxTokens, 1 << 20).status(), "device");
  ExpectInvalid(CublasHandle::Create(1 << 20).status(), "device");
  ExpectInvalid(CublasHandle::Create(0, -1).status(), "workspace_bytes");
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count > 1) {
    absl::StatusOr<std::shared_ptr<CublasHandle>> other = CublasHandle::Create(1);
    ASSERT_TRUE(other.ok()) << other.status();
    ExpectInvalid(CudaLayerMath::Create(good, w, options, kMaxTokens, 0, CudaLayerMath::Shared{*other, nullptr}).status(), "blas");
  }

  // Calls: n outside [1, max_tokens] and null pointers, before anything is enqueued.
  DeviceArray<uint16_t> x((kMaxTokens + 1) * kHidden), q((kMaxTokens + 1) * kHeads * kRow),
      rows((kMaxTokens + 1) * kRow), latent((kMaxTokens + 1) * kHeads * kRank), out((kMaxTokens + 1) * kHidden);
  DeviceArray<int32_t> positions(kMaxTokens + 1);
  DeviceArray<float> out_f((kMaxTokens + 1) * kHidden);
  Stream s;
  for (int n : {0, -1, kMaxTokens + 1}) {
    ExpectInvalid(m->Queries(x.get(), positions.get(), n, q.get(), s.get()), "n:");
    ExpectInvalid(m->LatentRows(x.get(), positions.get(), n, rows.get(), s.get()), "n:");
    ExpectInvalid(m->Output(latent.get(), n, out.get(), s.get()), "n:");
    ExpectInvalid(m->OutputFloat(latent.get(), n, out_f.get(), s.get()), "n:");
  }
  ExpectInvalid(m->Queries(nullptr, positions.get(), 1, q.get(), s.get()), "x");
  ExpectInvalid(m->Queries(x.get(), nullptr, 1, q.get(), s.get()), "positions");
  ExpectInvalid(m->Queries(x.get(), positions.get(), 1, nullptr, s.get()), "q");
  ExpectInvalid(m->LatentRows(x.get(), positions.get(), 1, nullptr, s.get()), "rows");
  ExpectInvalid(m->Output(nullptr, 1, out.get(), s.get()), "latent_out");
  ExpectInvalid(m->Output(latent.get(), 1, nullptr, s.get()), "out");
  // max_tokens itself is fine.
  EXPECT_TRUE(m->Output(latent.get(), kMaxTokens, out.get(), s.get()).ok());
  s.Sync();
}

}  // namespace
}  // namespace latentd::engine::layer
