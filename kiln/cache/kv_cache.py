"""KVCache: the physical K/V tensors of all layers plus the CPU swap space.

All layers live in one tensor so that a block copy or swap is one gather + one scatter over
every layer at once, whatever the number of blocks moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        # [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=self.device)
        # Swap space stays pageable: transfers gather the moved blocks into a small pinned
        # staging tensor (below), which is what the DMA engine touches, so pinning gigabytes
        # of swap space would buy nothing.
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cpu = torch.empty(cpu_shape, dtype=dtype, device="cpu")
        self._pin = self.device.type == "cuda"
        # block moves copy bits: through same-width integer views, as index_copy_ has no
        # float8 kernels (an fp8 cache's copy-on-write and swaps raised NotImplementedError)
        self._kv_bits, self._kv_cpu_bits = _bits(self.kv), _bits(self.kv_cpu)
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

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block dst <- block src in every layer, for each (src, dst) pair."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.device)
        # index_select materialises all sources before index_copy_ writes, so a dst that is
        # also another pair's src still reads its old content.
        self._kv_bits.index_copy_(2, dst, self._kv_bits.index_select(2, src))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """GPU block -> CPU block for each (gpu_block, cpu_block) pair, all layers."""
        if not pairs:
            return
        gpu_idx, _ = self._indices(pairs, self.device)
        _, cpu_idx = self._indices(pairs, "cpu")
        staging = self._staging(len(pairs))
        # Blocking device->host copy: the CPU blocks must hold the data before the GPU blocks
        # they came from are reused by the next forward pass.
        staging.copy_(self._kv_bits.index_select(2, gpu_idx))
        self._kv_cpu_bits.index_copy_(2, cpu_idx, staging)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """CPU block -> GPU block for each (cpu_block, gpu_block) pair, all layers."""
        if not pairs:
            return
        cpu_idx, _ = self._indices(pairs, "cpu")
        _, gpu_idx = self._indices(pairs, self.device)
        staging = torch.index_select(self._kv_cpu_bits, 2, cpu_idx,
                                     out=self._staging(len(pairs)))
        # Async from pinned memory is safe: the scatter is queued on the same stream, and the
        # caching host allocator keeps staging alive until the copy has finished.
        self._kv_bits.index_copy_(2, gpu_idx, staging.to(self.device, non_blocking=self._pin))

    def _staging(self, num_blocks: int) -> torch.Tensor:
        shape = list(self.kv_cpu.shape)
        shape[2] = num_blocks
        return torch.empty(shape, dtype=self._kv_cpu_bits.dtype, pin_memory=self._pin)

    @staticmethod
    def _indices(
        pairs: Sequence[tuple[int, int]], device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.long, device=device)  # [num_pairs, 2]
        return idx[:, 0], idx[:, 1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element width."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
