"""API-key guard: ``Authorization: Bearer <key>`` (or ``x-api-key``) on every route but ``/health``.

``/dashboard`` is static HTML holding no data (its script sends the key, taken from the page's ``#key=`` fragment,
to the guarded ``/v1/records``), so it is open too.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from twophase.server.errors import error_response

OPEN_PATHS = frozenset({"/health", "/dashboard"})


def _presented_key(headers: Headers) -> str:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return headers.get("x-api-key", "")


class APIKeyMiddleware:
    """Pure ASGI middleware; compares keys in constant time and answers 401 in the OpenAI envelope."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass authorised requests (and CORS preflights) through; answer the rest 401."""
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        presented = _presented_key(Headers(scope=scope)).encode()
        if hmac.compare_digest(presented, self._key):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key", None, "invalid_api_key",
                                  {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
