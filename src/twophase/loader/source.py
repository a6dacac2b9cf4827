"""``open_model_source``: turn a store name, an HF directory or a GGUF path into a ModelSource."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from twophase.config import ModelConfig
from twophase.loader import gguf_reader, safetensors_reader, store
from twophase.loader.errors import ModelLoadError, ModelNotFoundError

PROGRESS_ENV = "TWOPHASE_PROGRESS"  # "0" turns the loading bar off, "1" forces it on


@dataclass
class ModelSource:
    """A model on disk: its normalised config and a reader of its weights under HF names."""

    path: Path  # the HF directory or the .gguf file
    config: ModelConfig
    format: Literal["safetensors", "gguf"]
    shards: list[Path] = field(default_factory=list, repr=False)
    reader: gguf_reader.GGUFFile | None = field(default=None, repr=False, compare=False)

    @property
    def directory(self) -> Path:
        """The directory holding the model files (tokenizer files live here for HF models)."""
        return self.path if self.path.is_dir() else self.path.parent

    def metadata(self, key: str, default: Any = None) -> Any:
        """A GGUF metadata value (e.g. ``tokenizer.ggml.tokens``); ``default`` for safetensors models."""
        return default if self.reader is None else gguf_reader.gguf_field(self.reader, key, default)

    def num_tensors(self) -> int:
        """How many tensors ``iter_weights`` yields (for progress display)."""
        if self.reader is not None:
            return len(self.reader.tensors)
        return sum(safetensors_reader.check_shard(shard) for shard in self.shards)

    def iter_weights(self, progress: bool | None = None, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` in HF orientation ``[out_features, in_features]``.

        Safetensors tensors keep their stored dtype; GGUF tensors are dequantized to float32.
        ``progress``: show a tqdm bar (None: ``$TWOPHASE_PROGRESS``, else only on a terminal).
        ``skip``: HF names not to read (a GGUF tensor the runner executes from its stored blocks is never dequantized).
        """
        bar = tqdm(total=self.num_tensors(), desc=f"loading {self.path.name}", unit="tensor",
                   disable=_progress_disabled(progress), leave=False)
        with bar:
            if self.reader is not None:  # skipped before reading: never dequantised
                tensors = [t for t in self.reader.tensors if gguf_reader.hf_name(t.name) not in skip]
                bar.update(len(self.reader.tensors) - len(tensors))
                weights = gguf_reader.iter_gguf(self.reader, self.config, tensors)
            else:
                weights = safetensors_reader.iter_safetensors(self.shards, skip)
            for name, tensor in weights:
                yield name, tensor
                bar.update(1)


    def stores_native_blocks(self) -> bool:
        """Whether any 2-D weight is stored in a GGUF block format the kernels execute as stored (q8_0, q4_1)."""
        return self.reader is not None and any(
            t.tensor_type.name in gguf_reader.NATIVE_FORMATS and len(t.shape) == 2 for t in self.reader.tensors)

    def native_quantized_weights(self) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
        """HF name → (format, tensors) of each weight stored in a GGUF block format the kernels execute as stored
        (q8_0, q4_1); empty for safetensors models."""
        if self.reader is None:
            return {}
        return {name: (fmt, packed) for name, fmt, packed in gguf_reader.iter_gguf_native(self.reader, self.config)}


def _progress_disabled(progress: bool | None) -> bool | None:
    if progress is not None:
        return not progress
    env = os.environ.get(PROGRESS_ENV)
    if env is not None:
        return env.strip().lower() in ("0", "false", "no", "off", "")
    return None  # tqdm: disabled when not writing to a terminal


def open_model_source(model: str | os.PathLike[str]) -> ModelSource:
    """Open a store name, an HF directory (config.json + safetensors) or a GGUF file.

    Raises ModelNotFoundError (with how to get it) when nothing is there, ModelLoadError for corrupt
    or incomplete files, and ConfigError for an architecture twophase cannot run.
    """
    path = Path(model).expanduser()
    if path.exists():
        return _open_path(path)
    name = str(model)
    if name in store.REGISTRY:
        found = store.resolve(name)
        if found is None:
            raise ModelNotFoundError(f"model {name!r} is not downloaded; run `twophase pull {name}`")
        return _open_path(found)
    raise ModelNotFoundError(
        f"no model {name!r}: not a file or directory, and not a known model name "
        f"({', '.join(store.known_models())}); pass a GGUF file, an HF directory, or run `twophase pull <name>`"
    )


def _open_path(path: Path) -> ModelSource:
    if path.is_dir():
        if (path / "config.json").is_file():
            return _open_hf_dir(path)
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0])
        raise ModelLoadError(f"{path} holds neither config.json nor exactly one .gguf file")
    return _open_gguf(path)


def _open_hf_dir(path: Path) -> ModelSource:
    config = safetensors_reader.read_hf_config(path)
    shards = safetensors_reader.list_shards(path)
    return ModelSource(path=path, config=config, format="safetensors", shards=shards)


def _open_gguf(path: Path) -> ModelSource:
    reader = gguf_reader.open_gguf(path)
    return ModelSource(path=path, config=gguf_reader.gguf_config(reader), format="gguf", reader=reader)
