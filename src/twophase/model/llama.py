"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flat token batch with a paged KV cache.

One forward for every mix of prefill chunks and decode tokens: shapes are [num_tokens, ...] throughout.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twophase.config import ModelConfig
from twophase.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from twophase.model.layers import DirectCallModule, RMSNorm, RotaryEmbedding
from twophase.model.ops.fused import LayerOps, Rope
from twophase.model.ops.stack import build_decoder_stack, stack_row_limit


class LlamaAttention(DirectCallModule):
    """Grouped-query self-attention with a fused QKV projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x, rope: Rope, kv_cache: tuple[torch.Tensor, torch.Tensor], meta, ops: LayerOps):
        """x [T, hidden] → [T, hidden]: rotary and the K/V cache write in one op, then attention over the cache."""
        qkv = self.qkv_proj(x).contiguous()  # [T, q_size + 2 * kv_size]
        ops.rotary_cache_(qkv, rope, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads, self.num_kv_heads)
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)  # [T, H, D], rotated
        out = self.backend.attend(q, kv_cache[0], kv_cache[1], meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(DirectCallModule):
    """SwiGLU MLP with a fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        return self.down_proj(ops.gated(self.gate_up_proj, x))  # [T, 2 * inter] → [T, inter] → [T, hidden]


class LlamaDecoderLayer(DirectCallModule):
    """Pre-norm attention + MLP block, in the residual-stream form: the norm of each sub-block is fused with the
    residual add before it (``LayerOps.add_rms_norm_``)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, residual, next_norm: RMSNorm, rope, kv_cache, meta, ops: LayerOps) -> torch.Tensor:
        """h = input_layernorm(residual) [T, hidden] → next_norm(residual after this layer); ``residual`` [T, hidden]
        is updated in place (x + attn, then + mlp)."""
        h = self.self_attn(h, rope, kv_cache, meta, ops).contiguous()
        ops.add_rms_norm_(h, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        h = self.mlp(h, ops).contiguous()
        ops.add_rms_norm_(h, residual, next_norm.weight, next_norm.eps)
        return h


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus LM head (tied or untied)."""

    def __init__(self, config: ModelConfig, max_positions: int, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchPagedAttention(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.backend = backend
        # _weight: no random init (the model is built on the meta device and loaded; meta normal_ imports dynamo)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # a packed head (``pack``); None: plain matmul
        self.ops = LayerOps()  # eager torch until ``pack`` hands over the kernels
        self.stack: Any = None  # the C++ decoder stack (``ops/stack.py``): None until built, False if it cannot be
        self.stack_caches: list | None = None  # the KV cache list the stack holds
        self.stack_max_rows: float = 0  # set by ``pack``; beyond: the Python loop (projections there use a GEMM)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: ([slots, KVH, D], [slots, KVH, D])
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,  # [N] int64: the rows wanted, each request's last ones, in order
    ) -> torch.Tensor:  # [T, hidden], or [N, hidden] with output_rows
        """Hidden states of every token of the flat batch, or of ``output_rows`` alone. Every row's K / V is
        written either way; with ``output_rows`` the C++ stack runs the last layer past its K / V (attention,
        projections, MLP) on those rows only, as llama.cpp does for the rows it returns: a prefill chunk of 2,048
        tokens that samples one of them skips ~1/30 of its work."""
        self.backend.prepare(meta)  # backend index tensors, once for all layers
        residual = self.embed_tokens(input_ids)  # [T, hidden]
        ops = self.ops.bind(residual)  # kernels or eager torch, decided once for all layers
        if self._stack_applies(residual, ops, kv_caches):  # every layer in one C++ call, the same kernels
            return self.stack.forward(residual, positions.to(torch.long).contiguous(), meta.slot_mapping,
                                      meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.block_size,
                                      output_rows)
        rope = self._rope(positions, residual, ops)  # once for all layers
        first = self.layers[0].input_layernorm
        h = ops.rms_norm(residual, first.weight, first.eps)  # [T, hidden]
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, kv_cache in zip(self.layers, norms, kv_caches):
            h = layer(h, residual, next_norm, rope, kv_cache, meta, ops)
        return h if output_rows is None else h[output_rows]

    def _stack_applies(self, residual: torch.Tensor, ops: LayerOps, kv_caches: list) -> bool:
        """Whether this forward runs in the C++ decoder stack (built on first use, after any re-wrapping of the
        layers, e.g. tensor parallelism); points the stack at ``kv_caches``."""
        if self.stack is False or residual.dtype != torch.float32 or residual.shape[0] > self.stack_max_rows:
            return False
        if not ops.uses_kernels(residual):
            return False
        if self.stack is None:
            self.stack, self.stack_caches = build_decoder_stack(self, self.ops.kernels) or False, None
            if self.stack is False:
                return False
        if kv_caches is not self.stack_caches:
            self.stack.set_kv_caches([k for k, _ in kv_caches], [v for _, v in kv_caches])
            self.stack_caches = kv_caches
        return True

    def _rope(self, positions: torch.Tensor, like: torch.Tensor, ops: LayerOps) -> Rope:
        positions = positions.to(torch.long).contiguous()
        cos = sin = None
        if not ops.uses_kernels(like):
            cos, sin = self.rotary(positions, like.dtype)  # [T, 1, D] each
        return Rope(positions, self.rotary.cos, self.rotary.sin, cos, sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab]."""
        if self.logits_head is not None:
            return self.logits_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.t()

    def pack(self, quantization: str, kernels, native: dict | None = None, batch_invariant: bool = False) -> None:
        """After loading: put every projection and the LM head behind the fastest linear layer for the
        chosen weight format (see ``model/ops/linear.py``). ``native``: HF name → (format, tensors) of weights
        as stored in a GGUF file, used instead of requantizing when the format matches. ``batch_invariant``: the
        kernels at every batch size (no GEMM for large ones), so no row's result depends on the others."""
        from twophase.model.ops.linear import make_linear, pack_linear_layers

        native = native or {}
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        head_weight = None if head_weight.is_meta else head_weight.data
        self.logits_head = make_linear(head_weight, None, quantization, kernels, native.get(head_name), batch_invariant)
        # a tied head packed for its kernel (column panels, a block format) is a second copy: the embedding looks rows
        # up in its own row-major tensor
        self.lm_head = None
        self.ops = LayerOps(kernels)
        self.stack, self.stack_caches = None, None  # rebuilt over the packed layers on first use
        pack_linear_layers(self.layers, quantization, kernels, lambda name: _fused_native(native, f"layers.{name}"),
                           batch_invariant)
        self.stack_max_rows = stack_row_limit(self.layers)  # inf when batch-invariant (every kernel takes any batch)

    def weights_built_from_blocks(self, native: dict, quantization: str, kernels, dtype: torch.dtype,
                                  device: torch.device) -> set[str]:  # fmt: skip
        """HF names of the weights ``pack`` would build from their stored blocks alone (``builds_from_blocks``), so
        they need not be loaded (``load_weights(absent=...)``): every part of each such projection, and an untied LM
        head. A tied head stays loaded: the embedding looks its rows up."""
        from twophase.model.ops.linear import builds_from_blocks

        names: set[str] = set()
        for module_name, module in self.named_modules():
            if not isinstance(module, nn.Linear) or not module_name.startswith("layers."):
                continue
            if builds_from_blocks(_stored_format(native, module_name), quantization, kernels, dtype, device):
                names.update(_stored_parts(module_name))
        head = native.get("lm_head.weight")
        if self.lm_head is not None and head and builds_from_blocks(head[0], quantization, kernels, dtype, device):
            names.add("lm_head.weight")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], absent: Collection[str] = ()) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on missing or unexpected names.
        ``absent``: HF names deliberately not loaded (``weights_built_from_blocks``); their parameters go to the
        meta device, which tells ``pack`` to build those layers from the stored blocks."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name in absent:
            name, shard = _map_hf_name(hf_name)
            module_name, _, attr = name.rpartition(".")
            unloaded = torch.empty(params[name].shape, dtype=params[name].dtype, device="meta")  # frees the storage
            setattr(self.get_submodule(module_name), attr, nn.Parameter(unloaded, requires_grad=False))
            loaded.add(f"{name}:{shard}")
        for hf_name, tensor in weights:
            name, shard = _map_hf_name(hf_name)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # a tied checkpoint may still carry the head
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            _copy_shard(params[name], tensor, shard, self.config)
            loaded.add(f"{name}:{shard}")
        expected = {f"{n}:{s}" for n in params for s in _shards_of(n)}
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:5]}{' …' if len(missing) > 5 else ''}")


