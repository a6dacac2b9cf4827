"""Architecture name → model class."""

from __future__ import annotations

import torch

from twophase.config import ConfigError, ModelConfig
from twophase.model.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v biases come from config.attention_bias
}


def build_model(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device, backend=None
) -> torch.nn.Module:
    """An uninitialised model of the config's architecture on ``device`` in ``dtype`` (attention: ``backend``,
    default the plain-torch reference)."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ConfigError(f"unsupported architecture {config.architecture!r}; supported: {', '.join(MODEL_CLASSES)}")
    with torch.device("meta"):
        model = cls(config, max_positions, backend)
    _materialize(model, dtype, device)
    model.rotary.build_tables()  # computed in float32, never loaded
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialised storage: parameters in ``dtype``, buffers keep theirs.
    (``Module.to_empty`` does the same through ``empty_like`` on meta tensors, which costs ~1 s of Python refs.)"""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def random_weights(config: ModelConfig, seed: int = 0, std: float = 0.02):
    """HF-named random tensors for ``config`` (synthetic models for benchmarks and tests), float32."""
    generator = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    yield "model.embed_tokens.weight", rand(config.vocab_size, d)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, shape in (("q_proj", (q, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)), ("o_proj", (d, q))):
            yield p + f"self_attn.{name}.weight", rand(*shape)
        if config.attention_bias:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{name}.bias", rand(size)
        for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            yield p + f"mlp.{name}.weight", rand(*shape)
        yield p + "input_layernorm.weight", 1.0 + rand(d)
        yield p + "post_attention_layernorm.weight", 1.0 + rand(d)
    yield "model.norm.weight", 1.0 + rand(d)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", rand(config.vocab_size, d)
