"""Programs that share output tiles' K steps (split-K and stream-K), for the GEMM kernels.

The output tiles' K steps are laid end to end (``iters`` = tiles x steps a tile) and cut into
one even range per program: program p takes steps [p iters / P, (p + 1) iters / P), rounded
down. With P = tiles x split each range is 1/split of one tile (split-K); with P = the SM count
(stream-K) a range may end inside one tile and go on in the next, so every SM has the same
work however the tiles divide into the SMs.

A tile whose steps one range takes whole is the program's to store. A tile several programs
share gets a float32 partial from each; the last of them to arrive (one int32 counter a tile)
adds the partials in program order, the same bits whatever the arrival order, and resets the
counter for the next launch. A program keeps at most two partials, one for the tile its range
starts in and one for the tile it ends in (tiles in between are whole), so the partials take
2 P tile-sized slots, or P where no range takes more than one tile.

The counters are one zeroed int32 buffer per device, allocated on first use (which must not be
inside a CUDA graph capture: run once eagerly). Two launches must not overlap in time on
different streams of one device (with PDL, one stream's next kernel touches the counters only
after its wait, when the kernel before it has finished).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels._triton import tl, triton

COUNTER_CAPACITY = 1 << 16  # output tiles a launch may share through the counters


@dataclass(frozen=True)
class KRanges:
    """How ``programs`` programs share ``tiles`` output tiles of ``steps`` K steps each."""

    tiles: int
    steps: int
    programs: int

    def __post_init__(self) -> None:
        if not 1 <= self.programs <= self.iters:
            raise ValueError(f"{self.programs} programs for {self.iters} K steps: each program "
                             f"needs one step at least")
        if self.iters >= 2**31:
            raise ValueError(f"{self.tiles} tiles x {self.steps} steps overflow int32")
        if self.shared and self.tiles > COUNTER_CAPACITY:
            raise ValueError(f"{self.tiles} shared output tiles: more than the "
                             f"{COUNTER_CAPACITY} arrival counters")

    @property
    def iters(self) -> int:
        return self.tiles * self.steps

    @property
    def shared(self) -> bool:
        """Some tile's steps are taken by more than one program (float32 partials)."""
        length, rest = divmod(self.iters, self.programs)
        return bool(rest or length % self.steps)

    @property
    def crossing(self) -> bool:
        """Some program's range takes more than one tile."""
        length, rest = divmod(self.iters, self.programs)
        return bool(rest or self.steps % length)

    @property
    def slots(self) -> int:
        """Tile-sized float32 partials to allocate (0 when no tile is shared)."""
        return self.programs * (2 if self.crossing else 1) if self.shared else 0


_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed counters, one a shared output tile (each kernel leaves them zero)."""
    key = (device.type, device.index)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a split-K GEMM allocates its arrival counters on first use, which cannot "
                "happen inside a CUDA graph capture: run the model once eagerly before capturing")
        _counters[key] = torch.zeros(COUNTER_CAPACITY, device=device, dtype=torch.int32)
    return _counters[key]


@triton.jit
def range_start(program, programs, iters):
    """First step of a program's range (of all tiles' steps laid end to end)."""
    return (tl.cast(program, tl.int64) * iters // programs).to(tl.int32)


@triton.jit
def tile_steps(tile, begin, end, steps):
    """The steps [step_begin, step_end) of ``tile`` that the range [begin, end) takes."""
    tile_begin = tile * steps
    return (tl.maximum(begin, tile_begin) - tile_begin,
            tl.minimum(end, tile_begin + steps) - tile_begin)


@triton.jit
def _slot(program, tile, programs, iters, steps):
    """A program's partial of the tile its range starts in at ``program``, of the one it ends
    in at ``programs + program``."""
    first_tile = range_start(program, programs, iters) // steps
    return program + programs * (tile != first_tile).to(tl.int32)


@triton.jit
def share_partial(acc, tile, program, programs, iters, steps, part_ptr, count_ptr,
                  ROWS: tl.constexpr, COLS: tl.constexpr):
    """Stores ``acc`` [ROWS, COLS] float32 as this program's partial of ``tile`` and counts the
    arrival. Returns the sum of the tile's partials in program order and True for the last of
    its programs to arrive (which then owns the output), ``acc`` and False for the others."""
    local = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    slot = _slot(program, tile, programs, iters, steps)
    tl.store(part_ptr + slot.to(tl.int64) * (ROWS * COLS) + local, acc)
    tl.debug_barrier()  # every thread's partial stored before the arrival is counted
    # the programs whose ranges meet the tile: the owners of its first and last steps
    first = ((tile * steps + 1).to(tl.int64) * programs - 1) // iters
    last = (((tile + 1) * steps).to(tl.int64) * programs - 1) // iters
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    is_last = arrived == last - first
    total = acc
    if is_last:
        total = tl.zeros([ROWS, COLS], tl.float32)
        for q in range(first.to(tl.int32), last.to(tl.int32) + 1):
            q_slot = _slot(q, tile, programs, iters, steps)
            total += tl.load(part_ptr + q_slot.to(tl.int64) * (ROWS * COLS) + local,
                             cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(count_ptr + tile, 0)
    return total, is_last
