// Fused elementwise kernels of a Llama layer: RMSNorm (with the residual add), SiLU-and-mul, and rotary
// embedding together with the KV-cache write. Each replaces several eager torch ops per layer; the rounding
// follows the unfused torch code in the tensor's dtype (bf16: every op's result rounded, as eager torch does).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <vector>
#include "common.h"
#include "ops.h"

namespace tp {
namespace {

// Element access for float32 and bfloat16 (bits) rows.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
// v as the dtype T holds it (bf16: rounded), back in float.
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) { return bf16_to_f32(f32_to_bf16(v)); }

template <class T>
T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else if constexpr (std::is_same_v<T, int8_t>) return t.data_ptr<int8_t>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Rows of a [rows, n] job split over torch's threads, about `grain_elems` elements per task.
template <class F>
void for_rows(int64_t rows, int64_t n, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

#ifdef __AVX2__
// acc[0..1] += the squares of 8 floats, in double
inline void add_squares(__m256 v, __m256d* acc) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
  acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
}
#endif

// sum of x[i]^2 over n values, in double (four independent vector sums: a serial one was ~2,000 cycles a row).
template <class T>
double sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  double ss = 0.0;
#ifdef __AVX2__
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; i + 16 <= n; i += 16) add_squares(load8(x + i), acc), add_squares(load8(x + i + 8), acc + 2);
  const __m256d sum = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, sum);
  ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) {
    const double v = load(x, i);
    ss += v * v;
  }
  return ss;
}

// rsqrt(mean(x^2) + eps) of one row of n (float32 statistics).
template <class T>
float norm_scale(const T* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(static_cast<float>(sum_squares(x, n) / n) + eps);
}

// out = w * round(x * rsqrt(mean(x^2) + eps)) over one row of n, in x's dtype.
template <class T>
void norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  const float r = norm_scale(x, n, eps);
  for (int64_t i = 0; i < n; ++i) store(out, i, load(w, i) * round_to(load(x, i) * r, x));
}

// norm_row of a float32 row, its float32 result rounded once to bfloat16 by convert (as a bfloat16 GEMM rounds its
// input rows), a chunk at a time through a float32 buffer in L1.
void norm_row(uint16_t* out, const float* x, const float* w, int64_t n, float eps) {
  constexpr int64_t kChunk = 256;
  float buf[kChunk];
  const float r = norm_scale(x, n, eps);
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < len; ++i) buf[i] = w[i0 + i] * (x[i0 + i] * r);
    convert(out + i0, buf, len);
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous [T, H] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), what, ": weight must be [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight and x must share a dtype");
}

// residual += x, then each row's norm into op (x itself, or bfloat16 rows beside it)
template <class T, class O>
void add_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, float eps, O* op) {
  const int64_t n = x.size(1);
  T *xp = ptr<T>(x), *rp = ptr<T>(residual);
  const T* wp = ptr<T>(w);
  for_rows(x.size(0), n, [&](int64_t r) {
    T *xr = xp + r * n, *rr = rp + r * n;
    for (int64_t i = 0; i < n; ++i) store(rr, i, load(rr, i) + load(xr, i));
    norm_row(op + r * n, rr, wp, n, eps);
  });
}

// body(g, u, o, f) for every row of gate_up [T, 2F] and out [T, F]: g / u the row's gate and up halves, o its output.
template <class In, class Out, class Body>
void for_gate_up_rows(const at::Tensor& gu, at::Tensor& out, Body&& body) {
  const int64_t f = out.size(1);
  const In* gp = ptr<In>(gu);
  Out* op = ptr<Out>(out);
  for_rows(out.size(0), f, [&](int64_t r) { body(gp + r * 2 * f, gp + r * 2 * f + f, op + r * f, f); });
}

template <class T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  for_gate_up_rows<T, T>(gu, out, [](const T* g, const T* u, T* o, int64_t f) {
    int64_t i = 0;
#ifdef __AVX2__
    if constexpr (std::is_same_v<T, float>) {
      for (; i + 8 <= f; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    } else {
      alignas(32) float s[8];
      for (; i + 8 <= f; i += 8) {
        _mm256_store_ps(s, silu8(load_bf16x8(g + i)));
        for (int j = 0; j < 8; ++j) store(o, i + j, round_to(s[j], g) * load(u, i + j));
      }
    }
#endif
    for (; i < f; ++i) {
      const float v = load(g, i);
      store(o, i, round_to(silu_one(v), g) * load(u, i));
    }
  });
}

