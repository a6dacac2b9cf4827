// y[M, N] = x[M, K] @ W[N, K]^T for W in GGUF-style int8 blocks (Q8_0: w = d q; Q4_1: w = d q + m, q in 0..15; a
// scale d (and min m) a block of 32 k of an output), on AVX512-VNNI's vpdpbusd (64 int8 products an instruction,
// twice vdpbf16ps's count). Each row of x is rounded to int8 per block of 32 as it comes, xd = max|x| / 127 (as
// llama.cpp's Q8 activations and the AVX2 kernels of linear.cpp do, the same float32 operations: quant.py's
// quantize_activations gives the same q and xd). A block's 32 products are summed exactly in int32, then added into
// float32 with the two scales, y += (xd d) sum (+ m xs, xs = xd x the block's sum of q). Every row's arithmetic is
// the same whatever the other rows: the result never depends on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "common.h"
#include "ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define TP_HAVE_INT8_DOT 1
#include <immintrin.h>
#endif

namespace tp {

namespace {
constexpr int64_t kI8Cols = 32;   // outputs of a panel: two 16-lane int32 accumulators a row
constexpr int64_t kI8Block = 32;  // k values that share a scale (GGUF's block)
constexpr int64_t kQuads = kI8Block / 4;  // vpdpbusd steps a block (4 k each)
// 6 x (2 int32 + 2 float32) accumulators + 2 panel vectors + a broadcast: 27 of the 32 registers. SmolLM2's four
// shapes at 32 / 2,048 rows, 2 Zen 4 cores (GOP/s, one scale a row): 6 rows 522-678 / 632-689, 5 rows 511-658 /
// 523-641, 4 rows 409-642 / 515-613, 7 rows (spilled) 310-421 / 262-349.
constexpr int kI8MaxRows = 6;
constexpr int64_t kI8RowChunk = 32 * kI8MaxRows;  // rows an item covers (prefill): the chunk's rows stay in L2

void check_k(int64_t K) { TORCH_CHECK(K > 0 && K % kI8Block == 0, "int8 GEMM: K must be a multiple of ", kI8Block); }

// Row x (K values) -> its int8 values plus 128 (vpdpbusd's unsigned operand), a scale xd a block and, for a weight
// with mins, xs = xd * the block's sum of values.
void quantize_row(const float* x, int64_t K, uint8_t* q, float* xd, float* xs) {
  for (int64_t b = 0; b < K / kI8Block; ++b) {
    int32_t sum = 0;
    const float d = quantize_block_int8(x + b * kI8Block, kI8Block, q + b * kI8Block, 128, &sum);
    xd[b] = d;
    if (xs) xs[b] = d * static_cast<float>(sum);
  }
}

// [N, K / 32] float32 per-block values -> [P, K / 32, 32] (a panel's 32 outputs side by side a block; past N: 0).
at::Tensor panel_blocks(const at::Tensor& v, int64_t P) {
  const int64_t N = v.size(0), blocks = v.size(1);
  at::Tensor out = at::zeros({P * kI8Cols, blocks}, v.options().dtype(at::kFloat));
  out.narrow(0, 0, N).copy_(v);
  return out.view({P, kI8Cols, blocks}).transpose(1, 2).contiguous();
}
}  // namespace

bool int8_gemm_available() {
#ifdef TP_HAVE_INT8_DOT
  return true;
#else
  return false;
#endif
}

std::vector<at::Tensor> pack_int8_gemm(const at::Tensor& values, const at::Tensor& scales,
                                       const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar, "pack_int8_gemm: int8 values [N, K]");
  const int64_t N = values.size(0), K = values.size(1);
  check_k(K);
  const int64_t P = (N + kI8Cols - 1) / kI8Cols, quads = K / 4, blocks = K / kI8Block;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({N, blocks}), "pack_int8_gemm: scales must be [N, K / 32]");
  TORCH_CHECK(!mins.has_value() || mins->sizes() == scales.sizes(), "pack_int8_gemm: mins must be [N, K / 32]");
  const at::Tensor w = values.contiguous();
  at::Tensor packed = at::zeros({P, quads, kI8Cols, 4}, values.options());  // columns past N stay zero
  at::Tensor negsum = at::zeros({P, blocks, kI8Cols}, values.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* neg = negsum.data_ptr<int32_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kI8Cols && p * kI8Cols + j < N; ++j) {
        const int8_t* wrow = src + (p * kI8Cols + j) * K;
        for (int64_t q = 0; q < quads; ++q) std::memcpy(dst + ((p * quads + q) * kI8Cols + j) * 4, wrow + 4 * q, 4);
        for (int64_t b = 0; b < blocks; ++b) {
          int32_t sum = 0;
          for (int64_t k = 0; k < kI8Block; ++k) sum += wrow[b * kI8Block + k];
          neg[(p * blocks + b) * kI8Cols + j] = -128 * sum;  // takes back the activations' +128
        }
      }
  });
  std::vector<at::Tensor> out{packed, negsum, panel_blocks(scales, P)};
  if (mins.has_value()) out.push_back(panel_blocks(*mins, P));
  return out;
}

