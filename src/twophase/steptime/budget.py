"""Step budget policies: how many tokens the scheduler may put in the next step.

``FixedBudget`` is ``max_num_batched_tokens`` every step. ``SloBudget`` (``--step-budget auto``) picks, before
each step, the largest prefill chunk whose predicted step time — with the decode rows already in the step — stays
within a fraction (``headroom``) of the inter-token-latency objective, the prediction corrected by a high quantile
(``quantile``, p90 by default) of the recent ratios of actual to predicted step time; never below a floor while
prompts wait, and the cap when nothing decodes (no decode stream to protect).

Why a quantile and not a mean: a request's inter-token objective is broken by its *slowest* gap, so the step
must fit when it runs as slowly as the slow tail of recent steps does, not as the average one does (on a shared
machine 10-20% of steps running 1.3x slower move the mean by a few percent and the p90 by 30%). The headroom
covers what the window has not seen yet.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Protocol, Sequence

from twophase.config import SchedulerConfig
from twophase.outputs import SchedulerOutput
from twophase.request import Request
from twophase.steptime.features import FEATURE_NAMES, StepFeatures, step_features
from twophase.steptime.model import StepTimeModel


class BudgetPolicy(Protocol):
    """What the scheduler asks before and tells after each step."""

    def step_budget(self, running: Sequence[Request], waiting: Sequence[Request]) -> int:
        """Token budget of the next step, from the queues as they are before it is scheduled."""
        ...

    def predict(self, output: SchedulerOutput) -> float | None:
        """Predicted seconds of the scheduled batch (None without a model)."""
        ...

    def observe(self, predicted: float | None, actual: float) -> None:
        """The step's measured seconds, next to its prediction."""
        ...


