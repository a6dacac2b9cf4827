// The decoder stack in one call: for every layer, QKV projection, rotary + K/V cache write, paged attention,
// output projection, residual add + RMSNorm, gate/up projection, SiLU-and-mul, down projection, residual add +
// the next RMSNorm. The kernel calls of model/llama.py's layer loop, in its order, with the same results bit for bit;
// what it saves is Python: ~12 calls per layer, each a few microseconds of argument handling. (Where the bfloat16
// GEMMs take a layer, it also skips the float32 round trips between them: see mlp and forward.)
#include "stack.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <tuple>

namespace tp {

LinearOp::LinearOp(const std::string& kind, std::vector<at::Tensor> tensors, c10::optional<at::Tensor> bias,
                   bool batch_invariant, int64_t out_features)
    : t_(std::move(tensors)), bias_(std::move(bias)), batch_invariant_(batch_invariant), out_features_(out_features) {
  size_t want = 0;
  if (kind == "panels") kind_ = Kind::Panels, want = 1;
  else if (kind == "int8") kind_ = Kind::Int8, want = 2;
  else if (kind == "q8_0") kind_ = Kind::Q8_0, want = 2;
  else if (kind == "q4_1") kind_ = Kind::Q4_1, want = 3;
  else if (kind == "block_panels") kind_ = Kind::BlockPanels, want = 1;
  else TORCH_CHECK(false, "LinearOp: unknown kind '", kind, "' (panels, int8, q8_0, q4_1, block_panels)");
  TORCH_CHECK(t_.size() == want, "LinearOp ", kind, ": expected ", want, " tensors, got ", t_.size());
  TORCH_CHECK((kind_ != Kind::Panels && kind_ != Kind::Int8 && kind_ != Kind::BlockPanels) || out_features_ > 0,
              "LinearOp ", kind, ": out_features is required");
  for (auto& t : t_) t = t.contiguous();
  if (bias_.has_value() && bias_->defined()) bias_ = bias_->to(at::kFloat).contiguous();
}

void LinearOp::set_gemm_weight(at::Tensor weight, int64_t min_rows, c10::optional<at::Tensor> packed,
                               int64_t packed_max_rows) {
  TORCH_CHECK(weight.dim() == 2 && (out_features_ == 0 || weight.size(0) == out_features_),
              "LinearOp: the GEMM weight must be [out_features, in_features]");
  gemm_from(min_rows, /*rows_independent=*/false);
  gemm_weight_ = weight.contiguous();
  gemm_packed_ = packed.has_value() ? *packed : at::Tensor();
  gemm_packed_max_rows_ = packed_max_rows;
}

void LinearOp::set_int8_gemm(std::vector<at::Tensor> tensors, int64_t min_rows) {
  TORCH_CHECK(kind_ == Kind::Q8_0 || kind_ == Kind::Q4_1, "LinearOp: int8_gemm runs q8_0 / q4_1 blocks");
  TORCH_CHECK(tensors.size() == (kind_ == Kind::Q4_1 ? 4u : 3u), "LinearOp: pack_int8_gemm's tensors expected");
  gemm_from(min_rows, /*rows_independent=*/true);
  int8_ = std::move(tensors);
}

void LinearOp::set_dot_weight(at::Tensor dot, int64_t min_rows, bool fma, bool gate_up_by_16) {
  TORCH_CHECK(out_features_ > 0 && dot.dim() == 4 && dot.size(0) == (out_features_ + dot.size(2) - 1) / dot.size(2),
              "LinearOp: the dot-product weight must be pack_bf16_gemm of a bfloat16 [out_features, in] weight");
  gemm_from(min_rows, /*rows_independent=*/false);
  TORCH_CHECK(!gate_up_by_16 || out_features_ % 32 == 0,  // 16 gate and 16 up outputs a panel
              "LinearOp: a gate / up weight packed by 16s has a multiple of 32 outputs");
  dot_ = dot;
  dot_fma_ = fma;
  dot_gate_up_ = gate_up_by_16;
}

void LinearOp::gemm_from(int64_t min_rows, bool rows_independent) {
  // torch's GEMM may sum a row differently with other rows beside it; and a row computed by the kernel below
  // min_rows and by a GEMM from there would depend on the batch's size
  TORCH_CHECK(!batch_invariant_ || (rows_independent && min_rows <= 1),
              "LinearOp: a GEMM would make rows depend on the batch (batch_invariant)");
  gemm_min_rows_ = std::max<int64_t>(1, min_rows);
}

namespace {
// mkldnn::_linear_pointwise(X, W, B, attr, scalars, algorithm): oneDNN's linear on a weight it reordered (what
// inductor's freezing calls), through the dispatcher (boxed: no C++ header declares it).
at::Tensor linear_prepacked(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}
}  // namespace

at::Tensor LinearOp::gemm_unwidened(const at::Tensor& x) const {
  if (takes_dot()) return tp::bf16_gemm(x, dot_, out_features_, /*bf16_out=*/true, dot_fma_, dot_store());
  const at::Tensor xg = x.to(gemm_weight_.scalar_type());  // [M, K]
  const bool prepacked = gemm_packed_.defined() && x.size(0) < gemm_packed_max_rows_;
  return prepacked ? linear_prepacked(xg, gemm_packed_) : at::linear(xg, gemm_weight_);
}

at::Tensor LinearOp::gated_unwidened(const at::Tensor& x) const {
  if (takes_dot() && dot_gate_up_)
    return tp::bf16_gemm(x, dot_, out_features_, /*bf16_out=*/true, dot_fma_, kStoreSiluMul);
  return tp::silu_and_mul_widened(gemm_unwidened(x));
}

bool LinearOp::rounds_rows(int64_t rows) const {
  const bool bf16_copy = gemm_weight_.defined() && gemm_weight_.scalar_type() == at::kBFloat16;
  return takes_gemm(rows) && int8_.empty() && (takes_dot() || bf16_copy);
}

bool LinearOp::gives_bfloat16(int64_t rows) const {
  return rounds_rows(rows) && !(bias_.has_value() && bias_->defined());  // those GEMMs round their result too
}

at::Tensor LinearOp::gemm(const at::Tensor& x) const {
  // the bfloat16 result widened: by the dot-product kernel as it stores it, else a pass of its own
  at::Tensor y = !int8_.empty()         ? tp::int8_gemm(x, int8_[0], int8_[1], int8_[2],
                                                         int8_.size() > 3 ? c10::optional<at::Tensor>(int8_[3])
                                                                          : c10::nullopt,
                                                         t_[0].size(0))  // the blocks' rows: N
                 : takes_dot() ? tp::bf16_gemm(x, dot_, out_features_, /*bf16_out=*/false, dot_fma_, dot_store())
                                        : gemm_unwidened(x).to(at::kFloat);
  if (bias_.has_value() && bias_->defined()) y.add_(*bias_);
  return y;
}

at::Tensor LinearOp::kernel(const at::Tensor& x, bool gated) const {
  const bool panels = kind_ == Kind::Panels || kind_ == Kind::Int8 || kind_ == Kind::BlockPanels;
  if (gated && !(panels && tp::gates_in_panels(out_features_))) return tp::silu_and_mul(kernel(x, false));
  switch (kind_) {
    case Kind::Panels: return tp::panel_linear(x, t_[0], out_features_, bias_, batch_invariant_, c10::nullopt, gated);
    case Kind::Int8: return tp::panel_linear(x, t_[0], out_features_, bias_, batch_invariant_, t_[1], gated);
    case Kind::Q8_0: return tp::linear_q8_0(x, t_[0], t_[1], bias_);  // batch-invariant at every M
    case Kind::Q4_1: return tp::linear_q4_1(x, t_[0], t_[1], t_[2], bias_);
    case Kind::BlockPanels: return tp::block_panel_linear(x, t_[0], out_features_, bias_, batch_invariant_, gated);
  }
  TORCH_CHECK(false, "LinearOp: bad kind");
}

bool LinearOp::takes_gemm(int64_t rows) const {
  return (gemm_weight_.defined() || takes_dot() || !int8_.empty()) && rows >= gemm_min_rows_;
}

at::Tensor LinearOp::operator()(const at::Tensor& x) const {
  return takes_gemm(x.size(0)) ? gemm(x) : kernel(x, false);
}

at::Tensor LinearOp::silu_gated(const at::Tensor& x) const {
  return takes_gemm(x.size(0)) ? tp::silu_and_mul(gemm(x)) : kernel(x, true);
}

DecoderStack::DecoderStack(std::vector<StackLayer> layers, at::Tensor final_norm, double eps, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin)
    : layers_(std::move(layers)), final_norm_(final_norm.contiguous()), cos_(cos.contiguous()),
      sin_(sin.contiguous()), eps_(eps), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
  TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
  TORCH_CHECK(heads % kv_heads == 0, "DecoderStack: heads must be a multiple of kv_heads");
}

