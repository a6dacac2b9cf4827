// Shared helpers for twophase CPU kernels: AVX2 vector primitives with scalar fallbacks.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <cmath>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// Keeps v in a register (an empty asm the compiler cannot see through): without it GCC folds a load that several
// FMAs share into each of them, and the loop becomes load-bound (linear.cpp's panel tile: 12 loads per k instead of
// 3, ~105 instead of ~145 GFLOP/s at 32 rows in a standalone copy; attention.cpp's key and value slabs).
#if defined(__AVX512F__) && defined(__GNUC__)
#define TP_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX2__) && defined(__GNUC__)
#define TP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define TP_IN_REGISTER(v) (void)0
#endif

namespace tp {

// Calls body(u0, u1, state) on torch's intra-op threads for runs [u0, u1) that cover [0, n) in order, each thread
// claiming the next run when it finishes its last (dynamic scheduling: on a shared machine one core often runs
// slower, and a static split leaves the other waiting at the end); state = make_state() once per thread, for its
// scratch buffers; run_of(units left) is the length of the next run. Which thread runs a unit never changes that
// unit's arithmetic.
template <class RunOf, class MakeState, class Body>
void claim_runs(int64_t n, const RunOf& run_of, const MakeState& make_state, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t u0 = next.load(std::memory_order_relaxed); u0 < n;) {
      const int64_t run = run_of(n - u0);
      if (!next.compare_exchange_weak(u0, u0 + run, std::memory_order_relaxed)) continue;  // u0 now the latest
      body(u0, std::min(n, u0 + run), state);
      u0 = next.load(std::memory_order_relaxed);
    }
  });
}

// body(i, state) for every i in [0, n), one item a claim (claim_runs): for items of uneven sizes, longest first.
template <class MakeState, class Body>
void dynamic_for(int64_t n, const MakeState& make_state, const Body& body) {
  claim_runs(n, [](int64_t) { return int64_t{1}; }, make_state, [&](int64_t u0, int64_t u1, auto& state) {
    for (int64_t i = u0; i < u1; ++i) body(i, state);
  });
}

// body(i, next, state) for every i in [0, n), one item a claim, each thread claiming its next item (next; -1: none)
// before it runs this one, so that the item can fetch the next one's first data while it finishes.
template <class MakeState, class Body>
void claim_ahead(int64_t n, const MakeState& make_state, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < n) {
      const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
      body(i, j < n ? j : int64_t{-1}, state);
      i = j;
    }
  });
}

// claim_runs with runs of the units left / (2 x threads), at least one: long runs first, short ones at the end, so
// that the threads finish together (with items of a fixed size, one thread starting a little late leaves the other a
// whole extra item).
template <class MakeState, class Body>
void guided_for(int64_t n, const MakeState& make_state, const Body& body) {
  const int64_t threads = std::max(1, at::get_num_threads());
  claim_runs(n, [&](int64_t left) { return std::max<int64_t>(1, left / (2 * threads)); }, make_state, body);
}

// Asks for every 64-byte line of [p, p + n) (into L1).
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c + i, 0, 3);
  if (n > 0) __builtin_prefetch(c + n - 1, 0, 3);
}

// fn(std::integral_constant<int, rows>) for rows in [1, Max] (anything above Max as Max): a register tile's row count
// as a template argument.
template <int Max, class Fn, int... I>
inline void with_rows_of(int64_t rows, Fn& fn, std::integer_sequence<int, I...>) {
  (void)((rows == I + 1 && (fn(std::integral_constant<int, I + 1>{}), true)) || ... ||
         (fn(std::integral_constant<int, Max>{}), true));
}
template <int Max, class Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  with_rows_of<Max>(rows, fn, std::make_integer_sequence<int, Max - 1>{});
}

// bf16 bits -> float (exact: bf16 is the top half of an fp32).
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bf16 bits, round to nearest even (NaN kept quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half bits -> float (exact): F16C's instruction where the CPU has it, else by hand.
inline float half_to_f32(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);  // inf / nan
  else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) u = sign;  // zero
  else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400u));
    u = sign | static_cast<uint32_t>(112 - e) << 23 | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// n values from src to dst, converted to dst's type: a copy when the types match, bfloat16 widened exactly, float32
