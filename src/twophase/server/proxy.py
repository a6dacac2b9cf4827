"""``twophase proxy``: an OpenAI-compatible front for prefill/decode servers, or a router for replicas.

P/D mode: each completion first goes to a prefill server (``max_tokens=1``, not streamed,
``kv_transfer_params: {"do_remote_decode": true}``); its answer's ``kv_transfer_params`` (where the prompt's
blocks are leased) plus the prefill leg's duration go with the original request to a decode server, whose answer
(streamed or not) is passed to the client unchanged. Both legs are chosen before either is sent (503 when a role
has no healthy server: never only one leg); each server is chosen by fewest requests in flight through this proxy.
Whatever happens after the prefill leg — decode refusal, decode failure, client gone — the lease is released
explicitly (idempotent; a read already freed it). A client that disconnects cancels the leg in flight, which
closes its connection, which aborts that server's request.

Replica mode (``--replica``): each request goes whole to the least-loaded healthy replica.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twophase.server.disconnect import until_disconnect
from twophase.server.settings import CLIENT_KEEPALIVE_EXPIRY_S

logger = logging.getLogger("twophase.proxy")
COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
PASS_HEADERS = ("content-type", "cache-control", "retry-after")
FORWARD_HEADERS = ("authorization", "x-api-key")  # the client's credentials travel to both legs


@dataclass
class Backend:
    """One upstream server and what the proxy knows of it."""

    url: str
    role: str  # prefill | decode | replica
    healthy: bool = True
    num_in_flight: int = 0


class BackendPool:
    """Health-checked upstream servers by role; picks the least-loaded healthy one."""

    def __init__(self, prefill: list[str], decode: list[str], replicas: list[str]) -> None:
        if replicas and (prefill or decode):
            raise ValueError("give either --replica or --prefill/--decode, not both")
        if not replicas and not (prefill and decode):
            raise ValueError("give at least one --prefill and one --decode server (or --replica servers)")
        self.backends = [Backend(u.rstrip("/"), role) for role, urls in
                         (("prefill", prefill), ("decode", decode), ("replica", replicas)) for u in urls]

    @property
    def disaggregated(self) -> bool:
        """True in P/D mode."""
        return any(b.role == "prefill" for b in self.backends)

    def pick(self, role: str) -> Backend | None:
        """The healthy server of ``role`` with the fewest requests in flight (None when there is none)."""
        healthy = [b for b in self.backends if b.role == role and b.healthy]
        return min(healthy, key=lambda b: b.num_in_flight) if healthy else None

    async def check(self, client: httpx.AsyncClient) -> None:
        """One round of health checks (GET /health, 2 s)."""
        async def one(backend: Backend) -> None:
            try:
                backend.healthy = (await client.get(f"{backend.url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                backend.healthy = False
        await asyncio.gather(*(one(b) for b in self.backends))


def error_response(status: int, message: str, param: str | None, code: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error envelope (as ``server.errors``, without importing the engine and torch)."""
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _no_server(role: str) -> Response:
    return error_response(503, f"no healthy {role} server", None, "no_healthy_server", {"Retry-After": "1"})


def _upstream_error(backend: Backend, exc: Exception) -> Response:
    backend.healthy = False
    return error_response(502, f"{backend.role} server {backend.url} failed: {type(exc).__name__}: {exc}", None,
                          "upstream_error")


def _passthrough(resp: httpx.Response) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
    return Response(resp.content, status_code=resp.status_code, headers=headers)


