"""identity_decode_lane: row_serials then identity_decode_step in one call, for the steady
state of short requests only (rules in ``csrc/row_identity.h``). The two-call path is the
oracle: on random steps, steady or disturbed one way at a time, the lane either does exactly
what the two calls do (same state, same answer) or declines with nothing changed, and it
declines only where the two calls would not both go through with every serial kept.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.host_identity import (
    RowSerialsState,
    identity_decode_lane_host,
    identity_decode_step_host,
    row_serials_host,
)

BLOCK, CAPACITY, WIDTH, MAX_ROWS, MAX_BLOCKS, NUM_BLOCKS, K = 4, 12, 3, 4, 4, 16, 5
DISTURBANCES = ("none", "block", "version", "filled", "held", "too_long", "pick",
                "two_tokens", "outside", "first_token")


def _fresh_state() -> RowSerialsState:
    return RowSerialsState(
        versions=torch.randint(0, 3, (NUM_BLOCKS,), dtype=torch.int64),
        recorded_blocks=torch.full((MAX_ROWS, MAX_BLOCKS), -1, dtype=torch.int64),
        recorded_versions=torch.full((MAX_ROWS, MAX_BLOCKS), -1, dtype=torch.int64),
        covered=torch.zeros(MAX_ROWS, dtype=torch.int64),
        serials=torch.full((MAX_ROWS,), -1, dtype=torch.int64),
        next_serial=torch.zeros(1, dtype=torch.int64))


def _step(rng: random.Random, disturbance: str, index_dtype: torch.dtype) -> dict[str, Any]:
    """A batch after one recorded call (prompts of lens - 1 tokens, held and filled as the
    identity path leaves them), now decoding one token each, then disturbed."""
    rows = rng.randint(1, MAX_ROWS)
    state = _fresh_state()
    lens = [rng.randint(2, CAPACITY) for _ in range(rows)]
    table = torch.tensor([rng.sample(range(NUM_BLOCKS), MAX_BLOCKS) for _ in range(rows)])
    prompts = torch.tensor([n - 1 for n in lens])
    row_serials_host(state, table, prompts, prompts, rows=rows, block_size=BLOCK)
    held = torch.full((MAX_ROWS,), -1, dtype=torch.int64)
    held[:rows] = state.serials[:rows]
    filled = torch.zeros(MAX_ROWS, dtype=torch.int64)
    filled[:rows] = prompts
    topk = torch.tensor([[rng.randrange(-1, n) for _ in range(K)] for n in lens])
    starts = list(range(rows + 1))
    r = rng.randrange(rows)
    if disturbance == "block":          # a stable-prefix block handed to another owner
        table[r, 0] = (int(table[r, 0]) + 1) % NUM_BLOCKS
    elif disturbance == "version":      # the block rewritten since the last call
        state.versions[int(table[r, 0])] += 1
    elif disturbance == "filled":
        filled[r] -= 1
    elif disturbance == "held":
        held[r] = 99
    elif disturbance == "too_long":     # outgrew its hot row
        lens[r] = CAPACITY + 1
    elif disturbance == "pick":         # a top-k entry past the row's tokens (refused)
        topk[r, 0] = lens[r]
    elif disturbance == "two_tokens":   # a row with two query tokens
        starts = [s + (s > r) for s in starts]
    elif disturbance == "outside":      # a covered block id outside the pool (refused)
        table[r, (lens[r] - 1) // BLOCK] = NUM_BLOCKS + 3
    elif disturbance == "first_token":  # a one-token prompt: no stable prefix
        lens[r] = 1
    return {
        "pool": torch.randn(NUM_BLOCKS * BLOCK, WIDTH),
        "hot": torch.randn(MAX_ROWS * CAPACITY, WIDTH),
        "query_start_loc": torch.tensor(starts, dtype=index_dtype),
        "seq_lens": torch.tensor(lens, dtype=index_dtype),
        "block_table": table.to(index_dtype),
        "state": state, "held": held, "filled": filled,
        "topk": topk.to(index_dtype),
        "hot_slots": torch.full((rows, K), 99, dtype=torch.int64),
        "valid": torch.zeros(rows, K, dtype=torch.bool),
        "rows": rows,
    }


def _tensors(step: dict[str, Any]) -> dict[str, torch.Tensor]:
    state = step["state"]
    found = {name: value for name, value in step.items() if isinstance(value, torch.Tensor)}
    found.update({f"state.{name}": getattr(state, name) for name in
                  ("versions", "recorded_blocks", "recorded_versions", "covered", "serials",
                   "next_serial")})
    return found


def _copy(step: dict[str, Any]) -> dict[str, Any]:
    state = step["state"]
    copied = {name: value.clone() if isinstance(value, torch.Tensor) else value
              for name, value in step.items()}
    copied["state"] = RowSerialsState(**{name: getattr(state, name).clone() for name in
                                         ("versions", "recorded_blocks", "recorded_versions",
                                          "covered", "serials", "next_serial")})
    return copied


def _lane(step: dict[str, Any]) -> tuple[int, int] | None:
    return identity_decode_lane_host(
        step["pool"], step["hot"], step["query_start_loc"], step["seq_lens"],
        step["block_table"], step["state"], step["held"], step["filled"], step["topk"],
        step["hot_slots"], step["valid"], rows=step["rows"], block_size=BLOCK,
        capacity=CAPACITY)


def _two_calls(step: dict[str, Any]) -> tuple[int, int] | str | None:
    """The oracle; "not steady" when the first call renewed a serial or a row has several
    query tokens, "refused" when an op refuses."""
    rows, state = step["rows"], step["state"]
    starts = step["query_start_loc"].to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    before = state.serials[:rows].clone()
    try:
        row_serials_host(state, step["block_table"], step["seq_lens"], query_lens, rows=rows,
                         block_size=BLOCK)
        if not torch.equal(state.serials[:rows], before) or bool((query_lens != 1).any()):
            return "not steady"
        return identity_decode_step_host(
            step["pool"], step["hot"], step["block_table"], step["seq_lens"],
            state.serials[:rows].clone(), step["held"], step["filled"], step["topk"],
            step["hot_slots"], step["valid"], rows=rows, block_size=BLOCK, capacity=CAPACITY)
    except KernelArgumentError:
        return "refused"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("disturbance", DISTURBANCES)
def test_the_lane_is_the_two_calls_or_declines_with_nothing_changed(
        disturbance: str, index_dtype: torch.dtype) -> None:
    rng = random.Random(f"{disturbance}-{index_dtype}")
    taken = 0
    for _ in range(40):
        step = _step(rng, disturbance, index_dtype)
        oracle = _copy(step)
        before = {name: t.clone() for name, t in _tensors(step).items()}
        answer = _lane(step)
        expected = _two_calls(oracle)
        if answer is None:
            assert not isinstance(expected, tuple), "declined a steady step"
            for name, tensor in _tensors(step).items():
                assert torch.equal(tensor, before[name]), f"declined but changed {name}"
            continue
        taken += 1
        assert answer == expected
        for name, tensor in _tensors(step).items():
            assert torch.equal(tensor, _tensors(oracle)[name]), name
    if disturbance == "none":
        assert taken == 40
    else:
        assert taken == 0, f"took {taken} steps disturbed by {disturbance}"


def test_a_malformed_argument_raises_and_changes_nothing() -> None:
    step = _step(random.Random(1), "none", torch.int64)
    step["hot_slots"] = step["hot_slots"].to(torch.int32)
    before = {name: t.clone() for name, t in _tensors(step).items()}
    with pytest.raises(KernelArgumentError, match="hot_slots must be a contiguous int64"):
        _lane(step)
    for name, tensor in _tensors(step).items():
        assert torch.equal(tensor, before[name]), name
