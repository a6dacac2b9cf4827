"""The HTTP side of P/D disaggregation on a ``--kv-role prefill|decode`` server.

A prefill server accepts ``kv_transfer_params: {"do_remote_decode": true}`` and answers with the handle a decode
server needs (``remote_host``, ``remote_port``, ``remote_request_id``, ...); a decode server accepts that handle.
``/v1/kv_transfer/release`` frees a lease at once (the proxy's explicit release); ``/v1/kv_transfer/state``
reports leases, loads and ``check_invariants()`` (evaluated on the engine's loop thread).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, StrictStr

from twophase.kv_transfer.spec import RemoteHandle
from twophase.request import Request
from twophase.server.errors import APIError

router = APIRouter()
PARAM = "kv_transfer_params"


def take_kv_params(body: BaseModel, app: Any) -> dict[str, Any] | None:
    """Validate and remove ``kv_transfer_params`` from a request body on a P/D server (400 on a bad value). On a
    colocated server the field is left in place, to be refused like any unsupported field."""
    extra = body.model_extra or {}
    connector = app.state.llm.engine.kv_connector
    if connector is None or extra.get(PARAM) is None:
        return None
    params = extra.pop(PARAM)
    if not isinstance(params, dict):
        raise APIError(400, f"{PARAM} must be an object", PARAM, "invalid_value")
    if connector.role == "prefill" and params.get("do_remote_decode") is not True:
        raise APIError(400, f'a prefill server expects {PARAM} {{"do_remote_decode": true}}', PARAM, "invalid_value")
    if connector.role == "prefill" and getattr(body, "stream", False):
        raise APIError(400, "a prefill leg is not streamed (its answer carries the KV handle)", "stream",
                       "invalid_value")
    if connector.role == "decode":
        try:
            RemoteHandle.from_params(params)
        except ValueError as exc:
            raise APIError(400, str(exc), PARAM, "invalid_value") from exc
    return params


def request_setup(params: dict[str, Any] | None, num_choices: int) -> Callable[[Request], None] | None:
    """What to set on the engine request of a P/D leg (None for a plain request). One prompt and n=1 only."""
    if params is None:
        return None
    if num_choices != 1:
        raise APIError(400, f"{PARAM} needs exactly one prompt and n=1", PARAM, "invalid_value")
    handle = RemoteHandle.from_params(params) if "remote_request_id" in params else None

    def setup(request: Request) -> None:
        request.kv_transfer_params = params
        request.remote_handle = handle
        if handle is not None:
            request.timeline.remote_prefill_time = handle.remote_prefill_s

    return setup


def response_params(app: Any, request_id: str, num_prompt_tokens: int) -> dict[str, Any] | None:
    """The handle a prefill response carries (None on a decode server)."""
    connector = app.state.llm.engine.kv_connector
    if connector is None or connector.role != "prefill":
        return None
    return connector.handle_for(request_id, num_prompt_tokens)


class ReleaseRequest(BaseModel):
    """Body of ``POST /v1/kv_transfer/release``."""

    request_id: StrictStr


async def _in_loop(raw: HTTPRequest, fn: Callable[[], Any]) -> Any:
    connector = raw.app.state.llm.engine.kv_connector
    if connector is None:
        raise APIError(404, "this server has no KV transfer role (start it with --kv-role)", None, "not_found")
    return await asyncio.wait_for(asyncio.wrap_future(connector.call(fn)), timeout=60)


@router.post("/v1/kv_transfer/release")
async def release(body: ReleaseRequest, raw: HTTPRequest) -> JSONResponse:
    """Free a lease now (idempotent)."""
    connector = raw.app.state.llm.engine.kv_connector
    released = await _in_loop(raw, lambda: connector.scheduler_side.release(body.request_id))
    return JSONResponse({"released": released})


@router.get("/v1/kv_transfer/state")
async def state(raw: HTTPRequest) -> JSONResponse:
    """Leases, loads, block usage and the engine's invariants (for tests and operators)."""
    engine = raw.app.state.llm.engine
    return JSONResponse(await _in_loop(raw, lambda: _snapshot(engine)))


def _snapshot(engine: Any) -> dict[str, Any]:
    side = engine.kv_connector.scheduler_side
    try:
        engine.scheduler.check_invariants()
        error = None
    except AssertionError as exc:
        error = str(exc) or "assertion failed"
    c = side.counters
    return {"role": engine.kv_connector.role, "num_leases": len(side.leases), "num_loading": side.num_loading,
            "num_running": len(engine.scheduler.running), "num_waiting": len(engine.scheduler.waiting),
            "num_requests": len(engine.scheduler.requests),
            "num_blocks_in_use": engine.scheduler.block_manager.num_blocks_in_use,
            "invariants_ok": error is None, "invariants_error": error,
            "num_transfers": c.num_transfers, "num_bytes": c.num_bytes, "failures": dict(c.failures),
            "transport": engine.kv_connector.config.transport, "transfers_by_transport": dict(c.by_transport),
            "peers": {f"{host}:{port}": via for (host, port), via in list(engine.kv_connector.peers.items())},
            "num_prefix_hits": c.num_prefix_hits, "num_expired_leases": c.num_expired_leases}
