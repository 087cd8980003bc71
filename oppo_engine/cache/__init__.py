"""Paged KV cache: one byte arena shared by all models, and a page-table manager per model."""

from oppo_engine.cache.arena import KVArena, KVSpec
from oppo_engine.cache.manager import KVCacheManager

__all__ = ["KVArena", "KVCacheManager", "KVSpec"]
