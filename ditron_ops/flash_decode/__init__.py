"""flash_decode: split-KV decode attention over a sequence-sharded KV cache, LSE-merged."""
from .api import DETERMINISTIC_CHUNK, flash_decode

__all__ = ["flash_decode", "DETERMINISTIC_CHUNK"]
