"""Errors raised while finding, reading or downloading model weights."""

from __future__ import annotations


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a path on disk nor a downloaded store entry; the message says how to get it."""


class ModelLoadError(RuntimeError):
    """The model files exist but cannot be read (corrupt, truncated, incomplete, unsupported layout)."""