#ifdef TP_HAVE_INT8_DOT
namespace {
// One MR x 32 tile over all of K. xp: the rows' k quads quad-major ([quads][MR] int32, 4 unsigned bytes each); xd /
// xs: their block scales and sums (row r's at + r * blocks; xs only with mins); wp: the panel ([quads][32][4]
// int8); neg, d, mn: its -128 x block sums, scales and mins ([blocks][32]; mn null: none). f0 / f1: columns 0-15 /
// 16-31 of each row.
template <int MR>
inline void int8_tile(const int32_t* xp, const float* xd, const float* xs, const int8_t* wp, const int32_t* neg,
                      const float* d, const float* mn, int64_t blocks, __m512 f0[MR], __m512 f1[MR]) {
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) f0[r] = _mm512_setzero_ps(), f1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i i0[MR], i1[MR];
    const __m512i n0 = _mm512_loadu_si512(neg + b * kI8Cols), n1 = _mm512_loadu_si512(neg + b * kI8Cols + 16);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) i0[r] = n0, i1[r] = n1;
#pragma GCC unroll 8
    for (int64_t q = b * kQuads; q < (b + 1) * kQuads; ++q) {
      const __m512i w0 = _mm512_loadu_si512(wp + q * 4 * kI8Cols), w1 = _mm512_loadu_si512(wp + q * 4 * kI8Cols + 64);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m512i a = _mm512_set1_epi32(xp[q * MR + r]);
        i0[r] = _mm512_dpbusd_epi32(i0[r], a, w0);
        i1[r] = _mm512_dpbusd_epi32(i1[r], a, w1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * kI8Cols), d1 = _mm512_loadu_ps(d + b * kI8Cols + 16);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 s = _mm512_set1_ps(xd[r * blocks + b]);
      f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(s, d0), f0[r]);
      f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(s, d1), f1[r]);
    }
    if (mn) {
      const __m512 m0 = _mm512_loadu_ps(mn + b * kI8Cols), m1 = _mm512_loadu_ps(mn + b * kI8Cols + 16);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m512 t = _mm512_set1_ps(xs[r * blocks + b]);
        f0[r] = _mm512_fmadd_ps(m0, t, f0[r]);
        f1[r] = _mm512_fmadd_ps(m1, t, f1[r]);
      }
    }
  }
}

}  // namespace
#endif

