"""Shared fixtures: tiny random models written once per session, the default model when present."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from prerequisites import missing  # noqa: E402
from tiny_models import default_model_path, write_tiny_gguf, write_tiny_llama  # noqa: E402

os.environ.setdefault("TWOPHASE_PROGRESS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with tied head (HF safetensors + tokenizer)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (q/k/v biases)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-qwen2"), qwen2_bias=True, initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with an untied LM head."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-untied"), tie=False, initializer_range=0.3, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama written as an f32 GGUF."""
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf", dtype="f32")


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real SmolLM2-135M-Instruct GGUF (skips when it has not been pulled; fails under CI)."""
    path = default_model_path()
    if path is None:
        missing("default model not present: run `twophase pull smollm2-135m-instruct`")
    return path


@pytest.fixture(scope="session")
def default_server(default_model):
    """One `twophase serve` of the default model (max-model-len 512) shared by the modules that query it."""
    from server_harness import ServerProcess

    proc = ServerProcess(default_model, "--max-model-len", "512")
    yield proc
    assert proc.stop() == 0, proc.logs()
