"""Sampler benchmark: milliseconds to pick one token for each row of a decode step's logits, per sampling setting.

A batch-32 decode step of SmolLM2-135M on 2 CPU cores takes ~120 ms of forward and LM head (docs/runs/compare-cpu),
so the sampler's share of a step is this figure against that one. Logits are random ([rows, vocab], scaled so the
top-p cut needs a few hundred tokens, a harder case than most real steps); each request has a 256-token prompt and
50 output tokens (what the penalties read). Medians of ``--repeats`` calls after one warm-up call.

    python benchmarks/bench_sampler.py [--rows 32] [--vocab 49152] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from twophase.sample import Sampler
from twophase.sampling_params import SamplingParams

SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 1, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "temperature 1, repetition_penalty 1.1": {"temperature": 1.0, "repetition_penalty": 1.1},
    "temperature 1, frequency_penalty 0.5": {"temperature": 1.0, "frequency_penalty": 0.5},
    "temperature 1, seed per request": {"temperature": 1.0, "seed": 1},
    "temperature 1, logprobs 5": {"temperature": 1.0, "logprobs": 5},
}


def time_setting(sampler: Sampler, logits: torch.Tensor, fields: dict, repeats: int) -> float:
    """Median milliseconds of one sampler call over ``logits`` [rows, vocab] with every row using ``fields``."""
    rows = logits.shape[0]
    states = [sampler.make_state(SamplingParams(max_tokens=100, **fields), list(range(i, 256 + i)), list(range(50)),
                                 (2,)) for i in range(rows)]  # fmt: skip
    sampler(logits, states)  # warm-up: caches of the penalties, first-call allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, states)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3  # [rows, vocab]
    sampler = Sampler(args.vocab)
    results = {name: time_setting(sampler, logits, fields, args.repeats) for name, fields in SETTINGS.items()}
    print(f"sampler, {args.rows} rows x {args.vocab} vocabulary, {args.threads} threads (median ms per call)")
    for name, ms in results.items():
        print(f"  {name:40s} {ms:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "vocab": args.vocab, "threads": args.threads, "ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