// silu(gate) * up in float32 of bfloat16 gate_up [T, 2F], rounded once to bfloat16 [T, F]: silu_mul_impl<float>'s
// arithmetic on the widened values, then the rounding torch's .to(torch.bfloat16) of its result would apply.
void silu_mul_widened(const at::Tensor& gu, at::Tensor& out) {
  for_gate_up_rows<uint16_t, uint16_t>(gu, out, [](const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t f) {
    int64_t i = 0;
#ifdef __AVX512F__
    // 16 lanes a time, silu8's arithmetic lane for lane (the same bits, ~2x the rate of the 8-lane loop)
    for (; i + 16 <= f; i += 16) {
      const __m512 gv = widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
      const __m512 uv = widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), bf16x16_of(silu_mul16(gv, uv)));
    }
#endif
#ifdef __AVX2__
    for (; i + 8 <= f; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                       bf16x8_of(_mm256_mul_ps(silu8(load_bf16x8(g + i)), load_bf16x8(u + i))));
#endif
    for (; i < f; ++i) {
      const float v = bf16_to_f32(g[i]);
      o[i] = f32_to_bf16(v / (1.0f + std::exp(-v)) * bf16_to_f32(u[i]));
    }
  });
}

// One head row x[D] rotated in place: x*cos + roll(x, D/2)*signed_sin, each product rounded as T.
// d is even (rotate_half's halves); the two halves' loops have no index arithmetic, so they vectorise.
template <class T>
void rotate_head(T* x, const float* cos, const float* sin, int64_t d, float* tmp) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) tmp[j] = load(x, j);
  auto rotated = [&](int64_t j, int64_t partner) {
    const float c = round_to(cos[j], x), s = round_to(sin[j], x);
    return round_to(tmp[j] * c, x) + round_to(tmp[partner] * s, x);
  };
  for (int64_t j = 0; j < half; ++j) store(x, j, rotated(j, j + half));
  for (int64_t j = half; j < d; ++j) store(x, j, rotated(j, j - half));
}

constexpr int64_t MAX_ROTARY_DIM = 1024;  // head dims up to this rotate in a stack buffer

struct RopeArgs {
  int64_t heads, kv_heads, d, row, positions_max;
  const int64_t *positions, *slots;
  const float *cos, *sin;
};

// A K or V row of d values into its cache row: converted to the cache's dtype, or quantized (an int8 cache).
template <class C, class T>
inline void store_cache_row(C* dst, const T* src, int64_t d) { convert(dst, src, d); }
template <class T>
inline void store_cache_row(int8_t* dst, const T* src, int64_t d) { quantize_int8_row(dst, src, d); }

template <class T, class C>
void rotary_cache_impl(const RopeArgs& a, at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache) {
  T* qp = ptr<T>(qkv);
  C *kc = ptr<C>(k_cache), *vc = ptr<C>(v_cache);
  const int64_t kvd = a.kv_heads * a.d, ks0 = k_cache.stride(0), vs0 = v_cache.stride(0);
  const int64_t ks1 = k_cache.stride(1), vs1 = v_cache.stride(1);
  for_rows(qkv.size(0), a.row, [&](int64_t t) {
    float tmp[MAX_ROTARY_DIM];
    T* row = qp + t * a.row;
    const int64_t pos = a.positions[t];
    for (int64_t h = 0; h < a.heads + a.kv_heads; ++h)
      rotate_head(row + h * a.d, a.cos + pos * a.d, a.sin + pos * a.d, a.d, tmp);
    const T *k = row + a.heads * a.d, *v = k + kvd;
    const int64_t slot = a.slots[t];
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      store_cache_row(kc + slot * ks0 + h * ks1, k + h * a.d, a.d);
      store_cache_row(vc + slot * vs0 + h * vs1, v + h * a.d, a.d);
    }
  });
}

}  // namespace

// out [T,H] = weight * rms_norm(x) (float32 statistics, rounded as x's dtype); bf16_out (x float32): that result
// rounded once to bfloat16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16_out) {
  check_rows(x, weight, "rms_norm");
  TORCH_CHECK(!bf16_out || x.scalar_type() == at::kFloat, "rms_norm: bf16_out rounds a float32 x's result");
  auto out = at::empty_like(x, x.options().dtype(bf16_out ? at::kBFloat16 : x.scalar_type()));
  const int64_t n = x.size(1);
  auto rows = [&](const auto* xp, const auto* wp, auto* op) {
    for_rows(x.size(0), n, [&](int64_t r) { norm_row(op + r * n, xp + r * n, wp, n, (float)eps); });
  };
  if (x.scalar_type() == at::kBFloat16) rows(ptr<uint16_t>(x), ptr<uint16_t>(weight), ptr<uint16_t>(out));
  else if (bf16_out) rows(ptr<float>(x), ptr<float>(weight), ptr<uint16_t>(out));
  else rows(ptr<float>(x), ptr<float>(weight), ptr<float>(out));
  return out;
}

