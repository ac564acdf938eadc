// Throughput of the CPU implementation (the engine's CPU backend): KV bytes streamed per
// second for a few decode shapes, median of repeated calls on random data.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/mla_decode_cpu.h"
#include "kernels/testing/problem.h"

int main(int argc, char** argv) {
  using namespace latentd::kernels;
  const int threads = argc > 1 ? std::atoi(argv[1]) : 0;
  CpuMlaDecoder dec(threads);
  std::printf("CPU MLA decode, %d threads (hardware: %u), bf16, h_kv 1, s_q 1\n", dec.num_threads(),
              std::thread::hardware_concurrency());
  std::printf("%4s %5s %7s %10s %9s %9s\n", "b", "h_q", "s_k", "ms", "GB/s", "GFLOP/s");
  const int configs[][3] = {{1, 16, 4096}, {1, 16, 65536}, {16, 16, 4096}, {64, 16, 1024}, {4, 128, 4096}};
  std::mt19937_64 rng(7);
  for (const auto& c : configs) {
    testing::ProblemShape s;
    s.batch = c[0];
    s.h_q = c[1];
    s.seqlens.assign(c[0], c[2]);
    s.extra_pages = 0;
    auto pr = testing::MakeProblem(s, rng);
    auto p = pr.Params();
    std::vector<double> ms;
    for (int it = 0; it < 7; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      const Status st = dec.Run(p);
      const auto t1 = std::chrono::steady_clock::now();
      if (!st.ok()) {
        std::fprintf(stderr, "error: %s\n", st.message.c_str());
        return 1;
      }
      if (it > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double bytes = double(c[0]) * c[2] * kHeadDimQK * 2;
    const double flops = 2.0 * c[0] * c[1] * double(c[2]) * (kHeadDimQK + kHeadDimV);
    std::printf("%4d %5d %7d %10.3f %9.2f %9.1f\n", c[0], c[1], c[2], med, bytes / med / 1e6, flops / med / 1e6);
  }
  return 0;
}
