// Small-M linear kernels: y[M,N] = x[M,K] @ W[N,K]^T (+ bias), each weight row streamed once for all M rows.
// Weight formats: fp32, bf16, int8 (per-row scale), GGUF-style Q8_0 and Q4_1 blocks of 32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

constexpr int64_t QK = 32;  // GGUF block length

// ---- dense weight formats: load 8 consecutive weights as fp32 -------------------------------------------
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

// out[m][n] = dot(x[m], w[n]) over K for an MR x NR tile. Every (m, n) pair sums in the same order (one FMA chain
// over k, then the scalar tail) whatever MR and NR are, so a row's result does not depend on the batch it is in.
// FOUR (MR = NR = 1 only): four interleaved FMA chains instead, 10-15% faster for one row of float32 weights on
// Zen 3, but another summation order than the tiles of M >= 2: used only when batch invariance is not asked for.
template <class W, int MR, int NR, bool FOUR = false>
inline void dense_tile(const float* const* x, const typename W::T* const* w, int64_t K, float (&out)[MR][NR]) {
  int64_t k = 0;
#ifdef __AVX2__
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  if constexpr (FOUR) {
    static_assert(MR == 1 && NR == 1, "four chains: one row, one weight row");
    __m256 a1 = _mm256_setzero_ps(), a2 = a1, a3 = a1;
    for (; k + 32 <= K; k += 32) {
      acc[0][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k), W::eight(w[0] + k), acc[0][0]);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k + 8), W::eight(w[0] + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k + 16), W::eight(w[0] + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k + 24), W::eight(w[0] + k + 24), a3);
    }
    acc[0][0] = _mm256_add_ps(_mm256_add_ps(acc[0][0], a1), _mm256_add_ps(a2, a3));
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = W::eight(w[n] + k);
    for (int m = 0; m < MR; ++m) {
      __m256 xv = _mm256_loadu_ps(x[m] + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m][n] = hsum(acc[m][n]);
#else
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m][n] = 0.f;
#endif
  for (; k < K; ++k)
    for (int n = 0; n < NR; ++n) {
      float wk = W::one(w[n] + k);
      for (int m = 0; m < MR; ++m) out[m][n] = std::fma(x[m][k], wk, out[m][n]);  // fused at every MR
    }
}

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

// The scale of one block of 32 activations, d = max|x| / 127 (0 for an all-zero block).
inline float block_scale(const float* xb) {
  float amax = 0.f;
  for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
  return amax / 127.f;
}

// x / d rounded to the nearest integer, half to even (the default rounding mode), as quant.py's torch.round.
inline int32_t block_int(float x, float inv_d) { return static_cast<int32_t>(std::nearbyint(x * inv_d)); }

XQ8 quantize_x_q8(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  XQ8 r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    const float d = block_scale(xb), id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < QK; ++j) {
      const int32_t v = block_int(xb[j], id);
      r.q[i * QK + j] = static_cast<int8_t>(v);
      sum += v;
    }
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

inline void prefetch_bytes(const void* p, int64_t n) {  // every 64-byte line of [p, p + n)
#if defined(__SSE__)
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  if (n > 0) _mm_prefetch(c + n - 1, _MM_HINT_T0);
#endif
}

// Rows ahead that make ~kPrefetchBytes of a row-major weight whose rows are row_bytes long.
inline int64_t prefetch_rows_ahead(int64_t row_bytes) { return std::max<int64_t>(1, kPrefetchBytes / row_bytes); }

// ---- driver: partition N across threads, tile M by MR rows (tails clamp to the last row/col) --------------
struct Problem {
  int64_t M, N, K;
  const float* x;       // [M, K]
  const float* scale;   // [N] or nullptr (int8 per-row scale)
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
            if (p.scale) v *= p.scale[rows[n]];
            if (p.bias) v += p.bias[rows[n]];
            p.y[(m0 + m) * p.N + rows[n]] = v;
          }
      }
    }
  });
}

template <class W, int MR, int NR, bool FOUR = false>
void dense_run(const Problem& p, const typename W::T* w) {
  run_tiles<MR, NR>(p, p.K, [&](const float* const* xr, const int64_t*, const int64_t* rows, float (&out)[MR][NR]) {
    const typename W::T* wr[NR];
    for (int n = 0; n < NR; ++n) wr[n] = w + rows[n] * p.K;
    dense_tile<W, MR, NR, FOUR>(xr, wr, p.K, out);
  });
}

template <class W>
void dense_dispatch(const Problem& p, const typename W::T* w, bool batch_invariant) {
  if (p.M == 1 && !batch_invariant) dense_run<W, 1, 1, true>(p, w);  // rows read as one sequential stream
  else if (p.M == 1) dense_run<W, 1, 1>(p, w);
  else if (p.M == 2) dense_run<W, 2, 4>(p, w);
  else if (p.M == 3) dense_run<W, 3, 4>(p, w);
  else dense_run<W, 4, 3>(p, w);
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
  return Problem{x.size(0), N, x.size(1), x.data_ptr<float>(), nullptr, nullptr, y.data_ptr<float>()};
}

}  // namespace

// y = x @ w.T + bias; x fp32 [M,K]; w fp32 or bf16 [N,K]; bias [N] or None.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias,
                  bool batch_invariant) {
  TORCH_CHECK(w_in.dim() == 2, "w must be [N, K]");
  const int64_t N = w_in.size(0), K = w_in.size(1);
  at::Tensor x = prep_x(x_in, K), w = w_in.contiguous(), y, bk;
  Problem p = make_problem(x, N, y);
  p.bias = prep_vec(bias, N, "bias", bk);
  if (x.size(0) == 0) return y;
  if (w.scalar_type() == at::kFloat) dense_dispatch<WF32>(p, w.data_ptr<float>(), batch_invariant);
  else if (w.scalar_type() == at::kBFloat16)
    dense_dispatch<WBF16>(p, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), batch_invariant);
  else TORCH_CHECK(false, "w must be float32 or bfloat16, got ", w.scalar_type());
  return y;
}

// y = (x @ wq.T) * scale + bias; wq int8 [N,K]; scale fp32 [N].
at::Tensor linear_int8(const at::Tensor& x_in, const at::Tensor& wq_in, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, bool batch_invariant) {
  TORCH_CHECK(wq_in.dim() == 2 && wq_in.scalar_type() == at::kChar, "wq must be int8 [N, K]");
  const int64_t N = wq_in.size(0), K = wq_in.size(1);
  at::Tensor x = prep_x(x_in, K), wq = wq_in.contiguous(), y, bk, sk;
  Problem p = make_problem(x, N, y);
  p.bias = prep_vec(bias, N, "bias", bk);
  p.scale = prep_vec(scale, N, "scale", sk);
  TORCH_CHECK(p.scale, "scale is required");
  if (x.size(0) == 0) return y;
  dense_dispatch<WI8>(p, wq.data_ptr<int8_t>(), batch_invariant);
  return y;
}

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
      const float* xb = src + i * QK;
      const float d = block_scale(xb), id = d > 0.f ? 1.f / d : 0.f;
      for (int64_t j = 0; j < QK; ++j) dst[i * QK + j] = static_cast<float>(block_int(xb[j], id)) * d;
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

}  // namespace tp
