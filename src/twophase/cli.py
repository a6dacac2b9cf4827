"""`twophase pull / generate / chat / serve / bench / report / estimate`.

Each command module outside this file exposes ``register(subparsers)``; errors end as one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import multiprocessing
import os
import sys
import threading
from typing import TYPE_CHECKING

from twophase.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from twophase.engine.llm import LLM

# modules that add their own subcommands (each defines register(subparsers)), with the subcommands they add: a
# command line naming one of them imports only its module, one naming a command of this file none of them (the
# bench client alone costs ~0.3 s of `generate`'s start-up)
COMMAND_MODULES = {"twophase.server.cli": ("serve", "proxy"), "twophase.bench.cli": ("bench",),
                   "twophase.report.cli": ("report", "estimate"), "twophase.sim.cli": ("sim", "calibrate")}  # fmt: skip


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model."""
    from twophase.loader import DEFAULT_MODEL

    parser.add_argument("--model", "-m", default=DEFAULT_MODEL, help="store name, HF directory or .gguf path")
    add_execution_arguments(parser)
    add_scheduler_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--speculative-config", default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (vLLM spelling; off by default)',
    )  # fmt: skip
    from twophase.steptime.cli import add_budget_arguments

    add_budget_arguments(parser)
    add_parallel_arguments(parser)


def add_execution_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model runs: dtypes, weight format, backends, threads, device."""
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPUs for weights stored in GGUF Q8_0/Q4_1 blocks (run as stored); else "
             "bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, float32 on other CPUs",
    )  # fmt: skip
    parser.add_argument(
        "--quantization", "-q", default="none", choices=["none", "int8", "q8_0", "q4_1", "gguf"],
        help="quantized weights: int8 per channel (activations float32), GGUF Q8_0 / Q4_1 blocks (taken as stored "
        "from a GGUF file, else quantized at load; activations rounded to int8 blocks as llama.cpp does), or gguf: "
        "each weight as the GGUF file stores it",
    )  # fmt: skip
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "kernel"])
    parser.add_argument("--linear-backend", default="auto", choices=["auto", "torch"], help="torch: F.linear reference")
    parser.add_argument(
        "--gemm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="projections of 8+ rows (5+ on AVX512-BF16 without AMX; prefill, wide decode) through a GEMM in this "
             "dtype; auto: bfloat16 where --dtype auto runs GGUF-block weights in float32 on an AMX / AVX512-BF16 "
             "CPU, else float32 (the kernels)",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic", action="store_true",
        help="batch-invariant execution: every row of every step through the C++ kernels, whose per-row arithmetic does "
        "not depend on the batch, so batching and chunking never change a request's logits or tokens (CPU; prefill "
        "of long prompts is slower than with the GEMM it replaces)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """What a step may hold and the KV cache it draws on."""
    from twophase.config import SchedulerConfig

    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
        help="token budget per step (default %(default)s, as vLLM's server on CPU: fewer, larger prefill steps; a "
             "smaller budget, or --step-budget auto with --slo-itl-ms, keeps streams smoother; see the README)",
    )  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory", default="auto",
        help="KV cache budget, e.g. 512MiB, 2GiB; auto: enough for max-num-seqs full-length sequences, at most "
        "40%% of the memory available after loading the weights",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
        help="auto: the model's dtype; bfloat16 under a float32 model halves the KV cache's bytes (twice the tokens "
        "in the same memory, half the bytes decode attention reads) at bfloat16 precision for K and V; int8 stores "
        "each token's K and V rows as int8 with a float32 scale a row (llama.cpp's q8_0 cache, one scale per head "
        "row): ~0.53x bfloat16's bytes",
    )  # fmt: skip
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-chunked-prefill", action="store_true")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor-parallel options (see ``distributed/``); also read from a torchrun environment."""
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="ranks sharing each layer")
    group.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over")
    group.add_argument("--node-rank", type=int, default=0, help="this host (0 runs the engine; others only workers)")
    group.add_argument("--master-addr", default="127.0.0.1", help="host of rank 0, where every rank meets")
    group.add_argument("--master-port", type=int, default=0, help="port on --master-addr (0: a free one, one host)")
    group.add_argument("--tp-timeout", type=float, default=60.0, help="seconds a collective may take before the "
                       "engine stops with an error (a hung worker)")


