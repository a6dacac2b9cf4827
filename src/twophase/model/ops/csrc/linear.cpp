// Linear kernels: y[M,N] = x[M,K] @ W[N,K]^T (+ bias). float32 / bfloat16 / int8 (one scale per output) weights in
// column panels at any M (see kPanel); GGUF-style Q8_0 and Q4_1 blocks of 32 row by row, each weight row streamed
// once for all M rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr int64_t QK = 32;  // GGUF block length

// ---- dense weight formats (the column panels below): load 8 consecutive weights as fp32 ----------------
struct WF32 {
  using T = float;
  static float one(const T* p) { return *p; }
#ifdef __AVX2__
  static __m256 eight(const T* p) { return _mm256_loadu_ps(p); }
#endif
};
struct WBF16 {
  using T = uint16_t;
  static float one(const T* p) { return bf16_to_f32(*p); }
#ifdef __AVX2__
  static __m256 eight(const T* p) { return load_bf16x8(p); }
#endif
};
struct WI8 {
  using T = int8_t;
  static float one(const T* p) { return static_cast<float>(*p); }
#ifdef __AVX2__
  static __m256 eight(const T* p) {
    __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
#endif
};

// ---- GGUF block formats ---------------------------------------------------------------------------------
// Q8_0: qs int8 [N, K], d float16 [N, K/32]; w = d * q.
// Q4_1: qs uint8 [N, K/2] (per block 16 bytes: low nibbles = elements 0..15, high = 16..31), d, m float16
//       [N, K/32]; w = d * q + m.  The min term is folded in via per-block sums of x.
// Scales stay float16 as GGUF stores them (2 bytes a block each, converted exactly when read): float32 scales
// made a Q4_1 block 24 bytes instead of 20, a fifth more to read per decode step.
// Both run with x rounded to int8 blocks (XQ8 below), as llama.cpp runs them.
// Each format: one() for the scalar path; load() its block's 32 weights as bytes and dot() their products
// with 32 int8 activations, summed to 8 int32, for the AVX2 path.
struct Q8_0 {
  using T = int8_t;
  static constexpr bool has_min = false;
  static constexpr int64_t bytes_per_block = QK;
  static float one(const T* blk, int j) { return static_cast<float>(blk[j]); }
#ifdef __AVX2__
  static __m256i load(const T* blk) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)); }
  static __m256i dot(__m256i w, __m256i a) {  // maddubs wants unsigned x signed: move w's sign onto a
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
#endif
};
struct Q4_1 {
  using T = uint8_t;
  static constexpr bool has_min = true;
  static constexpr int64_t bytes_per_block = QK / 2;
  static float one(const T* blk, int j) {
    return static_cast<float>(j < 16 ? (blk[j] & 0xF) : (blk[j - 16] >> 4));
  }
#ifdef __AVX2__
  static __m256i load(const T* blk) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);  // elements 0..15 then 16..31
  }
  static __m256i dot(__m256i w, __m256i a) {  // w in 0..15: u8 x s8 pairs fit int16
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
  }
#endif
};

// ---- int8 activations (llama.cpp's Q8_1 idea) --------------------------------------------------------------
// x is quantized per block of 32: x ≈ xd * xq (xq int8, xd = max|x| / 127, round to nearest even), and
// xs = xd * sum(xq) carries the block sum for Q4_1's min term. A block dot product is then one integer
// multiply-add chain (32 products per maddubs) and one float FMA with the two scales.
struct XQ8 {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d, s; // [M, K/32]
};

XQ8 quantize_x_q8(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  XQ8 r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t i = 0; i < M * nb; ++i) {
    int32_t sum = 0;
    const float d = quantize_block_int8(x + i * QK, QK, r.q.data() + i * QK, 0, &sum);
    r.d[i] = d;
    r.s[i] = d * static_cast<float>(sum);
  }
  return r;
}

// out[m][n] = sum_b d[n][b] * xd[m][b] * dot_b(xq[m], q[n]) (+ mn[n][b] * xs[m][b]) for an MR x NR tile.
// AVX2 path, per group of 8 blocks: the 8 block scales d * xd and the min term come from one float16 -> float32
// vector conversion each (F16C), then each block is one integer dot and one FMA into one of two accumulators
// (alternating, so consecutive FMAs do not wait on each other: one chain made a 576-wide row latency-bound).
template <class Q, int MR, int NR>
inline void q8_tile(const int8_t* const* xq, const float* const* xd, const float* const* xs,
                    const typename Q::T* const* q, const uint16_t* const* d, const uint16_t* const* mn, int64_t nb,
                    float (&out)[MR][NR]) {
  float minacc[MR][NR] = {};
  int64_t b = 0;
#if defined(__AVX2__) && defined(__F16C__)
  __m256 acc[2][MR][NR], macc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[0][m][n] = acc[1][m][n] = macc[m][n] = _mm256_setzero_ps();
  alignas(32) float sc[MR][NR][8];
  for (; b + 8 <= nb; b += 8) {
    for (int n = 0; n < NR; ++n) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d[n] + b)));
      for (int m = 0; m < MR; ++m) _mm256_store_ps(sc[m][n], _mm256_mul_ps(dv, _mm256_loadu_ps(xd[m] + b)));
      if constexpr (Q::has_min) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn[n] + b)));
        for (int m = 0; m < MR; ++m) macc[m][n] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs[m] + b), macc[m][n]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      __m256i wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = Q::load(q[n] + (b + j) * Q::bytes_per_block);
      for (int m = 0; m < MR; ++m) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + (b + j) * QK));
        for (int n = 0; n < NR; ++n) {
          const __m256 p = _mm256_cvtepi32_ps(Q::dot(wv[n], av));
          acc[j & 1][m][n] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&sc[m][n][j]), acc[j & 1][m][n]);
        }
      }
    }
  }
  for (; b < nb; ++b) {  // the last nb % 8 blocks
    __m256i wv[NR];
    float dn[NR];
    for (int n = 0; n < NR; ++n) wv[n] = Q::load(q[n] + b * Q::bytes_per_block), dn[n] = half_to_f32(d[n][b]);
    for (int m = 0; m < MR; ++m) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * QK));
      for (int n = 0; n < NR; ++n) {
        const __m256 p = _mm256_cvtepi32_ps(Q::dot(wv[n], av));
        acc[0][m][n] = _mm256_fmadd_ps(p, _mm256_set1_ps(dn[n] * xd[m][b]), acc[0][m][n]);
        if constexpr (Q::has_min) minacc[m][n] = std::fma(half_to_f32(mn[n][b]), xs[m][b], minacc[m][n]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n)
      if constexpr (Q::has_min) out[m][n] = hsum(_mm256_add_ps(acc[0][m][n], acc[1][m][n])) + hsum(macc[m][n]) + minacc[m][n];
      else out[m][n] = hsum(_mm256_add_ps(acc[0][m][n], acc[1][m][n]));
#else
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float acc = 0.f;
      for (b = 0; b < nb; ++b) {
        int32_t t = 0;
        for (int j = 0; j < QK; ++j)
          t += static_cast<int32_t>(xq[m][b * QK + j]) * static_cast<int32_t>(Q::one(q[n] + b * Q::bytes_per_block, j));
        acc += half_to_f32(d[n][b]) * xd[m][b] * static_cast<float>(t);
        if constexpr (Q::has_min) minacc[m][n] = std::fma(half_to_f32(mn[n][b]), xs[m][b], minacc[m][n]);
      }
      out[m][n] = acc + minacc[m][n];
    }
#endif
}

