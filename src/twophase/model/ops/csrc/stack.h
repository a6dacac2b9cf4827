// The whole decoder stack of a Llama-family model in one C++ call (stack.cpp): the same kernels, in the same
// order, as the Python layer loop of model/llama.py, without a trip through Python per op.
#pragma once
#include <string>
#include <vector>
#include "ops.h"

namespace tp {

// One projection y = x W^T + b as its Python layer packed it: "panels" (W fp32/bf16 in column panels, from
// linear.py: pack_panels), "int8" (int8 panels, scale), "q8_0" (qs, d) or "q4_1" (qs, d, m) — the kernel's argument order;
// out_features: W's rows (panels and int8). The Python linear layers call it too, so
// the stack and the layer loop run one object per projection.
class LinearOp {
 public:
  LinearOp(const std::string& kind, std::vector<at::Tensor> tensors, c10::optional<at::Tensor> bias,
           bool batch_invariant, int64_t out_features);
  at::Tensor operator()(const at::Tensor& x) const;  // x fp32 [M, K] -> fp32 [M, N]
  // A gate / up projection ([gate; up] rows) through SiLU-and-mul: silu_and_mul((*this)(x)), x fp32 [M, K] -> fp32
  // [M, N / 2], the same bits; the panel kernels apply it as they store (without the [M, N] product).
  at::Tensor silu_gated(const at::Tensor& x) const;
  // From min_rows rows on, y = linear(x as w's dtype, w) in float32 (+ bias): a bfloat16 copy [N, K] of the weight
  // that torch's GEMM runs on AMX / AVX512-BF16, many times the float32 panels' rate for a prefill chunk. packed
  // (optional): the same weight reordered by oneDNN (torch.ops.mkldnn._reorder_linear_weight), run by
  // mkldnn::_linear_pointwise below packed_max_rows rows, where it saves the per-call reorder.
  void set_gemm_weight(at::Tensor weight, int64_t min_rows, c10::optional<at::Tensor> packed, int64_t packed_max_rows);
  // From min_rows rows on, at every row count, the projection runs bf16_gemm's AVX512-BF16 dot products instead of
  // its kernel: `dot` is its weight in bfloat16 [out_features, in], in pack_bf16_gemm's layout (no other copy is
  // kept). The bfloat16-rounded GEMM result torch's would give, summed in another order.
  // fma: its sums on float32 FMAs (fma_tile), where they outrun the dot-product instruction. gate_up_by_16: `dot`
  // packs a gate / up weight's rows by 16s (gemm.py: gate_up_by_16), which gated_unwidened takes through SiLU as it
  // stores; every result keeps the unpacked weight's column order.
  void set_dot_weight(at::Tensor dot, int64_t min_rows, bool fma = false, bool gate_up_by_16 = false);
  // From min_rows rows on, a block-format projection (q8_0, q4_1) runs int8_gemm on `tensors` (pack_int8_gemm of its
  // blocks: packed values, negsum, scales[, mins]) instead of its kernel: the same quantities (x rounded to int8
  // blocks, the blocks' products summed exactly) at AVX512-VNNI's rate; float32 sums in another order.
  void set_int8_gemm(std::vector<at::Tensor> tensors, int64_t min_rows);
  // Whether `rows` rows take a GEMM that rounds them to bfloat16 first (bf16_gemm, or torch's on a bfloat16 copy):
  // then rows already rounded (as a norm or attention can store them) give the same bits.
  bool rounds_rows(int64_t rows) const;
  // Whether `rows` rows take such a GEMM with a bfloat16 result before widening (no bias to add).
  bool gives_bfloat16(int64_t rows) const;
  // The GEMM's own result [M, N] in the copy's dtype (x in any float dtype): operator()'s values before widening.
  at::Tensor gemm_unwidened(const at::Tensor& x) const;
  // A gate / up projection's silu_and_mul_widened(gemm_unwidened(x)) [M, N / 2] bfloat16 (gives_bfloat16 rows), the
  // same bits; a dot-product weight packed by 16s applies it as it stores, without the [M, N] product.
  at::Tensor gated_unwidened(const at::Tensor& x) const;

