"""Which part of the model each tensor-parallel rank holds, and its slice of every (HF-named) weight.

Column-parallel (rows split): q/k/v by heads, gate/up by intermediate rows, the embedding and LM head by vocab.
Row-parallel (input columns split): o_proj by q heads, down_proj by intermediate columns. When the parallel size
exceeds the number of KV heads, each KV head is replicated on ``size / num_kv_heads`` consecutive ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from twophase.config import ConfigError, ModelConfig

QUANT_BLOCK = 32  # GGUF block width: row-parallel splits of the intermediate size stay multiples of it


@dataclass(frozen=True)
class Span:
    """A contiguous range [start, start + count)."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        """One past the last index."""
        return self.start + self.count


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    vocab_counts: tuple[int, ...]  # every rank's vocab count (rank 0 trims the gathered, padded logits)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: its heads, intermediate rows and vocab rows."""
        return dataclasses.replace(
            config, num_attention_heads=self.q_heads.count, num_key_value_heads=self.kv_heads.count,
            intermediate_size=self.intermediate.count, vocab_size=self.vocab.count,
        )  # fmt: skip


def split(total: int, parts: int, unit: int = 1) -> list[Span]:
    """``total`` split into ``parts`` contiguous spans as even as possible, in multiples of ``unit`` when
    ``total`` is one (the last spans get one unit less)."""
    unit = unit if total % unit == 0 and total // unit >= parts else 1
    units = total // unit
    counts = [(units // parts + (1 if i < units % parts else 0)) * unit for i in range(parts)]
    starts = [sum(counts[:i]) for i in range(parts)]
    return [Span(s, c) for s, c in zip(starts, counts)]


def valid_sizes(config: ModelConfig, limit: int = 1024) -> list[int]:
    """Every tensor-parallel size the model's shapes allow (up to ``limit``)."""
    return [n for n in range(1, limit + 1) if _size_problem(config, n) is None]


def _size_problem(config: ModelConfig, size: int) -> str | None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if size < 1:
        return "it must be at least 1"
    if heads % size:
        return f"{heads} attention heads do not split into {size} equal parts"
    if kv_heads % size and size % kv_heads:
        return f"{kv_heads} KV heads neither split into {size} parts nor replicate evenly over {size} ranks"
    if config.intermediate_size < size or config.vocab_size < size:
        return "the MLP or the vocabulary has fewer rows than ranks"
    return None


def check_size(config: ModelConfig, size: int) -> None:
    """Refuse a size the shapes cannot split, naming the sizes that work."""
    problem = _size_problem(config, size)
    if problem is not None:
        sizes = ", ".join(str(n) for n in valid_sizes(config, limit=max(64, config.num_attention_heads)))
        raise ConfigError(f"--tensor-parallel-size {size} does not fit this model: {problem}; sizes that work: {sizes}")


def plan_shards(config: ModelConfig, rank: int, size: int) -> ShardPlan:
    """The shard of rank ``rank`` (the size must pass ``check_size``)."""
    check_size(config, size)
    q_per_rank = config.num_attention_heads // size
    kv_heads = config.num_key_value_heads
    if kv_heads >= size:
        kv = Span(rank * (kv_heads // size), kv_heads // size)
    else:
        kv = Span(rank * kv_heads // size, 1)  # replicated on size / kv_heads consecutive ranks
    vocab = split(config.vocab_size, size)
    return ShardPlan(
        rank=rank, size=size, q_heads=Span(rank * q_per_rank, q_per_rank), kv_heads=kv,
        intermediate=split(config.intermediate_size, size, QUANT_BLOCK)[rank], vocab=vocab[rank],
        vocab_counts=tuple(s.count for s in vocab),
    )  # fmt: skip


def _weight_slices(plan: ShardPlan, config: ModelConfig, name: str) -> tuple[int, Span] | None:
    """(dimension, span) of the HF tensor ``name`` this rank keeps; None: kept whole."""
    d = config.head_dim
    q, kv, f = plan.q_heads, plan.kv_heads, plan.intermediate
    rules = {
        "q_proj": (0, Span(q.start * d, q.count * d)), "k_proj": (0, Span(kv.start * d, kv.count * d)),
        "v_proj": (0, Span(kv.start * d, kv.count * d)), "o_proj": (1, Span(q.start * d, q.count * d)),
        "gate_proj": (0, f), "up_proj": (0, f), "down_proj": (1, f),
        "embed_tokens": (0, plan.vocab), "lm_head": (0, plan.vocab),
    }  # fmt: skip
    parts = name.split(".")
    for part in parts:
        if part in rules:
            dim, span = rules[part]
            return (0, span) if parts[-1] == "bias" else (dim, span)  # column-parallel biases split with rows
    return None


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], plan: ShardPlan, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's slice of every HF-named tensor (norms whole)."""
    for name, tensor in weights:
        rule = _weight_slices(plan, config, name)
        yield name, tensor if rule is None else tensor.narrow(rule[0], rule[1].start, rule[1].count)


def shard_native(native: dict | None, plan: ShardPlan, config: ModelConfig) -> dict | None:
    """This rank's slice of weights kept as stored in a GGUF file (HF name → (format, packed tensors)).

    Packed tensors are [out, width] with ``width`` proportional to the input size, so a column split is a
    proportional slice; a split that cuts a quantization block drops the weight (it is quantized at load)."""
    if not native:
        return native
    out = {}
    for name, (fmt, tensors) in native.items():
        rule = _weight_slices(plan, config, name)
        if rule is None:
            out[name] = (fmt, tensors)
            continue
        sliced = _slice_packed(fmt, tensors, *rule)
        if sliced is not None:
            out[name] = (fmt, sliced)
    return out


def _slice_packed(fmt: str, tensors: tuple[torch.Tensor, ...], dim: int, span: Span):
    if dim == 0:
        return tuple(t.narrow(0, span.start, span.count) for t in tensors)
    if span.start % QUANT_BLOCK or span.count % QUANT_BLOCK:
        return None
    if fmt not in ("q8_0", "q4_1"):
        return None
    in_features = tensors[0].shape[1] * (1 if fmt == "q8_0" else 2)  # qs: q8_0 int8 [N, K]; q4_1 uint8 [N, K/2]
    sliced = []
    for t in tensors:
        per = t.shape[1] / in_features
        sliced.append(t.narrow(1, int(span.start * per), int(span.count * per)))
    return tuple(sliced)