// ---- software prefetch (block formats) -----------------------------------------------------------------------
// Each thread streams a contiguous run of weight rows. For the block formats, whose integer dot products keep the
// core busy, asking for the row it reaches ~4 KB later as it starts a row let the memory keep up: the default
// model's 120 Q8_0 layer matrices at M = 1 on 2 Zen 3 cores, 11.1 -> 14.5 GB/s (standalone copy of this code,
// medians of 10; a plain read of the same bytes ~14-15 GB/s). The float32 rows (one FMA per weight) already read
// at that rate, and prefetching did not help them (14.2-15.0 -> 13.8-14.0 GB/s), so they do without.
constexpr int64_t kPrefetchBytes = 4096;

// Rows ahead that make ~kPrefetchBytes of a row-major weight whose rows are row_bytes long.
inline int64_t prefetch_rows_ahead(int64_t row_bytes) { return std::max<int64_t>(1, kPrefetchBytes / row_bytes); }

// ---- driver: partition N across threads, tile M by MR rows (tails clamp to the last row/col) --------------
struct Problem {
  int64_t M, N, K;
  const float* x;       // [M, K]
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N]
};

struct NoRowHook {
  void operator()(const int64_t*) const {}
};

// tile(xrows, n_index_array, out) computes one MR x NR tile; MR/NR chosen by M. starting_rows(rows) runs once per
// NR weight rows, before their tiles (the block formats prefetch with it).
template <int MR, int NR, class Tile, class RowHook = NoRowHook>
void run_tiles(const Problem& p, int64_t work_per_row, Tile tile, RowHook starting_rows = {}) {
  const int64_t nblk = (p.N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, NR * work_per_row));
  at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t bi = b0; bi < b1; ++bi) {
      int64_t rows[NR];
      for (int n = 0; n < NR; ++n) rows[n] = std::min(bi * NR + n, p.N - 1);
      starting_rows(rows);
      for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
        const float* xr[MR];
        int64_t ms[MR];
        for (int m = 0; m < MR; ++m) {
          ms[m] = std::min(m0 + m, p.M - 1);
          xr[m] = p.x + ms[m] * p.K;
        }
        float out[MR][NR];
        tile(xr, ms, rows, out);
        for (int m = 0; m < MR && m0 + m < p.M; ++m)
          for (int n = 0; n < NR && bi * NR + n < p.N; ++n) {
            float v = out[m][n];
            if (p.bias) v += p.bias[rows[n]];
            p.y[(m0 + m) * p.N + rows[n]] = v;
          }
      }
    }
  });
}

template <class Q, int MR, int NR>
void q8_run(const Problem& p, const typename Q::T* q, const uint16_t* d, const uint16_t* mn, const XQ8& xq) {
  const int64_t nb = p.K / QK, row_bytes = nb * Q::bytes_per_block, ahead = prefetch_rows_ahead(row_bytes);
  run_tiles<MR, NR>(p, p.K / 4, [&](const float* const*, const int64_t* ms, const int64_t* rows, float (&out)[MR][NR]) {
    const typename Q::T* qr[NR];
    const uint16_t* dr[NR];
    const uint16_t* mr[NR];
    const int8_t* xr[MR];
    const float* xd[MR];
    const float* xs[MR];
    for (int n = 0; n < NR; ++n) {
      qr[n] = q + rows[n] * nb * Q::bytes_per_block;
      dr[n] = d + rows[n] * nb;
      mr[n] = mn ? mn + rows[n] * nb : nullptr;
    }
    for (int m = 0; m < MR; ++m) {
      xr[m] = xq.q.data() + ms[m] * p.K;
      xd[m] = xq.d.data() + ms[m] * nb;
      xs[m] = xq.s.data() + ms[m] * nb;
    }
    q8_tile<Q, MR, NR>(xr, xd, xs, qr, dr, mr, nb, out);
  }, [&](const int64_t* rows) {  // the rows `ahead` of these: their blocks, scales (and mins)
    for (int n = 0; n < NR; ++n) {
      const int64_t r = rows[n] + ahead;
      if (r >= p.N) continue;
      prefetch_bytes(q + r * row_bytes, row_bytes);
      prefetch_bytes(d + r * nb, nb * 2);
      if (mn) prefetch_bytes(mn + r * nb, nb * 2);
    }
  });
}

template <class Q>
void q8_dispatch(const Problem& p, const typename Q::T* q, const uint16_t* d, const uint16_t* mn) {
  const XQ8 xq = quantize_x_q8(p.x, p.M, p.K);
  // One weight row per tile: rows n..n+3 read in lockstep are four short interleaved streams the prefetcher
  // follows badly (30 layers of Q4_1 at M = 1: 14.2 ms with 4 rows per tile, 7.0 ms with 1, on 2 Zen 3 cores).
  if (p.M == 1) q8_run<Q, 1, 1>(p, q, d, mn, xq);
  else if (p.M == 2) q8_run<Q, 2, 1>(p, q, d, mn, xq);
  else if (p.M == 3) q8_run<Q, 3, 1>(p, q, d, mn, xq);
  else q8_run<Q, 4, 1>(p, q, d, mn, xq);
}

// ---- column panels (float32 / bfloat16 / int8 weights at any batch size) ----------------------------------
// The weight [N, K] is packed once at load time (linear.py: pack_panels) into panels of kPanel = 24 output columns, k-major:
// panels[p][k][j] = W[p * 24 + j][k] (rows past N zero). A 4 x 24 tile keeps 12 accumulators, loads the panel's
// 24 weights of one k into 3 registers and multiplies them by 4 broadcast activations (x packed k-major per block
// of 4 rows, as a BLIS micro-kernel does): 12 FMAs per 3 vector loads + 4 broadcasts, so it runs at the FMA rate
// instead of streaming each weight row per row tile. SmolLM2-135M's 120 layer matrices on 2 Zen 3 cores, against
// oneDNN's prepacked GEMM (what inductor's freezing uses; benchmarks/bench_kernels.py --gemm): 137 vs 108 GFLOP/s at
// 32 rows, 155 vs 137 at 512 (the FMA peak measured on the same cores: 182); one row, 2 chains per column: at the
// bandwidth of the row-streaming kernel it replaced.
// Every output is one FMA chain over k = 0..K-1 in order at every batch size, so each row's result is the same
// whatever the batch (batch-invariant), except the one-row kernel (two chains, even and odd k), which runs only
// when batch invariance is not asked for.
constexpr int64_t kPanel = 24;

template <class W>
struct PanelProblem {
  int64_t M, N, K;
  const typename W::T* panels;  // [ceil(N / 24), K, 24]
  const float* scale;           // [N] or nullptr (int8: one scale per output)
  const float* bias;            // [N] or nullptr
  float* y;                     // [M, N]; [M, N / 2] where gated
  int64_t gate_panels = 0;      // gated: N / 48, the panels of W's gate half (see physical_panel)
};

// The panel at position q of a projection's panel order: panel q itself, or, for a gate / up projection whose outputs
// go straight through SiLU-and-mul (gate_panels > 0: y = silu(x Wg^T) * (x Wu^T)), gate panel i at 2i and up panel
// i at 2i + 1. A thread then computes a row chunk's gate and up values of the same 24 outputs one after the other
// (store_panel), and the [M, N] product never exists: a prefill chunk of 2048 rows wrote and read back 25 MB of it
// a layer for the default model, and its SiLU-and-mul was a pass of its own.
template <class W>
inline int64_t physical_panel(const PanelProblem<W>& p, int64_t q) {
  return p.gate_panels == 0 ? q : q % 2 == 0 ? q / 2 : p.gate_panels + q / 2;
}

