"""Frozen configuration objects.

`ModelConfig` is normalised once from an HF ``config.json`` dict or from GGUF metadata; everything
downstream reads only this object. Derived runtime values (number of KV blocks, EOS ids in use) live in
runtime objects, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ConfigError(ValueError):
    """A configuration value is missing, invalid or unsupported."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """The rope_scaling entry as a plain dict (or None)."""
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * per_layer + d + head

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Normalise an HF ``config.json`` dict; refuses unknown architectures with a clear message."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(hf.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; twophase supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and isinstance(hf.get("rope_parameters"), dict):
            params = hf["rope_parameters"]
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=_freeze(rope_scaling),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )


def _arch_from_model_type(model_type: str | None) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        model_type or "", f"<model_type {model_type!r}>"
    )


def _freeze(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not d:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings. ``num_blocks`` overrides the memory budget when set (tests use it);
    ``kv_cache_memory_bytes`` None sizes the cache from free memory after the weights are loaded."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16 under a float32 model halves the KV bytes


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the continuous-batching scheduler."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None  # None: unbounded
    step_budget: str = "fixed"  # fixed: max_num_batched_tokens every step | auto: SLO-aware (steptime.budget)
    slo_itl_ms: float | None = None  # the inter-token-latency objective step_budget auto keeps each step within
    step_time_model: str | None = None  # step-time model file (`twophase calibrate`) for step_budget auto
    min_prefill_tokens: int = 32  # auto: the smallest prefill chunk while prompts wait
    slo_itl_headroom: float = 0.9  # auto: fraction of slo_itl_ms a corrected step + gap aims at
    step_time_quantile: float = 0.9  # auto: quantile of recent actual ÷ predicted ratios correcting the model


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (see kv_transfer/): ``role`` both = colocated, no transfer at all."""

    role: str = "both"  # both | prefill | decode
    host: str = "127.0.0.1"  # where a prefill engine serves its leased blocks
    port: int = 0  # 0: a free port (advertised in each prefill response)
    advertise_host: str | None = None  # the address decode engines should dial (default: host)
    lease_timeout_s: float = 30.0  # a finished prefill's blocks are freed if nobody reads them by then
    transfer_timeout_s: float = 10.0  # bound on every exchange with a remote engine
    transport: str = "auto"  # auto | tcp | cuda-ipc: how a read's payload travels (kv_transfer/placement.py)

    @property
    def advertised_host(self) -> str:
        """The address put into prefill responses."""
        return self.advertise_host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (see ``distributed/``): ranks, hosts and where they meet. ``master_port`` 0 picks a
    free port (one host only); ``timeout_s`` bounds a collective, so a hung worker stops the engine."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, passed as sub-configs."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0
    quantization: str = "none"  # none | int8 | q8_0 | q4_1 (weight-only; see model/ops/linear.py)
    attention_backend: str = "auto"  # auto | torch | kernel
    linear_backend: str = "auto"  # auto (our C++ kernels when they build) | torch (F.linear, the reference)
    gemm_dtype: str = "auto"  # auto | float32 | bfloat16: multi-row projections' GEMM (see llm_engine.resolve_gemm_dtype)
    deterministic: bool = False  # batch-invariant kernels: a request's logits never depend on its batch or chunking
    num_threads: int | None = None  # intra-op threads; None: the physical cores
    speculative_config: Any = None  # None (off), or a dict / JSON string / spec_decode.SpeculativeConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
