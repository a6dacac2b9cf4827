// Python bindings for twophase CPU kernels.
#include <ATen/ATen.h>
#include <torch/python.h>

namespace tp {
at::Tensor linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
at::Tensor linear_int8(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const c10::optional<at::Tensor>&);
at::Tensor linear_q8_0(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const c10::optional<at::Tensor>&);
at::Tensor linear_q4_1(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const c10::optional<at::Tensor>&);
void paged_attention(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double);
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double);
void add_rms_norm_(at::Tensor&, at::Tensor&, const at::Tensor&, double);
at::Tensor silu_and_mul(const at::Tensor&);
void rotary_cache_(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                   const at::Tensor&, int64_t, int64_t);
}  // namespace tp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "twophase CPU kernels (small-M linear, quantized linear, paged attention, fused layer ops)";
  m.def("linear", &tp::linear, "y = x @ w.T + bias (w fp32/bf16)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("linear_int8", &tp::linear_int8, "y = (x @ wq.T) * scale + bias", py::arg("x"), py::arg("wq"),
        py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q8_0", &tp::linear_q8_0, "GGUF Q8_0 linear (x rounded to int8 blocks)", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("bias") = py::none());
  m.def("linear_q4_1", &tp::linear_q4_1, "GGUF Q4_1 linear (x rounded to int8 blocks)", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("m"), py::arg("bias") = py::none());
  m.def("paged_attention", &tp::paged_attention, "varlen causal attention over a paged KV cache", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("block_size"), py::arg("scale"));
  m.def("rms_norm", &tp::rms_norm, "weight * rms_norm(x)", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm_", &tp::add_rms_norm_, "in place: residual += x; x = weight * rms_norm(residual)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &tp::silu_and_mul, "silu(gate) * up of gate_up [T, 2F]", py::arg("gate_up"));
  m.def("rotary_cache_", &tp::rotary_cache_, "rotate q/k heads of qkv in place, store k/v into the cache",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("heads"), py::arg("kv_heads"));
}
