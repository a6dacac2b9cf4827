// Python bindings for twophase CPU kernels.
#include <ATen/ATen.h>
#include <torch/python.h>
#include <pybind11/stl.h>

#include "dot_bf16.h"
#include "stack.h"

// The decoder stack's forward and a projection's call release the GIL while they run (tensor arguments only): a
// served step is one such call of up to a second, during which the HTTP thread could otherwise neither admit a
// request nor stream a token.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "twophase CPU kernels (small-M linear, quantized linear, paged attention, fused layer ops)";
  m.def("panel_shape", &tp::panel_shape, "shape of the column panels of a weight [n, k]", py::arg("n"), py::arg("k"));
  m.def("panel_linear", &tp::panel_linear, "y = (x @ w.T) * scale + bias for w in column panels (n: w's rows)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias") = py::none(), py::arg("batch_invariant") = false,
        py::arg("scale") = py::none(), py::arg("gated") = false);
  m.def("block_panel_shape", &tp::block_panel_shape, "shape of the block panels of a q8_0 / q4_1 weight [n, k]",
        py::arg("fmt"), py::arg("n"), py::arg("k"));
  m.def("block_panel_linear", &tp::block_panel_linear,
        "y = x @ w.T + bias for a float32 w kept as q8_0 / q4_1 block panels (the float32 panels' bits)", py::arg("x"),
        py::arg("panels"), py::arg("n"), py::arg("bias") = py::none(), py::arg("batch_invariant") = false,
        py::arg("gated") = false);
  m.def("widen_block_panels", &tp::widen_block_panels, "block panels -> the float32 column panels [P, K, 24]",
        py::arg("panels"));
  m.def("pack_block_panels_", &tp::pack_block_panels_, "q8_0 (qs, d) / q4_1 (qs, d, m) of a weight -> its block panels",
        py::arg("out"), py::arg("fmt"), py::arg("packed"));
  m.def("block_panels_equal", &tp::block_panels_equal, "whether block panels widen to exactly a float32 weight",
        py::arg("panels"), py::arg("weight"));
  m.def("instruction_peak", &tp::instruction_peak,
        "FLOP/s of the CPU's matmul instruction for a dtype ('bfloat16' or 'float32') on every thread at once",
        py::arg("dtype"), py::arg("seconds") = 0.2, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &tp::argmax_rows, "each row's first maximum (NaN as the maximum), as torch.max's indices",
        py::arg("logits"));
  m.def("top_p_mask_", &tp::top_p_mask_, "in place: -inf outside each row's top-p set (selection, no sort)",
        py::arg("logits"), py::arg("top_p"));
  m.def("linear_q8_0", &tp::linear_q8_0, "GGUF Q8_0 linear (x rounded to int8 blocks)", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("bias") = py::none());
  m.def("linear_q4_1", &tp::linear_q4_1, "GGUF Q4_1 linear (x rounded to int8 blocks)", py::arg("x"), py::arg("qs"), py::arg("d"),
        py::arg("m"), py::arg("bias") = py::none());
  m.def("paged_attention", &tp::paged_attention, "varlen causal attention over a paged KV cache", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("block_size"), py::arg("scale"), py::arg("dense_min_queries") = 0,
        py::arg("dot_min_queries") = 0, py::arg("dot_fma") = false);
  m.def("int8_qk_available", &tp::int8_qk_available,
        "whether attention over an int8 cache scores on AVX512-VNNI (queries rounded to int8 rows)");
  m.def("bf16_gemm_available", &tp::bf16_gemm_available, "whether bf16_gemm was built (AVX512-BF16)");
  m.attr("DOT_COLS") = tp::kDotCols;  // outputs a panel of pack_bf16_gemm's layout
  m.def("pack_bf16_gemm", &tp::pack_bf16_gemm,
        "a bfloat16 weight [n, k] in bf16_gemm's panel layout [ceil(n / 32), k / 2, 32, 2], written into `out` where given",
        py::arg("weight"), py::arg("out") = py::none());
  m.def("bf16_gemm", &tp::bf16_gemm, "y = x @ w.T on bfloat16 dot products (w packed by pack_bf16_gemm)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bf16_out"), py::arg("fma") = false,
        py::arg("store") = 0, py::call_guard<py::gil_scoped_release>());
  m.attr("GEMM_STORE_GATE_UP") = static_cast<int64_t>(tp::kStoreGateUp);  // bf16_gemm's store modes (ops.h)
  m.attr("GEMM_STORE_SILU_MUL") = static_cast<int64_t>(tp::kStoreSiluMul);
  m.def("int8_gemm_available", &tp::int8_gemm_available, "whether int8_gemm was built (AVX512-VNNI)");
  m.def("pack_int8_gemm", &tp::pack_int8_gemm,
        "int8 block values [n, k] with scales [, mins] [n, k / 32] -> int8_gemm's (packed, negsum, scales[, mins])",
        py::arg("values"), py::arg("scales"), py::arg("mins") = py::none());
  m.def("int8_gemm", &tp::int8_gemm, "y = x @ w.T on int8 products (x rounded per block of 32, w in int8 blocks)",
        py::arg("x"), py::arg("packed"), py::arg("negsum"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &tp::rms_norm, "weight * rms_norm(x) (bf16_out: a float32 x's result rounded once)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("bf16_out") = false);
  m.def("add_rms_norm_", &tp::add_rms_norm_,
        "in place: residual += x; x = weight * rms_norm(residual) (given out: into it as bfloat16, x as it was)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("silu_and_mul", &tp::silu_and_mul, "silu(gate) * up of gate_up [T, 2F]", py::arg("gate_up"));
  m.def("silu_and_mul_widened", &tp::silu_and_mul_widened,
        "silu(gate) * up of bfloat16 gate_up [T, 2F] in float32, rounded once to bfloat16", py::arg("gate_up"));
  m.def("rotary_cache_", &tp::rotary_cache_, "rotate q/k heads of qkv in place, store k/v into the cache",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("heads"), py::arg("kv_heads"));
  m.def("dequantize_gguf", &tp::dequantize_gguf, "raw GGUF q8_0 / q4_1 block bytes -> float32 [N, K]",
        py::arg("raw"), py::arg("fmt"), py::arg("n"), py::arg("k"));
  m.def("fake_quantize_activations", &tp::fake_quantize_activations,
        "float32 [T, K] rounded to int8 blocks of 32 (q * d), as the Q8_0 / Q4_1 kernels see it", py::arg("x"));
  m.def("dequantize_blocks", &tp::dequantize_blocks, "packed q8_0 (qs, d) / q4_1 (qs, d, m) -> float32 [N, K]",
        py::arg("fmt"), py::arg("packed"));
  py::class_<tp::LinearOp>(m, "LinearOp", "one projection as packed: panels (w's column panels), int8 (its panels, scale), q8_0 (qs, d), q4_1 (qs, d, m), block_panels (q8_0 / q4_1 block panels of a float32 w)")
      .def(py::init<const std::string&, std::vector<at::Tensor>, c10::optional<at::Tensor>, bool, int64_t>(),
           py::arg("kind"), py::arg("tensors"), py::arg("bias") = py::none(), py::arg("batch_invariant") = false,
           py::arg("out_features") = 0)
      .def("__call__", &tp::LinearOp::operator(), py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("silu_gated", &tp::LinearOp::silu_gated, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("set_gemm_weight", &tp::LinearOp::set_gemm_weight, py::arg("weight"), py::arg("min_rows"),
           py::arg("packed") = py::none(), py::arg("packed_max_rows") = 0)
      .def("set_dot_weight", &tp::LinearOp::set_dot_weight, py::arg("dot"), py::arg("min_rows"), py::arg("fma") = false,
           py::arg("gate_up_by_16") = false)
      .def("set_int8_gemm", &tp::LinearOp::set_int8_gemm, py::arg("tensors"), py::arg("min_rows"));
  py::class_<tp::StackLayer>(m, "StackLayer", "one decoder layer's norms and projections")
      .def(py::init<at::Tensor, at::Tensor, tp::LinearOp, tp::LinearOp, tp::LinearOp, tp::LinearOp>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"));
  py::class_<tp::DecoderStack>(m, "DecoderStack", "every decoder layer in one call (the kernels of llama.py's loop)")
      .def(py::init<std::vector<tp::StackLayer>, at::Tensor, double, int64_t, int64_t, int64_t, at::Tensor,
                    at::Tensor>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("eps"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("cos"), py::arg("sin"))
      .def("set_kv_caches", &tp::DecoderStack::set_kv_caches, py::arg("k_caches"), py::arg("v_caches"))
      .def("set_dense_attention", &tp::DecoderStack::set_dense_attention, py::arg("min_queries"))
      .def("set_dot_attention", &tp::DecoderStack::set_dot_attention, py::arg("min_queries"), py::arg("fma") = false)
      .def("forward", &tp::DecoderStack::forward, py::arg("residual"), py::arg("positions"), py::arg("slots"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("block_size"),
           py::arg("out_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
