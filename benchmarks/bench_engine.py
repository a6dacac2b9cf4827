"""Engine benchmark: twophase vs HF transformers on the same weights and dtype, with the physical floors.

Prints single-request decode tok/s, prefill tok/s for a 512-token prompt, and total output tok/s for 32
prompts generated together; floors from this machine's measured memory bandwidth and matmul rate.

    python benchmarks/bench_engine.py --model smollm2-135m-instruct [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from twophase import LLM, SamplingParams
from twophase.loader import open_model_source, resolve
from twophase.metrics.timeline import request_metrics


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over repeats (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a reduction over a tensor far larger than the caches (decode reads weights)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / median_time(lambda: data.sum(), repeats)


def measure_matmul(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n×n×n GEMM in dtype."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_time(lambda: a @ b, repeats)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (length,), generator=g).tolist()


def bench_twophase(model: str, dtype: str, args) -> dict[str, float]:
    llm = LLM(model, dtype=dtype, progress=False, enable_prefix_caching=False, max_num_seqs=64)
    vocab = llm.engine.model_config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    decode_rates, prefill_rates = [], []
    llm.generate([random_prompt(16, vocab, 0)], greedy)  # warm-up
    for r in range(args.repeats):
        out = llm.generate([random_prompt(16, vocab, r)], greedy)[0]
        m = request_metrics(out.timeline)
        decode_rates.append((m.num_output_tokens - 1) / m.decode_time)
        first = llm.generate([random_prompt(512, vocab, 100 + r)], SamplingParams(temperature=0, max_tokens=1))[0]
        prefill_rates.append(512 / request_metrics(first.timeline).prefill_time)
    prompts = [random_prompt(32 + 8 * i, vocab, 200 + i) for i in range(32)]
    batch_params = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    batch_time = median_time(lambda: llm.generate(prompts, batch_params), max(1, args.repeats - 1))
    return {
        "decode_tok_s": statistics.median(decode_rates),
        "prefill_tok_s": statistics.median(prefill_rates),
        "batch_out_tok_s": 32 * args.batch_tokens / batch_time,
    }


def bench_hf(model_path, dtype: torch.dtype, vocab: int, args) -> dict[str, float]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=dtype).eval()

    def generate(ids: torch.Tensor, n: int, mask=None):
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    prompt = torch.tensor([random_prompt(16, vocab, 0)])
    t_one = median_time(lambda: generate(prompt, 1), args.repeats)
    t_all = median_time(lambda: generate(prompt, args.decode_tokens), args.repeats)
    long_prompt = torch.tensor([random_prompt(512, vocab, 100)])
    with torch.inference_mode():
        t_prefill = median_time(lambda: hf(long_prompt), args.repeats)
    lengths = [32 + 8 * i for i in range(32)]
    width = max(lengths)
    ids = torch.zeros(32, width, dtype=torch.long)
    mask = torch.zeros(32, width, dtype=torch.long)
    for i, n in enumerate(lengths):  # left padding, as HF generate wants for decoder-only models
        ids[i, width - n :] = torch.tensor(random_prompt(n, vocab, 200 + i))
        mask[i, width - n :] = 1
    t_batch = median_time(lambda: generate(ids, args.batch_tokens, mask), max(1, args.repeats - 1))
    return {
        "decode_tok_s": (args.decode_tokens - 1) / (t_all - t_one),
        "prefill_tok_s": 512 / t_prefill,
        "batch_out_tok_s": 32 * args.batch_tokens / t_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch_dtype = getattr(torch, args.dtype)
    model_path = resolve(args.model) or __import__("pathlib").Path(args.model)
    config = open_model_source(str(model_path)).config
    weight_bytes = config.num_params * torch.empty((), dtype=torch_dtype).element_size()
    bandwidth, flops = measure_bandwidth(), measure_matmul(torch_dtype)
    print(f"machine: {torch.get_num_threads()} threads | read bandwidth {bandwidth / 1e9:.1f} GB/s | "
          f"{args.dtype} GEMM {flops / 1e9:.1f} GFLOP/s | model {config.num_params / 1e6:.1f} M params, "
          f"{weight_bytes / 1e6:.0f} MB in {args.dtype}")  # fmt: skip
    ours = bench_twophase(str(model_path), args.dtype, args)
    theirs = {} if args.skip_hf else bench_hf(model_path, torch_dtype, config.vocab_size, args)
    floors = {
        "decode_tok_s": bandwidth / weight_bytes,  # every step reads every weight once
        "prefill_tok_s": flops / (2 * config.num_params),  # 2 FLOPs per parameter per token
        "batch_out_tok_s": float("nan"),
    }
    print(f"\n{'metric':<28}{'twophase':>12}{'HF':>12}{'ratio':>8}{'floor-bound':>14}")
    for key, label in (("decode_tok_s", "decode tok/s (1 request)"), ("prefill_tok_s", "prefill tok/s (512 prompt)"),
                       ("batch_out_tok_s", "output tok/s (32 prompts)")):  # fmt: skip
        hf = theirs.get(key, float("nan"))
        print(f"{label:<28}{ours[key]:>12.1f}{hf:>12.1f}{ours[key] / hf:>8.2f}{floors[key]:>14.1f}")
    print("\nfloor-bound: the most the hardware allows (decode: bandwidth / weight bytes; prefill: GEMM rate / 2·params)")


if __name__ == "__main__":
    main()
