"""Speculative decoding benchmark: decode tok/s with and without ngram speculation, side by side.

Two workloads: ``grounded`` (chat prompts asking to repeat a passage: the answer is in the prompt, so prompt-lookup
proposals hit) and ``random`` (S1-shaped: random 256-token prompts, 128 output tokens, EOS ignored: proposals rarely
hit). Batch sizes 1 and 8 by default. One engine is loaded; speculation is toggled by swapping its proposer, so
both sides run the same weights, kernels and KV cache. Greedy outputs are checked identical on both sides.

    python benchmarks/bench_spec.py --model smollm2-135m-instruct --dtype float32 --k 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from twophase import LLM, SamplingParams
from twophase.loader import DEFAULT_MODEL
from twophase.spec_decode import NgramProposer

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day, and the fox was happy to be outside.",
    "Prefill computes the whole prompt at once; decode produces one token at a time and reads every weight.",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "Caches hold keys and values; blocks of sixteen tokens are shared between requests with a common prefix.",
]


def grounded_prompts(llm: LLM, n: int) -> list[list[int]]:
    """Chat prompts whose answer repeats a passage of the prompt."""
    return [llm.render_chat([{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGES[i % len(PASSAGES)]}"}])
            for i in range(n)]  # fmt: skip


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """S1-shaped random token prompts."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(n)]


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, proposer) -> dict:
    """Generate the batch once; decode tok/s over the window from the first to the last output token."""
    engine = llm.engine
    engine.proposer = proposer
    before = engine.scheduler.spec_stats.copy()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    stats = engine.scheduler.spec_stats
    firsts = [o.timeline.token_times[0] for o in outputs]
    lasts = [o.timeline.token_times[-1] for o in outputs]
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs)
    drafts = stats.num_drafts - before.num_drafts
    proposed = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    return {
        "decode_tok_s": decode_tokens / (max(lasts) - min(firsts)) if max(lasts) > min(firsts) else float("nan"),
        "wall_s": wall,
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "token_ids": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--random-prompt-len", type=int, default=256)
    parser.add_argument("--workloads", nargs="+", default=["grounded", "random"], choices=["grounded", "random"])
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (outputs checked identical); > 0: sampled, seeded per request (rejection "
                        "sampling keeps the distribution, not the exact tokens, so no identity check)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}  # fmt: skip
    llm = LLM(args.model, dtype=args.dtype, progress=False, speculative_config=spec, max_num_seqs=max(args.batch_sizes))
    proposer = llm.engine.proposer
    vocab = llm.engine.model_config.vocab_size
    rows = []
    print(f"ngram K={args.k} lookup [{args.lookup_min}, {args.lookup_max}], {args.max_tokens} output tokens, "
          f"temperature {args.temperature}")
    print(f"{'workload':<9} {'batch':>5} {'tok/s off':>10} {'tok/s on':>9} {'speedup':>8} {'accept':>7} {'mean len':>9}")
    for workload in args.workloads:
        for batch in args.batch_sizes:
            prompts = grounded_prompts(llm, batch) if workload == "grounded" else \
                random_prompts(batch, args.random_prompt_len, vocab)  # fmt: skip
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0,
                                    ignore_eos=workload == "random")  # fmt: skip
            measure(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4), None)  # warm-up
            off = measure(llm, prompts, params, None)
            on = measure(llm, prompts, params, proposer)
            if args.temperature == 0:
                assert on["token_ids"] == off["token_ids"], "speculation changed greedy output"
            row = {"workload": workload, "batch": batch, "off": off, "on": on,
                   "speedup": on["decode_tok_s"] / off["decode_tok_s"]}  # fmt: skip
            rows.append(row)
            rate = f"{on['acceptance_rate']:.0%}" if on["acceptance_rate"] is not None else "-"
            length = f"{on['mean_accepted_length']:.2f}" if on["mean_accepted_length"] is not None else "-"
            print(f"{workload:<9} {batch:>5} {off['decode_tok_s']:>10.1f} {on['decode_tok_s']:>9.1f} "
                  f"{row['speedup']:>7.2f}x {rate:>7} {length:>9}")  # fmt: skip
    if args.json:
        for row in rows:
            for side in ("off", "on"):
                row[side].pop("token_ids")
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
