"""Model weights: safetensors and GGUF readers yielding HF-named tensors, and the model store."""

from twophase.loader.errors import ModelLoadError, ModelNotFoundError
from twophase.loader.source import ModelSource, open_model_source
from twophase.loader.store import DEFAULT_MODEL, REGISTRY, known_models, pull, resolve, store_home

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelSource",
    "known_models",
    "open_model_source",
    "pull",
    "resolve",
    "store_home",
]