// ---- GGUF blocks in column panels: float32 weights read at a quarter of their bytes or less ------------------
// A float32 weight dequantised from Q8_0 / Q4_1 blocks is exactly d * q (+ m) in float32: a float16 d times a 4- or
// 8-bit integer has at most 19 significant bits, so the only rounding is the + m, and an FMA rounds it the same way.
// Kept as those blocks, rearranged per column panel and 32 k (linear.py: pack_block_panels), the weight streams at
// 1.06 (Q8_0) / 0.625 (Q4_1) bytes instead of 4, and is widened into the float32 panel (the thread's scratch) once
// per pass: the tiles then run the float32 panel's arithmetic on the same values, bit for bit the float32 weight's.
// One panel's block of 32 k (block_bytes): d [24] float16, (Q4_1: m [24] float16,) then q as [32 k][24 columns]:
// Q8_0 one int8 each; Q4_1 one byte per column for each pair of k (k even in the low nibble, k + 1 in the high).
// AVX2 + F16C: Scales(blk) holds a block's d (and m) for the 24 columns as 3 vectors each; pair(blk, sc, k, c) gives the
// float32 weights of k and k + 1 (k even) at columns 8c .. 8c + 7 (widen_block, the panel into the scratch, uses it);
// ints(blk, k, c) the integers q of the same places, as float32 (block_rows_folded uses them).
struct PQ8_0 {
  using T = uint8_t;
  static constexpr int64_t block_bytes = 2 * kPanel + QK * kPanel;
  static const uint16_t* d_of(const uint8_t* blk) { return reinterpret_cast<const uint16_t*>(blk); }
  static const int8_t* q_of(const uint8_t* blk) { return reinterpret_cast<const int8_t*>(blk + 2 * kPanel); }
  static constexpr bool has_min = false;
#if defined(__AVX2__) && defined(__F16C__)
  struct Scales {
    __m256 d[3];
    explicit Scales(const uint8_t* blk) {
      for (int c = 0; c < 3; ++c) d[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_of(blk) + 8 * c)));
    }
  };
  static void ints(const uint8_t* blk, int64_t k, int c, __m256& q0, __m256& q1) {  // q of k, k + 1 as float32
    auto row = [&](int64_t kk) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q_of(blk) + kk * kPanel + 8 * c));
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    };
    q0 = row(k), q1 = row(k + 1);
  }
  static void pair(const uint8_t* blk, const Scales& sc, int64_t k, int c, __m256& w0, __m256& w1) {  // d * q
    ints(blk, k, c, w0, w1);
    w0 = _mm256_mul_ps(sc.d[c], w0), w1 = _mm256_mul_ps(sc.d[c], w1);
  }
#endif
  static float one(const uint8_t* blk, int64_t k, int64_t j) {
    return half_to_f32(d_of(blk)[j]) * static_cast<float>(q_of(blk)[k * kPanel + j]);
  }
};
struct PQ4_1 {
  using T = uint8_t;
  static constexpr int64_t block_bytes = 4 * kPanel + QK / 2 * kPanel;
  static const uint16_t* d_of(const uint8_t* blk) { return reinterpret_cast<const uint16_t*>(blk); }
  static const uint16_t* m_of(const uint8_t* blk) { return d_of(blk) + kPanel; }
  static const uint8_t* q_of(const uint8_t* blk) { return blk + 4 * kPanel; }
  static constexpr bool has_min = true;  // Q4_1's min term (block_rows_folded)
#if defined(__AVX2__) && defined(__F16C__)
  struct Scales {
    __m256 d[3], m[3];
    explicit Scales(const uint8_t* blk) {
      for (int c = 0; c < 3; ++c) {
        d[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_of(blk) + 8 * c)));
        m[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_of(blk) + 8 * c)));
      }
    }
  };
  static void ints(const uint8_t* blk, int64_t k, int c, __m256& q0, __m256& q1) {  // q of k, k + 1 as float32
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q_of(blk) + k / 2 * kPanel + 8 * c));
    const __m256i v = _mm256_cvtepu8_epi32(b);
    q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
    q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static void pair(const uint8_t* blk, const Scales& sc, int64_t k, int c, __m256& w0, __m256& w1) {  // d * q + m
    ints(blk, k, c, w0, w1);
    w0 = _mm256_fmadd_ps(sc.d[c], w0, sc.m[c]), w1 = _mm256_fmadd_ps(sc.d[c], w1, sc.m[c]);
  }
#endif
  static float one(const uint8_t* blk, int64_t k, int64_t j) {
    const uint8_t b = q_of(blk)[k / 2 * kPanel + j];
    return std::fma(half_to_f32(d_of(blk)[j]), static_cast<float>(k % 2 ? b >> 4 : b & 0xF), half_to_f32(m_of(blk)[j]));
  }
};

// One block of 32 k of a panel, widened: out [32][24] float32.
template <class W>
inline void widen_block(const uint8_t* blk, float* out) {
#if defined(__AVX2__) && defined(__F16C__)
  const typename W::Scales sc(blk);
  for (int64_t k = 0; k < QK; k += 2)
    for (int c = 0; c < 3; ++c) {
      __m256 w0, w1;
      W::pair(blk, sc, k, c, w0, w1);
      _mm256_storeu_ps(out + k * kPanel + 8 * c, w0);
      _mm256_storeu_ps(out + (k + 1) * kPanel + 8 * c, w1);
    }
#else
  for (int64_t k = 0; k < QK; ++k)
    for (int64_t j = 0; j < kPanel; ++j) out[k * kPanel + j] = W::one(blk, k, j);
#endif
}

// Whether W is a block-panel format (PQ8_0, PQ4_1), and the elements of W::T one panel of K inputs takes.
template <class W, class = void>
struct BlockPanel : std::false_type {};
template <class W>
struct BlockPanel<W, std::void_t<decltype(W::block_bytes)>> : std::true_type {};
template <class W>
constexpr int64_t panel_stride(int64_t K) {
  if constexpr (BlockPanel<W>::value) return K / QK * W::block_bytes;
  else return K * kPanel;
}

// A tile's rows of x: element (m, k) at x[k * k_step + m * row_step]. Rows in place: k_step 1, row_step K; packed
// k-major per block of 4 rows (pack_rows_k_major): k_step = the block's rows, row_step 1.
struct XRows {
  const float* x;
  int64_t k_step, row_step;
};

// acc[m][0..23] of one panel's 24 columns for MR rows of x (xr). The accumulators are named variables, not an array:
// GCC kept an array's 12 vectors in registers but stored them to the stack on every k (54 instead of ~145 GFLOP/s at
// 32 rows). Each k broadcasts one value of each row from wherever the rows lie: the AVX2 tile reads them in place,
// the 4 rows' next values (16-24 KB of x at most) staying in L1 beside the panel.
template <class W, int MR>
inline void panel_tile(XRows xr, const typename W::T* wp, int64_t K, float (&acc)[MR][kPanel]) {
  static_assert(MR >= 1 && MR <= 4, "tiles of 1-4 rows");
  const float* xp = xr.x;
  const int64_t r1 = xr.row_step, r2 = 2 * xr.row_step, r3 = 3 * xr.row_step;
#ifdef __AVX2__
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c02 = zero, c10 = zero, c11 = zero, c12 = zero;
  __m256 c20 = zero, c21 = zero, c22 = zero, c30 = zero, c31 = zero, c32 = zero;
  for (int64_t k = 0; k < K; ++k, wp += kPanel, xp += xr.k_step) {
    __m256 w0 = W::eight(wp), w1 = W::eight(wp + 8), w2 = W::eight(wp + 16);
    TP_IN_REGISTER(w0);
    TP_IN_REGISTER(w1);
    TP_IN_REGISTER(w2);
    __m256 b = _mm256_broadcast_ss(xp);
    c00 = _mm256_fmadd_ps(b, w0, c00), c01 = _mm256_fmadd_ps(b, w1, c01), c02 = _mm256_fmadd_ps(b, w2, c02);
    if constexpr (MR > 1) {
      b = _mm256_broadcast_ss(xp + r1);
      c10 = _mm256_fmadd_ps(b, w0, c10), c11 = _mm256_fmadd_ps(b, w1, c11), c12 = _mm256_fmadd_ps(b, w2, c12);
    }
    if constexpr (MR > 2) {
      b = _mm256_broadcast_ss(xp + r2);
      c20 = _mm256_fmadd_ps(b, w0, c20), c21 = _mm256_fmadd_ps(b, w1, c21), c22 = _mm256_fmadd_ps(b, w2, c22);
    }
    if constexpr (MR > 3) {
      b = _mm256_broadcast_ss(xp + r3);
      c30 = _mm256_fmadd_ps(b, w0, c30), c31 = _mm256_fmadd_ps(b, w1, c31), c32 = _mm256_fmadd_ps(b, w2, c32);
    }
  }
  const __m256 rows[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(acc[m] + 8 * j, rows[m][j]);
#else
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kPanel; ++j) acc[m][j] = 0.f;
  (void)r2, (void)r3;
  for (int64_t k = 0; k < K; ++k, wp += kPanel, xp += xr.k_step)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kPanel; ++j) acc[m][j] = std::fma(xp[m * r1], W::one(wp + j), acc[m][j]);