 private:
  at::Tensor gemm(const at::Tensor& x) const;
  bool takes_gemm(int64_t rows) const;  // whether `rows` rows run on a GEMM (torch's, bf16_gemm or int8_gemm)
  // The GEMM set from min_rows rows on; rows_independent: it sums every row alone (int8_gemm), so under
  // batch_invariant it may run from one row
  void gemm_from(int64_t min_rows, bool rows_independent);
  // The kernel for its kind (gated: through SiLU-and-mul, applied as the panels store where gates_in_panels).
  at::Tensor kernel(const at::Tensor& x, bool gated) const;
  enum class Kind { Panels, Int8, Q8_0, Q4_1, BlockPanels } kind_;
  std::vector<at::Tensor> t_;
  c10::optional<at::Tensor> bias_;
  bool batch_invariant_;
  int64_t out_features_;
  at::Tensor gemm_weight_;  // defined: the GEMM is torch's on this copy (set_gemm_weight)
  int64_t gemm_min_rows_ = 0;
  at::Tensor gemm_packed_;  // undefined: at::linear at every row count from gemm_min_rows_
  int64_t gemm_packed_max_rows_ = 0;
  at::Tensor dot_;  // defined: the GEMM is bf16_gemm on it (set_dot_weight)
  bool dot_fma_ = false;  // bf16_gemm sums on FMAs (set_dot_weight)
  bool dot_gate_up_ = false;  // dot_ packs a gate / up weight by 16s (set_dot_weight)
  std::vector<at::Tensor> int8_;  // not empty: the GEMM is int8_gemm on these (set_int8_gemm)
  bool takes_dot() const { return dot_.defined(); }
  int64_t dot_store() const { return dot_gate_up_ ? kStoreGateUp : kStorePlain; }  // bf16_gemm's store for dot_
};

struct StackLayer {
  at::Tensor input_norm, post_norm;  // [hidden] fp32
  LinearOp qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, at::Tensor final_norm, double eps, int64_t heads, int64_t kv_heads,
               int64_t head_dim, at::Tensor cos, at::Tensor sin);
  // The K/V caches of every layer ([slots, KVH, D] each), kept until replaced.
  void set_kv_caches(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches);
  // Requests with at least min_queries queries attend through torch's SDPA in bfloat16 (paged_attention's
  // dense_min_queries; 0: never).
  void set_dense_attention(int64_t min_queries) { dense_min_queries_ = min_queries; }
  // Requests with at least min_queries queries attend on bfloat16 dot products (paged_attention's dot_min_queries),
  // summed on float32 FMAs with fma (its dot_fma).
  void set_dot_attention(int64_t min_queries, bool fma = false) { dot_min_queries_ = min_queries, dot_fma_ = fma; }
  // residual [T, hidden] fp32 (the embeddings; updated in place) -> the final norm of the last residual [T, hidden].
  // With out_rows [N] (rows of the batch, each request's a suffix of its queries, in order): only those rows' final
  // norm [N, hidden]; the last layer writes every row's K / V and runs the rest (attention, projections, MLP) on
  // those rows alone.
  at::Tensor forward(at::Tensor residual, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t block_size, const c10::optional<at::Tensor>& out_rows);

 private:
  at::Tensor mlp(const StackLayer& layer, const at::Tensor& h) const;  // [T, hidden] -> [T, hidden]
  // residual += x; weight * rms_norm(residual) [T, hidden]: x itself, in place, or bfloat16 rows where `next` (the
  // projection they go to; null: none) rounds them anyway.
  at::Tensor add_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, const LinearOp* next) const;
  std::vector<StackLayer> layers_;
  at::Tensor final_norm_, cos_, sin_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  std::vector<at::Tensor> k_caches_, v_caches_;
  int64_t dense_min_queries_ = 0, dot_min_queries_ = 0;
  bool dot_fma_ = false;
};

}  // namespace tp
