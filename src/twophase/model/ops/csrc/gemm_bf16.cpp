// y[M, N] = x[M, K] @ W[N, K]^T in bfloat16 products with float32 sums, on AVX512-BF16's dot-product instruction
// (vdpbf16ps: 32 products a cycle a core). Written for the rows of a batched decode step (8-127), where oneDNN's
// GEMM on its reordered weight used 47-72% of that rate on SmolLM2's shapes (2 Zen 4 cores: 218-331 of the 460
// GFLOP/s measured, 32 rows) and this kernel 65-87%. Larger M (prefill) stays with oneDNN, which blocks for the
// caches (this kernel has no cache blocking: 0.67-1.01x oneDNN's time at 2,048 rows). Tried without a gain on
// cold weights (the engine's case: 30 layers of weights, 25-28 ms a 32-row step either way): software prefetch of the
// next panel, and K in chunks of 32-128 pairs run through every row block while in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr int64_t kCols = 32;  // output columns of a panel: two 16-lane float32 accumulators a row
constexpr int kMaxTileRows = 12;  // 12 x 2 accumulators + 2 weight vectors + a broadcast fit AVX-512's 32 registers

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHaveBf16Dot = true;

// One MR x 32 tile over the whole of K: c[r][j] = sum over k pairs p of x[r][2p] w[j][2p] + x[r][2p+1] w[j][2p+1],
// one dot-product chain per output in k order. xp: the rows' k pairs, pair-major ([K/2][MR] int32, each two
// bfloat16); wp: the panel ([K/2][32][2] bfloat16). Rows written to out (ld apart), the first `cols` columns; as
// bfloat16 (round to nearest even), or as float32 holding those bfloat16 values (the GEMM's bfloat16 result, widened).
template <int MR>
void bf16_gemm_tile(const int32_t* xp, const uint16_t* wp, int64_t pairs, void* out, int64_t ld, int64_t cols,
                    bool bf16_out) {
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) c0[r] = _mm512_setzero_ps(), c1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kCols + kCols);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[p * MR + r]);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, w0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, w1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(c0[r]), h1 = (__m256i)_mm512_cvtneps_pbh(c1[r]);
    if (bf16_out) {
      uint16_t* o = static_cast<uint16_t*>(out) + r * ld;
      _mm256_mask_storeu_epi16(o, m0, h0);
      _mm256_mask_storeu_epi16(o + 16, m1, h1);
    } else {
      float* o = static_cast<float*>(out) + r * ld;
      _mm512_mask_storeu_ps(o, m0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16)));
      _mm512_mask_storeu_ps(o + 16, m1, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16)));
    }
  }
}

using TileFn = void (*)(const int32_t*, const uint16_t*, int64_t, void*, int64_t, int64_t, bool);
template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&bf16_gemm_tile<R + 1>...};
}
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kMaxTileRows>{});
#else
constexpr bool kHaveBf16Dot = false;
#endif

// The rows of x [M, K] (float32 or bfloat16) as bfloat16 k pairs, in blocks of at most kMaxTileRows rows, each block
// pair-major: block b's rows [r0, r0 + rows) at xp[r0 * pairs + p * rows + r] (int32: the pair's two bfloat16).
std::vector<int32_t> pack_rows(const at::Tensor& x, const std::vector<int64_t>& starts) {
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2;
  std::vector<int32_t> xp(M * pairs);
  std::vector<uint16_t> row(K);
  for (size_t b = 0; b + 1 < starts.size(); ++b) {
    const int64_t r0 = starts[b], rows = starts[b + 1] - r0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* src;
      if (x.scalar_type() == at::kFloat) {
        convert(row.data(), x.data_ptr<float>() + (r0 + r) * K, K);
        src = row.data();
      } else {
        src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + (r0 + r) * K;
      }
      int32_t* dst = xp.data() + r0 * pairs + r;
      for (int64_t p = 0; p < pairs; ++p) std::memcpy(dst + p * rows, src + 2 * p, 4);
    }
  }
  return xp;
}

}  // namespace

bool bf16_gemm_available() { return kHaveBf16Dot; }

at::Tensor pack_bf16_gemm(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_gemm: a bfloat16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0 && K > 0, "pack_bf16_gemm: K must be even (the products go in pairs of k)");
  const int64_t P = (N + kCols - 1) / kCols, pairs = K / 2;
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::zeros({P, pairs, kCols, 2}, weight.options());  // columns past N stay zero
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j) {
        const uint16_t* wrow = src + (p * kCols + j) * K;
        for (int64_t q = 0; q < pairs; ++q) {
          uint16_t* d = dst + ((p * pairs + q) * kCols + j) * 2;
          d[0] = wrow[2 * q], d[1] = wrow[2 * q + 1];
        }
      }
  });
  return out;
}

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool bf16_out) {
  TORCH_CHECK(kHaveBf16Dot, "bf16_gemm: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_gemm: x must be a float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_gemm: packed must come from pack_bf16_gemm");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(K == 2 * pairs, "bf16_gemm: x has ", K, " columns, the weight ", 2 * pairs);
  TORCH_CHECK(n > (P - 1) * kCols && n <= P * kCols, "bf16_gemm: n does not match the packed panels");
  at::Tensor out = at::empty({M, n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const at::Tensor xc = x.contiguous();
  const int64_t blocks = (M + kMaxTileRows - 1) / kMaxTileRows;  // rows spread evenly: 32 rows as 11 + 11 + 10
  std::vector<int64_t> starts(blocks + 1);
  for (int64_t b = 0; b <= blocks; ++b) starts[b] = b * M / blocks;
  const std::vector<int32_t> xp = pack_rows(xc, starts);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t elem = bf16_out ? 2 : 4;
  // a few panels an item, so that dynamic scheduling balances two threads without an item per panel
  const int64_t per_item = std::max<int64_t>(1, P / (8 * std::max(1, at::get_num_threads())));
  const int64_t items = (P + per_item - 1) / per_item;
  dynamic_for(items, [] { return 0; }, [&](int64_t i, int) {
    for (int64_t p = i * per_item; p < std::min(P, (i + 1) * per_item); ++p) {
      const int64_t cols = std::min(kCols, n - p * kCols);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = starts[b], rows = starts[b + 1] - r0;
        kTiles[rows - 1](xp.data() + r0 * pairs, wp + p * pairs * 2 * kCols, pairs,
                         base + (r0 * n + p * kCols) * elem, n, cols, bf16_out);
      }
    }
  });
#endif
  return out;
}

}  // namespace tp