#endif
}

// AVX-512 F + DQ (DQ: the 256-bit halves' insert / extract): panel_run takes pairs of panels (panel_pair_tile8).
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define TP_PAIR_TILES 1
#else
#define TP_PAIR_TILES 0
#endif

// AVX-512: 8 rows of two adjacent panels (48 columns) of float32 weights in 24 zmm accumulators. Per k: columns
// 0-15 of each panel in one zmm each, the two panels' columns 16-23 together in a third, and each row's x broadcast
// into the three (the tail of panel a in the low half, of panel b in the high half). 24 FMAs per 4 loads and 8
// broadcasts, where the 4 x 24 AVX2 tile (12 FMAs of half the width) runs at about 60% of that width's peak:
// SmolLM2's gate/up shape at 512 rows on 2 Xeon cores with AVX512 (standalone copy), 180 -> 300 GFLOP/s.
// Every output is the same FMA chain over k = 0..K-1 as in panel_tile, so the bits are panel_tile's.
// xa, xb: two full 4-row blocks of x packed k-major; wa, wb: the panels; acc_a / acc_b: their 8 x 24 results.
#if TP_PAIR_TILES
inline void panel_pair_tile8(const float* xa, const float* xb, const float* wa, const float* wb, int64_t K,
                             float (&acc_a)[8][kPanel], float (&acc_b)[8][kPanel]) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 c00 = zero, c01 = zero, c02 = zero, c10 = zero, c11 = zero, c12 = zero, c20 = zero, c21 = zero, c22 = zero;
  __m512 c30 = zero, c31 = zero, c32 = zero, c40 = zero, c41 = zero, c42 = zero, c50 = zero, c51 = zero, c52 = zero;
  __m512 c60 = zero, c61 = zero, c62 = zero, c70 = zero, c71 = zero, c72 = zero;
  for (int64_t k = 0; k < K; ++k, wa += kPanel, wb += kPanel, xa += 4, xb += 4) {
    __m512 w0 = _mm512_loadu_ps(wa), w1 = _mm512_loadu_ps(wb);
    __m512 w2 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(wa + 16)), _mm256_loadu_ps(wb + 16), 1);
    TP_IN_REGISTER(w0);
    TP_IN_REGISTER(w1);
    TP_IN_REGISTER(w2);
#define TP_PAIR_ROW(r, x)                                                                                       \
  {                                                                                                             \
    const __m512 b = _mm512_set1_ps(x);                                                                         \
    c##r##0 = _mm512_fmadd_ps(b, w0, c##r##0), c##r##1 = _mm512_fmadd_ps(b, w1, c##r##1);                      \
    c##r##2 = _mm512_fmadd_ps(b, w2, c##r##2);                                                                  \
  }
    TP_PAIR_ROW(0, xa[0]) TP_PAIR_ROW(1, xa[1]) TP_PAIR_ROW(2, xa[2]) TP_PAIR_ROW(3, xa[3])
    TP_PAIR_ROW(4, xb[0]) TP_PAIR_ROW(5, xb[1]) TP_PAIR_ROW(6, xb[2]) TP_PAIR_ROW(7, xb[3])
#undef TP_PAIR_ROW
  }
  const __m512 rows[8][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32},
                             {c40, c41, c42}, {c50, c51, c52}, {c60, c61, c62}, {c70, c71, c72}};
  for (int m = 0; m < 8; ++m) {
    _mm512_storeu_ps(acc_a[m], rows[m][0]);
    _mm256_storeu_ps(acc_a[m] + 16, _mm512_castps512_ps256(rows[m][2]));
    _mm512_storeu_ps(acc_b[m], rows[m][1]);
    _mm256_storeu_ps(acc_b[m] + 16, _mm512_extractf32x8_ps(rows[m][2], 1));
  }
}
#endif

// One row, two FMA chains per column (even and odd k, added at the end): the chains hide the FMA latency that one
// chain over a 576-long row exposes (not batch-invariant: another summation order than panel_tile).
template <class W>
inline void panel_row_two_chains(const float* x, const typename W::T* wp, int64_t K, float (&acc)[1][kPanel]) {
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2, wp += 2 * kPanel) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(xa, W::eight(wp), a0);
    a1 = _mm256_fmadd_ps(xa, W::eight(wp + 8), a1);
    a2 = _mm256_fmadd_ps(xa, W::eight(wp + 16), a2);
    b0 = _mm256_fmadd_ps(xb, W::eight(wp + 24), b0);
    b1 = _mm256_fmadd_ps(xb, W::eight(wp + 32), b1);
    b2 = _mm256_fmadd_ps(xb, W::eight(wp + 40), b2);
  }
  if (k < K) {
    const __m256 xa = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xa, W::eight(wp), a0);
    a1 = _mm256_fmadd_ps(xa, W::eight(wp + 8), a1);
    a2 = _mm256_fmadd_ps(xa, W::eight(wp + 16), a2);
  }
  _mm256_storeu_ps(acc[0], _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(acc[0] + 8, _mm256_add_ps(a1, b1));
  _mm256_storeu_ps(acc[0] + 16, _mm256_add_ps(a2, b2));
#else
  panel_tile<W, 1>(XRows{x, 1, K}, wp, K, acc);
#endif
}

// Rows through a block panel without widening its weights: per block of 32 k, each row's products with the
// integers q from one decoding of them, then acc += d * that + m * xsum[row][block] (the block's sum of the row's x;
// Q4_1 only), the min term folded out of the weights as llama.cpp's dot products do. One FMA a weight and row
// instead of two, each block asking for the bytes ~4 KB ahead (software prefetch, as the row kernels above), and the
// panel's bytes read once for all R rows, where widening it (to_float_panel, then float32 tiles) took longer than
// the few rows' arithmetic. One row keeps two FMA chains per column (even and odd k), R rows one each (the rows'
// chains are independent already). SmolLM2's 120 Q4_1 matrices (66 MB) at one row on 2 Xeon cores (AVX-512;
// standalone copy, medians of 15): widened in registers without prefetch 4.9-5.1 ms, with it 3.6-4.2, folded with
// it 3.3-3.5; engine decode at 2 / 4 requests 144-149 / 231-245 -> 247-300 / 352-400 tok/s. Not the float32 panels'
// bits (another rounding order of the same products, within float32 rounding of them; tested against float64), so
// only where batch invariance is not asked for. R rows need R x 3 accumulators, 6 integer vectors and 2 broadcasts:
// AVX-512's 32 registers hold R = 4, AVX2's 16 hold R = 2 (kFoldRows).
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int kFoldRows = 4;
#else
constexpr int kFoldRows = 2;
#endif
// Rows up to which block panels fold: two passes of kFoldRows over each panel (from L1), past which the folding's
// decoding of the integers per pass costs more than widening the panel once for float32 tiles.
constexpr int64_t kFoldMaxRows = 2 * kFoldRows - 1;

