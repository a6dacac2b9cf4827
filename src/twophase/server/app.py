"""The FastAPI application: ``build_app(async_llm, settings)``."""

from __future__ import annotations

import time

from fastapi import FastAPI, Query
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response

from twophase.engine.async_engine import AsyncLLM
from twophase.metrics.goodput import GoodputStatLogger
from twophase.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger
from twophase.metrics.records import RecordRing
from twophase.server.auth import APIKeyMiddleware
from twophase.server.dashboard import DASHBOARD_HTML
from twophase.server.errors import error_response, install_error_handlers
from twophase.server.kv_routes import router as kv_router
from twophase.server.limits import BodySizeLimitMiddleware
from twophase.server.protocol import DetokenizeRequest, TokenizeRequest
from twophase.server.routes import check_model, router
from twophase.server.settings import ServerSettings


def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """An app serving ``llm``; registers its Prometheus and record-ring stat loggers on it."""
    app = FastAPI(title="twophase", summary="OpenAI-compatible server with per-phase metrics")
    app.state.llm = llm
    app.state.settings = settings
    app.state.started = time.time()
    app.state.prometheus = PrometheusStatLogger(settings.model_name)
    app.state.records = RecordRing(settings.records_max_steps, settings.records_max_requests)
    llm.stat_loggers.extend([app.state.prometheus, app.state.records])
    goodput = GoodputStatLogger(settings.model_name, dict(settings.slos_ms), app.state.prometheus.registry)
    llm.stat_loggers.append(goodput)
    install_error_handlers(app)
    app.include_router(router)
    if llm.engine.kv_connector is not None:
        app.include_router(kv_router)
        app.state.prometheus.track_kv_transfers(llm.engine.kv_connector.scheduler_side.counters)
    _add_info_routes(app)
    _add_token_routes(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.cors_origins:  # outermost, so preflights are answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])
    return app


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process answers; 503 once the engine loop has died."""
        if not app.state.llm.is_running:
            return error_response(503, "engine loop is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the loop is alive and its heartbeat is recent (it beats when idle too)."""
        llm: AsyncLLM = app.state.llm
        age = time.monotonic() - llm.last_loop_time
        if not llm.is_running or age > app.state.settings.ready_stale_s:
            return error_response(503, f"engine not ready (last loop {age:.1f}s ago)", code="not_ready",
                                  headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready", "num_in_flight": llm.num_in_flight, "last_loop_age_s": age})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """The one served model."""
        settings: ServerSettings = app.state.settings
        card = {"id": settings.model_name, "object": "model", "created": int(app.state.started),
                "owned_by": "twophase", "max_model_len": app.state.llm.engine.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition (vLLM metric names)."""
        return Response(app.state.prometheus.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/records")
    async def records(since_step: int = Query(-1), since_request: int = Query(-1),
                      limit: int | None = Query(None, ge=1, le=100_000)) -> JSONResponse:
        """Recent StepRecords and finished requests' timelines and metrics (bounded ring)."""
        return JSONResponse(app.state.records.snapshot(since_step, since_request, limit))

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """A live page drawing the step mix, step duration, KV usage, TTFT and TPOT."""
        return HTMLResponse(DASHBOARD_HTML)


def _add_token_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        """Text (or chat messages through the template) → token ids."""
        check_model(body.model, app.state.settings)
        tokenizer = app.state.llm.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": app.state.llm.engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """Token ids → text (ids checked against the vocabulary)."""
        check_model(body.model, app.state.settings)
        engine = app.state.llm.engine
        ids = engine.tokenize_prompt(body.tokens) if body.tokens else []
        return JSONResponse({"prompt": engine.tokenizer.decode(ids)})
