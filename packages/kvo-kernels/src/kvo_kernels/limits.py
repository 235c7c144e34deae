"""Production constants of the fused ops (upstream ABI) and the hard limits every op enforces.

Sizes (top-k, block size, head dims) are read from the tensors, so tests run small; the
constants here are the production defaults used by allocation helpers and benchmarks. The
limits are checked at every op entry.
"""

from __future__ import annotations

TOPK = 2048
"""Top-k per query row."""
BLOCK_SIZE = 128
"""Tokens per cache block (indexer cache, hot buffer, host pool)."""
INDEXER_HEAD_DIM = 128
INDEXER_HEADS = 64
LATENT_DIM = 512
"""MLA latent (no-rope) width of query, kv cache and output."""
ROPE_DIM = 64
MAX_QUERY_ROWS = 14
"""Query rows per request (1 + up to 13 speculative MTP rows)."""
MAX_CAPACITY = 32640
"""Hot-buffer slots per request: slot ids must fit in 15 bits (255 blocks of 128)."""
MISS_CAPACITY = MAX_QUERY_ROWS * TOPK
"""Default width of the per-request miss lists: every query row's top-k missing, disjoint."""
