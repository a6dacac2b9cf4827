"""Tensor-parallel decode benchmark: decode tok/s at each --tp size, and the all-reduces each step costs.

Usage: ``python benchmarks/bench_tp.py [--model M] [--tp 1,3] [--batch 4] [--tokens 64] [--dtype float32]``.
All-reduce count and seconds are rank 0's (every rank runs the same collectives); decode steps are read from the
engine's step records. On one CPU host the ranks share the cores, so tp > 1 mostly measures communication cost.
"""

from __future__ import annotations

import argparse
import json

from twophase import LLM, SamplingParams
from twophase.loader import DEFAULT_MODEL


def measure(model: str, tp: int, batch: int, tokens: int, dtype: str, threads: int | None) -> dict:
    """Decode ``batch`` requests for ``tokens`` tokens at tensor-parallel size ``tp``."""
    llm = LLM(model, dtype=dtype, progress=False, max_model_len=512, tensor_parallel_size=tp, num_threads=threads)
    try:
        prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
        records_before = len(llm.engine.step_records)
        stats = llm.engine.tp.stats if llm.engine.tp else None
        before = stats.snapshot() if stats else None
        llm.generate(prompts, params)
        steps = list(llm.engine.step_records)[records_before:]
        decode = [s for s in steps if s.num_prompt_tokens == 0]
        decode_time = sum(s.duration for s in decode)
        decode_tokens = sum(s.num_decode_tokens for s in decode)
        result = {"tp": tp, "decode_steps": len(decode), "decode_tok_s": decode_tokens / decode_time,
                  "step_ms": 1000 * decode_time / len(decode)}  # fmt: skip
        if stats:
            result |= stats.per_step(before, len(steps))
        return result
    finally:
        llm.engine.close()


def main() -> None:
    """Print one row per tensor-parallel size, then the rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tp", default="1,3", help="comma-separated sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="per rank (default: cores / ranks)")
    args = parser.parse_args()
    rows = [measure(args.model, int(tp), args.batch, args.tokens, args.dtype, args.threads) for tp in args.tp.split(",")]
    for row in rows:
        extra = (f", {row['all_reduces_per_step']:.0f} all-reduces/step, {row['all_reduce_ms_per_step']:.2f} ms/step in them"
                 if "all_reduces_per_step" in row else "")  # fmt: skip
        print(f"tp={row['tp']}: decode {row['decode_tok_s']:.1f} tok/s ({row['step_ms']:.1f} ms/step){extra}")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
