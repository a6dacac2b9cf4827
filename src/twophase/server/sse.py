"""Server-sent events framing as OpenAI streams it: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One ``data:`` event carrying a JSON object (None fields of models left out)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=True)
    else:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n"
