"""Store keys built from vLLM block hashes.

A key names one block's KV for one layout: the model tag and a fingerprint of
the per-rank KV layout (dtype, block size, bytes per layer, TP size) keep
instances with incompatible caches from ever reading each other's bytes. Block
hashes are equal across processes and instances (sha256 with a fixed seed, or
PYTHONHASHSEED), so instances with the same settings share objects.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def layout_fingerprint(*parts: object) -> str:
    """Short stable digest of everything that determines the stored bytes."""
    text = "|".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hash_hex(block_hash: bytes | int | str) -> str:
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    if isinstance(block_hash, int):
        return f"{block_hash:x}"
    return str(block_hash)


def block_key(model_tag: str, fingerprint: str, group: int, block_hash: bytes | int | str) -> str:
    """Key of one block's object (all layers of one rank's shard)."""
    return f"{model_tag}:{fingerprint}:g{group}:{hash_hex(block_hash)}"


def block_keys(
    model_tag: str, fingerprint: str, group: int, hashes: Iterable[bytes | int | str]
) -> list[str]:
    return [block_key(model_tag, fingerprint, group, h) for h in hashes]
