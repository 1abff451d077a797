"""Host-to-device copies that do not wait for the GPU.

A copy from pageable host memory first synchronizes with the work queued on the stream before
it, so a step launched while the one before it still runs (async scheduling) would stall until
that step finished. A pinned source makes the copy asynchronous; torch's caching host allocator
keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued without waiting for the stream."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def take_rows(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``tensor[index]`` on its device, ``index`` (host ints, repeats allowed) uploaded as above."""
    return tensor[upload(torch.tensor(index, dtype=torch.int64), tensor.device)]