at::Tensor int8_gemm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& negsum,
                     const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t n) {
  TORCH_CHECK(int8_gemm_available(), "int8_gemm: built without AVX512-VNNI");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kI8Cols && packed.size(3) == 4 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              "int8_gemm: packed must come from pack_int8_gemm");
  const int64_t P = packed.size(0), K = packed.size(1) * 4, blocks = K / kI8Block;
  const std::vector<int64_t> panel_blocks_shape{P, blocks, kI8Cols};
  TORCH_CHECK(negsum.sizes() == at::IntArrayRef(panel_blocks_shape) && negsum.scalar_type() == at::kInt && negsum.is_contiguous(),
              "int8_gemm: negsum must come from pack_int8_gemm");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(panel_blocks_shape) && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_gemm: scales must come from pack_int8_gemm");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_mins || (mins->sizes() == at::IntArrayRef(panel_blocks_shape) && mins->scalar_type() == at::kFloat &&
                            mins->is_contiguous()), "int8_gemm: mins must come from pack_int8_gemm");
  TORCH_CHECK(n > (P - 1) * kI8Cols && n <= P * kI8Cols, "int8_gemm: n does not match the packed panels");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "int8_gemm: x must be [M, ", K, "]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), quads = K / 4;
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
#ifdef TP_HAVE_INT8_DOT
  // rows in tiles of up to 6, spread evenly (32 rows: 5 x 4 + 6 x 2); each tile's quads quad-major
  const int64_t tiles = (M + kI8MaxRows - 1) / kI8MaxRows;
  std::vector<int64_t> starts(tiles + 1);
  for (int64_t t = 0; t <= tiles; ++t) starts[t] = t * M / tiles;
  std::vector<int32_t> xp(M * quads);
  std::vector<float> xd(M * blocks), xs(has_mins ? M * blocks : 0);
  const int64_t grain = M * K >= (int64_t{1} << 18) ? 1 : tiles;  // a decode step's rows on the calling thread
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> row(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = starts[t], rows = starts[t + 1] - r0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (r0 + r) * blocks;
        quantize_row(x.data_ptr<float>() + (r0 + r) * K, K, row.data(), xd.data() + at,
                     has_mins ? xs.data() + at : nullptr);
        for (int64_t q = 0; q < quads; ++q) std::memcpy(&xp[r0 * quads + q * rows + r], row.data() + 4 * q, 4);
      }
    }
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* neg = negsum.data_ptr<int32_t>();
  const float* dp = scales.data_ptr<float>();
  const float* mp = has_mins ? mins->data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  // items: a chunk of rows (all of a decode step's) x a few panels, so that dynamic scheduling balances the threads
  const int64_t tiles_per_chunk = kI8RowChunk / kI8MaxRows, chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  const int64_t wanted_groups = (8 * std::max(1, at::get_num_threads()) + chunks - 1) / chunks;
  const int64_t per_item = std::max<int64_t>(1, P / wanted_groups), groups = (P + per_item - 1) / per_item;
  dynamic_for(chunks * groups, [] { return 0; }, [&](int64_t item, int) {
    const int64_t c = item / groups, g = item % groups;
    for (int64_t p = g * per_item; p < std::min(P, (g + 1) * per_item); ++p) {
      const int64_t cols = std::min(kI8Cols, n - p * kI8Cols);
      const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
      const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
      const int64_t at = p * blocks * kI8Cols;
      for (int64_t t = c * tiles_per_chunk; t < std::min(tiles, (c + 1) * tiles_per_chunk); ++t) {
        const int64_t r0 = starts[t];
        with_rows<kI8MaxRows>(starts[t + 1] - r0, [&](auto mr) {
          constexpr int MR = decltype(mr)::value;
          __m512 f0[MR], f1[MR];
          int8_tile<MR>(xp.data() + r0 * quads, xd.data() + r0 * blocks, has_mins ? xs.data() + r0 * blocks : nullptr,
                        wp + p * quads * 4 * kI8Cols, neg + at, dp + at, mp ? mp + at : nullptr, blocks, f0, f1);
          for (int r = 0; r < MR; ++r) {
            float* o = y + (r0 + r) * n + p * kI8Cols;
            _mm512_mask_storeu_ps(o, m0, f0[r]);
            _mm512_mask_storeu_ps(o + 16, m1, f1[r]);
          }
        });
      }
    }
  });
#endif
  return out;
}

}  // namespace tp
