"""Engine options of the step budget (`--step-budget auto` and its objective), shared by serve, sim and the rest."""

from __future__ import annotations

import argparse
from typing import Any


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """--step-budget, --slo-itl-ms, --slo-tpot-ms, --step-time-model, --min-prefill-tokens, --slo-itl-headroom,
    --step-time-quantile."""
    add = parser.add_argument
    add("--step-budget", default="fixed", choices=["fixed", "auto"],
        help="fixed: --max-num-batched-tokens every step; auto: each step's prefill chunk as large as the ITL "
        "objective allows (predicted by --step-time-model), --max-num-batched-tokens the cap")
    add("--slo-itl-ms", type=float, default=None, help="inter-token-latency objective for --step-budget auto")
    add("--slo-tpot-ms", type=float, default=None, help="TPOT objective; the ITL objective when --slo-itl-ms is unset")
    add("--step-time-model", default=None, metavar="FILE", help="step-time model written by `twophase calibrate`")
    add("--min-prefill-tokens", type=int, default=32, help="--step-budget auto: smallest prefill chunk while prompts wait")
    add("--slo-itl-headroom", type=float, default=0.9, metavar="FRACTION",
        help="--step-budget auto: fraction of the ITL objective a step (its corrected prediction plus the gap) aims at")
    add("--step-time-quantile", type=float, default=0.9, metavar="Q",
        help="--step-budget auto: the prediction is corrected by this quantile of the recent steps' actual / "
        "predicted time (0.5: the median; 1: the slowest)")


def budget_fields(args: argparse.Namespace) -> dict[str, Any]:
    """SchedulerConfig fields from those options (absent options keep the defaults)."""
    if not hasattr(args, "step_budget"):
        return {}
    itl = args.slo_itl_ms if args.slo_itl_ms is not None else args.slo_tpot_ms
    for name, value in (("--slo-itl-ms", args.slo_itl_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if args.step_budget == "auto" and (itl is None or not args.step_time_model):
        raise ValueError("--step-budget auto needs --slo-itl-ms (or --slo-tpot-ms) and --step-time-model FILE "
                         "(written by `twophase calibrate`)")  # fmt: skip
    if args.min_prefill_tokens < 1:
        raise ValueError(f"--min-prefill-tokens must be at least 1, got {args.min_prefill_tokens}")
    fractions = {"--slo-itl-headroom": args.slo_itl_headroom, "--step-time-quantile": args.step_time_quantile}
    for name, value in fractions.items():
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    return {"step_budget": args.step_budget, "slo_itl_ms": itl, "step_time_model": args.step_time_model,
            "min_prefill_tokens": args.min_prefill_tokens, "slo_itl_headroom": args.slo_itl_headroom,
            "step_time_quantile": args.step_time_quantile}  # fmt: skip
