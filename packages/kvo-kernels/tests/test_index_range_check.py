"""The index bound check every op runs on its index arguments: one pass when everything is in
range, and the same refusal (naming the smallest and largest offending entries) otherwise."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels._checks import index_range
from kvo_kernels.errors import KernelArgumentError


@pytest.mark.parametrize("values", [[0, 3, 4], [-1, 0, 4], [-1, -1], [4]])
def test_entries_in_range_or_padding_pass(values: list[int]) -> None:
    index_range("slots", torch.tensor(values), 0, 5, allow_pad=True)


@pytest.mark.parametrize(("values", "allow_pad", "low", "message"), [
    ([-1, 2], False, 0, r"entries in \[-1, 2\]; allowed: \[0, 5\)$"),
    ([-2, -1, 3], True, 0, r"entries in \[-2, 3\]; allowed: \[0, 5\) or -1"),
    ([-1, 5], True, 0, r"entries in \[5, 5\]"),
    ([0, 1], False, 1, r"entries in \[0, 1\]; allowed: \[1, 5\)"),
    ([-1, 0], True, 1, r"entries in \[0, 0\]; allowed: \[1, 5\) or -1"),
])
def test_out_of_range_entries_are_refused_by_name(values: list[int], allow_pad: bool, low: int,
                                                  message: str) -> None:
    with pytest.raises(KernelArgumentError, match=r"^slots has " + message):
        index_range("slots", torch.tensor(values), low, 5, allow_pad=allow_pad)


def test_padding_below_a_positive_low_bound_is_still_padding() -> None:
    index_range("slots", torch.tensor([-1, 1, 4]), 1, 5, allow_pad=True)
    index_range("slots", torch.empty(0, dtype=torch.int64), 0, 1)
