"""Features → step duration: a linear model with non-negative coefficients, fitted on relative error.

``fit_step_time_model`` solves weighted non-negative least squares (Lawson–Hanson active set, numpy only), sets the
level so that the fitted steps' predicted seconds sum to their measured seconds, checks
itself on a held-out fifth of the steps, and keeps the residual ratios (actual ÷ predicted) as the noise
distribution the simulator may draw from. The model saves to and loads from a small JSON file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from twophase.steptime.features import FEATURE_NAMES, StepFeatures

SCHEMA = "twophase.steptime.v1"
MIN_STEP_S = 1e-6
MIN_KIND_RESIDUALS = 20  # fewer residuals of a step kind than this: draw from all steps
# Row counts (prompt tokens + decode rows) at which the fit tries a second regime, where an engine switches kernels
# (its step time drops or jumps there, so one line fits neither side), and how much lower its training error must be
# to keep one.
SPLIT_CANDIDATES = (*range(2, 17), 24, 32, 48, 64, 96, 128)
SPLIT_GAIN = 0.9
SPLIT_FEATURES = ("constant", "decode_rows")  # what differs between the regimes; the rest is shared
log = logging.getLogger(__name__)


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ‖a·x − b‖₂ subject to x ≥ 0 (Lawson & Hanson's active-set method). a: [m, n], b: [m] → x: [n]."""
    m, n = a.shape
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        gradient = a.T @ (b - a @ x)  # [n]
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            blocked = passive & (z <= 0)
            alpha = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass
class FitReport:
    """How well the model fits: relative errors |pred − actual| / actual on the fitted and held-out steps."""

    num_steps: int
    num_holdout: int
    train_mean_rel_error: float
    holdout_mean_rel_error: float
    holdout_p90_rel_error: float
    unsplit_train_mean_rel_error: float | None = None  # the one-regime fit's, where a split was kept


@dataclass
class StepTimeModel:
    """duration = Σ coefficient · feature (FEATURE_NAMES order), plus the calibration's context.

    ``feature_max``: the largest value of each feature seen in calibration (a step beyond it is extrapolated);
    ``residual_ratios``: actual ÷ predicted of the calibration steps, ``residual_prefill``: whether each of those
    steps computed prompt tokens (the two kinds run different kernels and vary differently; empty: unknown);
    ``gap_s``: the median time between the end of one step and the start of the next while the engine is busy;
    ``admission_s``: the serving overhead outside the engine (client send → engine arrival plus engine first token
    → client receipt: client TTFT minus engine TTFT in a served calibration run; 0 for an engine-only one), plus
    ``admission_per_stream_s`` per request in flight when it arrives (fitted when a served run's requests pair with
    the engine's); ``jitter_s`` and ``jitter_corr``: how much later than the engine produced them the client
    received the tokens after the first, relative to the first token's delay, and their lag-1 correlation (served
    calibration only; see ``sim.simulator.DeliveryJitter``). ``rows_split`` > 0: steps of that many rows (prompt
    tokens + decode rows) or more take ``wide_coefficients`` instead, which differ from ``coefficients`` only in
    SPLIT_FEATURES (the engine's kernels switch there: on 2 Zen 4 cores a decode step of 7 rows took 25 ms, of 8
    rows 18 ms)."""

    coefficients: list[float]
    feature_max: list[float] = field(default_factory=list)
    residual_ratios: list[float] = field(default_factory=list)
    gap_s: float = 0.0
    report: FitReport | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    admission_s: float = 0.0
    residual_prefill: list[bool] = field(default_factory=list)
    jitter_s: list[float] = field(default_factory=list)  # client-side delivery delays of tokens after the first
    jitter_corr: float = 0.0  # their lag-1 correlation within a request
    admission_per_stream_s: float = 0.0  # more admission overhead per request already in flight
    rows_split: int = 0
    wide_coefficients: list[float] = field(default_factory=list)

    def coefficients_for(self, rows: int) -> list[float]:
        """The coefficients (FEATURE_NAMES order) of a step of ``rows`` rows (prompt tokens + decode rows)."""
        return self.wide_coefficients if self.rows_split and rows >= self.rows_split else self.coefficients

    def residuals_of_kind(self, prefill: bool) -> list[float]:
        """The calibration's residual ratios of the steps with (``prefill``) or without prompt tokens; all of them
        when that kind has fewer than MIN_KIND_RESIDUALS or the kinds are unknown."""
        if len(self.residual_prefill) != len(self.residual_ratios):
            return self.residual_ratios
        same = [r for r, p in zip(self.residual_ratios, self.residual_prefill) if p == prefill]
        return same if len(same) >= MIN_KIND_RESIDUALS else self.residual_ratios

    def predict(self, features: StepFeatures, rows: int | None = None) -> float:
        """Predicted seconds of one step; ``rows``: price it in the regime of a step of that many rows instead of
        its own (the budget policy prices the decode rows of a step whose chunk is still to be chosen)."""
        rows = features.prefill_tokens + features.decode_rows if rows is None else rows
        return max(MIN_STEP_S, float(np.dot(self.coefficients_for(rows), features.vector())))

    def out_of_range(self, features: StepFeatures) -> list[str]:
        """Names of the features above the calibrated range."""
        if not self.feature_max:
            return []
        return [name for name, v, hi in zip(FEATURE_NAMES, features.vector(), self.feature_max) if v > hi]

    def coefficient(self, name: str) -> float:
        """One coefficient by feature name (below ``rows_split``)."""
        return self.coefficients[FEATURE_NAMES.index(name)]

    def scaled(self, factor: float) -> "StepTimeModel":
        """A copy whose every predicted step takes ``factor`` times as long (the gap and admission unchanged); its
        meta records the product of all scales applied."""
        if not factor > 0:
            raise ValueError(f"a step-time scale must be positive, got {factor}")
        meta = {**self.meta, "scale": float(self.meta.get("scale", 1.0)) * factor}
        return replace(self, coefficients=[c * factor for c in self.coefficients],
                       wide_coefficients=[c * factor for c in self.wide_coefficients], meta=meta)

    def to_json(self) -> dict[str, Any]:
        """The saved form."""
        out = {"schema": SCHEMA, "features": list(FEATURE_NAMES), **asdict(self)}
        return out

    def save(self, path: str | Path) -> Path:
        """Write the JSON file (parents created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "StepTimeModel":
        """Read a file written by ``save``; a clear ValueError when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a step-time model file ({exc})") from exc
        if data.get("schema") != SCHEMA or list(data.get("features", [])) != list(FEATURE_NAMES):
            raise ValueError(f"{path}: not a {SCHEMA} step-time model (run `twophase calibrate`)")
        report = FitReport(**data["report"]) if data.get("report") else None
        return cls(list(map(float, data["coefficients"])), list(map(float, data.get("feature_max", []))),
                   list(map(float, data.get("residual_ratios", []))), float(data.get("gap_s", 0.0)), report,
                   dict(data.get("meta", {})), float(data.get("admission_s", 0.0)),
                   list(map(bool, data.get("residual_prefill", []))), list(map(float, data.get("jitter_s", []))),
                   float(data.get("jitter_corr", 0.0)), float(data.get("admission_per_stream_s", 0.0)),
                   int(data.get("rows_split", 0)), list(map(float, data.get("wide_coefficients", []))))  # fmt: skip


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising Σ w·((x·c − y) / y)², each step kind (with or without prompt tokens)
    weighing as much in total as the other (``kind_weights``); columns scaled to unit max for conditioning."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    root_w = np.sqrt(kind_weights(has_prompt_tokens(x)))  # [m]
    weighted = (x / scale) / y[:, None] * root_w[:, None]  # [m, n]
    return nnls(weighted, root_w) / scale


