"""twophase's side of the comparison: pp / tg / batched decode through ``twophase.LLM``, S1's server ``twophase serve``.

Engine options come as a ``twophase serve``-style argument string (``--dtype bfloat16 --max-num-seqs 32``) and are
parsed by the CLI's own parser, so a column's configuration means the same in-process and served.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from twophase import LLM, SamplingParams
from twophase.cli import add_engine_arguments, engine_config_from_args
from twophase.engine.llm_engine import engine_dtype, resolve_gemm_dtype
from twophase.loader import open_model_source
from twophase.metrics.timeline import request_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_engine's helpers
from bench_engine import random_prompt  # noqa: E402

from peers.common import HOST, Server, free_port, log, median, twophase_cli  # noqa: E402


def parse_engine_args(model: str, extra: str) -> argparse.Namespace:
    """The engine options of ``twophase serve`` from an argument string (``--model`` defaults to ``model``)."""
    parser = argparse.ArgumentParser(prog="--twophase-args", add_help=False)
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", model, *shlex.split(extra)])
    return args


def engine_dtypes(model: str, extra: str) -> tuple[str, str]:
    """(the dtype the engine will run in, that of its multi-row projections) as torch dtype names, 'auto' resolved
    as the engine does: the GEMMs' is the engine's own unless they round to another."""
    config = engine_config_from_args(parse_engine_args(model, extra))
    source = open_model_source(config.model)
    dtype = engine_dtype(config, source)
    gemm = resolve_gemm_dtype(config, source) or dtype
    return str(dtype).removeprefix("torch."), str(gemm).removeprefix("torch.")


def gemm_note(dtype: str, gemm: str) -> str:
    """' (bfloat16 GEMMs)' where the engine runs its multi-row projections in another dtype than its own, else ''."""
    return "" if gemm == dtype else f" ({gemm} GEMMs)"


def bench_engine(model: str, extra: str, shapes: dict, repeats: int) -> dict[str, float]:
    """tg / pp / batched-decode rates in tok/s, medians over ``repeats``, shapes as llama-bench's.

    - ``tg``: 1 request, a 16-token prompt, ``shapes['tg']`` greedy tokens; rate over the
      decode span (first token to last), as llama-bench's tg counts generated tokens only.
    - ``pp``: a ``shapes['pp']``-token prompt, 1 output token; rate over the prefill span.
    - ``batch``: ``npl`` prompts of ``npp`` tokens, ``ntg`` tokens each, submitted together; S_TG-style rate:
      tokens made after every request has its first token, over that span (llama-batched-bench's S_TG).
    """
    args = parse_engine_args(model, extra)
    args.no_prefix_caching = True  # as bench_engine: random prompts share nothing; keep the runs independent
    config = engine_config_from_args(args)
    llm = LLM.from_engine_config(config, progress=False)
    vocab = llm.engine.model_config.vocab_size
    tg_params = SamplingParams(temperature=0, max_tokens=shapes["tg"], ignore_eos=True)
    pp_params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([random_prompt(16, vocab, 0)], tg_params)  # warm-up
    llm.generate([random_prompt(shapes["pp"], vocab, 1)], pp_params)
    tg, pp, batch = [], [], []
    for r in range(repeats):
        m = request_metrics(llm.generate([random_prompt(16, vocab, 10 + r)], tg_params)[0].timeline)
        tg.append((m.num_output_tokens - 1) / m.decode_time)
        m = request_metrics(llm.generate([random_prompt(shapes["pp"], vocab, 100 + r)], pp_params)[0].timeline)
        pp.append(shapes["pp"] / m.prefill_time)
    npp, ntg, npl = shapes["npp"], shapes["ntg"], shapes["npl"]
    batch_params = SamplingParams(temperature=0, max_tokens=ntg, ignore_eos=True)
    for r in range(repeats):
        outs = llm.generate([random_prompt(npp, vocab, 1000 * r + i) for i in range(npl)], batch_params)
        times = [o.timeline.token_times for o in outs]
        start = max(t[0] for t in times)
        end = max(t[-1] for t in times)
        made = sum(1 for t in times for x in t if x > start)
        batch.append(made / (end - start))
    log(f"  twophase [{extra or 'defaults'}]: tg {median(tg):.1f}, pp {median(pp):.1f}, batch S_TG {median(batch):.1f}")
    del llm
    return {"tg": median(tg), "pp": median(pp), "batch": median(batch),
            "runs": {"tg": tg, "pp": pp, "batch": batch}}


def server(model: str, extra: str) -> Server:
    """``twophase serve`` on a free loopback port, with the column's engine options."""
    port = free_port()
    argv = [twophase_cli(), "serve", "--model", model, "--host", HOST, "--port", str(port), *shlex.split(extra),
            "--log-level", "warning"]
    return Server("twophase-serve", argv, port)