void DecoderStack::set_kv_caches(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "DecoderStack: one K and one V cache per layer expected");
  k_caches_ = std::move(k_caches);
  v_caches_ = std::move(v_caches);
}

// down(silu_and_mul(gate_up(h))): [T, hidden] -> [T, 2F] -> [T, F] -> [T, hidden]. Where both GEMMs run in bfloat16,
// gate_up's bfloat16 result goes to SiLU-and-mul unwidened and comes out in bfloat16 for down's GEMM, the values
// the widened path rounds to (bit for bit) without two float32 [T, 2F] / [T, F] tensors and their conversions.
at::Tensor DecoderStack::mlp(const StackLayer& layer, const at::Tensor& h) const {
  const int64_t T = h.size(0);
  if (layer.gate_up.gives_bfloat16(T) && layer.down.gives_bfloat16(T))
    return layer.down(layer.gate_up.gated_unwidened(h));
  return layer.down(layer.gate_up.silu_gated(h));
}

at::Tensor DecoderStack::add_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                                  const LinearOp* next) const {
  if (next == nullptr || !next->rounds_rows(x.size(0))) {
    tp::add_rms_norm_(x, residual, weight, eps_);
    return x;
  }
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  tp::add_rms_norm_(x, residual, weight, eps_, out);
  return out;
}