_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}  # fmt: skip


def _stored_parts(module_name: str) -> list[str]:
    """HF names of the stored weights a (possibly fused) projection is made of, in fusion order."""
    parts = [f"model.{module_name.replace(fused, part)}.weight" for part, (fused, _) in _FUSED.items() if fused in module_name]
    return parts or [f"model.{module_name}.weight"]


def _stored_format(native: dict, module_name: str) -> str | None:
    """The block format every stored part of a (possibly fused) projection shares; None unless all are stored
    natively in one format."""
    formats = {native[p][0] if p in native else None for p in _stored_parts(module_name)}
    return formats.pop() if len(formats) == 1 else None


def _fused_native(native: dict, module_name: str):
    """(format, tensors) of a (possibly fused) projection from its stored parts, rows concatenated in fusion
    order; None unless every part is stored natively in one format."""
    fmt = _stored_format(native, module_name)
    if fmt is None:
        return None
    found = [native[p][1] for p in _stored_parts(module_name)]
    return fmt, tuple(torch.cat(tensors, dim=0) for tensors in zip(*found))


def _map_hf_name(hf_name: str) -> tuple[str, str]:
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            parts[i] = fused
            return ".".join(parts), shard
    return name, "all"


def _shards_of(name: str) -> tuple[str, ...]:
    if ".qkv_proj." in name:
        return ("q", "k", "v")
    if ".gate_up_proj." in name:
        return ("gate", "up")
    return ("all",)


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: str, config: ModelConfig) -> None:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    f = config.intermediate_size
    offsets = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, f), "up": (f, f)}
    target = param.data if shard == "all" else param.data.narrow(0, *offsets[shard])
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch for {shard} of a {tuple(param.shape)} parameter: got {tuple(tensor.shape)}")
    if shard == "all" and tensor.device == param.device and tensor.is_contiguous():
        param.data = tensor.to(param.dtype)  # adopt the loaded tensor: no second copy of a whole weight
        return
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))
