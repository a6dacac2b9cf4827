"""Prefill and decode timed apart in-process, with their analytic cost (the engine of `bench phases`).

Random token ids go straight into the model forward (plus the LM head of each sequence's last token): no
tokenizer, scheduler or sampler in the timed region. Batches are built with the engine's own
``build_input_batch`` from hand-made SchedulerOutputs, outside the timed region.

The runner is started the way the engine starts it (``start_model_runner``), so ``--tensor-parallel-size N``
times N ranks: each forward then also holds the step broadcast to the other ranks, exactly as an engine step
does, and rank 0's all-reduce count and time over the timed repetitions are reported per forward step.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from twophase.bench.roofline import StepCost, step_cost, synchronize
from twophase.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from twophase.engine.input_batch import InputBatch, build_input_batch
from twophase.engine.model_runner import ModelRunner
from twophase.outputs import ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 16
WARM_UP_SECONDS = 0.2


def _synthetic(name: str, **sizes) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", tie_word_embeddings=True, rope_theta=500000.0,
                       max_position_embeddings=131072, torch_dtype="bfloat16", **sizes)  # fmt: skip


SYNTHETIC_CONFIGS: dict[str, ModelConfig] = {
    "llama-1b": _synthetic("llama-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-135m": _synthetic("llama-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "tiny": _synthetic("tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}  # fmt: skip


@dataclass
class PhaseResult:
    """One measured shape: ``batch`` sequences each computing ``tokens_per_seq`` tokens (prefill: in one step;
    decode: one per step over ``tokens_per_seq`` steps) on ``depth`` tokens of context."""

    name: str  # llama-bench label: pp512, tg128, pp512 @ d2048
    kind: str  # 'prefill' | 'decode'
    tokens_per_seq: int
    batch: int
    depth: int
    seconds: list[float]  # one per repetition
    flops: float
    bytes: float
    all_reduces_per_step: float | None = None  # tensor parallelism: rank 0's, per forward step (None: tp = 1)
    all_reduce_ms_per_step: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens processed per repetition."""
        return self.tokens_per_seq * self.batch

    @property
    def seconds_mean(self) -> float:
        """Mean wall time of one repetition."""
        return statistics.fmean(self.seconds)

    @property
    def tok_s(self) -> list[float]:
        """Tokens/s of each repetition."""
        return [self.num_tokens / s for s in self.seconds]

    def to_dict(self, peak_flops: float | None = None, bandwidth: float | None = None) -> dict:
        """JSON form, with achieved rates and (when ceilings are known) MFU and bandwidth utilisation."""
        rates = self.tok_s
        achieved_flops, achieved_bw = self.flops / self.seconds_mean, self.bytes / self.seconds_mean
        return {
            **asdict(self), "num_tokens": self.num_tokens, "seconds_mean": self.seconds_mean,
            "tokens_per_s_mean": statistics.fmean(rates),
            "tokens_per_s_std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "intensity": self.flops / self.bytes, "flops_per_s": achieved_flops, "bytes_per_s": achieved_bw,
            "mfu": achieved_flops / peak_flops if peak_flops else None,
            "bandwidth_utilization": achieved_bw / bandwidth if bandwidth else None,
        }  # fmt: skip


@dataclass
class SyntheticSource:
    """A model source of random weights for a synthetic config (what ``build_model_runner`` reads)."""

    config: ModelConfig

    def iter_weights(self, progress: bool | None = None, skip=()):
        """Random HF-named weights (seed 0); none is stored quantized, so none is skipped."""
        from twophase.model.registry import random_weights

        return random_weights(self.config, seed=0)

    def stores_native_blocks(self) -> bool:
        """None stored quantized."""
        return False

    def native_quantized_weights(self) -> dict:
        """None stored quantized."""
        return {}


