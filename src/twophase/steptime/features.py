"""What a step computes, as the numbers its duration depends on (the step-time model's regressors)."""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import astuple, dataclass
from typing import Any

from twophase.outputs import SchedulerOutput, StepRecord

# order of the model's coefficients; "constant" is the intercept
FEATURE_NAMES = ("constant", "prefill_tokens", "prefill_rows", "prefill_attention_pairs", "decode_rows",
                 "decode_context_tokens", "sampled_rows")  # fmt: skip


@dataclass(frozen=True)
class StepFeatures:
    """One step's mix. A prefill chunk of n tokens starting at position p attends n·p + n(n+1)/2 (query, key)
    pairs (causal); a decode row at position p attends p + 1 keys."""

    prefill_tokens: int = 0
    prefill_rows: int = 0
    prefill_attention_pairs: int = 0
    decode_rows: int = 0
    decode_context_tokens: int = 0
    sampled_rows: int = 0

    def vector(self) -> list[float]:
        """The regressors in FEATURE_NAMES order (the leading 1 is the intercept)."""
        return [1.0, *map(float, astuple(self))]

    @property
    def is_empty(self) -> bool:
        """True when the step computes nothing."""
        return self.prefill_tokens == 0 and self.decode_rows == 0


def chunk_attention_pairs(num_tokens: int, start_position: int) -> int:
    """Causal (query, key) pairs of a chunk of ``num_tokens`` tokens whose first token sits at ``start_position``."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


def step_features(output: SchedulerOutput) -> StepFeatures:
    """The features of the batch a SchedulerOutput describes."""
    prefill_tokens = prefill_rows = pairs = decode_rows = context = sampled = 0
    for s in output.scheduled:
        n = len(s.token_ids)
        if s.is_prompt:
            prefill_tokens += n
            prefill_rows += 1
            pairs += chunk_attention_pairs(n, s.start_position)
        else:
            decode_rows += n
            context += s.start_position + n
        sampled += int(s.sample)
    return StepFeatures(prefill_tokens, prefill_rows, pairs, decode_rows, context, sampled)


def record_features(record: Any) -> StepFeatures:
    """The features a StepRecord (or its JSON dict) carries."""
    d = record if isinstance(record, dict) else record.__dict__
    return StepFeatures(
        prefill_tokens=int(d.get("num_prompt_tokens", 0)), prefill_rows=int(d.get("prefill_rows", 0)),
        prefill_attention_pairs=int(d.get("prefill_attention_pairs", 0)), decode_rows=int(d.get("decode_rows", 0)),
        decode_context_tokens=int(d.get("decode_context_tokens", 0)), sampled_rows=int(d.get("sampled_rows", 0)),
    )  # fmt: skip


def make_step_record(
    output: SchedulerOutput, scheduler: Any, start: float, duration: float, updates: Sequence[Any] = ()
) -> StepRecord:
    """The StepRecord of a finished step (engine and simulator build it the same way); ``updates``: the
    scheduler's StepUpdates of the step (tokens produced, proposals verified and accepted)."""
    features = step_features(output)
    block_manager = scheduler.block_manager
    return StepRecord(
        step_id=output.step_id, start_time=start, duration=duration,
        num_prompt_tokens=output.num_prompt_tokens, num_decode_tokens=output.num_decode_tokens,
        num_requests=len(output.scheduled), num_blocks_in_use=block_manager.num_blocks_in_use,
        num_blocks_total=block_manager.num_blocks, num_waiting=len(scheduler.waiting),
        num_preempted=len(output.preempted_request_ids), prefill_rows=features.prefill_rows,
        prefill_attention_pairs=features.prefill_attention_pairs, decode_rows=features.decode_rows,
        decode_context_tokens=features.decode_context_tokens, sampled_rows=features.sampled_rows,
        token_budget=output.token_budget, predicted_duration=output.predicted_duration,
        num_output_tokens=sum(len(u.new_token_ids) for u in updates),
        num_draft_tokens=sum(u.num_draft_tokens for u in updates),
        num_accepted_tokens=sum(u.num_accepted_tokens for u in updates),
    )  # fmt: skip
