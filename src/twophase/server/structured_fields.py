"""The request fields that ask for structured output, turned into one ``StructuredOutputSpec``.

OpenAI's ``response_format`` (``text`` / ``json_object`` / ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one constraint per request; malformed values
are a 400 naming the field. Whether a schema / regex / grammar compiles is checked at admission.
"""

from __future__ import annotations

from typing import Any

from twophase.sampling_params import InvalidRequestError
from twophase.structured import StructuredOutputSpec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_spec(body: Any) -> StructuredOutputSpec | None:
    """The one structured-output constraint a completions or chat request asks for (None: free text)."""
    specs = [spec for spec in (_response_format(body.response_format), _structured_outputs(body.structured_outputs),
                               *(_guided(name, getattr(body, name)) for name in GUIDED_FIELDS)) if spec is not None]
    if len(specs) > 1:
        names = ", ".join(spec.param for spec in specs)
        raise InvalidRequestError(f"only one structured output constraint per request; got {names}", specs[1].param)
    return specs[0] if specs else None


def _response_format(value: dict[str, Any] | None) -> StructuredOutputSpec | None:
    param = "response_format"
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object", param=param)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise InvalidRequestError("response_format.json_schema.schema is required for type json_schema", param)
        return StructuredOutputSpec.json_schema(inner["schema"], param)
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema; got {kind!r}", param)


def _structured_outputs(value: dict[str, Any] | None) -> StructuredOutputSpec | None:
    param = "structured_outputs"
    if value is None:
        return None
    unknown = sorted(k for k, v in value.items() if k not in STRUCTURED_OUTPUTS_KEYS and v not in (None, False))
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported by this server", param)
    given = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}",
                                  param)
    return _constraint(given[0], value[given[0]], param)


def _guided(name: str, value: Any) -> StructuredOutputSpec | None:
    return None if value is None else _constraint(name.removeprefix("guided_"), value, name)


def _constraint(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec.json_schema(value, param)
    if kind == "json_object":
        return StructuredOutputSpec("json_object", param=param)
    if kind == "choice":
        return StructuredOutputSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}: the {kind} must be a non-empty string", param)
    return StructuredOutputSpec(kind, value, param=param)
