// The register tile of our bfloat16 dot-product kernels (AVX512-BF16 vdpbf16ps, 32 products an instruction): the
// GEMM from 5 rows on (gemm_bf16.cpp) and prefill attention's two products (attention.cpp).
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
// pairs (int32, each two bfloat16, as a row of bfloat16 values lies), row r's from xp + r * XLD, or with XLD ==
// kRowMajor from xp + r * x_ld; wp: a panel ([pairs][32][2] bfloat16); init: MR rows of
// 32 float32 init_ld apart, or null for zeros. store(r, c0, c1) receives row r's columns 0-15 and 16-31.
// prefetch_pairs > 0: the panel's lines that many pairs ahead are prefetched into L1 as the tile goes (past the
// panel: the memory after it, the next panel in a packed weight). l2_lines: one 64-byte line from there a pair is
// prefetched into L2 (memory another tile will read).
constexpr int kRowMajor = -1;  // dot_tile's XLD for rows x_ld pairs apart, a stride known at run time

// MR rows ld values of T apart, read in step from column 0 on: row r's column i at base[r / 3] + (r % 3) * stride +
// i (bytes), one base register and the stride register scaled by 1 or 2, so the rows take (MR + 2) / 3 + 1 registers.
// With a pointer a row, a 12-row tile held 12 of the 16 general registers and GCC spilled the loop's others to the
// stack, reloaded every pair: 2,048 x 576 x 1,152 GEMMs on Zen 4 went from 190-194 to 201-208 GFLOP/s on one core,
// 387-395 to 424-426 on two; at 32 rows, 383-402 to 420-432 (the two loops alternating in one process, medians of
// 15-41 calls). LD > 0: the stride known at compile time, one base and constant offsets (prefill attention's rows; with
// a base every three rows, each advanced every pair, its 8 x 256-token prefill over 30 layers took 99.6-117.0 ms
// against 99.2-108.5).
template <int MR, class T, int64_t LD = 0>
struct RowCursor {
  static constexpr int kBases = LD > 0 ? 1 : (MR + 2) / 3;
  const char* base[kBases];
  int64_t stride;  // bytes
  RowCursor(const T* x, int64_t ld) : stride((LD > 0 ? LD : ld) * static_cast<int64_t>(sizeof(T))) {
#pragma GCC unroll 4
    for (int k = 0; k < kBases; ++k) base[k] = reinterpret_cast<const char*>(x) + 3 * k * stride;
  }
  T at(int r, int64_t i) const {  // row r's value i past the current column
    const int64_t col = i * static_cast<int64_t>(sizeof(T));
    const char* at = LD > 0 ? base[0] + r * (LD * static_cast<int64_t>(sizeof(T))) + col
                            : base[r / 3] + (r % 3) * stride + col;
    T v;
    std::memcpy(&v, at, sizeof(T));
    return v;
  }
  void advance(int64_t n) {
#pragma GCC unroll 4
    for (int k = 0; k < kBases; ++k) base[k] += n * static_cast<int64_t>(sizeof(T));
  }
};

template <int MR, int XLD, class Store>
inline void dot_tile(const int32_t* xp, const uint16_t* wp, int64_t pairs, const float* init, int64_t init_ld,
                     Store&& store, int64_t prefetch_pairs = 0, const char* l2_lines = nullptr, int64_t x_ld = 0) {
  __m512 c0[MR], c1[MR];
  static_assert(XLD > 0 || XLD == kRowMajor, "dot_tile: a row stride");
  RowCursor<MR, int32_t, (XLD > 0 ? XLD : 0)> xrow(xp, x_ld);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    c0[r] = init ? _mm512_loadu_ps(init + r * init_ld) : _mm512_setzero_ps();
    c1[r] = init ? _mm512_loadu_ps(init + r * init_ld + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p, xrow.advance(1)) {
    if (prefetch_pairs) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols + kDotCols), _MM_HINT_T0);
    }
    if (l2_lines) _mm_prefetch(l2_lines + p * 64, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kDotCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + p * 2 * kDotCols + kDotCols);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xrow.at(r, 0));
      c0[r] = _mm512_dpbf16_ps(c0[r], a, w0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) store(r, c0[r], c1[r]);
}

