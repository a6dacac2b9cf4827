"""``twophase serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    from twophase.cli import add_engine_arguments

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--api-key", default=None, help="require this key (or set TWOPHASE_API_KEY); /health stays open")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="waiting-queue bound; past it requests get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=2 << 20, help="request body limit (413 above)")
    p.add_argument("--allow-request-chat-template", action="store_true",
                   help="accept a chat_template field in requests (rendered in the sandbox)")
    p.add_argument("--cors-origins", default="", help="comma-separated allowed origins (CORS is off by default)")
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--max-top-logprobs", type=int, default=20)
    p.add_argument("--max-stop-strings", type=int, default=16)
    p.add_argument("--max-stop-string-chars", type=int, default=256)
    p.add_argument("--max-prompts", type=int, default=64, help="prompts per completions request")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT objective for the goodput metrics")
    p.add_argument("--slo-e2el-ms", type=float, default=None, help="end-to-end latency objective for the goodput metrics")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true")
    add_kv_arguments(p)
    p.set_defaults(func=_serve)
    register_proxy(subparsers)


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation options of ``serve``."""
    p.add_argument("--kv-role", default="both", choices=["both", "prefill", "decode"],
                   help="both: colocated (default); prefill: answer max_tokens=1 legs and lend the prompt's KV "
                   "blocks; decode: read them from the prefill server named in kv_transfer_params")
    p.add_argument("--kv-host", default="127.0.0.1", help="prefill: address the KV transfer server binds")
    p.add_argument("--kv-port", type=int, default=0, help="prefill: KV transfer port (0: a free one)")
    p.add_argument("--kv-advertise-host", default=None, help="prefill: address decode servers dial (default --kv-host)")
    p.add_argument("--kv-lease-timeout", type=float, default=30.0,
                   help="prefill: seconds a finished prefill's blocks wait for their reader before they are freed")
    p.add_argument("--kv-transfer-timeout", type=float, default=10.0, help="bound on each KV transfer exchange (s)")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "tcp", "cuda-ipc"],
                   help="how KV blocks travel: tcp (bytes over TCP, any device, across hosts); cuda-ipc (a CUDA IPC "
                   "handle, the blocks stay on the GPU: both servers on CUDA on one host, else the handshake refuses); "
                   "auto (default): cuda-ipc when the handshake finds both on CUDA on one host, tcp otherwise")


def kv_transfer_config(args: argparse.Namespace):
    """KVTransferConfig from the ``serve`` options (the colocated default for other commands)."""
    from twophase.config import KVTransferConfig

    if getattr(args, "kv_role", "both") == "both":
        return KVTransferConfig()
    return KVTransferConfig(role=args.kv_role, host=args.kv_host, port=args.kv_port,
                            advertise_host=args.kv_advertise_host, lease_timeout_s=args.kv_lease_timeout,
                            transfer_timeout_s=args.kv_transfer_timeout, transport=args.kv_transport)


def register_proxy(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``proxy`` subcommand (P/D proxy, or a data-parallel router with --replica)."""
    p = subparsers.add_parser("proxy", help="OpenAI-compatible front for prefill/decode servers or replicas")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill server (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode server (repeatable)")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a colocated server (repeatable): plain data-parallel routing, no roles")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="bound on each leg (s)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    from twophase.server.proxy import run_proxy

    return run_proxy(args)


def _serve(args: argparse.Namespace) -> int:
    from twophase.server.main import run_server

    return run_server(args)
