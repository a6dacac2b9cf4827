// The kernels' C++ entry points (defined in linear.cpp, attention.cpp, fused.cpp, dequant.cpp), shared by the Python
// bindings and the decoder stack (stack.cpp), which calls them without going through Python.
#pragma once
#include <ATen/ATen.h>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tp {
// batch_invariant: each output row summed in one order at every batch size (the block formats always are).

// Column panels of a float32 / bfloat16 / int8 weight [N, K] (linear.cpp, kPanel; packed by linear.py): their shape,
// and y = (x @ W.T) * scale + bias through them at any batch size (scale: int8 only). gated: W is a gate / up
// projection [gate; up] and y = silu_and_mul of that [M, N / 2], the same bits, without the [M, N] product where N
// is a multiple of 48 (whole panels a half; otherwise the two ops in turn).
std::vector<int64_t> panel_shape(int64_t N, int64_t K);
bool gates_in_panels(int64_t N);  // whether N outputs split into whole panels a half (gated takes them)
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias,
                        bool batch_invariant, const c10::optional<at::Tensor>& scale, bool gated = false);
// GGUF Q8_0 / Q4_1 blocks of a float32 weight [N, K] rearranged per column panel (linear.cpp, PQ8_0 / PQ4_1;
// packed by linear.py: pack_block_panels): their shape [P, K/32, bytes], y = x @ W.T + bias through them (the same
// bits as the float32 panels of W), and W's float32 panels [P, K, 24] widened from them.
std::vector<int64_t> block_panel_shape(const std::string& fmt, int64_t N, int64_t K);
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                              const c10::optional<at::Tensor>& bias, bool batch_invariant, bool gated = false);
at::Tensor widen_block_panels(const at::Tensor& panels);
// (qs, d[, m]) of a q8_0 / q4_1 weight [N, K] in quant.py's layout written into out, its block panels (uint8, of
// block_panel_shape; linear.py: pack_block_panels_reference is the torch reference); rows past N zero.
void pack_block_panels_(at::Tensor& out, const std::string& fmt, const std::vector<at::Tensor>& packed);
// Whether the block panels widen to exactly weight [N, K] float32, value for value (as torch.equal).
bool block_panels_equal(const at::Tensor& panels, const at::Tensor& weight);

// ---- the compute floor (peak.cpp) ----
// FLOP/s of this CPU's matmul instruction for dtype ('bfloat16': vdpbf16ps, 'float32': the widest FMA) on every
// thread of the team at once, over ~seconds: the floor the GEMMs are measured against. Raises where the build lacks
// the instruction.
double instruction_peak(const std::string& dtype, double seconds);

// ---- sampling (sampling.cpp) ----
// In place: each row of logits [rows, vocab] float32 keeps the smallest best-first set whose probability reaches
// top_p [rows] (an entry is kept while the mass above it is below top_p; the best always), the rest set to -inf.
// Rows with top_p >= 1, NaN or no finite logit are left as they are.
void top_p_mask_(at::Tensor& logits, const at::Tensor& top_p);
// Each row's first maximum of logits [rows, vocab] float32 (rows contiguous, any row stride), NaN counting as the
// maximum: torch.max(logits, -1).indices, int64 [rows]. Rows in parallel, 16 lanes a step on AVX-512.
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias);
// x float32 [T, K] rounded to int8 blocks of 32 (q * d), what the Q8_0 / Q4_1 kernels compute with.
at::Tensor fake_quantize_activations(const at::Tensor& x);
at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       const c10::optional<at::Tensor>& bias);
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t block_size, double scale, int64_t dense_min_queries = 0,
                     int64_t dot_min_queries = 0, bool dot_fma = false);
// Whether attention over an int8 cache scores on AVX512-VNNI (its queries rounded to int8 rows).
bool int8_qk_available();
// bfloat16 GEMM on AVX512-BF16 dot products (gemm_bf16.cpp): whether this build has it; a bfloat16 weight [N, K]
// (K even) in its panel layout; y = x @ W.T for x float32 / bfloat16 [M, K], as bfloat16 or as float32 holding the
// bfloat16-rounded values. Each output is one chain over k in order whatever M: a row's result never depends on
// the other rows.
bool bf16_gemm_available();
at::Tensor pack_bf16_gemm(const at::Tensor& weight, const c10::optional<at::Tensor>& into = c10::nullopt);
// How bf16_gemm stores its sums. kStorePlain: y [M, n] in the packed weight's output order. The other two take a
// gate / up weight ([gate; up], n = 2F outputs, F a multiple of 16) packed by 16s (each panel the gate outputs
// 16j .. 16j + 15 and then the same up outputs: gemm.py's gate_up_by_16): kStoreGateUp y [M, n] as the unpacked
// weight gives it (gate outputs in columns 0 .. F, up in F .. 2F); kStoreSiluMul silu(gate) * up [M, F] in bfloat16,
// what silu_and_mul_widened makes of kStoreGateUp's bfloat16 y, bit for bit, without that [M, n] product.
enum GemmStore : int64_t { kStorePlain = 0, kStoreGateUp = 1, kStoreSiluMul = 2 };
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool bf16_out, bool fma = false,
                     int64_t store = kStorePlain);
// GGUF-style int8 blocks on AVX512-VNNI (gemm_int8.cpp): whether this build has it; values int8 [N, K] (K a
// multiple of 32) with scales [and mins] float32 [N, K / 32] (w = scale q [+ min] a block) -> the kernel's tensors
// (packed values, -128 x block sums, scales[, mins] by panel); y = x @ W.T as float32 [M, n], x float32 [M, K]
// rounded to int8 per block of 32 (quant.py: quantize_activations).
bool int8_gemm_available();
std::vector<at::Tensor> pack_int8_gemm(const at::Tensor& values, const at::Tensor& scales,
                                       const c10::optional<at::Tensor>& mins);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& negsum,
                     const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t n);
// weight * rms_norm(x) [T, H] in x's dtype, or (bf16_out, x float32) that rounded once to bfloat16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16_out = false);
// residual += x; x = weight * rms_norm(residual), or into out (bfloat16, x float32 and left as it was).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                   const c10::optional<at::Tensor>& out = c10::nullopt);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor silu_and_mul_widened(const at::Tensor& gate_up);
void rotary_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t heads,
                   int64_t kv_heads);
// Q8_0 / Q4_1 -> float32 [N, K], the same bits as quant.py's torch reference: from the file's raw block bytes
// (load time), or from quant.py's packed tensors (qs, d[, m]).
at::Tensor dequantize_gguf(const at::Tensor& raw, const std::string& fmt, int64_t n, int64_t k);
at::Tensor dequantize_blocks(const std::string& fmt, const std::vector<at::Tensor>& packed);
// (N, K) of packed block tensors qs [N, K/32 * bytes_per_block] and float16 d [N, K/32]; raises otherwise.
std::pair<int64_t, int64_t> check_blocks(const at::Tensor& qs, const at::Tensor& d, int64_t bytes_per_block);
}  // namespace tp
