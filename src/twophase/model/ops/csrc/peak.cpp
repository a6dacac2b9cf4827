// The compute floor the GEMMs are measured against: the FLOP/s a team of threads gets from this CPU's matmul
// instruction for a dtype (vdpbf16ps for bfloat16, the widest FMA for float32), each thread running 24 independent
// chains of it on registers (no loads: enough chains to cover the instruction's latency at its throughput). The
// loops are written in assembly: a compiler is free to hoist or spill what a benchmark means to run (two versions in
// intrinsics measured a stored accumulator or a hoisted load instead of the instruction; 2 Zen 4 cores, session 51).
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include "ops.h"

namespace tp {
namespace {

using PassFn = void (*)(int64_t);

#define TP_X4(op, a, b, c, d) op(a) op(b) op(c) op(d)
#define TP_X24(op) TP_X4(op, 0, 1, 2, 3) TP_X4(op, 4, 5, 6, 7) TP_X4(op, 8, 9, 10, 11) \
  TP_X4(op, 12, 13, 14, 15) TP_X4(op, 16, 17, 18, 19) TP_X4(op, 20, 21, 22, 23)
#define TP_ZERO(i) "vpxord %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n\t"

// n passes of the 24 instructions op(0) .. op(23) on zmm0-23, every one reading zmm30 and zmm31 (zeros: no
// subnormal can slow a lane)
#define TP_ZMM_PASSES(name, op)                                                                                      \
  void name(int64_t n) {                                                                                             \
    __asm__ volatile(TP_X24(TP_ZERO) TP_ZERO(30) TP_ZERO(31) "1:\n\t" TP_X24(op) "dec %0\n\t"                       \
                     "jnz 1b\n\t"                                                                                   \
                     "vzeroupper\n\t"                                                                               \
                     : "+r"(n)                                                                                       \
                     :                                                                                               \
                     : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",      \
                       "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20",     \
                       "zmm21", "zmm22", "zmm23", "zmm30", "zmm31", "cc");                                           \
  }

#if defined(__AVX512BF16__)
#define TP_DPBF16(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
constexpr double kBf16PassFlops = 24 * 16 * 4;  // 24 instructions x 16 lanes x (2 products + 2 sums)
TP_ZMM_PASSES(bf16_passes, TP_DPBF16)
#endif

#if defined(__AVX512F__)
#define TP_FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
constexpr double kF32PassFlops = 24 * 16 * 2;  // 24 instructions x 16 lanes x (a product + a sum)
TP_ZMM_PASSES(f32_passes, TP_FMA)
#elif defined(__AVX2__) && defined(__FMA__)
#define TP_ZERO_Y(i) "vpxor %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n\t"
#define TP_FMA_Y(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define TP_X12(op) TP_X4(op, 0, 1, 2, 3) TP_X4(op, 4, 5, 6, 7) TP_X4(op, 8, 9, 10, 11)
constexpr double kF32PassFlops = 12 * 8 * 2;  // 12 instructions x 8 lanes x (a product + a sum)
void f32_passes(int64_t n) {
  __asm__ volatile(TP_X12(TP_ZERO_Y) TP_ZERO_Y(14) TP_ZERO_Y(15)
                   "1:\n\t" TP_X12(TP_FMA_Y) "dec %0\n\t"
                   "jnz 1b\n\t"
                   "vzeroupper\n\t"
                   : "+r"(n)
                   :
                   : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
                     "xmm14", "xmm15", "cc");
}
#endif

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Every thread of the team runs the same number of passes at once (sized on this thread to last ~seconds); the
// team's FLOPs over the parallel region's wall time.
double team_rate(PassFn passes, double pass_flops, double seconds) {
  int64_t n = 1 << 12;
  for (;;) {  // size the loop: ~an eighth of the time on one thread, then scale to the whole
    const auto start = std::chrono::steady_clock::now();
    passes(n);
    const double took = seconds_since(start);
    if (took >= seconds / 8 || n >= (int64_t{1} << 40)) {
      n = std::max<int64_t>(1, static_cast<int64_t>(n * seconds / std::max(took, 1e-9)));
      break;
    }
    n *= 4;
  }
  const int64_t threads = std::max(1, at::get_num_threads());
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) passes(n);
  });
  return static_cast<double>(threads) * static_cast<double>(n) * pass_flops / seconds_since(start);
}

}  // namespace

double instruction_peak(const std::string& dtype, double seconds) {
  TORCH_CHECK(seconds > 0, "instruction_peak: seconds must be positive");
  if (dtype == "bfloat16") {
#if defined(__AVX512BF16__)
    return team_rate(bf16_passes, kBf16PassFlops, seconds);
#else
    TORCH_CHECK(false, "instruction_peak: this build has no bfloat16 dot-product instruction (AVX512-BF16)");
#endif
  }
  if (dtype == "float32") {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return team_rate(f32_passes, kF32PassFlops, seconds);
#else
    TORCH_CHECK(false, "instruction_peak: this build has no float32 FMA instruction (AVX2 + FMA or AVX-512)");
#endif
  }
  TORCH_CHECK(false, "instruction_peak: dtype must be 'bfloat16' or 'float32', not '", dtype, "'");
  return 0.0;
}

}  // namespace tp
