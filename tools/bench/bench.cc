// MLA decode benchmark: measures a read-bandwidth ceiling, then per config the whole
// decode (host planner + kernel + combine) and the decode kernel alone, median of many
// runs with CUDA events, inputs rotated over a pool larger than L2 and filled with
// random numbers. Prints a markdown table.
//   bench [--runs N] [--only b,h_q,s_k] [--tile 16|32|64] [--kv_dtype model|fp8_e4m3] [--fp8_regs 0|1]
//         [--p_rounding split|once] [--splits N] [--shape b,h_q,s_k[,s_q]] [--copies N]
//         [--page_order sequential|shuffled] [--repeat N]
// --shape times that one bf16 shape (causal when s_q > 1) instead of the table's rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tools/bench/bench_kernels.h"
#include "kernels/kv_fp8.h"
#include "kernels/mla_decode_cuda.h"

namespace latentd::bench {
namespace {

using kernels::DecodePlan;
using kernels::DeviceInfo;
using kernels::DType;
using kernels::MlaDecodeParams;

#define CHECK_CUDA(x)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = static_cast<cudaError_t>(x);                                                  \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

#define CHECK_OK(x)                                                                   \
  do {                                                                                \
    kernels::Status s_ = (x);                                                         \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_.message.c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Config {
  int b, h_q, s_k;
  DType dtype;
  int s_q = 1;
  bool causal = false;
  kernels::KvDType kv = kernels::KvDType::kModel;
};

bool IsFp8(const Config& c) { return c.kv == kernels::KvDType::kFp8E4M3; }
// Bytes of one token's KV row (h_kv 1) in the cache.
int RowBytes(const Config& c) { return IsFp8(c) ? kernels::kFp8RowBytes : kernels::kHeadDimQK * 2; }

int g_tile = 0;  // --tile: force the planner's tile (0: its choice)
int g_splits = 0;  // --splits: force about this many partitions per sequence (0: the planner's)

// --splits: the planner's plan cut into about g_splits partitions of whole 32-key tiles,
// to measure split counts the planner does not choose.
void ForceSplits(DecodePlan* plan, int s_k) {
  if (g_splits <= 0) return;
  const int want = std::max(1, (s_k + g_splits - 1) / g_splits);
  plan->keys_per_split = (want + 31) / 32 * 32;
  plan->num_splits = std::max(1, (s_k + plan->keys_per_split - 1) / plan->keys_per_split);
}
// --fp8_regs 0|1: the 16-row tile's FP8 pipeline forced, in place (0) or in registers (1);
// -1: the planner's choice.
int g_fp8_regs = -1;
// --p_rounding: how bf16 P is rounded (MlaDecodeParams::p_rounding; fp16 rows ignore it).
kernels::PRounding g_p_rounding = kernels::PRounding::kSplit;

// The plan's overrides of the flags above.
void Override(const MlaDecodeParams& p, int s_k, DecodePlan* plan) {
  ForceSplits(plan, s_k);
  if (g_fp8_regs >= 0 && plan->tile_rows == 16 && p.kv_dtype == kernels::KvDType::kFp8E4M3) {
    plan->fp8_pipeline = g_fp8_regs == 1 ? kernels::Fp8Pipeline::kRegisters : kernels::Fp8Pipeline::kInPlace;
    plan->smem_bytes = kernels::PlanSmemBytes(p.dtype, p.kv_dtype, plan->tile_rows, plan->fp8_pipeline,
                                              plan->smem_plan);
  }
}
int g_max_copies = 1024;  // --copies: at most this many copies of the inputs, used in turn
// --page_order sequential: each sequence's pages in pool order instead of shuffled, to
// measure what scattered pages cost (address translation, DRAM locality).
bool g_sequential_pages = false;

constexpr size_t kPoolBytes = size_t(1) << 30;  // KV pool: 1 GiB, ~17x the H200's L2

struct Result {
  double whole_ms, kernel_ms;
  DecodePlan plan;
  int copies;
};

Result RunConfig(const DeviceInfo& dev, const Config& c, int runs, void* pool, size_t pool_bytes,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int h_kv = 1, s_q = c.s_q;
  const int pages_per_seq = (c.s_k + kernels::kPageSize - 1) / kernels::kPageSize;
  const size_t page_bytes = size_t(kernels::kPageSize) * h_kv * RowBytes(c);
  const int64_t pool_pages = int64_t(pool_bytes / page_bytes);
  const int64_t pages_per_copy = int64_t(c.b) * pages_per_seq;
  if (pages_per_copy > pool_pages) {
    std::fprintf(stderr, "config does not fit the KV pool\n");
    std::exit(1);
  }
  const int copies = static_cast<int>(std::min<int64_t>(g_max_copies, pool_pages / pages_per_copy));

  // Per copy: its own pages (a random permutation of a disjoint pool range) and its own q.
  std::mt19937_64 rng(c.b * 1000003ull + c.h_q * 1009ull + c.s_k);
  std::vector<int32_t> table(size_t(copies) * pages_per_copy);
  for (int k = 0; k < copies; ++k) {
    std::vector<int32_t> pages(pages_per_copy);
    std::iota(pages.begin(), pages.end(), int32_t(k * pages_per_copy));
    if (!g_sequential_pages) std::shuffle(pages.begin(), pages.end(), rng);
    std::copy(pages.begin(), pages.end(), table.begin() + size_t(k) * pages_per_copy);
  }
  int32_t* d_table = nullptr;
  int32_t* d_seqlens = nullptr;
  uint16_t *d_q = nullptr, *d_out = nullptr;
  float* d_lse = nullptr;
  const size_t q_elems = size_t(c.b) * s_q * c.h_q * kernels::kHeadDimQK;
  CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int32_t> seqlens(c.b, c.s_k);
  CHECK_CUDA(cudaMalloc(&d_seqlens, c.b * 4));
  CHECK_CUDA(cudaMemcpy(d_seqlens, seqlens.data(), c.b * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_q, q_elems * copies * 2));
  CHECK_CUDA(LaunchRandomFill(d_q, q_elems * copies, 777, c.dtype == DType::kBF16, stream));
  CHECK_CUDA(cudaMalloc(&d_out, size_t(c.b) * s_q * c.h_q * kernels::kHeadDimV * 2));
  CHECK_CUDA(cudaMalloc(&d_lse, size_t(c.b) * s_q * c.h_q * 4));

  auto params = [&](int k) {
    MlaDecodeParams p;
    p.dtype = c.dtype;
    p.kv_dtype = c.kv;
    p.p_rounding = g_p_rounding;
    p.batch = c.b;
    p.s_q = s_q;
    p.h_q = c.h_q;
    p.h_kv = h_kv;
    p.num_pages = static_cast<int>(pool_pages);
    p.max_pages_per_seq = pages_per_seq;
    p.softmax_scale = 1.0f / 24.0f;
    p.causal = c.causal;
    kernels::SetContiguousStrides(&p);
    p.q = d_q + q_elems * k;
    p.kv = pool;
    p.block_table = d_table + size_t(k) * pages_per_copy;
    p.seqlens = d_seqlens;
    p.out = d_out;
    p.lse = d_lse;
    return p;
  };

  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  Result r{};
  r.copies = copies;
  CHECK_OK(kernels::PlanDecode(dev, params(0), seqlens.data(), &r.plan, g_tile));
  Override(params(0), c.s_k, &r.plan);
  if (kernels::DecodeWorkspaceBytes(params(0), r.plan) > workspace_bytes) {
    std::fprintf(stderr, "workspace too small\n");
    std::exit(1);
  }
  // The two timings alternate run by run, so clock or thermal drift over the config
  // shifts both alike and the whole-minus-kernel gap is the planner and launch alone.
  std::vector<double> whole, kern;
  auto time_one = [&](auto&& launch) {
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaEventRecord(e0, stream));
    launch();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms);
  };
  for (int it = -5; it < runs; ++it) {
    const MlaDecodeParams p = params((it + 5) % copies);
    // Whole call: host planner + kernel (+ combine).
    const double w = time_one([&] {
      DecodePlan plan;
      CHECK_OK(kernels::PlanDecode(dev, p, seqlens.data(), &plan, g_tile));
      Override(p, c.s_k, &plan);
      CHECK_OK(kernels::LaunchDecode(p, plan, workspace, workspace_bytes, stream));
    });
    // The decode kernel alone, on the plan made beforehand, over the next copy of the
    // inputs (so neither timing finds the other's KV in L2).
    const MlaDecodeParams pk = params((it + 6) % copies);
    const double k = time_one([&] { CHECK_OK(kernels::LaunchDecodeKernel(pk, r.plan, workspace, workspace_bytes, stream)); });
    if (it >= 0) {
      whole.push_back(w);
      kern.push_back(k);
    }
  }
  r.whole_ms = Median(whole);
  r.kernel_ms = Median(kern);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(d_table);
  cudaFree(d_seqlens);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_lse);
  return r;
}