constexpr bool folding_supported() {  // block_rows_folded has a vector body
#if defined(__AVX2__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// acc[r] = the 24 outputs of row r of x [R, K] (rows K apart; xsum [R, K / 32]).
template <class W, int R>
inline void block_rows_folded(const float* x, const float* xsum, const uint8_t* wp, int64_t K,
                              float (&acc)[R][kPanel]) {
#if defined(__AVX2__) && defined(__F16C__)
  constexpr int kChains = R == 1 ? 2 : 1;
  const int64_t blocks = K / QK;
  __m256 a[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) a[r][c] = _mm256_setzero_ps();
  for (int64_t k0 = 0, blk = 0; k0 < K; k0 += QK, wp += W::block_bytes, ++blk) {
    prefetch_bytes(wp + kPrefetchBytes, W::block_bytes);  // the bytes this thread reaches ~4 KB later (see above)
    __m256 dot[R][kChains][3];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kChains; ++h)
        for (int c = 0; c < 3; ++c) dot[r][h][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < QK; k += 2) {
      __m256 q0[3], q1[3];
      for (int c = 0; c < 3; ++c) W::ints(wp, k, c, q0[c], q1[c]);
      for (int r = 0; r < R; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * K + k0 + k), xb = _mm256_broadcast_ss(x + r * K + k0 + k + 1);
        for (int c = 0; c < 3; ++c) {
          dot[r][0][c] = _mm256_fmadd_ps(xa, q0[c], dot[r][0][c]);
          dot[r][kChains - 1][c] = _mm256_fmadd_ps(xb, q1[c], dot[r][kChains - 1][c]);
        }
      }
    }
    const typename W::Scales sc(wp);
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 3; ++c) {
        const __m256 d = kChains == 2 ? _mm256_add_ps(dot[r][0][c], dot[r][1][c]) : dot[r][0][c];
        a[r][c] = _mm256_fmadd_ps(sc.d[c], d, a[r][c]);
      }
      if constexpr (W::has_min) {
        const __m256 xs = _mm256_broadcast_ss(xsum + r * blocks + blk);
        for (int c = 0; c < 3; ++c) a[r][c] = _mm256_fmadd_ps(sc.m[c], xs, a[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm256_storeu_ps(acc[r] + 8 * c, a[r][c]);
#else
  (void)x, (void)xsum, (void)wp, (void)K, (void)acc;  // never called: folding_supported() is false
#endif
}

// Rows of x per pass over a thread's panels: the rows' values stay in cache while the panels stream.
constexpr int64_t kPanelRowChunk = 256;

// Where gated, a gate panel's values wait for its up panel's in this thread's scratch, row m at m % kPanelRowChunk.
inline float* gate_values(int64_t m) {
  return thread_scratch<3>(kPanelRowChunk * kPanel) + m % kPanelRowChunk * kPanel;
}

// out[j] = silu(g[j]) * u[j] for one panel's 24 outputs: silu_and_mul's arithmetic (fused.cpp), the same bits.
inline void silu_mul_panel(const float* g, const float* u, float* out) {
#ifdef __AVX2__
  for (int c = 0; c < kPanel; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + c)), _mm256_loadu_ps(u + c)));
#else
  for (int c = 0; c < kPanel; ++c) out[c] = silu_one(g[c]) * u[c];
#endif
}

// y[j] = acc[j] (* scale[j]) (+ bias[j]) for j < cols (scale, bias: nullptr for none), a multiply then an add as the
// scalar loop rounds them. A whole panel's row in vectors, three of them, a count GCC unrolls: the one loop over
// `cols` it made a call to memcpy for the common case (neither) on every row of every tile (1% of a profiled prefill
// step; the 121 block-panel matrices, both builds in one process: 0.995x the time at 32 and at 256 rows, same bits).
inline void store_row(const float* acc, const float* scale, const float* bias, int64_t cols, float* y) {
#ifdef __AVX2__
  if (cols == kPanel) {  // a whole row: a fixed count of vectors, which GCC unrolls instead of calling memcpy
    for (int64_t c = 0; c < kPanel; c += 8) {
      __m256 v = _mm256_loadu_ps(acc + c);
      if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + c));
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
      _mm256_storeu_ps(y + c, v);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < cols; ++j) {
    float v = acc[j];
    if (scale) v *= scale[j];
    if (bias) v += bias[j];
    y[j] = v;
  }
}

// y[m0 .. m0 + MR)[panel's columns] = acc * scale + bias (only the columns below N); gated: a gate panel's values
// wait (gate_values), an up panel's meet them in y = silu(gate) * up.
template <class W, int MR>
inline void store_panel(const PanelProblem<W>& p, int64_t m0, int64_t panel, const float (&acc)[MR][kPanel]) {
  const int64_t n0 = physical_panel(p, panel) * kPanel, cols = std::min(kPanel, p.N - n0);
  const bool up = p.gate_panels > 0 && panel % 2 == 1;
  float* gates = p.gate_panels > 0 ? gate_values(m0) : nullptr;  // the tile's rows lie in one row chunk
  const float* scale = p.scale ? p.scale + n0 : nullptr;
  const float* bias = p.bias ? p.bias + n0 : nullptr;
  for (int m = 0; m < MR; ++m) {
    float up_values[kPanel];
    float* yr = p.gate_panels == 0 ? p.y + (m0 + m) * p.N + n0 : up ? up_values : gates + m * kPanel;
    store_row(acc[m], scale, bias, cols, yr);
    if (up) {  // output column (n0 / 24 - gate_panels) * 24 of y [M, N / 2]
      float* out = p.y + (m0 + m) * (p.N / 2) + (n0 / kPanel - p.gate_panels) * kPanel;
      silu_mul_panel(gates + m * kPanel, up_values, out);
    }
  }
}

// Rows m0 .. m0 + MR of one panel, its weights at wp (the panel itself, or its float32 copy: WT = WF32).
template <class WT, int MR, class W>
inline void panel_block(const PanelProblem<W>& p, const typename WT::T* wp, XRows xr, int64_t m0, int64_t panel) {
  float acc[MR][kPanel];
  panel_tile<WT, MR>(xr, wp, p.K, acc);
  store_panel<W, MR>(p, m0, panel, acc);
}

// The sums of each row of x [M, K] over each block of 32 k, in order: the folded kernels' min term ([M, K / 32]).
inline const float* block_sums(const float* x, int64_t M, int64_t K) {
  float* sums = thread_scratch<2>(M * (K / QK));
  for (int64_t b = 0; b < M * (K / QK); ++b) {
    float s = 0.f;
    for (int64_t k = 0; k < QK; ++k) s += x[b * QK + k];
    sums[b] = s;
  }
  return sums;
}

// Rows m0 .. m0 + R of one block panel through block_rows_folded (R < 1 + kFoldRows), stored.
template <class W, int R>
inline void fold_rows(const PanelProblem<W>& p, const float* x, const float* xsum, const uint8_t* wq, int64_t m0,
                      int64_t panel) {
  float acc[R][kPanel];
  block_rows_folded<W, R>(x + m0 * p.K, xsum + m0 * (p.K / QK), wq, p.K, acc);
  store_panel<W, R>(p, m0, panel, acc);
}

// x [M, K] packed k-major per block of 4 rows (the last block holds the M % 4 rows left): block b at b * 4 * K.
const float* pack_rows_k_major(const float* x, int64_t M, int64_t K) {
  float* xp = thread_scratch<0>(M * K);
  at::parallel_for(0, (M + 3) / 4, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * 4, mr = std::min<int64_t>(4, M - m0);
      float* dst = xp + m0 * K;
      int64_t k = 0;
#ifdef __AVX2__
      if (mr == 4) {  // four rows' next 4 values transposed into 16 consecutive floats
        const float* r = x + m0 * K;
        for (; k + 4 <= K; k += 4) {
          __m128 a = _mm_loadu_ps(r + k), b = _mm_loadu_ps(r + K + k);
          __m128 c = _mm_loadu_ps(r + 2 * K + k), d = _mm_loadu_ps(r + 3 * K + k);
          _MM_TRANSPOSE4_PS(a, b, c, d);
          _mm_storeu_ps(dst + k * 4, a), _mm_storeu_ps(dst + k * 4 + 4, b);
          _mm_storeu_ps(dst + k * 4 + 8, c), _mm_storeu_ps(dst + k * 4 + 12, d);
        }
      }
#endif
      for (; k < K; ++k)
        for (int64_t m = 0; m < mr; ++m) dst[k * mr + m] = x[(m0 + m) * K + k];
    }
  });
  return xp;
}

