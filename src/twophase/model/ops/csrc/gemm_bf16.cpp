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

bool bf16_gemm_available() {
#ifdef TP_HAVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_gemm(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_gemm: a bfloat16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0 && K > 0, "pack_bf16_gemm: K must be even (the products go in pairs of k)");
  const int64_t P = (N + kDotCols - 1) / kDotCols, pairs = K / 2;
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::zeros({P, pairs, kDotCols, 2}, weight.options());  // columns past N stay zero
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
// x's rows as bf16_gemm's tiles read them, the weight's panels, and the rows spread evenly over tiles of at most
// kDotMaxRows (32 rows as 10 + 11 + 11).
struct PanelGemm {
  int64_t M = 0, pairs = 0, P = 0, blocks = 0, panel_bytes = 0;
  std::vector<int64_t> starts;  // [blocks + 1]
  at::Tensor xb;                // [M, K] bfloat16, row-major
  const int32_t* xr = nullptr;  // xb's k pairs
  const uint16_t* wp = nullptr;  // [P, pairs, 32, 2]

  PanelGemm(const at::Tensor& x, const at::Tensor& packed)
      : M(x.size(0)), pairs(packed.size(1)), P(packed.size(0)), blocks((M + kDotMaxRows - 1) / kDotMaxRows),
        panel_bytes(pairs * 2 * kDotCols * static_cast<int64_t>(sizeof(uint16_t))), starts(blocks + 1) {
    for (int64_t b = 0; b <= blocks; ++b) starts[b] = b * M / blocks;
    // x's rows as bfloat16, row-major, their k pairs read in place by the tiles: x itself where it is bfloat16
    // (down's input, from SiLU-and-mul), else rounded once, over the threads from 256K values on. They were packed
    // pair-major a row block at a time before (a transpose into a zeroed buffer, on the calling thread for a decode
    // step): in one process, 2 Zen 4 cores, alternating, 2,048-token prefill steps 1,305 -> 1,252 ms, 32-row decode
    // steps 38.6 -> 37.6 ms; down's GEMM alone at 32 rows 1.09-1.26x, at 2,048 rows 1.07x.
    const at::Tensor xc = x.contiguous();
    xb = xc.scalar_type() == at::kBFloat16 ? xc : rows_as_bf16(xc);
    xr = reinterpret_cast<const int32_t*>(xb.data_ptr<at::BFloat16>());
    wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  }

  // Items of a few panels (or panel pairs) each, `units` in all, so that dynamic scheduling balances two threads
  // without an item per panel: the items' count and the units an item.
  static std::pair<int64_t, int64_t> items(int64_t units) {
    const int64_t per_item = std::max<int64_t>(1, units / (8 * std::max(1, at::get_num_threads())));
    return {(units + per_item - 1) / per_item, per_item};
  }

  // Row block b's tile of panel p: store(r, c0, c1) gets row starts[b] + r's columns 0-15 and 16-31. The first block
  // reads the panel from memory, prefetching ahead in it (into the memory after it at its end); the blocks after
  // it bring panel `next` into L2 meanwhile, a share each (a line a pair: half the panel where there are two blocks,
  // as measured).
  template <class Store>
  void tile(int64_t p, int64_t next, int64_t b, Store&& store) const {
    const int64_t r0 = starts[b];
    const char* next_share = b == 0 ? nullptr
                                    : reinterpret_cast<const char*>(wp + next * pairs * 2 * kDotCols) +
                                          (b - 1) * panel_bytes / (blocks - 1);
    with_tile_rows(starts[b + 1] - r0, [&](auto mr) {
      dot_tile<decltype(mr)::value, kRowMajor>(xr + r0 * pairs, wp + p * pairs * 2 * kDotCols, pairs, nullptr, 0,
                                               store, b == 0 ? kPrefetchPairs : 0, next_share, pairs);
    });
  }
};
#endif

// The checks bf16_gemm and bf16_gemm_silu share: x [M, K] float32 or bfloat16, packed from pack_bf16_gemm with K's
// pairs and n outputs.
void check_gemm_args(const char* what, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(bf16_gemm_available(), what, ": built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), what,
              ": x must be a float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kDotCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              what, ": packed must come from pack_bf16_gemm");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), what, ": x has ", x.size(1), " columns, the weight ", 2 * packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * kDotCols && n <= packed.size(0) * kDotCols, what,
              ": n does not match the packed panels");
}
}  // namespace

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool bf16_out) {
  check_gemm_args("bf16_gemm", x, packed, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (x.size(0) == 0) return out;
#ifdef TP_HAVE_BF16_DOT
  const PanelGemm g(x, packed);
  uint16_t* out16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  float* out32 = bf16_out ? nullptr : out.data_ptr<float>();
  const auto [items, per_item] = PanelGemm::items(g.P);
  dynamic_for(items, [] { return 0; }, [&](int64_t i, int) {
    for (int64_t p = i * per_item; p < std::min(g.P, (i + 1) * per_item); ++p) {
      const int64_t cols = std::min(kDotCols, n - p * kDotCols);
      const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
      const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
      for (int64_t b = 0; b < g.blocks; ++b) {
        // the rows' sums rounded once to bfloat16, stored as such or widened
        g.tile(p, p + 1, b, [&](int r, __m512 c0, __m512 c1) {
          const int64_t at = (g.starts[b] + r) * n + p * kDotCols;
          const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(c0), h1 = (__m256i)_mm512_cvtneps_pbh(c1);
          if (out16) {
            _mm256_mask_storeu_epi16(out16 + at, m0, h0);
            _mm256_mask_storeu_epi16(out16 + at + 16, m1, h1);
          } else {
            _mm512_mask_storeu_ps(out32 + at, m0, widen_bf16x16(h0));
            _mm512_mask_storeu_ps(out32 + at + 16, m1, widen_bf16x16(h1));
          }
        });
      }
    }
  });
#endif
  return out;
}

bool bf16_gemm_silu_fits(int64_t n) { return n % (2 * kDotCols) == 0; }

at::Tensor bf16_gemm_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_gemm_args("bf16_gemm_silu", x, packed, n);
  TORCH_CHECK(bf16_gemm_silu_fits(n), "bf16_gemm_silu: gate and up must each be whole panels (n a multiple of ",
              2 * kDotCols, ")");
  const int64_t F = n / 2;
  at::Tensor out = at::empty({x.size(0), F}, x.options().dtype(at::kBFloat16));
  if (x.size(0) == 0) return out;
#ifdef TP_HAVE_BF16_DOT
  const PanelGemm g(x, packed);
  const int64_t gates = F / kDotCols;  // gate panel p's up panel is p + gates
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto [items, per_item] = PanelGemm::items(gates);
  dynamic_for(items, [] { return 0; }, [&](int64_t i, int) {
    alignas(64) float gate[kDotMaxRows][kDotCols];  // a tile's gate values, rounded to bfloat16 as bf16_gemm stores
    for (int64_t p = i * per_item; p < std::min(gates, (i + 1) * per_item); ++p) {
      for (int64_t b = 0; b < g.blocks; ++b) {
        g.tile(p, p + gates, b, [&](int r, __m512 c0, __m512 c1) {
          _mm512_store_ps(gate[r], widen_bf16x16((__m256i)_mm512_cvtneps_pbh(c0)));
          _mm512_store_ps(gate[r] + 16, widen_bf16x16((__m256i)_mm512_cvtneps_pbh(c1)));
        });
        g.tile(p + gates, p + 1, b, [&](int r, __m512 c0, __m512 c1) {
          uint16_t* row = o + (g.starts[b] + r) * F + p * kDotCols;
          const __m512 u0 = widen_bf16x16((__m256i)_mm512_cvtneps_pbh(c0));
          const __m512 u1 = widen_bf16x16((__m256i)_mm512_cvtneps_pbh(c1));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), bf16x16_of(silu_mul16(_mm512_load_ps(gate[r]), u0)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16),
                              bf16x16_of(silu_mul16(_mm512_load_ps(gate[r] + 16), u1)));
        });
      }
    }
  });
#endif
  return out;
}

}  // namespace tp