namespace {
// rows [N] of a batch whose requests' queries start at qsl [R + 1], each request's rows a suffix of its queries in
// order (its last row, or its last 1 + proposals) -> (rows as int64, their query starts per request [R + 1] int32).
std::tuple<at::Tensor, at::Tensor> suffix_rows(const at::Tensor& rows_in, const at::Tensor& qsl_in) {
  const at::Tensor rows = rows_in.to(at::kLong).contiguous(), qsl = qsl_in.to(at::kInt).contiguous();
  TORCH_CHECK(rows.dim() == 1 && qsl.dim() == 1, "DecoderStack: out_rows must be [N], query_start_loc [R + 1]");
  const int64_t N = rows.size(0), R = qsl.size(0) - 1;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int32_t* q = qsl.data_ptr<int32_t>();
  at::Tensor starts = at::empty({R + 1}, qsl.options());
  int32_t* start = starts.data_ptr<int32_t>();
  int64_t j = 0;
  start[0] = 0;
  for (int64_t r = 0; r < R; ++r) {
    int64_t count = 0;
    while (j + count < N && row[j + count] < q[r + 1]) ++count;
    for (int64_t k = 0; k < count; ++k)
      TORCH_CHECK(row[j + k] == q[r + 1] - count + k, "DecoderStack: out_rows must be each request's last rows, in order");
    j += count;
    start[r + 1] = static_cast<int32_t>(j);
  }
  TORCH_CHECK(j == N, "DecoderStack: out_rows outside the batch");
  return {rows, starts};
}
}  // namespace

at::Tensor DecoderStack::forward(at::Tensor residual, const at::Tensor& positions, const at::Tensor& slots,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, int64_t block_size,
                                 const c10::optional<at::Tensor>& out_rows) {
  TORCH_CHECK(k_caches_.size() == layers_.size(), "DecoderStack: set_kv_caches first");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "DecoderStack: residual must be a contiguous float32 [T, hidden] tensor");
  const int64_t T = residual.size(0), q_size = heads_ * head_dim_;
  // the last layer's rows and their query starts; none to select where every row is asked for (a decode step)
  at::Tensor rows, last_qsl;
  if (out_rows.has_value() && out_rows->defined() && out_rows->size(0) < T)
    std::tie(rows, last_qsl) = suffix_rows(*out_rows, query_start_loc);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  // Rows bound for a projection that rounds them to bfloat16 (the norms' results, attention's) are stored rounded by
  // the kernel that makes them: the same bits, without a float32 copy and a pass to round it (three a layer; at 32
  // rows on the calling thread alone, the other waiting). SmolLM2-135M, 2 Zen 4 cores, with bf16x16_of's one
  // instruction: a 2,048-token prefill step's norms and conversions 5.1% -> 2.4% of its samples; 32-row decode steps
  // 36.6 / 40.0 -> 34.3 / 37.9 ms (alternating processes); S1-shaped rounds in one process 437 -> 458 tok/s (medians
  // of six).
  at::Tensor h = tp::rms_norm(residual, layers_[0].input_norm, eps_, layers_[0].qkv.rounds_rows(T));  // [T, hidden]
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& layer = layers_[i];
    at::Tensor qkv = layer.qkv(h);  // [T, (H + 2 KVH) * D]
    tp::rotary_cache_(qkv, positions, cos_, sin_, k_caches_[i], v_caches_[i], slots, heads_, kv_heads_);
    // q [T, H, D]: the rotated query part of qkv, read in place (a copy was a serial pass over fresh pages)
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
    const at::Tensor* qsl = &query_start_loc;
    if (rows.defined() && i + 1 == layers_.size()) {  // the last layer past its K / V: the rows asked for alone
      if (rows.size(0) == 0) return at::empty({0, residual.size(1)}, residual.options());
      q = q.index_select(0, rows);  // [N, H, D]
      residual = residual.index_select(0, rows);  // [N, hidden]
      qsl = &last_qsl;
    }
    const int64_t rows_now = q.size(0);
    const at::ScalarType attn_dtype = layer.o.rounds_rows(rows_now) ? at::kBFloat16 : at::kFloat;
    at::Tensor attn = at::empty({rows_now, heads_, head_dim_}, qkv.options().dtype(attn_dtype));
    tp::paged_attention(attn, q, k_caches_[i], v_caches_[i], block_tables, seq_lens, *qsl, block_size, scale,
                        dense_min_queries_, dot_min_queries_, dot_fma_);
    h = layer.o(attn.view({rows_now, q_size}));  // [rows, hidden] float32
    h = add_norm(h, residual, layer.post_norm, &layer.gate_up);
    h = mlp(layer, h);
    const bool last = i + 1 == layers_.size();
    h = add_norm(h, residual, last ? final_norm_ : layers_[i + 1].input_norm, last ? nullptr : &layers_[i + 1].qkv);
  }
  return h;
}

}  // namespace tp
