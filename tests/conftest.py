from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when the @triton.jit decorators run, so this must be
    # set before any kiln module is imported: without a GPU the kernels run interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import VARIANTS, build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One random checkpoint per supported Llama-family variant, built once per test session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {v: build_model(v, root / v) for v in VARIANTS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama3.1"]