def parse_bytes(text: str) -> int:
    """'512MiB' / '2GiB' / '1000000' → bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from the shared engine options."""
    from twophase.config import CacheConfig, EngineConfig, SchedulerConfig
    from twophase.server.cli import kv_transfer_config
    from twophase.spec_decode import SpeculativeConfig
    from twophase.steptime.cli import budget_fields

    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_memory_bytes=None if args.kv_cache_memory == "auto" else parse_bytes(args.kv_cache_memory),
        enable_prefix_caching=not args.no_prefix_caching,
        cache_dtype=args.kv_cache_dtype,
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill,
        max_waiting_requests=getattr(args, "max_waiting_requests", None),
        **budget_fields(args),
    )
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, cache=cache, scheduler=scheduler,
        quantization=args.quantization, attention_backend=args.attention_backend,
        linear_backend=args.linear_backend, gemm_dtype=args.gemm_dtype, deterministic=args.deterministic, num_threads=args.threads, parallel=parallel_config_from_args(args),
        kv_transfer=kv_transfer_config(args),
        speculative_config=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
    )  # fmt: skip


def parallel_config_from_args(args: argparse.Namespace):
    """ParallelConfig from the tensor-parallel options (``add_parallel_arguments``)."""
    from twophase.config import ParallelConfig

    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, timeout_s=args.tp_timeout,
    )  # fmt: skip


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling options of generate / chat."""
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling options (validated)."""
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, seed=args.sampling_seed,
        stop=args.stop,
    )  # fmt: skip


@contextlib.contextmanager
def collector_paused(freeze: bool = False):
    """Start-up without the cyclic garbage collector. Importing torch and building an engine make ~190,000
    long-lived objects, which the collector's passes walk again and again: 3 full and 42 middle passes, ~0.4 s of
    ``twophase generate --max-tokens 8 "Hi"`` (measured on a 2-core machine). On leaving, the collector is on again
    if it was. ``freeze`` (a process of one command: the console entry point) first freezes what start-up made,
    leaving it out of every later pass: re-enabled alone, the collector's next passes walk all of it once more
    (~0.2 s measured). A longer-lived caller of ``main`` (tests) does not freeze: cyclic garbage present at that
    moment would stay."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; given ``argv``, only the command modules it needs (all of them for help or a typo)."""
    parser = argparse.ArgumentParser(prog="twophase", description="LLM inference that measures prefill and decode apart")
    sub = parser.add_subparsers(dest="command", required=True)
    pull = sub.add_parser("pull", help="fetch a model into the store")
    pull.add_argument("name", nargs="?", default=None)
    pull.set_defaults(func=cmd_pull)
    for name, func, text in (("generate", cmd_generate, "generate from one prompt"), ("chat", cmd_chat, "interactive chat")):
        p = sub.add_parser(name, help=text)
        add_engine_arguments(p)
        add_sampling_arguments(p)
        if name == "generate":
            p.add_argument("prompt")
            p.add_argument("--raw", action="store_true", help="send the text as is (no chat template)")
        p.set_defaults(func=func)
    for module_name in _modules_for(argv, built_in=set(sub.choices)):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
    return parser


def _modules_for(argv: list[str] | None, built_in: set[str]) -> list[str]:
    """The command modules whose subcommands the command line ``argv`` may need (none for a ``built_in`` one)."""
    command = next((arg for arg in (argv or []) if not arg.startswith("-")), None)
    if command in built_in:
        return []
    owners = [name for name, commands in COMMAND_MODULES.items() if command in commands]
    return owners or list(COMMAND_MODULES)


def cmd_pull(args: argparse.Namespace) -> int:
    """twophase pull NAME."""
    from twophase.loader import DEFAULT_MODEL, pull

    path = pull(args.name or DEFAULT_MODEL)
    print(path)
    return 0


