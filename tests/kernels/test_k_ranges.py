"""The K-range schedule shared by the GEMM kernels (kiln/kernels/k_ranges.py): host-side
properties, and the device helpers' ranges and partial slots read back from a probe kernel.
(Under the interpreter programs run one after another, so a kernel's results cannot show two
programs' partials colliding in one slot; the probe checks the slots themselves.)"""

import pytest
import torch
from kernel_testing import needs_triton

from kiln.kernels import k_ranges
from kiln.kernels._triton import tl, triton
from kiln.kernels.k_ranges import KRanges


@pytest.mark.parametrize("tiles, steps, programs, shared, crossing, slots", [
    (6, 8, 6, False, False, 0),  # a tile a program
    (6, 8, 3, False, True, 0),  # two whole tiles a program
    (6, 8, 24, True, False, 24),  # split-K: a quarter of one tile a program
    (6, 8, 5, True, True, 10),  # stream-K: ranges of 9.6 steps
    (48, 32, 132, True, True, 264),  # qkv at 256 rows on an H100
])  # fmt: skip
def test_k_ranges_properties(tiles, steps, programs, shared, crossing, slots):
    r = KRanges(tiles, steps, programs)
    assert (r.iters, r.shared, r.crossing, r.slots) == (tiles * steps, shared, crossing, slots)


def test_k_ranges_rejects_impossible_splits():
    with pytest.raises(ValueError, match="one step at least"):
        KRanges(2, 4, 9)
    with pytest.raises(ValueError, match="arrival counters"):
        KRanges(k_ranges.COUNTER_CAPACITY + 1, 2, 2 * (k_ranges.COUNTER_CAPACITY + 1))
    KRanges(k_ranges.COUNTER_CAPACITY + 1, 2, k_ranges.COUNTER_CAPACITY + 1)  # none shared


@triton.jit
def _probe_kernel(out_ptr, steps, iters, MAX_TILES: tl.constexpr):
    """Per program, for each tile its range meets: [tile, step_begin, step_end, slot, owner of
    the tile's first step, owner of its last], -1 past the last."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    begin = k_ranges.range_start(program, programs, iters)
    end = k_ranges.range_start(program + 1, programs, iters)
    row = out_ptr + program * MAX_TILES * 6
    for i in range(0, (end - 1) // steps - begin // steps + 1):
        tile = begin // steps + i
        step_begin, step_end = k_ranges.tile_steps(tile, begin, end, steps)
        first = ((tile * steps + 1).to(tl.int64) * programs - 1) // iters
        last = (((tile + 1) * steps).to(tl.int64) * programs - 1) // iters
        values = [tile, step_begin, step_end, k_ranges._slot(program, tile, programs, iters,
                                                            steps), first, last]
        for j in tl.static_range(6):
            tl.store(row + i * 6 + j, values[j])


@needs_triton
@pytest.mark.parametrize("tiles, steps, programs", [
    (6, 8, 5), (6, 8, 24), (6, 8, 3), (3, 8, 7), (48, 32, 132), (224, 32, 132), (5, 3, 15),
])  # fmt: skip
def test_k_ranges_cover_every_step_once_and_partials_never_collide(tiles, steps, programs):
    r = KRanges(tiles, steps, programs)
    max_tiles = -(-r.iters // programs) // steps + 2
    out = torch.full((programs, max_tiles, 6), -1, dtype=torch.int32)
    _probe_kernel[(programs,)](out, steps, r.iters, MAX_TILES=max_tiles)
    covered = torch.zeros(tiles, steps, dtype=torch.int32)
    slots: dict[int, tuple[int, int]] = {}
    sharers: dict[int, list[int]] = {}  # shared tile -> the programs with a partial of it
    owners: dict[int, set[tuple[int, int]]] = {}  # shared tile -> (first, last) as computed
    for p in range(programs):
        for tile, step_begin, step_end, slot, first, last in out[p].tolist():
            if tile < 0:
                continue
            assert 0 <= step_begin < step_end <= steps
            covered[tile, step_begin:step_end] += 1
            if step_end - step_begin < steps:
                assert r.shared and 0 <= slot < r.slots
                assert slots.setdefault(slot, (p, tile)) == (p, tile), "two partials in a slot"
                sharers.setdefault(tile, []).append(p)
                owners.setdefault(tile, set()).add((first, last))
    assert torch.equal(covered, torch.ones(tiles, steps, dtype=torch.int32))
    assert r.shared == bool(sharers)
    for tile, programs_of_tile in sharers.items():  # the sum runs over exactly these
        ((first, last),) = owners[tile]
        assert programs_of_tile == list(range(first, last + 1))
