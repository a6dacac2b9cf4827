"""Client-disconnect handling shared by the server's routes and the proxy (no torch: the proxy imports it)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from starlette.requests import Request


async def until_disconnect(http_request: Request, coro: Awaitable[Any], poll_s: float = 0.1):
    """Await ``coro``; cancel it (and return None) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
