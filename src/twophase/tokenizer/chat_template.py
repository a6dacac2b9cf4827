"""Chat templates: validated messages rendered by a sandboxed jinja2, the way HF transformers does.

The environment matches transformers' (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson``) so templates render byte-identically,
but any access to an unsafe attribute (``''.__class__`` and friends) is an error rather than a silent
empty string.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from twophase.sampling_params import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool", "developer")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that raises on unsafe attribute access instead of returning Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; syntax errors raise InvalidRequestError('chat_template')."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise InvalidRequestError(f"invalid chat template: {exc.message} (line {exc.lineno})", "chat_template") from exc


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies with text-part lists joined into one string.

    Each message is a dict with ``role`` in ROLES and ``content`` a string, a list of
    ``{"type": "text", "text": ...}`` parts, or None (assistant messages carrying tool calls).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    return [_validate_message(i, message) for i, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):
        content = _join_text_parts(content, f"{where}.content")
    elif content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {**message, "content": content}


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}] must be {{'type': 'text', 'text': <string>}}", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(template: jinja2.Template, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                special_tokens: dict[str, str | None], **extra: Any) -> str:
    """Render already-validated messages; template failures raise InvalidRequestError."""
    context = {"tools": None, "documents": None, **special_tokens, **extra}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except SecurityError as exc:
        raise InvalidRequestError(f"chat template refused: {exc}", "chat_template") from exc
    except TemplateError as exc:  # raise_exception(...) from the template, undefined values
        raise InvalidRequestError(f"chat template rejected the messages: {exc}", "messages") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        raise InvalidRequestError(f"chat template failed on these messages: {exc}", "messages") from exc
