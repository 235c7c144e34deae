"""Offload mode's row identity under vLLM's prefix cache (unit level; the real engines:
``tests/e2e/test_dsa_prefix_cache.py``).

A prefix-cache hit hands a new request blocks another request wrote. Hot-buffer copies of
those blocks' pool rows stay right exactly as long as the blocks were not written again: a
batch row that held request A and now holds B, a hit on A's blocks whose first step is one
token (a decode-length query), keeps its serial (and A's hot copies); once one of the blocks
was evicted and written with other tokens (its first row written again: a new version), B
gets a fresh serial, so the residency row resets and nothing stale is served.
"""

from __future__ import annotations

import pytest
import torch

from kvo_vllm.dsa.offload_identity import RowIdentity

BS = 4


def _identity(native: bool) -> RowIdentity:
    """The NumPy reference or kvo-kernels' C++ ``row_serials`` (the decode path's)."""
    return RowIdentity(max_rows=2, num_blocks=8, block_size=BS, max_blocks_per_row=4,
                       native=native)


def _slots(blocks: list[int], positions: range) -> torch.Tensor:
    return torch.tensor([blocks[p // BS] * BS + p % BS for p in positions])


def _run_a_then_b(identity: RowIdentity, *, rewrite_shared: bool) -> tuple[int, int]:
    """A (blocks 3, 5: a 2-block prefix of 8 tokens and one decoded token in block 2) decodes
    in row 0; B is a hit on blocks 3, 5 with one token of its own (in block 6)."""
    a_blocks = [3, 5, 2]
    identity.note_writes(_slots(a_blocks, range(0, 8)))           # A's prefill
    identity.serials(torch.tensor([[*a_blocks, 0]]), torch.tensor([8]), torch.tensor([8]))
    identity.note_writes(_slots(a_blocks, range(8, 9)))           # A's first decode token
    a = int(identity.serials(torch.tensor([[*a_blocks, 0]]), torch.tensor([9]),
                             torch.tensor([1]))[0])
    if rewrite_shared:   # block 5 evicted and written with another prompt's tokens
        identity.note_writes(_slots([5], range(0, BS)))
    b_blocks = [3, 5, 6]
    identity.note_writes(_slots(b_blocks, range(8, 9)))           # B's one uncached token
    b = int(identity.serials(torch.tensor([[*b_blocks, 0]]), torch.tensor([9]),
                             torch.tensor([1]))[0])
    return a, b


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_a_hit_on_unchanged_blocks_keeps_the_rows_serial(native: bool) -> None:
    a, b = _run_a_then_b(_identity(native), rewrite_shared=False)
    assert b == a


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_a_hit_whose_block_was_reused_meanwhile_gets_a_fresh_serial(native: bool) -> None:
    a, b = _run_a_then_b(_identity(native), rewrite_shared=True)
    assert b != a