class Proxy:
    """The proxy's request handling over a BackendPool and one shared HTTP client."""

    def __init__(self, pool: BackendPool, timeout_s: float) -> None:
        self.pool = pool
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20,  # httpx's default pool sizes
                              keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)  # fmt: skip
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits)

    async def handle(self, raw: Request, route: str) -> Response:
        """Serve one completion request (P/D or replica mode)."""
        try:
            body = await raw.json()
        except ValueError:
            return error_response(400, "request body is not valid JSON", None, "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", None, "invalid_value")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARD_HEADERS}
        if not self.pool.disaggregated:
            replica = self.pool.pick("replica")
            return await self._forward(raw, replica, route, body, headers) if replica else _no_server("replica")
        prefill, decode = self.pool.pick("prefill"), self.pool.pick("decode")
        if prefill is None or decode is None:
            return _no_server("prefill" if prefill is None else "decode")
        started = time.monotonic()
        leg = await until_disconnect(raw, self._prefill(prefill, route, body, headers))
        if leg is None:
            return Response(status_code=499)
        if isinstance(leg, Response):
            return leg
        handle = {**leg, "remote_prefill_s": time.monotonic() - started}
        release = lambda: asyncio.ensure_future(self._release(prefill, handle, headers))  # noqa: E731
        return await self._forward(raw, decode, route, {**body, "kv_transfer_params": handle}, headers, release)

    async def _prefill(self, backend: Backend, route: str, body: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any] | Response:
        """The prefill leg: the handle from its answer, or the error response to pass on."""
        leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens", "logprobs",
                                                          "top_logprobs", "max_completion_tokens")}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        backend.num_in_flight += 1
        try:
            resp = await self.client.post(f"{backend.url}{route}", json=leg, headers=headers)
        except httpx.HTTPError as exc:
            return _upstream_error(backend, exc)
        finally:
            backend.num_in_flight -= 1
        if resp.status_code != 200:
            return _passthrough(resp)
        handle = resp.json().get("kv_transfer_params")
        if not isinstance(handle, dict):
            return error_response(502, f"prefill server {backend.url} sent no kv_transfer_params (is it started "
                                  "with --kv-role prefill?)", None, "upstream_error")
        return handle

    async def _release(self, backend: Backend, handle: dict[str, Any], headers: dict[str, str]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(f"{backend.url}/v1/kv_transfer/release",
                                   json={"request_id": handle["remote_request_id"]}, headers=headers, timeout=5.0)

    async def _forward(self, raw: Request, backend: Backend, route: str, body: dict[str, Any],
                       headers: dict[str, str], on_done=None) -> Response:
        """Send ``body`` to ``backend`` and pass its answer (streamed or not) to the client; ``on_done`` runs
        once the upstream exchange is over, however it ended."""
        backend.num_in_flight += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                backend.num_in_flight -= 1
                if on_done is not None:
                    on_done()

        try:
            request = self.client.build_request("POST", f"{backend.url}{route}", json=body, headers=headers)
            resp = await until_disconnect(raw, self.client.send(request, stream=True))
            if resp is None:
                end()
                return Response(status_code=499)
        except httpx.HTTPError as exc:
            end()
            return _upstream_error(backend, exc)
        if resp.status_code != 200 or not body.get("stream"):
            try:
                content = await until_disconnect(raw, resp.aread())
            except httpx.HTTPError as exc:
                return _upstream_error(backend, exc)
            finally:
                await resp.aclose()
                end()
            return _passthrough(resp) if content is not None else Response(status_code=499)
        return StreamingResponse(self._relay(resp, end), status_code=200,
                                 headers={k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS})

    async def _relay(self, resp: httpx.Response, end) -> AsyncIterator[bytes]:
        """Stream an upstream SSE body through; closing it (client gone) closes the upstream connection."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("upstream stream broke: %s", exc)
            yield b'data: {"error": {"message": "upstream server failed mid-stream", "type": ' \
                  b'"internal_server_error", "param": null, "code": "upstream_error"}}\n\ndata: [DONE]\n\n'
        finally:
            end()
            with anyio.CancelScope(shield=True):  # also when the client is gone and this task is cancelled
                await resp.aclose()


def build_proxy_app(pool: BackendPool, timeout_s: float = 600.0, health_interval_s: float = 1.0) -> FastAPI:
    """The proxy's FastAPI app (health checks run while it serves)."""
    proxy = Proxy(pool, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async def loop() -> None:
            while True:
                await pool.check(proxy.client)
                await asyncio.sleep(health_interval_s)
        task = asyncio.create_task(loop())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.client.aclose()

    app = FastAPI(title="twophase proxy", lifespan=lifespan)
    app.state.pool = pool
    for route in COMPLETION_ROUTES:
        app.add_api_route(route, _route_handler(proxy, route), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        """200 when every role has a healthy server."""
        roles = {b.role for b in pool.backends}
        missing = [r for r in sorted(roles) if pool.pick(r) is None]
        return _no_server(missing[0]) if missing else JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        """The models of a decode server (or replica)."""
        backend = pool.pick("decode" if pool.disaggregated else "replica")
        if backend is None:
            return _no_server("decode" if pool.disaggregated else "replica")
        try:
            return _passthrough(await proxy.client.get(f"{backend.url}/v1/models"))
        except httpx.HTTPError as exc:
            return _upstream_error(backend, exc)

    @app.get("/v1/proxy/backends")
    async def backends() -> JSONResponse:
        """Each upstream server's role, health and requests in flight."""
        return JSONResponse([vars(b) for b in pool.backends])

    return app


def _route_handler(proxy: Proxy, route: str):
    async def handler(raw: Request) -> Response:
        return await proxy.handle(raw, route)
    return handler


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until a signal arrives."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pool = BackendPool(args.prefill, args.decode, args.replica)
    except ValueError as exc:
        raise SystemExit(f"twophase proxy: {exc}") from None
    app = build_proxy_app(pool, args.timeout, args.health_interval)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
