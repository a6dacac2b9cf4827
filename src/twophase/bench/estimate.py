"""`twophase estimate`: the seeds' back-of-the-envelope phase arithmetic as a tool.

Convention (vLLM's TPOT): a request producing ``n`` output tokens gets its first token from prefill, and the
``n − 1`` tokens after it from decode at TPOT each, so

    total = prompt_tokens / prefill_tok_s  +  (n − 1) × TPOT.

``--decode-tokens N`` states the decode steps directly (N tokens after the first, i.e. n = N + 1). The seeds'
examples read this way: 8,000 / 40 at 20,000 tok/s and 30 ms → 0.400 + 39 × 0.030 = 1.570 s; 200 / 800 at
5,000 tok/s and 30 ms → 0.040 + 23.970 = 24.010 s; a 2,000-token prompt with 300 ms prefill and 100 decode tokens
at 20 ms → 300 + 100 × 20 = 2,300 ms (there the 100 tokens are the decode steps, ``--decode-tokens 100``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Estimate:
    """Phase totals of one request, in milliseconds."""

    prompt_tokens: int
    decode_tokens: int  # tokens after the first, each costing one TPOT
    prefill_ms: float
    tpot_ms: float

    @property
    def decode_ms(self) -> float:
        """Decode phase: decode_tokens × TPOT."""
        return self.decode_tokens * self.tpot_ms

    @property
    def total_ms(self) -> float:
        """Prefill + decode."""
        return self.prefill_ms + self.decode_ms

    @property
    def dominant(self) -> str:
        """'prefill' or 'decode' (ties go to decode)."""
        return "prefill" if self.prefill_ms > self.decode_ms else "decode"


def estimate(
    prompt_tokens: int,
    output_tokens: int | None = None,
    *,
    decode_tokens: int | None = None,
    prefill_tok_s: float | None = None,
    prefill_ms: float | None = None,
    tpot_ms: float,
) -> Estimate:
    """One request's phase totals; give output_tokens (n, decode = n − 1) or decode_tokens, and a prefill rate
    or a prefill time."""
    if (output_tokens is None) == (decode_tokens is None):
        raise ValueError("give exactly one of output tokens or decode tokens")
    if decode_tokens is None:
        if output_tokens < 1:
            raise ValueError("output tokens must be at least 1")
        decode_tokens = output_tokens - 1
    if prefill_ms is None:
        if not prefill_tok_s or prefill_tok_s <= 0:
            raise ValueError("give a positive prefill rate (tok/s) or a prefill time (ms)")
        prefill_ms = 1000.0 * prompt_tokens / prefill_tok_s
    return Estimate(prompt_tokens, decode_tokens, prefill_ms, tpot_ms)


def format_estimate(e: Estimate) -> str:
    """The worked example, line by line, with the dominant phase."""
    share = (lambda ms: 100 * ms / e.total_ms if e.total_ms else 0.0)  # noqa: E731
    rate = f" ({1000 * e.prompt_tokens / e.prefill_ms:,.0f} tok/s)" if e.prefill_ms else ""
    return "\n".join([
        f"prefill: {e.prompt_tokens:,} prompt tokens{rate} → {e.prefill_ms / 1000:.3f} s ({share(e.prefill_ms):.1f}%)",
        f"decode:  {e.decode_tokens:,} tokens after the first × {e.tpot_ms:g} ms → {e.decode_ms / 1000:.3f} s "
        f"({share(e.decode_ms):.1f}%)",
        f"total:   {e.prefill_ms / 1000:.3f} + {e.decode_ms / 1000:.3f} = {e.total_ms / 1000:.3f} s "
        f"({e.total_ms:,.0f} ms) — {e.dominant} dominates",
    ])  # fmt: skip


def rates_from_phases(result: dict, prompt_tokens: int, batch: int = 1) -> tuple[float, float]:
    """(prefill tok/s, TPOT ms) from a `bench phases` JSON: the batch-1 prefill row closest in length
    (log scale) to ``prompt_tokens``, and the decode row at ``batch`` (per-sequence TPOT)."""
    prefill_rows = [r for r in result["results"] if r["kind"] == "prefill" and r["batch"] == 1]
    if not prefill_rows:
        raise ValueError("the bench phases result has no prefill rows")
    row = min(prefill_rows, key=lambda r: abs(math.log(r["tokens_per_seq"] / max(prompt_tokens, 1))))
    decode_rows = [b["decode"] for b in result.get("batched", []) if b["batch"] == batch]
    if batch == 1:
        decode_rows += [r for r in result["results"] if r["kind"] == "decode" and r["batch"] == 1]
    if not decode_rows:
        raise ValueError(f"the bench phases result has no decode row at batch {batch}")
    decode = decode_rows[0]
    return row["tokens_per_s_mean"], 1000.0 * decode["seconds_mean"] / decode["tokens_per_seq"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def register_estimate(subparsers) -> None:
    """Add the top-level `estimate` command."""
    p = subparsers.add_parser("estimate", help="phase totals of a workload from prefill rate and TPOT")
    p.add_argument("--prompt-tokens", type=_ints, required=True, help="one length or a comma-separated list")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-tokens", type=_ints, help="output tokens n (decode counts n − 1 after the first)")
    out.add_argument("--decode-tokens", type=_ints, help="decode tokens after the first (n − 1)")
    p.add_argument("--prefill-tok-s", type=float, default=None)
    p.add_argument("--prefill-ms", type=float, default=None, help="prefill time instead of a rate")
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--from-phases", default=None, help="a `bench phases --output-json` result")
    p.add_argument("--batch", type=int, default=1, help="decode batch whose TPOT --from-phases uses")
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args) -> int:
    """twophase estimate: one block per (prompt, output) pair; lists are zipped, a single value broadcasts."""
    counts = args.output_tokens if args.output_tokens is not None else args.decode_tokens
    n = max(len(args.prompt_tokens), len(counts))
    prompts = args.prompt_tokens * n if len(args.prompt_tokens) == 1 else args.prompt_tokens
    counts = counts * n if len(counts) == 1 else counts
    if len(prompts) != len(counts):
        raise ValueError("--prompt-tokens and the output/decode token lists must have the same length")
    phases = json.loads(Path(args.from_phases).read_text()) if args.from_phases else None
    estimates = []
    for prompt, count in zip(prompts, counts):
        tok_s, tpot = args.prefill_tok_s, args.tpot_ms
        if phases is not None:
            measured_tok_s, measured_tpot = rates_from_phases(phases, prompt, args.batch)
            tok_s, tpot = tok_s or measured_tok_s, tpot if tpot is not None else measured_tpot
        if tpot is None:
            raise ValueError("give --tpot-ms or --from-phases")
        key = "output_tokens" if args.output_tokens is not None else "decode_tokens"
        e = estimate(prompt, **{key: count}, prefill_tok_s=tok_s, prefill_ms=args.prefill_ms, tpot_ms=tpot)
        estimates.append(e)
        print(format_estimate(e) + ("\n" if n > 1 else ""))
    if n > 1:
        prefill, decode = sum(e.prefill_ms for e in estimates), sum(e.decode_ms for e in estimates)
        dominant = "prefill" if prefill > decode else "decode"
        print(f"all {n} requests, one at a time: {prefill / 1000:.3f} + {decode / 1000:.3f} = "
              f"{(prefill + decode) / 1000:.3f} s — {dominant} dominates")  # fmt: skip
    return 0