// rounded to nearest even into bfloat16 (as torch's .to(torch.bfloat16)).
inline void convert(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void convert(uint16_t* dst, const uint16_t* src, int64_t n) { std::memcpy(dst, src, n * sizeof(uint16_t)); }
// (float32 to and from bfloat16: after the AVX2 helpers below)

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// 8 floats from float32 or bfloat16 values
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return load_bf16x8(p); }

// exp's range reduction x = n ln 2 + r, shared by exp256, exp512 and exp512_nonpositive: log2 e, and ln 2 in two
// parts (the first exact in few bits, so n * kLn2Hi is exact).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;

// exp(x) for x <= 0 region mostly (Cephes-style polynomial, ~1-2 ulp); clamps to avoid inf/denormals.
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 lo = _mm256_set1_ps(-87.0f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// silu(g) for 8 floats: g / (1 + exp(-g)). silu_and_mul (fused.cpp) and the gate / up projection that applies it as
// it stores (linear.cpp: silu_gated) both take it, so the two give the same bits.
inline __m256 silu8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}
#endif

// silu(g) of one float without AVX2 (silu8's formula with the C library's exp).
inline float silu_one(float g) { return g / (1.0f + std::exp(-g)); }

#ifdef __AVX2__
// f32_to_bf16 of 8 floats (the same bits, NaN and subnormals included: AVX512-BF16's vcvtneps2bf16 would flush
// subnormal inputs to zero).
inline __m128i bf16x8_of(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // [r0..r3 r0..r3 | r4..r7 r4..r7] as 16-bit lanes
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // qwords 0 and 2: r0..r7
}

// 8 floats to float32 or bfloat16 values (bfloat16: rounded as f32_to_bf16 rounds); load8's counterpart.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16x8_of(v)); }
#endif

#ifdef __AVX512F__
// 16 bfloat16 values as float32 (exact).
inline __m512 widen_bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// exp(x) of 16 lanes: exp256's arithmetic lane for lane (the same clamps, polynomial and rounding).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// silu(g) * u of 16 lanes: g / (1 + exp(-g)), times u (silu8's formula on exp512). silu_and_mul_widened and
// bf16_gemm's gate / up store (kStoreSiluMul) both take it, so the two give the same bits.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));  // exp(-g)
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(silu, u);
}

