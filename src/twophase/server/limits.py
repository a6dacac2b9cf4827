"""Request body size limit (413), checked on ``Content-Length`` and on the bytes actually streamed in."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twophase.server.errors import error_response


class BodySizeLimitMiddleware:
    """Reads the body up to ``max_body_bytes`` before the app sees it; larger bodies get 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 413 for an oversized body; otherwise replay the buffered body to the app."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._reject(scope, receive, send)
            return
        body, more, disconnected = await self._read(receive)
        if disconnected:
            return
        if more:
            await self._reject(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> tuple[bytes, bool, bool]:
        """(body, exceeded limit, client gone)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", False, True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True, False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False, False

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body exceeds the limit of {self.max_body_bytes} bytes"
        response = error_response(413, message, None, "request_too_large", {"Connection": "close"})
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for http.disconnect from the real client

    return replay