def load_llm(args: argparse.Namespace) -> LLM:
    """The ``LLM`` of the command line's engine options, imported and built with the collector paused."""
    with collector_paused(freeze=args.own_process):
        from twophase.engine.llm import LLM

        return LLM.from_engine_config(engine_config_from_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    """twophase generate PROMPT: stream text, then a phase summary."""
    params = sampling_params_from_args(args)
    if not args.prompt.strip():
        raise InvalidRequestError("prompt must not be empty", "prompt")
    llm = load_llm(args)
    prompt = args.prompt
    if not args.raw and llm.tokenizer.has_chat_template:
        prompt = llm.render_chat([{"role": "user", "content": args.prompt}])
    stream_to_terminal(llm, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """twophase chat: a conversation on the terminal (empty line or EOF ends it)."""
    params = sampling_params_from_args(args)
    llm = load_llm(args)
    messages: list[dict] = []
    while True:
        try:
            text = input("> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        reply = stream_to_terminal(llm, llm.render_chat(messages), params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def stream_to_terminal(llm, prompt, params: SamplingParams) -> str:
    """Print text as it streams, then the one-line phase summary; returns the full text."""
    from twophase.metrics.timeline import request_metrics

    final = None
    for output in llm.stream(prompt, params):
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        final = output
    sys.stdout.write("\n")
    m = request_metrics(final.timeline)
    decode_rate = (m.num_output_tokens - 1) / m.decode_time if m.decode_time else float("nan")
    print(
        f"[prompt {len(final.prompt_token_ids)} tok, cached {final.num_cached_tokens} | TTFT {m.ttft * 1000:.1f} ms | "
        f"decode {m.num_output_tokens} tok at {decode_rate:.1f} tok/s{_spec_summary(m)} | finish {final.finish_reason}]",
        file=sys.stderr,
    )
    return final.text


def _spec_summary(m) -> str:
    """' | spec acceptance 62% (mean accepted length 2.9)' when proposals were verified, else ''."""
    if m.acceptance_rate is None:
        return ""
    return f" | spec acceptance {m.acceptance_rate:.0%} (mean accepted length {m.mean_accepted_length:.2f})"


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Entry point: run a command, turning expected errors into one line. ``own_process``: nothing else runs in this
    process (the console entry point), so what start-up makes may be frozen (``collector_paused``)."""
    argv = sys.argv[1:] if argv is None else argv
    with collector_paused(freeze=own_process):  # the command's modules, torch among them
        args = build_parser(argv).parse_args(argv)
    args.own_process = own_process
    try:
        if hasattr(args, "tensor_parallel_size"):
            worker_status = _run_worker_host(args)
            if worker_status is not None:
                return worker_status
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 — every error ends as one clear line
        if _is_user_error(exc):
            print(f"twophase: error: {exc}", file=sys.stderr)
            return 2
        raise


def _run_worker_host(args: argparse.Namespace) -> int | None:
    """On a host (or torchrun process) without rank 0, serve its tensor-parallel ranks instead of the command;
    None on the engine's host. A command with its own options builds its config with ``args.engine_config``."""
    from twophase.distributed.launch import is_engine_process, run_worker_host

    config = getattr(args, "engine_config", engine_config_from_args)(args)
    if is_engine_process(config.parallel):
        return None
    return run_worker_host(config)


def _is_user_error(exc: Exception) -> bool:
    """Errors the user can act on (bad input, a missing or broken model) rather than bugs."""
    from twophase.config import ConfigError
    from twophase.distributed.group import TensorParallelError
    from twophase.loader import ModelLoadError

    user_errors = (InvalidRequestError, ConfigError, ModelLoadError, FileNotFoundError, ValueError, TensorParallelError)
    return isinstance(exc, user_errors)


# commands that end when their output is printed: once nothing is left running they skip the interpreter's teardown
ONE_SHOT_COMMANDS = ("generate", "chat", "pull")


def run() -> None:
    """Console entry point: ``main`` on ``sys.argv``, then the exit. A one-shot command with no child process or
    non-daemon thread left exits at once after flushing its output: the interpreter's teardown of torch's modules
    and the weights alone takes about a second on a 2-core machine (measured: 6.2 s -> 5.2 s wall for
    ``twophase generate --max-tokens 8 "Hi"``)."""
    argv = sys.argv[1:]
    status = main(argv, own_process=True)
    if argv and argv[0] in ONE_SHOT_COMMANDS and _nothing_left_running():
        _exit_now(status)
    sys.exit(status)


def _nothing_left_running() -> bool:
    """True when no child process and no non-daemon thread besides this one is alive (nothing to join at exit)."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    return not others and not multiprocessing.active_children()


def _exit_now(status: int) -> None:
    """Flush logs and standard streams, then end the process without the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


if __name__ == "__main__":
    run()