// exp(x) of 16 lanes for x <= 0 (probabilities of a softmax) in 11 instructions against exp512's 17: x = n ln 2 + r
// with n = round(x log2 e) and |r| <= ln 2 / 2 (ln 2 in two parts, as exp512), e^r by its Taylor polynomial of
// degree 6, scaled by 2^n (vscalefps: 0 far below, without exp512's clamps and exponent arithmetic). Over 1.6M x in
// [-30, 0]: at most 2.2e-7 from exp in float64 (exp512: 1.2e-7). A version in base 2 (scores times log2 e, one
// rounding less) erred by 1.9e-6 and moved the real-model top-1 agreement test from 0.993 to 0.986; this one keeps
// 0.993.
inline __m512 exp512_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(1.f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// 16 float32 lanes as bfloat16, rounded to nearest even (NaN kept quiet), as f32_to_bf16 / convert round them.
// AVX512-BF16's conversion rounds the same way and quiets NaN the same way, but reads subnormal inputs as zero: it
// takes every vector without one (one instruction where the integer rounding below takes ten; a 2,048 x 576 add-norm
// storing bfloat16 rows through a vector loop of its own, in cache, 2 Zen 4 cores: 0.353 -> 0.307-0.315 ms).
inline __m256i bf16x16_of(__m512 f) {
#ifdef __AVX512BF16__
  if (_mm512_fpclass_ps_mask(f, 0x20) == 0) return (__m256i)_mm512_cvtneps_pbh(f);  // 0x20: the subnormal class
#endif
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// 16 floats from float32 or bfloat16 values (widened exactly), and back (bfloat16: rounded as bf16x16_of rounds).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16_of(v)); }
#endif

inline void convert(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16x16_of(_mm512_loadu_ps(src + i)));
#endif
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16x8_of(_mm256_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

inline void convert(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
#endif
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// src rounded to bfloat16 as convert rounds it, kept as float32 values (the widening back is exact): what fma_tile
// reads where dot_tile would read convert's pairs.
inline void round_to_bf16(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen_bf16x16(bf16x16_of(_mm512_loadu_ps(src + i))));
#endif
  for (; i < n; ++i) dst[i] = bf16_to_f32(f32_to_bf16(src[i]));
}

// An int8 KV cache row (--kv-cache-dtype int8): D int8 values q, then the row's float32 scale s (its 4 bytes), a
// value being q[d] * s: the row quantized as one block by quantize_block_int8 below, the bytes
// twophase.model.attention.quantize_int8_rows writes. A row of D = 64 is 68 bytes against bfloat16's 128.
constexpr int64_t kInt8RowExtra = 4;  // the scale's bytes after a row's values

inline float int8_row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(float));
  return s;
}

// x[0, n) as int8 values q with x ~ d * q: d = max |x| / 127 and q = x * (1 / d) rounded to nearest even (all 0 where
// d is 0), in float32; returns d. The one rounding rule of the int8 GEMMs' activation blocks (quantize_row,
// quantize_x_q8: blocks of 32), the int8 KV cache's rows (a block a row) and quant.quantize_blocks. Each value is
// stored plus offset as a byte (int8, or uint8 with offset 128: vpdpbusd's unsigned operand); sum (if given) gets
// the sum of the q, from the same registers (a second pass reading the stored bytes back stalled on the stores).
template <class Byte>
inline float quantize_block_int8(const float* x, int64_t n, Byte* q, int32_t offset = 0, int32_t* sum = nullptr) {
  static_assert(sizeof(Byte) == 1, "bytes out");
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int32_t total = 0;
  i = 0;
#ifdef __AVX512F__
  const __m512 iv = _mm512_set1_ps(inv);  // cvtps_epi32 rounds to nearest even (the default mode), as nearbyint
  const __m512i off = _mm512_set1_epi32(offset);
  __m512i vsum = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv));  // |v| <= 127
    if (sum) vsum = _mm512_add_epi32(vsum, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, off)));
  }
  if (sum) total = _mm512_reduce_add_epi32(vsum);
#endif
  for (; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    total += v;
    q[i] = static_cast<Byte>(v + offset);
  }
  if (sum) *sum = total;
  return d;
}

// An int8 cache row: its D values quantized as one block, then the scale's bytes.
inline void quantize_int8_row(int8_t* dst, const float* src, int64_t D) {
  const float s = quantize_block_int8(src, D, dst);
  std::memcpy(dst + D, &s, sizeof(float));
}
constexpr int64_t kInt8MaxRow = 1024;  // the longest row quantize_int8_row takes from bfloat16 (MAX_ROTARY_DIM)
inline void quantize_int8_row(int8_t* dst, const uint16_t* src, int64_t D) {
  TORCH_CHECK(D <= kInt8MaxRow, "quantize_int8_row: a bfloat16 row of at most ", kInt8MaxRow, " values");
  float row[kInt8MaxRow];
  convert(row, src, D);
  quantize_int8_row(dst, row, D);
}

// The row's D values as float32.
inline void dequantize_int8_row(float* dst, const int8_t* src, int64_t D) {
  const float s = int8_row_scale(src, D);
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 sv = _mm512_set1_ps(s);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))))));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
}

// dot(a, b) over n floats.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x over n floats.
inline void axpy_f32(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// y *= a over n floats.
inline void scale_f32(float* y, float a, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(av, _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] *= a;
}

// y[i] = exp(x[i] - m) for i < n; returns the sum.
inline float exp_sub_sum(float* y, const float* x, float m, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(y + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) {
    y[i] = std::exp(x[i] - m);
    s += y[i];
  }
  return s;
}

// n floats of this thread's scratch buffer number Slot, kept between calls and grown as needed, never initialised:
// a fresh vector per call (a prefill chunk's packed rows are megabytes) was mapped and zeroed by the C library on
// every call of every projection. Slots: 0-3 the panel kernels (linear.cpp), 4 bf16_gemm's widened rows.
template <int Slot>
float* thread_scratch(int64_t n) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < n) buffer.reset(new float[n]), capacity = n;
  return buffer.get();
}

}  // namespace tp
