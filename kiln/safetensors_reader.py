"""Reading safetensors checkpoints tensor by tensor, with errors that name the file.

Shared by the dense loader (kiln/models/loader.py) and the quantized one
(kiln/quant/checkpoint.py), which the dense loader calls: it sits below both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (file name, tensor name, tensor on CPU) for every tensor of every file."""
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:
            raise ValueError(f"{f.name}: not a readable safetensors file ({exc}); the file may be "
                             f"truncated or corrupt") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"{f.name}: tensor {name!r} cannot be read ({exc}); the file "
                                     f"may be truncated") from exc
                yield f.name, name, tensor
