"""Names of KV blocks in the store.

A full block whose tokens are known is stored under its vLLM block hash (which chains over the
whole prefix), so any request with the same prefix finds it: that is what makes a prefix-cache
hit load through the store. A block that is not full yet, or whose hash is not known when it is
written (async scheduling), is stored under the request id and block position instead; those
keys are private to the request and removed when it finishes.

The scheduler names blocks without knowing which worker will move them (``block_name``); each
worker turns a name into its keys by adding its tensor-parallel rank, the layer index and the
cache part (``kv`` for the main KV, ``idx`` for a DSA layer's indexer keys). An MLA model's KV
is the same on every TP rank: there every rank uses rank 0's keys, and only rank 0 saves
(``connector.kv_replicated_across_tp``). Every
key starts with a namespace derived from what makes KV bytes interchangeable (model, dtype,
block geometry, parallel layout), so engines with different models or layouts can share one
store without ever reading each other's blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import attrs

from kvo_core.buffer_regions import MAIN_PART

PREFIX = "kvo-lw"


def namespace_for(parts: Sequence[object]) -> str:
    """A short stable digest of everything that must match for two caches to be exchangeable."""
    text = "|".join(repr(part) for part in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hashed_block_name(block_hash: bytes) -> str:
    """Content-addressed name of one full block."""
    return f"h/{bytes(block_hash).hex()}"


REQUEST_BLOCK_MARK = "q/"
"""What ``request_block_name``s start with."""


def request_block_name(engine_id: str, request_id: str, block_position: int) -> str:
    """Name of a request's own block (partial, or hashed too late to be shared)."""
    return f"{REQUEST_BLOCK_MARK}{engine_id}/{request_id}/{block_position}"


@attrs.frozen
class StoreKeys:
    """Turns block names into store keys for one tensor-parallel rank."""

    namespace: str
    rank: int = 0

    def key(self, block_name: str, layer: int, part: str = MAIN_PART) -> str:
        """One cache part (``kv``, ``idx``) of one layer of one block, on this rank."""
        return self.block_prefix(block_name) + layer_suffix(layer, part)

    def block_prefix(self, block_name: str) -> str:
        """What every key of the block starts with: a key is this + ``layer_suffix`` (the
        per-layer save path builds its keys from both, without a call per key)."""
        return f"{self.rank_prefix}{block_name}/"

    @property
    def rank_prefix(self) -> str:
        """What every key of this rank starts with."""
        return f"{PREFIX}/{self.namespace}/r{self.rank}/"

    def block_prefixes(self, block_names: Iterable[str]) -> list[str]:
        """``block_prefix`` of each name (a step's saves: one format, not a call, per block)."""
        head = self.rank_prefix
        return [f"{head}{name}/" for name in block_names]

    def for_rank(self, rank: int) -> StoreKeys:
        return attrs.evolve(self, rank=rank)


def layer_suffix(layer: int, part: str = MAIN_PART) -> str:
    """The end of every key of one cache part of one layer (see ``StoreKeys.block_prefix``)."""
    return f"L{layer}/{part}"