// dot_tile's sums on float32 FMAs, for a CPU whose vdpbf16ps runs at a fraction of its FMA rate (2 Intel Xeon cores
// without AMX, Emerald Rapids: 0.5 vdpbf16ps a cycle, 2 zmm FMAs, so 32 against 64 products a cycle a core). The same
// panel ([pairs][32][2] bfloat16), each pair widened in registers to four float32 vectors (w[j][2p] shifted up, w[j][2p
// + 1] masked: exact); x: the rows as float32 values (bfloat16-rounded where the caller wants dot_tile's products),
// row r's from x + r * x_ld, each value broadcast from memory. c[r][j] += x[r][2p] w[j][2p], then += x[r][2p + 1]
// w[j][2p + 1]: every product exact and summed in its own rounding, one chain per output, pairs in order (dot_tile
// rounds each pair's two products together). init, prefetch arguments: as dot_tile's.
template <int MR, class Store>
inline void fma_tile(const float* x, int64_t x_ld, const uint16_t* wp, int64_t pairs, Store&& store,
                     int64_t prefetch_pairs = 0, const char* l2_lines = nullptr, const float* init = nullptr,
                     int64_t init_ld = 0) {
  __m512 c0[MR], c1[MR];
  RowCursor<MR, float> xrow(x, x_ld);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    c0[r] = init ? _mm512_loadu_ps(init + r * init_ld) : _mm512_setzero_ps();
    c1[r] = init ? _mm512_loadu_ps(init + r * init_ld + 16) : _mm512_setzero_ps();
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t p = 0; p < pairs; ++p, xrow.advance(2)) {
    if (prefetch_pairs) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + (p + prefetch_pairs) * 2 * kDotCols + kDotCols), _MM_HINT_T0);
    }
    if (l2_lines) _mm_prefetch(l2_lines + p * 64, _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(wp + p * 2 * kDotCols), w1 = _mm512_loadu_si512(wp + p * 2 * kDotCols + kDotCols);
    const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xe = _mm512_set1_ps(xrow.at(r, 0)), xo = _mm512_set1_ps(xrow.at(r, 1));
      c0[r] = _mm512_fmadd_ps(xe, w0e, c0[r]);
      c1[r] = _mm512_fmadd_ps(xe, w1e, c1[r]);
      c0[r] = _mm512_fmadd_ps(xo, w0o, c0[r]);
      c1[r] = _mm512_fmadd_ps(xo, w1o, c1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) store(r, c0[r], c1[r]);
}

// fn(std::integral_constant<int, rows>) for rows in [1, kDotMaxRows]: a tile's row count as a template argument.
template <class Fn>
inline void with_tile_rows(int64_t rows, Fn&& fn) { with_rows<kDotMaxRows>(rows, fn); }

#endif

#if defined(__AVX512F__)
// r[i] lane j -> r[j] lane i: a 16 x 16 transpose of 32-bit values (interleaves of 32 and 64 bits within 128-bit
// lanes, then two rounds of lane shuffles).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  __m512i u[16];  // u[4b + c]: rows 4b..4b+3 of columns c, c + 4, c + 8, c + 12 (a 128-bit lane each)
  for (int b = 0; b < 4; ++b) {
    u[4 * b] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    u[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    u[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// Pairs p0 .. p0 + 15 of rows[0 .. n) (bfloat16 values, a pair an int32; rows from n on count as zeros) transposed:
// dst + q * ld gets pair p0 + q of every row, row r in lane r, in the lanes keep selects. Packs a key chunk's K as a
// panel (attend_dot).
__attribute__((always_inline)) inline void transpose_pairs16(const uint16_t* const* rows, int64_t n, int64_t p0, int32_t* dst, int64_t ld,
                              __mmask16 keep) {
  __m512i t[16];
  for (int64_t r = 0; r < 16; ++r) t[r] = r < n ? _mm512_loadu_si512(rows[r] + 2 * p0) : _mm512_setzero_si512();
  transpose16x16_epi32(t);
  for (int64_t q = 0; q < 16; ++q) {
    if (keep == 0xffff) _mm512_storeu_si512(dst + q * ld, t[q]);  // whole rows unmasked (a masked store cost
    else _mm512_mask_storeu_epi32(dst + q * ld, keep, t[q]);       // attend_dot 2-5%)
  }
}
#endif

}  // namespace tp
