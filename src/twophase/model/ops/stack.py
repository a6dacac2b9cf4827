"""The whole decoder stack in one C++ call (``csrc/stack.cpp``): the same kernels, in the same order, as the Python
layer loop of ``model/llama.py`` (bit-identical results), without ~12 Python-level calls per layer. A decode step
of the default model makes ~360 of them (~4 ms on a 2-core CPU); the stack makes one.

It applies when every op of every layer has a kernel: float32 activations on CPU, the C++ attention backend, each
projection behind a kernel (its ``op``: the ``LinearOp`` its Python layer calls too), and at most
as many tokens as every projection's kernel takes (``stack_row_limit``: beyond that some projections take a GEMM
instead of their kernel). Anything else — tensor-parallel wrappers, the torch attention reference, float64 or bfloat16 —
runs the Python loop, which stays the reference. ``TWOPHASE_NO_STACK=1`` turns the stack off (A/B timing).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from twophase.model.attention import KernelPagedAttention
DISABLE_ENV = "TWOPHASE_NO_STACK"


def stack_row_limit(layers: torch.nn.Module) -> float:
    """Tokens up to which every projection in ``layers`` runs its kernel (the decoder stack's limit): the least
    ``max_rows`` of the projections that have one (``op``); 0 if none has, where the stack cannot apply."""
    return min((m.max_rows for m in layers.modules() if getattr(m, "op", None) is not None), default=0)


def stack_enabled() -> bool:
    """Whether ``TWOPHASE_NO_STACK`` leaves the stack on."""
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


def build_decoder_stack(model: Any, kernels: ModuleType | None) -> Any | None:
    """``kernels.DecoderStack`` over ``model``'s layers (a ``LlamaForCausalLM``), or None when some op of some
    layer has no kernel (then the Python loop runs)."""
    if kernels is None or not hasattr(kernels, "DecoderStack") or not stack_enabled():
        return None
    if not isinstance(model.backend, KernelPagedAttention):
        return None
    layers = [_stack_layer(layer, kernels) for layer in model.layers]
    if any(layer is None for layer in layers) or not _all_float32(model.norm.weight, model.rotary.cos):
        return None
    eps = {layer.input_layernorm.eps for layer in model.layers} | {layer.post_attention_layernorm.eps for layer in model.layers}
    if len(eps | {model.norm.eps}) != 1:
        return None
    config = model.config
    stack = kernels.DecoderStack(
        layers, model.norm.weight.data, model.norm.eps, config.num_attention_heads, config.num_key_value_heads,
        config.head_dim, model.rotary.cos, model.rotary.sin,
    )  # fmt: skip
    stack.set_dense_attention(model.backend.dense_min_queries)
    stack.set_dot_attention(model.backend.dot_min_queries, model.backend.dot_fma)
    return stack


def _stack_layer(layer: Any, kernels: ModuleType) -> Any | None:
    """One ``kernels.StackLayer``, or None if a projection has no kernel or a norm is not float32."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [getattr(m, "op", None) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data)
    if any(p is None for p in projections) or not _all_float32(*norms):
        return None
    return kernels.StackLayer(*norms, *projections)


def _all_float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
