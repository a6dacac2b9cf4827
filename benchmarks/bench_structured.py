"""Structured-output costs: the time to compile a typical JSON schema (and the one-off tokenizer table), the
sampler's grammar work per step, and, with ``--s1``, S1-style serving output tok/s with ``response_format:
json_object`` vs without (and with a schema whose long string runs every request to max_tokens, so output lengths
match the plain row).

    python benchmarks/bench_structured.py                 # compile times only (seconds)
    python benchmarks/bench_structured.py --s1 --quick    # + serving with / without json_object

The S1 rows run with ``ignore_eos`` off (the random dataset turns it on; a grammar ends the output with EOS, so
ignore_eos is refused with one):
both rows report output tok/s over whatever lengths the model chose, and the mean output length beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.common import HOST, Server, Workload, free_port, log, twophase_cli  # noqa: E402
from twophase.loader import open_model_source, resolve  # noqa: E402
from twophase.structured import StructuredOutputSpec  # noqa: E402
from twophase.tokenizer import load_tokenizer  # noqa: E402

TYPICAL_SCHEMA = {  # an order with nested objects, arrays, enums, bounds and optional fields
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 64}, "email": {"type": "string", "format": "email"},
            "vip": {"type": "boolean"}}, "required": ["name", "email"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity", "price"]}},
        "status": {"type": "string", "enum": ["new", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
}  # fmt: skip
LONG_TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}},
                    "required": ["text"]}  # every request runs to max_tokens: same lengths as the plain row
S1_ROWS = {"plain": None, "json_object": {"response_format": {"type": "json_object"}},
           "json_schema_long": {"response_format": {"type": "json_schema", "json_schema": {
               "name": "long", "schema": LONG_TEXT_SCHEMA}}}}  # fmt: skip
QUICK_S1 = Workload(num_prompts=16, input_len=64, output_len=64, concurrency=8)
FULL_S1 = Workload(num_prompts=64, input_len=256, output_len=128, concurrency=32)


def compile_times(model: str, repeats: int) -> dict[str, float]:
    """Seconds: building xgrammar's tokenizer table once, then cold compiles (fresh compiler, median)."""
    from twophase.structured.grammar import GrammarCompiler, tokenizer_info

    source = open_model_source(str(resolve(model) or model))
    tokenizer = load_tokenizer(source)
    start = time.perf_counter()
    info = tokenizer_info(tokenizer.backend, source.config.vocab_size, tuple(tokenizer.eos_token_ids))
    result = {"tokenizer_table_s": time.perf_counter() - start}
    specs = {"typical_schema_s": StructuredOutputSpec.json_schema(TYPICAL_SCHEMA, "bench"),
             "json_object_s": StructuredOutputSpec("json_object", param="bench")}
    for key, spec in specs.items():
        times = []
        for _ in range(repeats):
            compiler = GrammarCompiler(info)
            start = time.perf_counter()
            compiler.compile(spec)
            times.append(time.perf_counter() - start)
        result[key] = statistics.median(times)
        start = time.perf_counter()
        compiler.compile(spec)
        result[key[:-2] + "_cached_s"] = time.perf_counter() - start
    return result


def serve_rows(model: str, workload: Workload, extra_args: list[str]) -> dict[str, dict]:
    """S1-style load against one ``twophase serve``, plain then json_object."""
    port = free_port()
    argv = [twophase_cli(), "serve", "--model", model, "--host", HOST, "--port", str(port), *extra_args,
            "--log-level", "warning"]
    rows = {}
    with Server("twophase-serve", argv, port) as server:
        run_bench(server.base_url, Workload(2, 16, 4, 2), model, None)  # warm-up
        for name, extra_body in S1_ROWS.items():
            rows[name] = run_bench(server.base_url, workload, model, extra_body)
    return rows


def mask_times(model: str, batch_sizes: tuple[int, ...] = (1, 8, 32), repeats: int = 20) -> dict[str, float]:
    """Seconds per step of the sampler's grammar work alone (fill every row's bitmask, mask the logits, advance
    the matchers) for ``batch_size`` rows inside a JSON string, the widest mask."""
    import torch

    from twophase.structured.grammar import GrammarCompiler, Matcher, apply_bitmasks, tokenizer_info

    source = open_model_source(str(resolve(model) or model))
    tokenizer = load_tokenizer(source)
    vocab = source.config.vocab_size
    info = tokenizer_info(tokenizer.backend, vocab, tuple(tokenizer.eos_token_ids))
    compiled = GrammarCompiler(info).compile(StructuredOutputSpec.json_schema(LONG_TEXT_SCHEMA, "bench"))
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    result = {}
    for batch in batch_sizes:
        matchers = {i: Matcher(compiled) for i in range(batch)}
        for m in matchers.values():
            m.matcher.accept_string('{"text": "')
        logits = torch.randn(batch, vocab)
        start = time.perf_counter()
        for _ in range(repeats):
            apply_bitmasks(logits, matchers)
            for m in matchers.values():
                m.accept(token)
        result[f"mask_step_batch{batch}_s"] = (time.perf_counter() - start) / repeats
    return result


def run_bench(base_url: str, workload: Workload, tokenizer: str, extra_body: dict | None) -> dict:
    """One ``twophase bench serve`` random-dataset run; the figures this script prints."""
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        argv = [twophase_cli(), "bench", "serve", "--base-url", base_url, "--dataset-name", "random",
                "--num-prompts", str(workload.num_prompts), "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len), "--max-concurrency", str(workload.concurrency),
                "--tokenizer", tokenizer, "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", tmp,
                "--result-filename", "result.json", "--label", "structured"]
        argv += ["--extra-body", json.dumps({"ignore_eos": False, **(extra_body or {})})]  # random sets it
        proc = subprocess.run(argv, capture_output=True, text=True)
        path = Path(tmp) / "result.json"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"bench serve failed: {(proc.stdout + proc.stderr)[-2000:]}")
        result = json.loads(path.read_text())
    completed = result.get("completed") or 1
    return {"output_tok_s": result["output_throughput"], "mean_tpot_ms": result["mean_tpot_ms"],
            "mean_output_tokens": result["total_output_tokens"] / completed, "failed": result["failed"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="store name, HF directory or .gguf path")
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles per schema (median)")
    parser.add_argument("--s1", action="store_true", help="also serve S1-style load with / without json_object")
    parser.add_argument("--quick", action="store_true", help="S1 with 16 prompts x 64 in / 64 out, concurrency 8")
    parser.add_argument("--label", default="", help="a note printed with the figures, e.g. 'busy machine'")
    parser.add_argument("--serve-args", default="", help="extra `twophase serve` args")
    args = parser.parse_args(argv)
    print(f"# structured outputs on {args.model}" + (f" ({args.label})" if args.label else ""))
    times = {**compile_times(args.model, args.repeats), **mask_times(args.model)}
    for key, seconds in times.items():
        print(f"{key:28s} {seconds * 1000:10.2f} ms")
    if args.s1:
        workload = QUICK_S1 if args.quick else FULL_S1
        log(f"S1: {workload.describe()}, no ignore_eos")
        for name, row in serve_rows(args.model, workload, args.serve_args.split()).items():
            print(f"S1 {name:16s} {row['output_tok_s']:8.1f} out tok/s  TPOT {row['mean_tpot_ms']:7.1f} ms  "
                  f"mean output {row['mean_output_tokens']:6.1f} tokens  failed {row['failed']}")


if __name__ == "__main__":
    main()
