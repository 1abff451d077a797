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
    """Yield (file name, tensor name, tensor on CPU) for every tensor of every file.

    A tensor in two files is an error: which copy would load depends on the order of the
    files, and shards that overlap are a stale shard left from another download.
    """
    found_in: dict[str, str] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:
            raise ValueError(f"{f.name}: not a readable safetensors file ({exc}); the file may be "
                             f"truncated or corrupt") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in found_in:
                    raise ValueError(f"tensor {name!r} is in both {found_in[name]} and {f.name}; "
                                     "the checkpoint's files overlap: remove the stale one or "
                                     "download the checkpoint again")
                found_in[name] = f.name
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"{f.name}: tensor {name!r} cannot be read ({exc}); the file "
                                     f"may be truncated") from exc
                yield f.name, name, tensor


def check_floating(file_name: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse an integer or bool tensor where a floating-point weight belongs: copied into the
    parameter it would be converted silently, loading numbers that mean something else (the
    codes of a format Kiln does not read)."""
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{file_name}: tensor {name!r} is {tensor.dtype}, but this weight is "
                         "floating-point; the file holds quantized or corrupt data: use the "
                         "dense checkpoint (or one `kiln quantize` wrote)")