class FixedBudget:
    """The same budget every step."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def step_budget(self, running: Sequence[Request], waiting: Sequence[Request]) -> int:
        """The fixed budget."""
        return self.budget

    def predict(self, output: SchedulerOutput) -> float | None:
        """No model: None."""
        return None

    def observe(self, predicted: float | None, actual: float) -> None:
        """Nothing to learn."""


class SloBudget:
    """The largest prefill chunk that keeps the corrected predicted step within ``headroom · itl_s`` (see the module
    docstring). ``ratio`` is the correction: the ``quantile`` of the last ``window`` actual ÷ predicted ratios
    (1 before any step is observed)."""

    def __init__(self, model: StepTimeModel, itl_s: float, cap: int, floor: int = 32, max_num_seqs: int | None = None,
                 quantile: float = 0.9, headroom: float = 0.9, window: int = 64) -> None:
        if itl_s <= 0:
            raise ValueError("the ITL objective must be positive")
        _check_fraction("quantile", quantile)
        _check_fraction("headroom", headroom)
        if window < 1:
            raise ValueError(f"the ratio window must hold at least one step, got {window}")
        self.model, self.itl_s, self.cap, self.floor = model, itl_s, cap, min(floor, cap)
        self.max_num_seqs, self.quantile, self.headroom = max_num_seqs, quantile, headroom
        self.ratios: deque[float] = deque(maxlen=window)  # recent actual ÷ predicted, oldest first
        self.ratio = 1.0  # the correction: quantile of ``ratios``

    @property
    def target_s(self) -> float:
        """The seconds a step plus its gap may take: ``headroom`` × the ITL objective."""
        return self.headroom * self.itl_s

    def step_budget(self, running: Sequence[Request], waiting: Sequence[Request]) -> int:
        """decode rows + the largest prefill chunk within the objective (floor ≤ chunk; total ≤ cap).

        The chunk may be split over every prompt that can join the step (running partial prefills, then waiting
        prompts up to ``max_num_seqs``): each adds its row cost, and the chunk is priced as one row from the latest
        start position among them — an upper bound on the causal pairs of any split from those positions."""
        decode = [r for r in running if _is_decoding(r)]
        starts = [r.num_computed_tokens for r in running if not _is_decoding(r)]
        free_seqs = len(waiting) if self.max_num_seqs is None else max(0, self.max_num_seqs - len(running))
        starts += [0] * min(len(waiting), free_seqs)  # a prefix-cache hit only makes a waiting prompt cheaper
        if not decode or not starts:
            return self.cap
        base = StepFeatures(decode_rows=len(decode), decode_context_tokens=sum(r.num_tokens for r in decode),
                            sampled_rows=len(decode))  # fmt: skip
        chunk = max(self.largest_chunk(base, max(starts), len(starts)), self.floor)
        return min(self.cap, len(decode) + chunk)

    def largest_chunk(self, base: StepFeatures, start: int, rows: int = 1) -> int:
        """Largest n ≥ 0 with ratio · predict(base + n prefill tokens over ``rows`` rows, priced as one chunk
        from ``start``) + gap ≤ target_s (a decode row's next token comes one step plus one gap later).

        The prediction is a + b·n + q·n² (q from the causal pairs n·start + n(n+1)/2), solved in closed form in each
        of the model's regimes (``rows_split``): the largest n of the wide regime where the step is wide, else of
        the narrow one below the split."""
        split = self.model.rows_split
        if not split:
            return self._solve(0, base, start, rows)
        narrow_max = split - 1 - base.decode_rows  # the largest chunk that keeps the step below the split
        wide = self._solve(split, base, start, rows)
        if wide > narrow_max:
            return wide
        return max(0, min(narrow_max, self._solve(0, base, start, rows)))

    def _solve(self, regime_rows: int, base: StepFeatures, start: int, rows: int) -> int:
        """``largest_chunk`` in the regime of a step of ``regime_rows`` rows."""
        c = dict(zip(FEATURE_NAMES, self.model.coefficients_for(regime_rows)))
        a = self.model.predict(base, regime_rows)
        a += rows * (c["prefill_rows"] + c["sampled_rows"])  # each row, sampled when it completes its prompt
        b = c["prefill_tokens"] + c["prefill_attention_pairs"] * (start + 0.5)
        q = c["prefill_attention_pairs"] / 2
        room = (self.target_s - self.model.gap_s) / self.ratio - a
        if room <= 0:
            return 0
        if q > 0:
            n = (-b + math.sqrt(b * b + 4 * q * room)) / (2 * q)
        elif b > 0:
            n = room / b
        else:
            return self.cap
        return int(min(math.floor(n + 1e-9), self.cap))

    def predict(self, output: SchedulerOutput) -> float | None:
        """The model's (uncorrected) seconds for the batch."""
        features = step_features(output)
        return None if features.is_empty else self.model.predict(features)

    def observe(self, predicted: float | None, actual: float) -> None:
        """Add actual ÷ predicted (bounded to [0.25, 4]) to the window; ``ratio`` becomes the window's quantile."""
        if predicted and actual > 0:
            self.ratios.append(min(4.0, max(0.25, actual / predicted)))
            self.ratio = ratio_quantile(self.ratios, self.quantile)


def ratio_quantile(values: Iterable[float], quantile: float) -> float:
    """The nearest-rank ``quantile`` of ``values`` (an observed value, never an interpolation; 1 when empty):
    the smallest value with at least ``quantile`` of the values at or below it."""
    ordered = sorted(values)
    if not ordered:
        return 1.0
    return ordered[max(0, math.ceil(quantile * len(ordered) - 1e-9) - 1)]


def _check_fraction(name: str, value: float) -> None:
    """Raise unless 0 < value ≤ 1."""
    if not 0 < value <= 1:
        raise ValueError(f"the step budget's {name} must be in (0, 1], got {value}")


def _is_decoding(request: Request) -> bool:
    """True when the request's next step is one decode token."""
    return request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1


def make_budget_policy(config: SchedulerConfig) -> BudgetPolicy:
    """The policy the config names: fixed, or auto (needs ``slo_itl_ms`` and ``step_time_model``)."""
    if config.step_budget == "fixed":
        return FixedBudget(config.max_num_batched_tokens)
    if config.step_budget != "auto":
        raise ValueError(f"unknown step budget {config.step_budget!r}; use a number of tokens or auto")
    if not config.slo_itl_ms or not config.step_time_model:
        raise ValueError("--step-budget auto needs --slo-itl-ms (or --slo-tpot-ms) and --step-time-model FILE "
                         "(written by `twophase calibrate`)")  # fmt: skip
    model = StepTimeModel.load(config.step_time_model)
    return SloBudget(model, config.slo_itl_ms / 1000, config.max_num_batched_tokens, config.min_prefill_tokens,
                     config.max_num_seqs, quantile=config.step_time_quantile, headroom=config.slo_itl_headroom)
