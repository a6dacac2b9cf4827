// y[M, N] = x[M, K] @ W[N, K]^T in bfloat16 products with float32 sums, on AVX512-BF16's dot-product instruction
// (vdpbf16ps: 32 products a cycle a core). Written for the rows of a batched decode step (5-127), where oneDNN's
// GEMM on its reordered weight used 47-72% of that rate on SmolLM2's shapes (2 Zen 4 cores: 218-331 of the 460
// GFLOP/s measured, 32 rows) and this kernel 65-87%; since x's rows are read in place (below) it also runs prefill
// chunks at oneDNN's rate or better (2,048 rows: 373-401 GFLOP/s against oneDNN's 329-395 with its conversions).
// Tried without a gain on cold weights (the engine's case: 30 layers of weights, 25-28 ms a 32-row step either way):
// software prefetch of the next panel, and K in chunks of 32-128 pairs run through every row block while in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "dot_bf16.h"
#include "ops.h"

namespace tp {

// The first row block of a panel reads it from memory (the weights of a decode step are read once); it prefetches
// the panel this many k pairs (3 KB) ahead, into the next panel at the end. A decode step's GEMMs at 32 rows over 30
// layers of distinct weights and the head, 2 Zen 4 cores: 30.5 -> 28.7 ms (16 rows: 19.1 -> 18.8; 8 to 64 pairs
// ahead all within 29.4-30.4). The other row blocks (more than 12 rows) bring the next panel into L2 meanwhile, so
// that the first block's reads are not all from memory: the same GEMMs alternating in one process, medians of 18-30
// runs, 28.7 -> 26.9 ms at 32 rows, 24.9 -> 23.8 at 24, 25.8 -> 24.9 at 16 (a slower spell), 54.1 / 61.4 against
// 56.0 / 61.7 at 64 (within the spread). Every block spreading the next panel, the first included, was between.
constexpr int64_t kPrefetchPairs = 24;
// Panels in groups of about kGroupBytes, row block by row block, from kGroupMinBlocks row blocks on (bf16_gemm).
constexpr int64_t kGroupBytes = int64_t{512} << 10;
constexpr int64_t kGroupMinBlocks = 8;

bool bf16_gemm_available() {
#ifdef TP_HAVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_gemm(const at::Tensor& weight, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_gemm: a bfloat16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0 && K > 0, "pack_bf16_gemm: K must be even (the products go in pairs of k)");
  const int64_t P = (N + kDotCols - 1) / kDotCols, pairs = K / 2;
  const at::Tensor w = weight.contiguous();
  at::Tensor out;
  if (into) {
    out = *into;
    TORCH_CHECK(out.sizes() == at::IntArrayRef({P, pairs, kDotCols, 2}) && out.scalar_type() == at::kBFloat16 &&
                    out.is_contiguous(),
                "pack_bf16_gemm: out must be a contiguous bfloat16 [", P, ", ", pairs, ", ", kDotCols, ", 2] tensor");
    if (N % kDotCols) out[P - 1].zero_();  // the last panel's columns past N
  } else {
    out = at::zeros({P, pairs, kDotCols, 2}, weight.options());  // columns past N stay zero
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kDotCols && p * kDotCols + j < N; ++j) {
        const uint16_t* wrow = src + (p * kDotCols + j) * K;
        for (int64_t q = 0; q < pairs; ++q) {
          uint16_t* d = dst + ((p * pairs + q) * kDotCols + j) * 2;
          d[0] = wrow[2 * q], d[1] = wrow[2 * q + 1];
        }
      }
  });
  return out;
}

namespace {
// float32 rows [M, K] rounded to bfloat16 (as torch rounds them), over the threads from 256K values on
at::Tensor rows_as_bf16(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, K}, x.options().dtype(at::kBFloat16));
  const float* src = x.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t grain = M * K >= (int64_t{1} << 18) ? std::max<int64_t>(1, (int64_t{1} << 14) / K) : M;
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) { convert(dst + r0 * K, src + r0 * K, (r1 - r0) * K); });
  return out;
}