// A panel's K x 24 weights as float32 (exact).
template <class W>
inline void to_float_panel(const typename W::T* wp, int64_t K, float* out) {
  if constexpr (BlockPanel<W>::value) {
    for (int64_t b = 0; b < K / QK; ++b) widen_block<W>(wp + b * W::block_bytes, out + b * QK * kPanel);
  } else {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i < K * kPanel; i += 8) _mm256_storeu_ps(out + i, W::eight(wp + i));
#endif
    for (; i < K * kPanel; ++i) out[i] = W::one(wp + i);
  }
}

// panel_block for the 1-4 rows left at m0.
template <class WT, class W>
inline void panel_rows(const PanelProblem<W>& p, const typename WT::T* wp, XRows xr, int64_t m0, int64_t q,
                       int64_t rows) {
  switch (rows) {
    case 4: panel_block<WT, 4>(p, wp, xr, m0, q); break;
    case 3: panel_block<WT, 3>(p, wp, xr, m0, q); break;
    case 2: panel_block<WT, 2>(p, wp, xr, m0, q); break;
    default: panel_block<WT, 1>(p, wp, xr, m0, q);
  }
}

// Rows beyond which bfloat16 / int8 panels are converted to float32 once per pass (see panel_run).
constexpr int64_t kConvertRows = 8;

constexpr bool kPairTiles = TP_PAIR_TILES;  // whether panel_run takes pairs of panels (panel_pairs)

// Rows c0 .. c1 (x packed: pack_rows_k_major) of the whole pairs of panels in q0 .. q1, float32 weights (W itself,
// or widened into wf, room for two panels): 8 rows at a time by panel_pair_tile8, the rows left by panel_tile per
// panel. Returns the first panel not done (q1, or the odd one left).
template <class W>
int64_t panel_pairs(const PanelProblem<W>& p, const float* xp, int64_t c0, int64_t c1, int64_t q0, int64_t q1,
                    float* wf) {
  int64_t q = q0;
#if TP_PAIR_TILES
  for (; q + 2 <= q1; q += 2) {
    const typename W::T* wa = p.panels + physical_panel(p, q) * panel_stride<W>(p.K);
    const typename W::T* wb = p.panels + physical_panel(p, q + 1) * panel_stride<W>(p.K);
    const float *fa, *fb;
    if (wf) {
      to_float_panel<W>(wa, p.K, wf);
      to_float_panel<W>(wb, p.K, wf + p.K * kPanel);
      fa = wf, fb = wf + p.K * kPanel;
    } else {
      fa = reinterpret_cast<const float*>(wa), fb = reinterpret_cast<const float*>(wb);
    }
    int64_t m0 = c0;
    for (; m0 + 8 <= c1; m0 += 8) {
      float acc_a[8][kPanel], acc_b[8][kPanel];
      panel_pair_tile8(xp + m0 * p.K, xp + (m0 + 4) * p.K, fa, fb, p.K, acc_a, acc_b);
      store_panel<W, 8>(p, m0, q, acc_a);
      store_panel<W, 8>(p, m0, q + 1, acc_b);
    }
    for (; m0 < c1; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, c1 - m0);
      const XRows xr{xp + m0 * p.K, rows, 1};
      panel_rows<WF32>(p, fa, xr, m0, q, rows);
      panel_rows<WF32>(p, fb, xr, m0, q + 1, rows);
    }
  }
#else
  (void)p, (void)xp, (void)c0, (void)c1, (void)q1, (void)wf;
#endif
  return q;
}

template <class W>
void panel_run(const PanelProblem<W>& p, const float* x, bool batch_invariant) {
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
  // Groups of panels (times chunks of rows) go to the threads in runs as they finish the ones before (guided_for):
  // a static half each left one core idle ~12% of a profiled batch-32 decode step, and items of a fixed few panels
  // left one thread a whole extra item when the other started late (batch-1 decode steps, bfloat16 panels, 2 Zen 4
  // cores, builds alternating 4 times: 210 -> 222 tok/s in medians of the steps; --quantization gguf 215 / 217).
  const int64_t group = kPairTiles || p.gate_panels ? 2 : 1;  // whole pairs of panels in a group (panel_pairs; gated)
  const int64_t groups = (panels + group - 1) / group;
  // One row is already k-major, so it is not packed; without batch invariance it takes the two-chain kernel.
  const bool two_chains = p.M == 1 && !batch_invariant;
  // a few rows through block panels, without batch invariance: folded, kFoldRows at a time (block_rows_folded)
  constexpr bool blocks = BlockPanel<W>::value;
  const bool folded = blocks && folding_supported() && !batch_invariant && p.M <= kFoldMaxRows;
  // Only the AVX-512 pair tiles read x packed k-major per 4 rows; the other kernels read the rows in place.
  const bool packed = kPairTiles && !two_chains && !folded;
  const float* xp = packed ? pack_rows_k_major(x, p.M, p.K) : x;
  auto rows_at = [&](int64_t m0, int64_t rows) {
    return packed ? XRows{xp + m0 * p.K, rows, 1} : XRows{x + m0 * p.K, 1, p.K};
  };
  const float* xsum = nullptr;  // the folded kernels' block sums of the rows
  if constexpr (blocks) {
    if (W::has_min && folded) xsum = block_sums(x, p.M, p.K);
  }
  // bfloat16 / int8 panels for more than kConvertRows rows: converted to float32 once per panel and pass, not once
  // per 4-row tile (int8 converts in 3 instructions per 8 weights, in every tile). The conversion is exact, so
  // every row's arithmetic is the same either way.
  // Block panels are widened into the scratch at every batch size (their tiles have no other way to read them),
  // except a few rows without batch invariance (block_rows_folded, never widened).
  constexpr bool convertible = !std::is_same_v<W, WF32>;
  auto converted = [&] {
    const int64_t panels_at_once = kPairTiles ? 2 : 1;  // panel_pairs widens two
    return convertible && ((blocks && !two_chains && !folded) || (!blocks && p.M > kConvertRows))
               ? thread_scratch<1>(panels_at_once * p.K * kPanel)
               : nullptr;
  };
  const int64_t chunks = (p.M + kPanelRowChunk - 1) / kPanelRowChunk;
  auto run_item = [&](int64_t item, float* wf) {
    // Row chunks outermost: every group of one chunk before the next, so the chunk's packed rows stay in cache.
    const int64_t c0 = item / groups * kPanelRowChunk, c1 = std::min(p.M, c0 + kPanelRowChunk);
    const int64_t q0 = item % groups * group, q1 = std::min(panels, q0 + group);
    int64_t q = q0;
    if constexpr (kPairTiles) {
      if (!two_chains && (wf || std::is_same_v<W, WF32>)) q = panel_pairs(p, xp, c0, c1, q0, q1, wf);
    }
    for (; q < q1; ++q) {
      const typename W::T* wq = p.panels + physical_panel(p, q) * panel_stride<W>(p.K);
      if constexpr (blocks) {
        if (folded) {
          for (int64_t m0 = 0; m0 < p.M; m0 += kFoldRows) {
            switch (std::min<int64_t>(kFoldRows, p.M - m0)) {
              case 1: fold_rows<W, 1>(p, x, xsum, wq, m0, q); break;
              case 2: fold_rows<W, 2>(p, x, xsum, wq, m0, q); break;
              case 3: fold_rows<W, kFoldRows >= 3 ? 3 : 1>(p, x, xsum, wq, m0, q); break;
              default: fold_rows<W, kFoldRows>(p, x, xsum, wq, m0, q); break;
            }
          }
          continue;
        }
      }
      if (two_chains) {  // one row: other formats read as they are, block panels widened (no folding built)
        float acc[1][kPanel];
        if constexpr (blocks) {
          float* scratch = thread_scratch<1>(p.K * kPanel);
          to_float_panel<W>(wq, p.K, scratch);
          panel_row_two_chains<WF32>(x, scratch, p.K, acc);
        } else {
          panel_row_two_chains<W>(x, wq, p.K, acc);
        }
        store_panel<W, 1>(p, 0, q, acc);
        continue;
      }
      if (wf) to_float_panel<W>(wq, p.K, wf);
      for (int64_t m0 = c0; m0 < c1; m0 += 4) {
        const int64_t rows = std::min<int64_t>(4, p.M - m0);
        if (wf) panel_rows<WF32>(p, wf, rows_at(m0, rows), m0, q, rows);
        else if constexpr (!blocks) panel_rows<W>(p, wq, rows_at(m0, rows), m0, q, rows);
      }
    }
  };
  guided_for(groups * chunks, converted, [&](int64_t u0, int64_t u1, float* wf) {
    for (int64_t item = u0; item < u1; ++item) run_item(item, wf);
  });
}

