"""A missing prerequisite (the default model, transformers, Chromium) skips a local run and fails a CI run.

CI sets the ``CI`` environment variable (any value but empty, ``0`` or ``false``); there a skip would hide a test
that never ran, so it is a failure instead.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str, module_level: bool = False) -> NoReturn:
    """Skip with ``reason``, or fail the test (or its module) under CI."""
    if in_ci():
        pytest.fail(f"missing prerequisite (required when CI is set): {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module_level)


def import_or_missing(name: str, module_level: bool = False) -> ModuleType:
    """Import a module, or treat its absence as a missing prerequisite."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} is not importable ({exc})", module_level)


def built_kernels() -> ModuleType:
    """The C++ kernels (built by the set-up), or their absence treated as a missing prerequisite."""
    from twophase.model.ops.extension import load_kernels

    kernels = load_kernels()
    if kernels is None:
        missing("the C++ kernels did not build")
    return kernels
