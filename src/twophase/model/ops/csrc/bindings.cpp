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
}  // namespace tp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "twophase CPU kernels (small-M linear, quantized linear, paged attention)";
  m.def("linear", &tp::linear, "y = x @ w.T + bias (w fp32/bf16)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("linear_int8", &tp::linear_int8, "y = (x @ wq.T) * scale + bias", py::arg("x"), py::arg("wq"),
        py::arg("scale"), py::arg("bias") = py::none());
  m.def("linear_q8_0", &tp::linear_q8_0, "GGUF Q8_0 weight-only linear", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("bias") = py::none());
  m.def("linear_q4_1", &tp::linear_q4_1, "GGUF Q4_1 weight-only linear", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("m"), py::arg("bias") = py::none());
  m.def("paged_attention", &tp::paged_attention, "varlen causal attention over a paged KV cache", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("block_size"), py::arg("scale"));
}
