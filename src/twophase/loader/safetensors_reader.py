"""Hugging Face checkpoint directories: ``config.json`` plus one or many ``*.safetensors`` shards."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from twophase.config import ModelConfig
from twophase.loader.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed by the model


def read_hf_config(model_dir: Path) -> ModelConfig:
    """Read and normalise ``config.json`` (ConfigError for an unsupported architecture)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; not a Hugging Face model directory")
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    return ModelConfig.from_hf_dict(hf)


def list_shards(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order, each checked to open."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read shard index {index_path}: {exc}") from exc
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    for shard in shards:
        check_shard(shard)
    return shards


def check_shard(shard: Path) -> int:
    """Open one shard's header; returns its tensor count. Missing or truncated files raise ModelLoadError."""
    if not shard.is_file():
        raise ModelLoadError(f"missing safetensors shard {shard}")
    try:
        with safe_open(str(shard), framework="pt") as handle:
            return len(list(handle.keys()))
    except Exception as exc:  # safetensors raises its own error types for bad headers and short files
        raise ModelLoadError(f"corrupt or truncated safetensors file {shard}: {exc}") from exc


def iter_safetensors(shards: list[Path], skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` in native dtype from every shard, except the names in ``skip`` (never read)."""
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith(_SKIPPED_SUFFIXES) or name in skip:
                        continue
                    yield name, handle.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"corrupt or truncated safetensors file {shard}: {exc}") from exc
