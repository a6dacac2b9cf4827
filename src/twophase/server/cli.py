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
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from twophase.server.main import run_server

    return run_server(args)
