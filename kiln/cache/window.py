"""Which KV blocks sliding-window attention can still read, when every layer slides.

A query at position p of a layer with window W sees keys p - W < k <= p, but a kernel loads
whole key tiles, so it may read keys further back than that (masked, yet a NaN there would still
reach the output). The engine states the distance as one number, the *lookback*: the most keys
before a query's position that any layer's attention may load (kiln/engine/sizing.py,
window_lookback). A step whose first query sits at p0 then loads no key below p0 - lookback, nor
does any later step of the sequence (their queries start further on), so the whole blocks below
it can be given back for good (as vLLM's SlidingWindowManager does). Their block-table entries
then name the null block: a block the cache manager holds for itself, that nothing writes, zeroed
at start-up.

With a layer that attends to everything there is no lookback (None) and no block is freed.
"""

from __future__ import annotations


def num_unreachable_blocks(first_query_pos: int, lookback: int | None, block_size: int) -> int:
    """Leading blocks of a sequence that no attention from ``first_query_pos`` on loads: every
    key in them lies more than ``lookback`` keys before it (0 without a lookback)."""
    if lookback is None:
        return 0
    return max(0, first_query_pos - lookback) // block_size


def max_blocks_held(num_tokens: int, max_step_tokens: int, block_size: int,
                    lookback: int | None) -> int:
    """The most blocks one sequence of up to ``num_tokens`` tokens holds at once when a step
    computes at most ``max_step_tokens`` of them: all of its blocks without a lookback.

    A step computing [p0, p0 + n) holds the blocks from the one holding key p0 - lookback (or
    block 0) through the one holding p0 + n - 1: n + lookback keys, and up to block_size - 1
    before them in the first block.
    """
    num_all = -(-num_tokens // block_size)
    if lookback is None:
        return num_all
    return min(num_all, -(-(max_step_tokens + lookback + block_size - 1) // block_size))
