"""KVCache: the physical K/V tensors of all layers plus the CPU swap space.

All layers live in one tensor so that a block copy or swap is one gather + one scatter over
every layer at once, whatever the number of blocks moved.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

STAGING_BYTES = 256 * 2**20  # the two swap staging buffers together


class KVCache:
    """Paged K/V storage: k_caches[layer] and v_caches[layer] are views of one allocation.

    Each view has shape [num_blocks, block_size, num_kv_heads, head_dim]; token t of a
    sequence lives at block_table[t // block_size], offset t % block_size.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_cpu_blocks: int = 0,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        # [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=self.device)
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cpu = torch.empty(cpu_shape, dtype=dtype, device="cpu")
        # block moves copy bits: through same-width integer views, as index_copy_ has no
        # float8 kernels (an fp8 cache's copy-on-write and swaps raised NotImplementedError)
        self._kv_bits, self._kv_cpu_bits = _bits(self.kv), _bits(self.kv_cpu)
        # Swap space stays pageable: swaps go through two staging buffers of ``_chunk`` blocks
        # (pinned on CUDA: what the DMA engine touches), a chunk at a time, so that the host's
        # gather or scatter of one chunk runs while the other is in flight. They are allocated
        # here, once: pinned at first use as big as that swap, they stalled its step.
        self._pin = self.device.type == "cuda"
        per_block = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        self._chunk = min(num_cpu_blocks, max(1, staging_bytes // 2 // per_block))
        self._staging = [torch.empty(self._chunk * per_block // self.kv.element_size(),
                                     dtype=self._kv_bits.dtype, pin_memory=self._pin)
                         for _ in range(2 if num_cpu_blocks else 0)]
        # per staging buffer, the last transfer that used it (CUDA)
        self._staged = [torch.cuda.Event() if self._pin else None for _ in self._staging]
        self.k_caches = [self.kv[layer, 0] for layer in range(num_layers)]
        self.v_caches = [self.kv[layer, 1] for layer in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, K and V together."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in budget_bytes (0 if the budget is negative)."""
        per_block = KVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, int(budget_bytes) // per_block)

    def zero_block(self, block_id: int) -> None:
        """Zero one block in every layer: what freed block-table entries name (the null block,
        kiln/cache/window.py), so that even a read of it would add finite keys and values, which
        the window masks to nothing, where uninitialized memory could hold NaN. Through the
        integer view, as block moves are: all-zero bits are 0.0 in every cache dtype."""
        self._kv_bits[:, :, block_id].zero_()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block dst <- block src in every layer, for each (src, dst) pair."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.device)
        # index_select materialises all sources before index_copy_ writes, so a dst that is
        # also another pair's src still reads its old content.
        self._kv_bits.index_copy_(2, dst, self._kv_bits.index_select(2, src))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """GPU block -> CPU block for each (gpu_block, cpu_block) pair, all layers.

        Returns once the CPU blocks hold the data (a swap-in may read them next); the GPU blocks
        may be reused at once: their gathers are queued before anything that writes them."""
        if not pairs:
            return
        gpu_idx, _ = self._indices(pairs, self.device)
        _, cpu_idx = self._indices(pairs, "cpu")
        chunks = list(self._chunks(gpu_idx, cpu_idx))
        for i, (src, _) in enumerate(chunks):
            self._stage(i, len(src)).copy_(self._kv_bits.index_select(2, src),
                                           non_blocking=self._pin)
            self._mark(i)
            if i:  # scatter the chunk before while this one moves
                self._scatter_to_cpu(i - 1, chunks[i - 1][1])
        self._scatter_to_cpu(len(chunks) - 1, chunks[-1][1])

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """CPU block -> GPU block for each (cpu_block, gpu_block) pair, all layers; returns with
        the copies queued on the current stream."""
        if not pairs:
            return
        cpu_idx, _ = self._indices(pairs, "cpu")
        _, gpu_idx = self._indices(pairs, self.device)
        for i, (src, dst) in enumerate(self._chunks(cpu_idx, gpu_idx)):
            staging = torch.index_select(self._kv_cpu_bits, 2, src,
                                         out=self._stage(i, len(src)))
            self._kv_bits.index_copy_(2, dst, staging.to(self.device, non_blocking=self._pin))
            self._mark(i)  # the buffer is free again once the scatter has run

    def _chunks(self, src: torch.Tensor,
                dst: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(src), self._chunk):
            yield src[start:start + self._chunk], dst[start:start + self._chunk]

    def _stage(self, i: int, num_blocks: int) -> torch.Tensor:
        """Chunk i's staging buffer as [num_layers, 2, num_blocks, ...], once the transfer that
        used it last has finished."""
        event = self._staged[i % 2]
        if event is not None:
            event.synchronize()
        shape = list(self.kv_cpu.shape)
        shape[2] = num_blocks
        return self._staging[i % 2][:math.prod(shape)].view(shape)

    def _mark(self, i: int) -> None:
        """Chunk i's transfer is queued: its buffer is busy until the stream gets here."""
        event = self._staged[i % 2]
        if event is not None:
            event.record()

    def _scatter_to_cpu(self, i: int, dst: torch.Tensor) -> None:
        self._kv_cpu_bits.index_copy_(2, dst, self._stage(i, len(dst)))

    @staticmethod
    def _indices(
        pairs: Sequence[tuple[int, int]], device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.long, device=device)  # [num_pairs, 2]
        return idx[:, 0], idx[:, 1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element width."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
