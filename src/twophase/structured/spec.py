"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or an EBNF
grammar, optionally between a fixed prefix and suffix (tool calls). Plain data: no xgrammar, no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from twophase.sampling_params import InvalidRequestError

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One structured-output constraint; equal specs share one compiled grammar.

    ``value``: the JSON schema as canonical JSON text (``json``), the regex, the choices as a JSON list
    (``choice``), the EBNF text (``grammar``); empty for ``json_object``. ``prefix`` / ``suffix``: literal text
    the output starts / ends with around the constrained part. ``param``: the request field it came from (named in
    errors; not part of the identity).
    """

    kind: str
    value: str = ""
    prefix: str = ""
    suffix: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", self.param)
        if not isinstance(self.value, str) or (self.kind != "json_object" and not self.value):
            raise InvalidRequestError(f"{self.param}: the {self.kind} constraint must not be empty", self.param)

    @classmethod
    def json_schema(cls, schema: object, param: str, prefix: str = "", suffix: str = "") -> StructuredOutputSpec:
        """A spec from a JSON schema (a dict, or JSON text), re-serialised so equal schemas share a grammar."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON ({exc})", param) from exc
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object", param)
        return cls("json", json.dumps(schema), prefix, suffix, param)  # property order is output order

    @classmethod
    def choice(cls, choices: object, param: str) -> StructuredOutputSpec:
        """A spec for exactly one of ``choices`` (non-empty strings)."""
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(choices), param=param)
