"""Paged KV cache: physical tensors (KVCache), blocks (BlockPool), block tables (KVCacheManager),
what sliding windows let go (window).

Imports only torch and the standard library, so the engine can drive it and tests can run it
without a model.
"""

from kiln.cache.block_pool import Block, BlockPool, hash_block_tokens
from kiln.cache.kv_cache import KVCache
from kiln.cache.kv_cache_manager import CacheStats, KVCacheManager
from kiln.cache.window import max_blocks_held, num_unreachable_blocks

__all__ = ["Block", "BlockPool", "CacheStats", "KVCache", "KVCacheManager", "hash_block_tokens",
           "max_blocks_held", "num_unreachable_blocks"]