// ---- argument checking -----------------------------------------------------------------------------------
at::Tensor prep_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K=", K, ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  return x.contiguous();
}

const float* prep_vec(const c10::optional<at::Tensor>& t, int64_t N, const char* what, at::Tensor& keep) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == N, what, " must be [N] with N=", N);
  keep = t->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

Problem make_problem(const at::Tensor& x, int64_t N, at::Tensor& y) {
  y = at::empty({x.size(0), N}, x.options());
  return Problem{x.size(0), N, x.size(1), x.data_ptr<float>(), nullptr, y.data_ptr<float>()};
}

}  // namespace

bool gates_in_panels(int64_t N) { return N % (2 * kPanel) == 0; }

namespace {

// The output of a panel projection of N outputs: y [M, N], or [M, N / 2] gated (gates_in_panels).
at::Tensor panel_output(const at::Tensor& x, int64_t N, bool gated) {
  return at::empty({x.size(0), gated ? N / 2 : N}, x.options());
}

}  // namespace

namespace {
// A float16 tensor's data as its bit patterns.
const uint16_t* half_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }
}  // namespace

// Checks the block tensors of a GGUF-style weight; returns (N, K).
std::pair<int64_t, int64_t> check_blocks(const at::Tensor& qs, const at::Tensor& d, int64_t bytes_per_block) {
  TORCH_CHECK(qs.dim() == 2 && d.dim() == 2 && d.size(0) == qs.size(0), "qs [N, *] and d [N, K/32] expected");
  TORCH_CHECK(d.scalar_type() == at::kHalf, "block scales must be float16 (as GGUF stores them)");
  const int64_t N = qs.size(0), nb = d.size(1);
  TORCH_CHECK(qs.size(1) == nb * bytes_per_block, "qs must be [N, ", nb * bytes_per_block, "], got ", qs.sizes());
  return {N, nb * QK};
}

// x float32 [T, K] rounded to its int8 blocks, q * d per element: what the block formats' kernels compute with, for
// their F.linear path (batches beyond the kernels' row limit). One parallel pass; the same bits as
// quant.fake_quantize_activations (the same float32 operations, in the same order, per element).
at::Tensor fake_quantize_activations(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % QK == 0, "x must be [T, K] with K a multiple of 32, got ",
              x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "x must be float32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, x.numel() / QK, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      int8_t q[QK];
      const float d = quantize_block_int8(src + i * QK, QK, q);
      for (int64_t j = 0; j < QK; ++j) dst[i * QK + j] = static_cast<float>(q[j]) * d;
    }
  });
  return y;
}

// Q8_0: qs int8 [N,K], d fp16 [N,K/32]; y = xq @ (d*q).T + bias, xq: x rounded to int8 blocks (XQ8).
at::Tensor linear_q8_0(const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs_in.scalar_type() == at::kChar, "q8_0 qs must be int8");
  auto [N, K] = check_blocks(qs_in, d_in, QK);
  at::Tensor x = prep_x(x_in, K), qs = qs_in.contiguous(), d = d_in.contiguous(), y, bk;
  Problem p = make_problem(x, N, y);
  p.bias = prep_vec(bias, N, "bias", bk);
  if (x.size(0) == 0) return y;
  q8_dispatch<Q8_0>(p, qs.data_ptr<int8_t>(), half_bits(d), nullptr);
  return y;
}

// Q4_1: qs uint8 [N,K/2] (GGUF nibble order per block), d, m fp16 [N,K/32]; y = xq @ (d*q+m).T + bias.
at::Tensor linear_q4_1(const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                          const at::Tensor& m_in, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs_in.scalar_type() == at::kByte, "q4_1 qs must be uint8");
  auto [N, K] = check_blocks(qs_in, d_in, QK / 2);
  TORCH_CHECK(m_in.sizes() == d_in.sizes() && m_in.scalar_type() == at::kHalf, "m must match d");
  at::Tensor x = prep_x(x_in, K), qs = qs_in.contiguous(), d = d_in.contiguous(), mn = m_in.contiguous(), y, bk;
  Problem p = make_problem(x, N, y);
  p.bias = prep_vec(bias, N, "bias", bk);
  if (x.size(0) == 0) return y;
  q8_dispatch<Q4_1>(p, qs.data_ptr<uint8_t>(), half_bits(d), half_bits(mn));
  return y;
}

// The shape of the column panels [ceil(N / 24), K, 24] of a float32 / bfloat16 / int8 weight [N, K] (rows past N
// zero; packed by linear.py: pack_panels); see kPanel.
std::vector<int64_t> panel_shape(int64_t N, int64_t K) { return {(N + kPanel - 1) / kPanel, K, kPanel}; }

// y = (x @ W.T) * scale + bias for W in column panels (linear.py: pack_panels); x fp32 [M, K]; n: W's rows (N); scale: [N], int8 only.
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n,
                        const c10::optional<at::Tensor>& bias, bool batch_invariant,
                        const c10::optional<at::Tensor>& scale, bool gated) {
  TORCH_CHECK(!gated || gates_in_panels(n), "gated: n = ", n, " is not two halves of whole panels of ", kPanel);
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must be a contiguous [P, K, 24] tensor from pack_panels_");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == panels.size(0), "n = ", n, " does not fit ", panels.size(0),
              " panels");
  const int64_t K = panels.size(1);
  at::Tensor x = prep_x(x_in, K), y = panel_output(x, n, gated), bk, sk;
  const float* b = prep_vec(bias, n, "bias", bk);
  const float* sc = prep_vec(scale, n, "scale", sk);
  TORCH_CHECK((sc != nullptr) == (panels.scalar_type() == at::kChar), "a scale goes with int8 panels, and only");
  if (x.size(0) == 0) return y;
  const int64_t M = x.size(0), gate_panels = gated ? n / (2 * kPanel) : 0;
  const float* xd = x.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  if (panels.scalar_type() == at::kFloat)
    panel_run<WF32>({M, n, K, panels.data_ptr<float>(), sc, b, yd, gate_panels}, xd, batch_invariant);
  else if (panels.scalar_type() == at::kBFloat16)
    panel_run<WBF16>({M, n, K, reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), sc, b, yd,
                      gate_panels}, xd, batch_invariant);
  else if (panels.scalar_type() == at::kChar)
    panel_run<WI8>({M, n, K, panels.data_ptr<int8_t>(), sc, b, yd, gate_panels}, xd, batch_invariant);
  else TORCH_CHECK(false, "panels must be float32, bfloat16 or int8, got ", panels.scalar_type());
  return y;
}

