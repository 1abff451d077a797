"""Kiln's own small models, trained on the Python standard library and shipped with the package.

This module is the registry and imports nothing heavy, so any model loader can resolve zoo
names cheaply: `model_path("kiln-tiny")` is the installed Hugging Face directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class ZooModel:
    name: str
    size: str  # the `kiln zoo train --size` preset that produced it
    description: str


ZOO_MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("kiln-tiny", "tiny", "15.7M-parameter Llama, 1024-token context; default model"),
        ZooModel("kiln-tiny-draft", "draft", "1.8M-parameter Llama, draft model for kiln-tiny"),
    )
}
DEFAULT_MODEL = "kiln-tiny"
DRAFT_MODEL = "kiln-tiny-draft"


def is_zoo_name(name: str) -> bool:
    return name in ZOO_MODELS


def model_path(name: str) -> Path:
    """Installed directory of zoo model `name` (config.json, safetensors, tokenizer files)."""
    if name not in ZOO_MODELS:
        raise KeyError(f"unknown zoo model {name!r}; valid: {', '.join(sorted(ZOO_MODELS))}")
    path = _MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"zoo model {name!r} is registered but not installed at {path}")
    return path


def resolve_model(model: str) -> str:
    """A zoo name becomes its directory; any other path or hub id passes through unchanged."""
    return str(model_path(model)) if model in ZOO_MODELS else model


__all__ = [
    "DEFAULT_MODEL",
    "DRAFT_MODEL",
    "ZOO_MODELS",
    "ZooModel",
    "is_zoo_name",
    "model_path",
    "resolve_model",
]