#ifdef TP_HAVE_BF16_DOT
// x's rows [M, K] as float32 values rounded to bfloat16 (fma_tile's x: the products dot_tile would form), in this
// thread's scratch (a prefill chunk's are megabytes: a tensor of their own was mapped and zeroed on every call), over
// the threads from 256K values on: bfloat16 rows widened exactly, float32 rows rounded as rows_as_bf16 rounds them
const float* rows_as_rounded_f32(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  float* dst = thread_scratch<4>(M * K);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const uint16_t* src16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* src32 = bf16 ? nullptr : x.data_ptr<float>();
  const int64_t grain = M * K >= (int64_t{1} << 18) ? std::max<int64_t>(1, (int64_t{1} << 14) / K) : M;
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    const int64_t i0 = r0 * K, i1 = r1 * K;
    if (bf16) return convert(dst + i0, src16 + i0, i1 - i0);
    round_to_bf16(dst + i0, src32 + i0, i1 - i0);
  });
  return dst;
}
#endif
}  // namespace

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool bf16_out, bool fma, int64_t store) {
  TORCH_CHECK(bf16_gemm_available(), "bf16_gemm: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_gemm: x must be a float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kDotCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_gemm: packed must come from pack_bf16_gemm");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(K == 2 * pairs, "bf16_gemm: x has ", K, " columns, the weight ", 2 * pairs);
  TORCH_CHECK(n > (P - 1) * kDotCols && n <= P * kDotCols, "bf16_gemm: n does not match the packed panels");
  TORCH_CHECK(store == kStorePlain || store == kStoreGateUp || store == kStoreSiluMul, "bf16_gemm: unknown store ",
              store);
  TORCH_CHECK(store == kStorePlain || n % kDotCols == 0,
              "bf16_gemm: a gate / up weight packed by 16s has a multiple of 32 outputs");
  TORCH_CHECK(store != kStoreSiluMul || bf16_out, "bf16_gemm: silu(gate) * up is stored in bfloat16");
  const int64_t out_cols = store == kStoreSiluMul ? n / 2 : n, half = n / 2;  // half: F of a gate / up weight
  at::Tensor out = at::empty({M, out_cols}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
#ifdef TP_HAVE_BF16_DOT
  const at::Tensor xc = x.contiguous();
  const int64_t blocks = (M + kDotMaxRows - 1) / kDotMaxRows;  // rows spread evenly: 32 rows as 10 + 11 + 11
  std::vector<int64_t> starts(blocks + 1);
  for (int64_t b = 0; b <= blocks; ++b) starts[b] = b * M / blocks;
  // x's rows as bfloat16, row-major, their k pairs read in place by the tiles: x itself where it is bfloat16 (down's
  // input, from SiLU-and-mul), else rounded once, over the threads from 256K values on. They were packed pair-major a
  // row block at a time before (a transpose into a zeroed buffer, on the calling thread for a decode step): in one
  // process, 2 Zen 4 cores, alternating, 2,048-token prefill steps 1,305 -> 1,252 ms, 32-row decode steps 38.6 ->
  // 37.6 ms; down's GEMM alone at 32 rows 1.09-1.26x, at 2,048 rows 1.07x.
  // fma: the rows as bfloat16-rounded float32 values instead, each broadcast by fma_tile
  const at::Tensor xb = fma ? at::Tensor() : xc.scalar_type() == at::kBFloat16 ? xc : rows_as_bf16(xc);
  const int32_t* xr = fma ? nullptr : reinterpret_cast<const int32_t*>(xb.data_ptr<at::BFloat16>());  // [M, pairs]
  const float* xf = fma ? rows_as_rounded_f32(xc) : nullptr;  // [M, K]
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* out16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  float* out32 = bf16_out ? nullptr : out.data_ptr<float>();
  // The work in units of a panel's row block, panel by panel, claimed in runs that shrink towards the end
  // (guided_for). Items of a few whole panels before (dynamic_for) left one thread a whole extra item when the other
  // started late: down at 32 rows is 18 panels of ~15 us. Alternating builds 8 times, 2 Zen 4 cores, 32 rows over 30
  // layers' weights, medians: qkv 103.0 -> 97.1 us, o 60.4 -> 59.0, gate/up 338.7 -> 303.2, down 177.8 -> 153.5; at
  // 2,048 rows the same (a layer's four 35.5 / 35.0 ms). S1-shaped rounds in one process, 3 x 2 alternating: 444.8
  // -> 455.9 tok/s, decode steps 35.8 -> 34.8 ms.
  const int64_t panel_bytes = pairs * 2 * kDotCols * static_cast<int64_t>(sizeof(uint16_t));
  // From kGroupMinBlocks row blocks on (prefill chunks) the units go a group of panels at a time (~kGroupBytes, in
  // L2), row block by row block within it: a thread's run keeps its row block in L1 across the group's panels, where
  // panel by panel x's rows streamed through the caches once a panel.
  const int64_t group = blocks >= kGroupMinBlocks ? std::max<int64_t>(1, kGroupBytes / panel_bytes) : 1;
  // The store mode as a template argument (each its own GEMM body): a runtime mode's branches and offsets in the
  // plain store cost the plain GEMMs 1-2% (2 Zen 4 cores, alternating builds).
  auto run = [&](auto mode) {
    constexpr int64_t kMode = decltype(mode)::value;
    guided_for(P * blocks, [] { return 0; }, [&](int64_t u0, int64_t u1, int) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t g0 = u / (group * blocks) * group, in_group = std::min(group, P - g0);
        const int64_t unit = u - g0 * blocks;  // within the group: row block unit / in_group, panel unit % in_group
        const int64_t p = g0 + unit % in_group, b = unit / in_group, r0 = starts[b];
        const int64_t cols = std::min(kDotCols, n - p * kDotCols);
        const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
        const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
        // the rows' sums rounded once to bfloat16, stored as such or widened: the panel's 32 columns side by side, or
        // (a gate / up weight packed by 16s) its 16 gate and 16 up outputs in their own columns, or silu(gate) * up
        // of the two in bfloat16 (silu_and_mul_widened's arithmetic)
        auto store_row = [&](int r, __m512 c0, __m512 c1) {
          const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(c0), h1 = (__m256i)_mm512_cvtneps_pbh(c1);
          if constexpr (kMode == kStoreSiluMul) {
            const __m256i y = bf16x16_of(silu_mul16(widen_bf16x16(h0), widen_bf16x16(h1)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16 + (r0 + r) * out_cols + p * 16), y);
          } else {
            // the panel's second 16 columns: beside its first, or (gate / up) among the up outputs
            const int64_t at0 = (r0 + r) * out_cols + (kMode == kStorePlain ? p * kDotCols : p * 16);
            const int64_t at1 = kMode == kStorePlain ? at0 + 16 : (r0 + r) * out_cols + half + p * 16;
            if (out16) {
              _mm256_mask_storeu_epi16(out16 + at0, m0, h0);
              _mm256_mask_storeu_epi16(out16 + at1, m1, h1);
            } else {
              _mm512_mask_storeu_ps(out32 + at0, m0, widen_bf16x16(h0));
              _mm512_mask_storeu_ps(out32 + at1, m1, widen_bf16x16(h1));
            }
          }
        };
        // a run's first block reads its panel from memory, prefetching it into L1 as it goes; the blocks after it bring
        // the next panel into L2 meanwhile, a share each (a line a pair: half the panel where there are two blocks, as
        // measured)
        // (in groups every block prefetches: the thread that brought the group's panels may be the other one)
        const bool reads_panel = b == 0 || u == u0 || group > 1;
        // (Keep this dispatch in the run's lambda: moved into a helper struct's method, GCC left dot_tile<12> out of
        // line and 2,048-row GEMMs ran ~10% slower, 32-row ones not; session 45. Check nm -C after a change.)
        with_tile_rows(starts[b + 1] - r0, [&](auto mr) {
          const char* next_share = reads_panel ? nullptr
                                               : reinterpret_cast<const char*>(wp + (p + 1) * pairs * 2 * kDotCols) +
                                                     (b - 1) * panel_bytes / (blocks - 1);
          if (fma)
            fma_tile<decltype(mr)::value>(xf + r0 * K, K, wp + p * pairs * 2 * kDotCols, pairs, store_row,
                                          reads_panel ? kPrefetchPairs : 0, next_share);
          else
            dot_tile<decltype(mr)::value, kRowMajor>(xr + r0 * pairs, wp + p * pairs * 2 * kDotCols, pairs, nullptr, 0,
                                                     store_row, reads_panel ? kPrefetchPairs : 0, next_share, pairs);
        });
      }
    });
  };
  if (store == kStoreSiluMul) run(std::integral_constant<int64_t, kStoreSiluMul>{});
  else if (store == kStoreGateUp) run(std::integral_constant<int64_t, kStoreGateUp>{});
  else run(std::integral_constant<int64_t, kStorePlain>{});
#endif
  return out;
}

}  // namespace tp
