"""What both sides of a transfer must agree on, and the error every failed transfer raises."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Any, Sequence

ROLES = ("both", "prefill", "decode")


class KVTransferError(RuntimeError):
    """A KV transfer failed; ``cause`` is a short label for metrics (timeout, lease_expired, handshake, ...)."""

    def __init__(self, message: str, cause: str = "error") -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class KVSpec:
    """The layout of one KV block; two workers exchange blocks only when their specs are equal."""

    model: str  # digest of the model's shape (architecture, sizes, vocab)
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    def to_json(self) -> dict[str, Any]:
        """Plain dict for the wire."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "KVSpec":
        """Parse the wire form (raises KVTransferError on a malformed spec)."""
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise KVTransferError(f"malformed KV spec: {exc}", "handshake") from exc

    def mismatch(self, other: "KVSpec") -> str | None:
        """A one-line description of the first difference, or None when the specs agree."""
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine!r} here, {theirs!r} on the remote worker"
        return None


def model_digest(model_config: Any) -> str:
    """A short digest of a ModelConfig's fields (two different shapes never share a digest)."""
    text = json.dumps(asdict(model_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_digest(token_ids: Sequence[int]) -> str:
    """Digest of the tokens whose KV a read asks for: a read never returns another prompt's blocks."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


@dataclass(frozen=True)
class RemoteHandle:
    """Where a decode engine reads a prompt's blocks: the prefill server's answer, passed on by the proxy."""

    host: str
    port: int
    request_id: str
    num_prompt_tokens: int
    remote_prefill_s: float | None = None  # how long the prefill leg took (set by the proxy; for timings)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "RemoteHandle":
        """Parse ``kv_transfer_params`` sent to a decode server (ValueError names the bad key)."""
        try:
            handle = cls(str(params["remote_host"]), int(params["remote_port"]), str(params["remote_request_id"]),
                         int(params["num_prompt_tokens"]),
                         float(params["remote_prefill_s"]) if params.get("remote_prefill_s") is not None else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_params: missing or bad field {exc}") from exc
        if not 0 < handle.port < 65536:
            raise ValueError("kv_transfer_params: remote_port out of range")
        return handle