int Main(int argc, char** argv) {
  int runs = 100;
  int repeat = 1;  // --repeat: the whole table this many times in one process
  std::string only, kv_filter;  // --kv_dtype: only the rows of that KV cache dtype
  std::string shape;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    if (!std::strcmp(argv[i], "--tile") && i + 1 < argc) g_tile = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--kv_dtype") && i + 1 < argc) kv_filter = argv[++i];
    if (!std::strcmp(argv[i], "--fp8_regs") && i + 1 < argc) g_fp8_regs = std::atoi(argv[++i]) != 0;
    if (!std::strcmp(argv[i], "--p_rounding") && i + 1 < argc) {
      const std::string r = argv[++i];
      if (r != "split" && r != "once") {
        std::fprintf(stderr, "--p_rounding: expected split or once, got %s\n", r.c_str());
        return 2;
      }
      g_p_rounding = r == "once" ? kernels::PRounding::kOnce : kernels::PRounding::kSplit;
    }
    if (!std::strcmp(argv[i], "--splits") && i + 1 < argc) g_splits = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) shape = argv[++i];
    if (!std::strcmp(argv[i], "--copies") && i + 1 < argc) g_max_copies = std::max(1, std::atoi(argv[++i]));
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = std::max(1, std::atoi(argv[++i]));
    if (!std::strcmp(argv[i], "--page_order") && i + 1 < argc) {
      const std::string order = argv[++i];
      if (order != "sequential" && order != "shuffled") {
        std::fprintf(stderr, "--page_order: expected sequential or shuffled, got %s\n", order.c_str());
        return 2;
      }
      g_sequential_pages = order == "sequential";
    }
  }
  if (!kv_filter.empty() && kv_filter != "model" && kv_filter != "fp8_e4m3") {
    std::fprintf(stderr, "--kv_dtype: expected model or fp8_e4m3, got %s\n", kv_filter.c_str());
    return 2;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("bench: no CUDA GPU\n");
    return 0;
  }
  DeviceInfo dev;
  CHECK_OK(kernels::QueryDevice(0, &dev));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  // Read-bandwidth ceiling: 4 GiB, 16-byte loads, median of 20.
  const size_t ceil_bytes = size_t(4) << 30;
  void* big = nullptr;
  uint32_t* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&big, ceil_bytes));
  CHECK_CUDA(cudaMalloc(&sink, 1 << 20));
  CHECK_CUDA(LaunchRandomFill(static_cast<uint16_t*>(big), ceil_bytes / 2, 1, true, stream));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = -3; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    CHECK_CUDA(LaunchReadKernel(big, ceil_bytes, sink, stream));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 0) t.push_back(ms);
  }
  const double ceiling = ceil_bytes / (Median(t) * 1e-3) / 1e9;
  CHECK_CUDA(cudaFree(big));

  void* pool = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, kPoolBytes));
  const auto fp8 = kernels::KvDType::kFp8E4M3;

  std::vector<Config> configs = {
      {64, 16, 4096, DType::kBF16},   {1, 64, 4096, DType::kBF16},    {64, 16, 1024, DType::kBF16},
      {1, 16, 16384, DType::kBF16},   {1, 16, 256, DType::kBF16},     {1, 16, 1024, DType::kBF16},
      {1, 16, 4096, DType::kBF16},    {1, 16, 65536, DType::kBF16},   {4, 16, 1024, DType::kBF16},
      {4, 16, 4096, DType::kBF16},    {16, 16, 1024, DType::kBF16},   {16, 16, 4096, DType::kBF16},
      {64, 128, 4096, DType::kBF16},  {128, 128, 2048, DType::kBF16}, {32, 64, 8192, DType::kBF16},
      {64, 16, 4096, DType::kFP16},   {1, 16, 65536, DType::kFP16},   {64, 128, 4096, DType::kFP16},
      // Multi-token prediction: 2 query tokens, causal.
      {64, 128, 4096, DType::kBF16, 2, true}, {32, 16, 8192, DType::kBF16, 2, true},
      // FP8 KV cache (kernels/kv_fp8.h), beside the bf16 rows above.
      {64, 16, 4096, DType::kBF16, 1, false, fp8},   {1, 16, 65536, DType::kBF16, 1, false, fp8},
      {1, 64, 4096, DType::kBF16, 1, false, fp8},    {16, 16, 4096, DType::kBF16, 1, false, fp8},
      {64, 128, 4096, DType::kBF16, 1, false, fp8},  {128, 128, 2048, DType::kBF16, 1, false, fp8},
      {32, 64, 8192, DType::kBF16, 1, false, fp8},   {64, 16, 4096, DType::kFP16, 1, false, fp8},
      {64, 128, 4096, DType::kBF16, 2, true, fp8},
  };
  if (!shape.empty()) {
    Config c{0, 0, 0, DType::kBF16};
    const int n = std::sscanf(shape.c_str(), "%d,%d,%d,%d", &c.b, &c.h_q, &c.s_k, &c.s_q);
    if (n < 3 || c.b < 1 || c.h_q < 1 || c.s_k < 1 || c.s_q < 1) {
      std::fprintf(stderr, "--shape: expected b,h_q,s_k[,s_q] with positive values, got %s\n", shape.c_str());
      return 2;
    }
    c.causal = c.s_q > 1;
    configs = {c};
  }
  size_t ws_bytes = 0;
  for (const auto& c : configs)
    ws_bytes = std::max(ws_bytes, kernels::MaxDecodeWorkspaceBytes(dev, c.b, c.s_q, c.h_q, 1));
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 256)));

  kernels::TileOccupancy tiles[2][4];
  int ntiles[2] = {0, 0};
  CHECK_OK(kernels::DescribeTiles(dev, DType::kBF16, tiles[0], 4, &ntiles[0]));
  CHECK_OK(kernels::DescribeTiles(dev, DType::kFP16, tiles[1], 4, &ntiles[1]));

  std::printf("GPU: %s, %d SMs, cc %d.%d\n", dev.name, dev.sm_count, dev.cc_major, dev.cc_minor);
  std::printf("read ceiling (4 GiB, 16-byte loads, median of 20): %.0f GB/s\n", ceiling);
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < ntiles[d]; ++i)
      std::printf("%s tile %2d rows: %3d regs, %6d B smem, %d CTAs/SM here, %d on A100\n", d ? "fp16" : "bf16",
                  tiles[d][i].tile_rows, tiles[d][i].regs_per_thread, tiles[d][i].smem_bytes,
                  tiles[d][i].ctas_per_sm, tiles[d][i].ctas_per_sm_a100);
  std::printf("median of %d runs (the first row also runs once untimed before); GB/s counts the KV cache once; h_kv 1%s%s\n\n", runs,
              g_tile ? (" ; tile forced to " + std::to_string(g_tile)).c_str() : "",
              g_fp8_regs == 1      ? "; fp8 rows: converted in registers (16-row tile)"
              : g_fp8_regs == 0    ? "; fp8 rows: dequantized in place"
                                   : "; fp8 rows: the planner's pipeline (16-row tile: in registers from 16 tiles per split)");
  if (g_p_rounding == kernels::PRounding::kOnce) std::printf("bf16 rows: P rounded once (--p_rounding once)\n\n");
  if (g_sequential_pages || g_max_copies < 1024)
    std::printf("pages of a sequence: %s; at most %d copies of the inputs\n\n",
                g_sequential_pages ? "in pool order (--page_order sequential)" : "shuffled", g_max_copies);
  std::printf(
      "| dtype | kv | b | h_q | s_q | s_k | tile | splits | CTAs/SM (A100) | whole ms | whole GB/s | %% ceil | whole "
      "TFLOP/s | kernel ms | kernel GB/s | %% ceil | kernel TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto selected = [&](const Config& c) {
    if (!only.empty()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%d,%d,%d", c.b, c.h_q, c.s_k);
      if (only != buf) return false;
    }
    return kv_filter.empty() || (kv_filter == "fp8_e4m3") == IsFp8(c);
  };
  bool warmed = false;
  // Passes over the table in one process: a row's process-to-process spread against its
  // spread within a process.
  for (int pass = 0; pass < repeat; ++pass)
  for (const auto& c : configs) {
    if (!selected(c)) continue;
    if (IsFp8(c)) {
      CHECK_CUDA(LaunchFp8RowFill(pool, kPoolBytes / kernels::kFp8RowBytes, c.s_k * 31 + c.b,
                                  c.dtype == DType::kBF16, stream));
    } else {
      CHECK_CUDA(LaunchRandomFill(static_cast<uint16_t*>(pool), kPoolBytes / 2, c.s_k * 31 + c.b,
                                  c.dtype == DType::kBF16, stream));
    }
    // The first row a process times runs ~14% slow on an H100 (bf16 (64,16,4096): 0.131
    // against 0.114-0.116 ms when timed again in the same process; 0cf8fcc), so the first
    // selected row runs once untimed before it is timed.
    if (!warmed) RunConfig(dev, c, runs, pool, kPoolBytes, ws, ws_bytes, stream);
    warmed = true;
    const Result r = RunConfig(dev, c, runs, pool, kPoolBytes, ws, ws_bytes, stream);
    const double kv_bytes = double(c.b) * c.s_k * RowBytes(c);
    // Keys seen per query row, summed over the s_q rows (causal: row i sees s_k - s_q + i + 1).
    const double keys = c.causal ? double(c.s_q) * c.s_k - c.s_q * (c.s_q - 1) / 2.0 : double(c.s_q) * c.s_k;
    const double flops = 2.0 * c.b * c.h_q * keys * (kernels::kHeadDimQK + kernels::kHeadDimV);
    const int d = c.dtype == DType::kBF16 ? 0 : 1;
    int a100 = 0;
    for (int i = 0; i < ntiles[d]; ++i)
      if (tiles[d][i].tile_rows == r.plan.tile_rows) a100 = tiles[d][i].ctas_per_sm_a100;
    auto gbs = [&](double ms) { return kv_bytes / (ms * 1e-3) / 1e9; };
    std::printf("| %s | %s | %d | %d | %d%s | %d | %d x %d | %d x %d | %d (%d) | %.4f | %.0f | %.1f | %.1f | %.4f | %.0f | %.1f | %.1f |\n",
                c.dtype == DType::kBF16 ? "bf16" : "fp16", IsFp8(c) ? "fp8" : "16-bit", c.b, c.h_q, c.s_q,
                c.causal ? " causal" : "", c.s_k,
                r.plan.tile_rows, r.plan.row_tiles,
                r.plan.num_splits, r.plan.keys_per_split, r.plan.ctas_per_sm, a100, r.whole_ms, gbs(r.whole_ms),
                100 * gbs(r.whole_ms) / ceiling, flops / (r.whole_ms * 1e-3) / 1e12, r.kernel_ms, gbs(r.kernel_ms),
                100 * gbs(r.kernel_ms) / ceiling, flops / (r.kernel_ms * 1e-3) / 1e12);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace latentd::bench

int main(int argc, char** argv) { return latentd::bench::Main(argc, argv); }
