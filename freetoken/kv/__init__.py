"""KV page bookkeeping, pure Python: the page pool (pool.py) and the radix prefix cache over
token ids (radix.py). No tensors here: kv_cache.py owns the storage the page ids index."""
from .pool import PagePool
from .radix import RadixCache

__all__ = ["PagePool", "RadixCache"]