def bench_engine_config(model: str, dtype: str, device: str, plan: PhasePlan, **fields) -> EngineConfig:
    """The engine config a phase bench runs under: room for ``plan``'s longest shape, one block range per
    sequence alive at once. ``fields``: further EngineConfig fields (``parallel``, ``num_threads``)."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=math.ceil(plan.max_len / BLOCK_SIZE) * plan.max_seqs)
    scheduler = SchedulerConfig(max_model_len=plan.max_len, max_num_seqs=plan.max_seqs)
    return EngineConfig(model=model, dtype=dtype, device=device, cache=cache, scheduler=scheduler, **fields)


class PhaseBench:
    """Owns rank 0's ModelRunner (and its tensor-parallel ranks) and hands out disjoint block tables for
    synthetic sequences."""

    def __init__(self, runner: ModelRunner, max_len: int) -> None:
        """``runner``: built with ``bench_engine_config``'s cache (``max_len`` positions per sequence)."""
        self.runner = runner
        self.config = runner.model_config
        self.device = runner.device
        self.max_len = min(max_len, self.config.max_position_embeddings)
        self.blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
        self.generator = torch.Generator().manual_seed(0)
        self.bytes_per_elem = torch.empty((), dtype=runner.dtype).element_size()

    @classmethod
    def start(cls, config: EngineConfig, source) -> PhaseBench:
        """Start the runner of ``config`` on an opened ``source`` as the engine does (other ranks included)."""
        from twophase.engine.llm_engine import start_model_runner

        return cls(start_model_runner(config, source, progress=False), config.scheduler.max_model_len)

    @property
    def tp(self):
        """The tensor-parallel group (None at size 1)."""
        return self.runner.tp

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (no-op without them)."""
        if self.tp is not None:
            self.tp.close()

    def _batch(self, batch: int, query_len: int, start: int) -> tuple[SchedulerOutput, InputBatch]:
        """``batch`` sequences of ``query_len`` random tokens at position ``start``, each sampling its last."""
        ids = torch.randint(0, self.config.vocab_size, (batch, query_len), generator=self.generator)  # [B, q]
        scheduled = [
            ScheduledRequest(
                request_id=f"bench-{i}", token_ids=ids[i].tolist(), start_position=start,
                block_ids=list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)),
                sample=True, is_prompt=query_len > 1,
            )  # fmt: skip
            for i in range(batch)
        ]
        step = SchedulerOutput(step_id=0, scheduled=scheduled)
        return step, build_input_batch(step, BLOCK_SIZE, self.device)

    def _timed(self, steps: list[tuple[SchedulerOutput, InputBatch]]) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for step, batch in steps:
            self.runner.sampled_logits(step, batch)  # [B, vocab]
        synchronize(self.device)
        return time.perf_counter() - start

    def _repeat(self, make_steps, repetitions: int) -> tuple[list[float], dict[str, float]]:
        """Seconds of each timed repetition, and (tensor parallelism) their all-reduces per forward step."""
        steps = make_steps()
        warm_up_s, runs = 0.0, 0
        while runs < 2 or (warm_up_s < WARM_UP_SECONDS and runs < 10):  # thread pools and caches settle first
            warm_up_s += self._timed(steps)
            runs += 1
        before = self.tp.stats.snapshot() if self.tp else None
        seconds = [self._timed(steps) for _ in range(repetitions)]
        return seconds, self.tp.stats.per_step(before, repetitions * len(steps)) if self.tp else {}

    def prefill(self, prompt_len: int, depth: int, batch: int, repetitions: int, name: str) -> PhaseResult:
        """Time one step computing ``prompt_len`` tokens for each of ``batch`` sequences after ``depth``."""
        self._check_len(depth + prompt_len)
        seconds, collectives = self._repeat(lambda: [self._batch(batch, prompt_len, depth)], repetitions)
        cost = step_cost(self.config, prompt_len, depth, batch, self.bytes_per_elem)
        return PhaseResult(name, "prefill", prompt_len, batch, depth, seconds, cost.flops, cost.bytes, **collectives)

    def decode(self, steps: int, depth: int, batch: int, repetitions: int, name: str) -> PhaseResult:
        """Time ``steps`` decode steps of ``batch`` sequences starting with ``depth`` tokens of context."""
        self._check_len(depth + steps)
        seconds, collectives = self._repeat(lambda: [self._batch(batch, 1, depth + i) for i in range(steps)],
                                            repetitions)  # fmt: skip
        costs = [step_cost(self.config, 1, depth + i, batch, self.bytes_per_elem) for i in range(steps)]
        total = _sum_costs(costs)
        return PhaseResult(name, "decode", steps, batch, depth, seconds, total.flops, total.bytes, **collectives)

    def _check_len(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"shape needs {length} positions but the bench was built for {self.max_len} "
                             f"(the plan's longest shape, at most the model's {self.config.max_position_embeddings})")


def _sum_costs(costs: list[StepCost]) -> StepCost:
    return StepCost(*(sum(getattr(c, f) for c in costs) for f in ("flops", "bytes", "weight_bytes", "kv_bytes",
                                                                   "activation_bytes")))  # fmt: skip


def label(kind: str, tokens: int, depth: int) -> str:
    """llama-bench's label: 'pp512', 'tg128', 'pp512 @ d2048'."""
    return f"{'pp' if kind == 'prefill' else 'tg'}{tokens}" + (f" @ d{depth}" if depth else "")


@dataclass
class PhasePlan:
    """What to measure (llama-bench's -p, -n, -b, -d, -r)."""

    prompt_lens: list[int]
    decode_steps: int
    batch_sizes: list[int]
    depth: int = 0
    repetitions: int = 3
    batched_prompt_len: int | None = None  # PP of the batched table (default: the first of prompt_lens)

    @property
    def pp_batched(self) -> int:
        """PP used in the batched table."""
        return self.batched_prompt_len or self.prompt_lens[0]

    @property
    def max_len(self) -> int:
        """Positions any shape needs."""
        return self.depth + max(max(self.prompt_lens, default=0), self.pp_batched + self.decode_steps, self.decode_steps)

    @property
    def max_seqs(self) -> int:
        """Most sequences alive at once."""
        return max(self.batch_sizes, default=1)


def run_plan(bench: PhaseBench, plan: PhasePlan) -> tuple[list[PhaseResult], list[dict]]:
    """llama-bench rows (pp per length, tg at batch 1) and the batched table rows (prefill + decode per B)."""
    r, d = plan.repetitions, plan.depth
    rows = [bench.prefill(p, d, 1, r, label("prefill", p, d)) for p in plan.prompt_lens]
    if plan.decode_steps:
        rows.append(bench.decode(plan.decode_steps, d, 1, r, label("decode", plan.decode_steps, d)))
    batched = []
    for b in plan.batch_sizes:
        pp = bench.prefill(plan.pp_batched, d, b, r, f"{label('prefill', plan.pp_batched, d)} b{b}")
        tg = bench.decode(plan.decode_steps, d + plan.pp_batched, b, r, f"tg{plan.decode_steps} b{b}")
        batched.append({"pp": plan.pp_batched, "tg": plan.decode_steps, "batch": b, "prefill": pp, "decode": tg})
    return rows, batched