def _level(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """``coef`` scaled so that the fitted steps' predicted seconds sum to their measured seconds. A fit on relative
    error predicts low on average: with step times spread around the line (multiplicative noise n), the scale it
    picks is E[1/n] / E[1/n²] of the truth's, below 1 by about the spread's square (served CPU calibrations: Σ
    actual ÷ Σ predicted 1.015-1.025 on their own steps). A simulated run's time is a sum of steps, so the level is
    set by the sum."""
    return coef * (y.sum() / np.maximum(x @ coef, MIN_STEP_S).sum())  # every step at least MIN_STEP_S: no 0 / 0


def has_prompt_tokens(x: np.ndarray) -> np.ndarray:
    """Per step (a row of regressors), whether it computed prompt tokens: the step's kind."""
    return x[:, FEATURE_NAMES.index("prefill_tokens")] > 0  # [m]


def kind_weights(prefill: np.ndarray) -> np.ndarray:
    """Per step: 1 / (steps of its kind), so that the few steps carrying prompt tokens (a served run's steps are
    mostly decode-only) set the prefill coefficients instead of being outvoted; ones when a kind is missing."""
    counts = np.array([(~prefill).sum(), prefill.sum()])
    if counts.min() == 0:
        return np.ones(len(prefill))
    return len(prefill) / (2.0 * counts[prefill.astype(int)])


def _rel_errors(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> np.ndarray:
    return np.abs(np.maximum(x @ coef, MIN_STEP_S) - y) / y


def fit_step_time_model(features: Sequence[StepFeatures], durations: Sequence[float], gap_s: float = 0.0,
                        holdout_fraction: float = 0.2, seed: int = 0) -> StepTimeModel:
    """Fit on all steps; the report's hold-out errors come from a fit that did not see a random fifth of them."""
    keep = [(f, d) for f, d in zip(features, durations) if not f.is_empty and d > 0]
    if len(keep) < len(FEATURE_NAMES) + 2:
        raise ValueError(f"need at least {len(FEATURE_NAMES) + 2} timed steps to fit a step-time model, got {len(keep)}")
    x = np.array([f.vector() for f, _ in keep])  # [m, n]
    y = np.array([d for _, d in keep])  # [m]
    order = np.random.default_rng(seed).permutation(len(y))
    num_holdout = max(1, int(len(y) * holdout_fraction))
    test, train = order[:num_holdout], order[num_holdout:]
    rows = x[:, FEATURE_NAMES.index("prefill_tokens")] + x[:, FEATURE_NAMES.index("decode_rows")]  # [m]
    split, unsplit_error = _choose_split(x[train], y[train], rows[train])
    xs = _split_design(x, rows, split)  # [m, n + 2]
    holdout_errors = _rel_errors(xs[test], y[test], _level(xs[train], y[train], _fit(xs[train], y[train])))
    coef = _level(xs, y, _fit(xs, y))
    ratios = y / np.maximum(xs @ coef, MIN_STEP_S)
    report = FitReport(len(y), num_holdout, float(_rel_errors(xs, y, coef).mean()), float(holdout_errors.mean()),
                       float(np.percentile(holdout_errors, 90)), unsplit_error if split else None)  # fmt: skip
    narrow, wide = _regime_coefficients(coef)
    return StepTimeModel(narrow, x.max(axis=0).tolist(), np.round(ratios, 4).tolist(), gap_s, report,
                         residual_prefill=has_prompt_tokens(x).tolist(), rows_split=split,
                         wide_coefficients=wide if split else [])  # fmt: skip


def _split_design(x: np.ndarray, rows: np.ndarray, split: int) -> np.ndarray:
    """x [m, n] with SPLIT_FEATURES' columns zeroed from ``split`` rows on and appended with only those rows
    ([m, n + len(SPLIT_FEATURES)]: each regime its own coefficients for them); zero columns where ``split`` is 0."""
    wide = (rows >= split) if split else np.zeros(len(rows), dtype=bool)  # [m]
    cols = [FEATURE_NAMES.index(name) for name in SPLIT_FEATURES]
    narrow_part = x.copy()
    narrow_part[np.ix_(wide, cols)] = 0.0
    return np.column_stack([narrow_part, x[:, cols] * wide[:, None]])


def _regime_coefficients(coef: np.ndarray) -> tuple[list[float], list[float]]:
    """The split fit's coefficients [n + len(SPLIT_FEATURES)] as the two regimes' FEATURE_NAMES-ordered lists."""
    n = len(FEATURE_NAMES)
    narrow, wide = coef[:n].tolist(), coef[:n].tolist()
    for i, name in enumerate(SPLIT_FEATURES):
        wide[FEATURE_NAMES.index(name)] = float(coef[n + i])
    return narrow, wide


def _choose_split(x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> tuple[int, float]:
    """The row count (of SPLIT_CANDIDATES) whose two-regime fit has the least training error, or 0 where none
    beats the one-regime fit's by SPLIT_GAIN (a line in the rows needs no split); and the one-regime error."""
    def error(split: int) -> float:
        xs = _split_design(x, rows, split)
        return float(_rel_errors(xs, y, _fit(xs, y)).mean())

    unsplit = error(0)
    enough = [t for t in SPLIT_CANDIDATES if MIN_KIND_RESIDUALS <= (rows >= t).sum() <= len(rows) - MIN_KIND_RESIDUALS]
    tried = [(error(t), t) for t in enough]  # each regime with at least MIN_KIND_RESIDUALS steps
    best_error, best = min(tried, default=(unsplit, 0))
    return (best, unsplit) if best_error <= SPLIT_GAIN * unsplit else (0, unsplit)


def busy_gap(start_times: Sequence[float], durations: Sequence[float], step_ids: Sequence[int]) -> float:
    """Median time from one step's end to the next step's start over consecutive step ids (the engine's own
    overhead between steps: output processing, streaming, the loop)."""
    gaps = [start_times[i + 1] - (start_times[i] + durations[i]) for i in range(len(step_ids) - 1)
            if step_ids[i + 1] == step_ids[i] + 1]  # fmt: skip
    gaps = [g for g in gaps if g >= 0]
    return float(np.median(gaps)) if gaps else 0.0


def drift_scale(model: StepTimeModel, features: Sequence[StepFeatures], durations: Sequence[float]) -> float:
    """Σ actual ÷ Σ predicted seconds over the steps that computed something: how much slower (> 1) or faster the
    machine runs now than when ``model`` was fitted. Summed, not averaged per step, so long steps weigh as much as
    the time they take."""
    pairs = [(model.predict(f), d) for f, d in zip(features, durations) if not f.is_empty and d > 0]
    if not pairs:
        raise ValueError("no timed step to measure the drift on")
    return sum(d for _, d in pairs) / sum(p for p, _ in pairs)
