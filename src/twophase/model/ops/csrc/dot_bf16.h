// The register tile of our bfloat16 dot-product kernels (AVX512-BF16 vdpbf16ps, 32 products an instruction): the
// GEMM for 5-127 rows (gemm_bf16.cpp) and prefill attention's two products (attention.cpp).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include "common.h"

namespace tp {

constexpr int64_t kDotCols = 32;  // output columns of a panel: two 16-lane float32 accumulators a row
constexpr int kDotMaxRows = 12;   // 12 x 2 accumulators + 2 panel vectors + a broadcast fit AVX-512's 32 registers

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TP_HAVE_BF16_DOT 1

// One MR x 32 tile: c[r][j] = init[r][j] + sum over k pairs p of x[r][2p] w[j][2p] + x[r][2p+1] w[j][2p+1], the
// pairs in order, one dot-product chain per output (a row's sums never depend on the other rows). xp: the rows' k
// pairs pair-major ([pairs][MR] int32, each two bfloat16), or with XLD > 0 row-major (row r's pairs from xp + r * XLD,
// as a row of bfloat16 values lies); wp: a panel ([pairs][32][2] bfloat16); init: MR rows of
// 32 float32 init_ld apart, or null for zeros. store(r, c0, c1) receives row r's columns 0-15 and 16-31.
// prefetch_pairs > 0: the panel's lines that many pairs ahead are prefetched into L1 as the tile goes (past the
// panel: the memory after it, the next panel in a packed weight). l2_lines: one 64-byte line from there a pair is
// prefetched into L2 (memory another tile will read).
template <int MR, int XLD = 0, class Store>
inline void dot_tile(const int32_t* xp, const uint16_t* wp, int64_t pairs, const float* init, int64_t init_ld,
                     Store&& store, int64_t prefetch_pairs = 0, const char* l2_lines = nullptr) {
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    c0[r] = init ? _mm512_loadu_ps(init + r * init_ld) : _mm512_setzero_ps();
    c1[r] = init ? _mm512_loadu_ps(init + r * init_ld + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch_pairs) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols + kDotCols), _MM_HINT_T0);
    }
    if (l2_lines) _mm_prefetch(l2_lines + p * 64, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kDotCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kDotCols + kDotCols);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(XLD > 0 ? xp[r * XLD + p] : xp[p * MR + r]);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, w0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) store(r, c0[r], c1[r]);
}

// fn(std::integral_constant<int, rows>) for rows in [1, kDotMaxRows]: a tile's row count as a template argument.
template <class Fn>
inline void with_tile_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    case 9: return fn(std::integral_constant<int, 9>{});
    case 10: return fn(std::integral_constant<int, 10>{});
    case 11: return fn(std::integral_constant<int, 11>{});
    default: return fn(std::integral_constant<int, 12>{});
  }
}

#endif

// Rows [r0, r0 + rows) of src (float32 or bfloat16, ld elements apart, k values each, k even) as bfloat16 k pairs,
// pair-major: dst[p * rows + r] holds row r0 + r's values 2p and 2p + 1 (float32 rounded to nearest even, as torch).
template <class T>
inline void pack_pairs(const T* src, int64_t ld, int64_t r0, int64_t rows, int64_t k, int32_t* dst, uint16_t* row) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s;
    if constexpr (std::is_same_v<T, float>) {
      convert(row, src + (r0 + r) * ld, k);
      s = row;
    } else {
      s = src + (r0 + r) * ld;
    }
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(dst + p * rows + r, s + 2 * p, 4);
  }
}

}  // namespace tp