// In place: residual += x; x = weight * rms_norm(residual). Given out (bfloat16, x's shape, x float32): the norm goes
// there, rounded once to bfloat16, and x is left as it was.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   const c10::optional<at::Tensor>& out) {
  check_rows(x, weight, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(), "add_rms_norm_: residual must match x");
  if (out.has_value()) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && out->scalar_type() == at::kBFloat16 && out->sizes() == x.sizes() &&
                    out->is_contiguous(),
                "add_rms_norm_: out must be a contiguous bfloat16 tensor of x's shape (x float32)");
    add_norm_impl<float>(x, residual, weight, (float)eps, ptr<uint16_t>(*out));
  } else if (x.scalar_type() == at::kFloat) {
    add_norm_impl<float>(x, residual, weight, (float)eps, ptr<float>(x));
  } else {
    add_norm_impl<uint16_t>(x, residual, weight, (float)eps, ptr<uint16_t>(x));
  }
}

// gate_up [T, 2F] -> silu(gate) * up [T, F].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous [T, 2F] tensor");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else if (gate_up.scalar_type() == at::kBFloat16) silu_mul_impl<uint16_t>(gate_up, out);
  else TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16");
  return out;
}

// bfloat16 gate_up [T, 2F] -> bfloat16 silu(gate) * up [T, F], in float32 and rounded once (for a bfloat16 GEMM next).
at::Tensor silu_and_mul_widened(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kBFloat16,
              "silu_and_mul_widened: gate_up must be a contiguous bfloat16 [T, 2F] tensor");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_widened(gate_up, out);
  return out;
}

// In place on qkv [T, (H + 2 KVH) * D]: rotate the q and k heads at `positions` with the float32 tables
// cos / signed sin [P, D], then store k and v rows into k_cache / v_cache [S, KVH, D] at `slots`.
void rotary_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t heads,
                   int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rotary_cache_: qkv must be a contiguous [T, C] tensor");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "rotary_cache_: caches must be [S, KVH, D]");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "rotary_cache_: cache rows contiguous in D");
  const auto ct = k_cache.scalar_type(), qt = qkv.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == ct && (ct == qt || ct == at::kChar || (qt == at::kFloat && ct == at::kBFloat16)),
              "rotary_cache_: the caches must share qkv's dtype, be bfloat16 under float32 qkv, or int8");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0, "rotary_cache_: shapes");
  const int64_t d = qkv.size(1) / (heads + 2 * kv_heads);  // an int8 cache's rows hold d values and a scale
  TORCH_CHECK(d % 2 == 0 && d <= MAX_ROTARY_DIM, "rotary_cache_: head dim must be even and at most ", MAX_ROTARY_DIM);
  TORCH_CHECK(k_cache.size(1) == kv_heads && k_cache.size(2) == d + (ct == at::kChar ? kInt8RowExtra : 0),
              "rotary_cache_: cache shapes");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rotary_cache_: cos/sin must be contiguous float32 [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.numel() == T &&
                  slots.numel() == T && positions.is_contiguous() && slots.is_contiguous(),
              "rotary_cache_: positions and slots must be contiguous int64 [T]");
  RopeArgs a{heads, kv_heads, d, qkv.size(1), cos.size(0), positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
             cos.data_ptr<float>(), sin.data_ptr<float>()};
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(a.positions[t] >= 0 && a.positions[t] < a.positions_max, "rotary_cache_: position out of range");
    TORCH_CHECK(a.slots[t] >= 0 && a.slots[t] < k_cache.size(0), "rotary_cache_: slot out of range");
  }
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16, "rotary_cache_: float32 or bfloat16");
  if (ct == at::kChar && qt == at::kFloat) rotary_cache_impl<float, int8_t>(a, qkv, k_cache, v_cache);
  else if (ct == at::kChar) rotary_cache_impl<uint16_t, int8_t>(a, qkv, k_cache, v_cache);
  else if (qt == at::kFloat && ct == at::kFloat) rotary_cache_impl<float, float>(a, qkv, k_cache, v_cache);
  else if (qt == at::kFloat) rotary_cache_impl<float, uint16_t>(a, qkv, k_cache, v_cache);
  else rotary_cache_impl<uint16_t, uint16_t>(a, qkv, k_cache, v_cache);
}

}  // namespace tp