namespace {
// The block-panel format of a [P, K/32, block_bytes] uint8 tensor (pack_block_panels): PQ8_0 or PQ4_1 by its last
// dimension; calls f with a value of that type. K = 32 * size(1).
template <class F>
void with_block_format(const at::Tensor& panels, F&& f) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous(),
              "block panels must be a contiguous uint8 [P, K/32, bytes] tensor from pack_block_panels");
  if (panels.size(2) == PQ8_0::block_bytes) f(PQ8_0{});
  else if (panels.size(2) == PQ4_1::block_bytes) f(PQ4_1{});
  else TORCH_CHECK(false, "block panels: ", panels.size(2), " bytes per block is neither q8_0 (", PQ8_0::block_bytes,
                   ") nor q4_1 (", PQ4_1::block_bytes, ")");
}
}  // namespace

std::vector<int64_t> block_panel_shape(const std::string& fmt, int64_t N, int64_t K) {
  TORCH_CHECK(K % QK == 0, "block panels need K a multiple of ", QK, ", got ", K);
  TORCH_CHECK(fmt == "q8_0" || fmt == "q4_1", "block panels: unknown format ", fmt);
  return {(N + kPanel - 1) / kPanel, K / QK, fmt == "q8_0" ? PQ8_0::block_bytes : PQ4_1::block_bytes};
}

at::Tensor block_panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n,
                              const c10::optional<at::Tensor>& bias, bool batch_invariant, bool gated) {
  TORCH_CHECK(!gated || gates_in_panels(n), "gated: n = ", n, " is not two halves of whole panels of ", kPanel);
  TORCH_CHECK(n > 0 && panels.dim() == 3 && (n + kPanel - 1) / kPanel == panels.size(0), "n = ", n,
              " does not fit ", panels.size(0), " panels");
  const int64_t K = panels.size(1) * QK;
  at::Tensor x = prep_x(x_in, K), y = panel_output(x, n, gated), bk;
  const float* b = prep_vec(bias, n, "bias", bk);
  const int64_t gate_panels = gated ? n / (2 * kPanel) : 0;
  with_block_format(panels, [&](auto format) {
    using W = decltype(format);
    if (x.size(0) > 0)
      panel_run<W>({x.size(0), n, K, panels.data_ptr<uint8_t>(), nullptr, b, y.data_ptr<float>(), gate_panels},
                   x.data_ptr<float>(), batch_invariant);
  });
  return y;
}

// Block b of panel p (pack_block_panels: d [24], (m [24],) then the 32 k x 24 rows of q) from rows p*24 .. p*24+23 of
// qs / d (/ m) in quant.py's layout; rows past N are zero.
template <class W>
void pack_panel_block(const uint8_t* qs, const uint16_t* d, const uint16_t* mn, int64_t N, int64_t K, int64_t p,
                      int64_t b, uint8_t* blk) {
  constexpr bool q4 = std::is_same_v<W, PQ4_1>;
  const int64_t nb = K / QK;
  uint8_t* qb = blk + (q4 ? 4 : 2) * kPanel;
  for (int64_t j = 0; j < kPanel; ++j) {
    const int64_t row = p * kPanel + j;
    const bool real = row < N;
    const uint16_t dv = real ? d[row * nb + b] : 0, mv = real && q4 ? mn[row * nb + b] : 0;
    std::memcpy(blk + 2 * j, &dv, 2);
    if constexpr (q4) {
      std::memcpy(blk + 2 * (kPanel + j), &mv, 2);
      const uint8_t* src = qs + row * (K / 2) + b * (QK / 2);  // elements 0..15 low nibbles, 16..31 high
      auto nibble = [&](int64_t k) { return k < QK / 2 ? src[k] & 0xF : src[k - QK / 2] >> 4; };
      for (int64_t i = 0; i < QK / 2; ++i) qb[i * kPanel + j] = real ? nibble(2 * i) | nibble(2 * i + 1) << 4 : 0;
    } else {
      const uint8_t* src = qs + row * K + b * QK;
      for (int64_t k = 0; k < QK; ++k) qb[k * kPanel + j] = real ? src[k] : 0;
    }
  }
}

void pack_block_panels_(at::Tensor& out, const std::string& fmt, const std::vector<at::Tensor>& packed) {
  const bool q4 = fmt == "q4_1";
  TORCH_CHECK(packed.size() == (q4 ? 3u : 2u), fmt, " takes ", q4 ? "(qs, d, m)" : "(qs, d)");
  const at::Tensor qs = packed[0].contiguous(), d = packed[1].contiguous();
  TORCH_CHECK(qs.element_size() == 1, "qs must be int8 or uint8");
  auto [N, K] = check_blocks(qs, d, q4 ? QK / 2 : QK);
  at::Tensor mn;
  if (q4) {
    mn = packed[2].contiguous();
    TORCH_CHECK(mn.sizes() == d.sizes() && mn.scalar_type() == at::kHalf, "m must match d");
  }
  TORCH_CHECK(out.sizes() == at::IntArrayRef(block_panel_shape(fmt, N, K)) && out.scalar_type() == at::kByte && out.is_contiguous(),
              "out must be a contiguous uint8 tensor of block_panel_shape");
  const uint8_t* q = static_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t *dd = half_bits(d), *mm = q4 ? half_bits(mn) : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t P = out.size(0), nb = K / QK, bytes = out.size(2);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = dst + (p * nb + b) * bytes;
        if (q4) pack_panel_block<PQ4_1>(q, dd, mm, N, K, p, b, blk);
        else pack_panel_block<PQ8_0>(q, dd, mm, N, K, p, b, blk);
      }
  });
}

bool block_panels_equal(const at::Tensor& panels, const at::Tensor& weight_in) {
  bool equal = false;
  with_block_format(panels, [&](auto format) {
    using W = decltype(format);
    const int64_t P = panels.size(0), nb = panels.size(1), K = nb * QK;
    if (weight_in.dim() != 2 || weight_in.scalar_type() != at::kFloat || weight_in.size(1) != K ||
        (weight_in.size(0) + kPanel - 1) / kPanel != P)
      return;
    const at::Tensor weight = weight_in.contiguous();
    const int64_t N = weight.size(0);
    const float* w = weight.data_ptr<float>();
    const uint8_t* src = panels.data_ptr<uint8_t>();
    std::atomic<bool> same{true};
    // Row by row, each weight from its block as W::one gives it (the vector widening's arithmetic: d * q (+ m), one
    // rounding), against the row read in order: widening whole blocks and reading them down a column was 5x slower.
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1 && same.load(std::memory_order_relaxed); ++p) {
        bool differs = false;
        for (int64_t j = 0; j < std::min(kPanel, N - p * kPanel); ++j) {
          const float* wr = w + (p * kPanel + j) * K;
          for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = src + (p * nb + b) * W::block_bytes;
            for (int64_t k = 0; k < QK; ++k) differs |= !(W::one(blk, k, j) == wr[b * QK + k]);
          }
        }
        if (differs) same = false;
      }
    });
    equal = same;
  });
  return equal;
}

at::Tensor widen_block_panels(const at::Tensor& panels) {
  at::Tensor out;
  with_block_format(panels, [&](auto format) {
    using W = decltype(format);
    const int64_t P = panels.size(0), K = panels.size(1) * QK;
    out = at::empty({P, K, kPanel}, panels.options().dtype(at::kFloat));
    const uint8_t* src = panels.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) to_float_panel<W>(src + p * panel_stride<W>(K), K, dst + p * K * kPanel);
    });
  });
  return out;
}

}  // namespace tp
