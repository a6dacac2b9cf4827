"""``run_server(args)``: load the engine, start its loop, serve the app with uvicorn, shut down gracefully.

On SIGTERM / SIGINT uvicorn stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then cancels them (which aborts their engine requests); the engine loop is then
stopped and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import threading
from typing import Iterator

import uvicorn

from twophase.server.settings import ServerSettings

logger = logging.getLogger("twophase.server")
API_KEY_ENV = "TWOPHASE_API_KEY"


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that does not re-raise the captured signal after a graceful shutdown (so the exit is 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM to ``handle_exit`` while serving; restore the old handlers after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from the ``serve`` options (the API key may come from ``TWOPHASE_API_KEY``)."""
    origins = tuple(o.strip() for o in (args.cors_origins or "").split(",") if o.strip())
    for name in ("ttft", "tpot", "e2el"):
        value = getattr(args, f"slo_{name}_ms", None)
        if value is not None and value <= 0:
            raise ValueError(f"--slo-{name}-ms must be positive, got {value}")
    return ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        allow_request_chat_template=args.allow_request_chat_template,
        cors_origins=origins,
        max_n=args.max_n,
        max_top_logprobs=args.max_top_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_prompts=args.max_prompts,
        slos_ms=tuple((name, float(getattr(args, f"slo_{name}_ms"))) for name in ("ttft", "tpot", "e2el")
                      if getattr(args, f"slo_{name}_ms", None) is not None),
    )


def serving_stack(config: uvicorn.Config) -> str:
    """Which event loop and HTTP parser uvicorn serves ``config`` with, e.g. ``"uvloop, httptools"``. With uvloop
    and httptools installed (a dependency where they build), "auto" takes them over asyncio's loop and h11: the
    streamed chunks of a decode step then cost the loop thread, which holds the GIL while it writes them, a few
    hundred microseconds instead of ~2 ms, time in which the engine's step thread waits."""
    if not config.loaded:
        config.load()
    get_loop_factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36; older ones set the loop up
    factory = get_loop_factory() if get_loop_factory is not None else None
    loop = factory.__module__.split(".")[0] if factory is not None else str(config.loop)
    return f"{loop}, {config.http_protocol_class.__module__.rsplit('.', 1)[-1].removesuffix('_impl')}"


def run_server(args: argparse.Namespace) -> int:
    """Serve until a signal arrives; returns the exit status."""
    from twophase.cli import engine_config_from_args
    from twophase.engine.async_engine import AsyncLLM, build_off_main_thread
    from twophase.engine.llm_engine import LLMEngine
    from twophase.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    engine = build_off_main_thread(lambda: LLMEngine(engine_config_from_args(args), progress=False))
    llm = AsyncLLM(engine)  # its step loop: the one thread of the process that runs OpenMP regions from now on
    if engine.kv_connector is not None:
        engine.kv_connector.attach(llm.call_in_loop)
    llm.start()
    app = build_app(llm, settings)
    # What start-up made (the model's modules, the tokenizer, the app) lives as long as the server: leave it out of
    # the collector's full passes, which otherwise walk it again and again as streamed chunks come and go.
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.access_log)
    server = GracefulServer(config)
    logger.info("serving %s on http://%s:%d (%s)", settings.model_name, args.host, args.port, serving_stack(config))
    try:
        server.run()
    finally:
        llm.shutdown()
        if engine.kv_connector is not None:
            engine.kv_connector.close()
        engine.close()
    return 0 if server.started else 1
