// Random MLA decode problems for tests and benchmarks: random q and owned KV rows,
// NaN in every cache row no sequence owns, randomly permuted block tables, poisoned
// outputs; plus a naive double-precision reference and FlashMLA's tolerances.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/params.h"

namespace latentd::kernels::testing {

struct ProblemShape {
  DType dtype = DType::kBF16;
  int batch = 1;
  int s_q = 1;
  int h_q = 16;
  int h_kv = 1;
  bool causal = false;
  std::vector<int> seqlens;  // [batch]
  int extra_pages = 3;       // unowned pages (NaN) beyond what the sequences need
  KvDType kv_dtype = KvDType::kModel;  // fp8: the cache is kv quantized (kernels/kv_fp8.h)
  bool heavy_tailed = false;  // KV values normal x exp(normal): a few large outliers per block
  // Key t's rope values (not V) scaled by 1 + t/4: scores whose maximum keeps rising
  // along the sequence, so the online softmax rescales again and again after the first
  // tile, with V (and so the outputs) at the usual scale.
  bool rising_keys = false;
};

// Host-side tensors of one problem, in the contiguous layouts of params.h.
struct Problem {
  ProblemShape shape;
  std::vector<uint16_t> q;            // [b, s_q, h_q, 576]
  std::vector<uint16_t> kv;           // [num_pages, 64, h_kv, 576], as a client sent it
  std::vector<uint8_t> kv8;           // fp8 cache: [num_pages, 64, h_kv, 656 bytes], unowned rows 0xff (NaN)
  std::vector<int32_t> block_table;   // [b, max_pages]
  std::vector<int32_t> seqlens;       // [b]
  std::vector<uint16_t> out;          // [b, s_q, h_q, 512], poisoned with NaN
  std::vector<float> lse;             // [b, h_q, s_q], poisoned with NaN
  int num_pages = 0;
  int max_pages_per_seq = 0;
  float softmax_scale = 0.f;

  // Params over this problem's host buffers.
  MlaDecodeParams Params();
  // Refills out and lse with NaN.
  void Poison();
};

Problem MakeProblem(const ProblemShape& shape, std::mt19937_64& rng);

// Naive double-precision reference: out [b, s_q, h_q, 512], lse [b, h_q, s_q]. With an
// fp8 cache it reads the cache's bytes dequantized exactly as the kernels do, unless
// `unquantized`, which uses the rows as sent (to measure the quantization error itself).
void ReferenceDecode(const Problem& p, std::vector<double>* out, std::vector<double>* lse,
                     bool unquantized = false);

struct Comparison {
  bool ok = true;
  double max_abs_out = 0, max_rel_out = 0, cos_dist = 0, max_abs_lse = 0;
  std::string first_failure;
};

// Output tolerances: by default FlashMLA's acceptance, each out element within abs 8e-4
// plus rel 2/128 (as torch's assert_close combines them) and cosine distance under 5e-6
// over the whole output. PRounding::kOnce is held to the looser bound of
// docs/p-rounding.md (POnceTolerance).
struct Tolerance {
  double abs_out = 8e-4;
  double rel_out = 2.0 / 128;
  double cos_dist = 5e-6;
};
Tolerance POnceTolerance();

// The output within `tol`, lse within abs 1e-6 or rel 8/65536 (whatever the P rounding:
// the row sums add P in fp32); -inf lse and zero rows where a query sees no keys; no NaN.
Comparison Compare(const Problem& p, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                   const std::vector<double>& ref_out, const std::vector<double>& ref_lse,
                   const Tolerance& tol = Tolerance());

std::string Describe(const ProblemShape& s);

}  // namespace latentd::kernels::testing
