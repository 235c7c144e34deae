"""Validation of keyed batches (KV-store put/get) before they reach a C++ client."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

from kvo_transport.errors import StoreArgumentError
from kvo_transport.regions import RegionRegistry, int_list

MAX_KEY_BYTES = 4096


@attrs.frozen
class KeyedBatch:
    """Equally long lists of keys, local addresses and lengths."""

    keys: list[str]
    addrs: list[int]
    lengths: list[int]


def check_keys(keys: Sequence[str], *, unique: bool = False) -> list[str]:
    """Keys as a list of non-empty str, each at most MAX_KEY_BYTES of UTF-8."""
    if isinstance(keys, str):
        raise StoreArgumentError(f"keys must be a sequence of str, not one str ({keys!r})")
    checked = list(keys)
    for i, key in enumerate(checked):
        if not isinstance(key, str) or not key:
            raise StoreArgumentError(f"key {i} must be a non-empty str, got {key!r}")
        if len(key.encode()) > MAX_KEY_BYTES:
            raise StoreArgumentError(
                f"key {i} is longer than {MAX_KEY_BYTES} bytes: {key[:64]!r}..."
            )
    if unique and len(set(checked)) != len(checked):
        dup = sorted(k for k, n in Counter(checked).items() if n > 1)
        raise StoreArgumentError(f"keys repeat within one batch: {dup}")
    return checked


def check_keyed_batch(
    registry: RegionRegistry,
    keys: Sequence[str],
    addrs: Sequence[int],
    lengths: Sequence[int],
    *,
    unique: bool,
) -> KeyedBatch:
    """Validate keys and ranges; every range must lie inside registered memory."""
    checked_keys = check_keys(keys, unique=unique)
    local = int_list(addrs, "addrs", StoreArgumentError)
    sizes = int_list(lengths, "lengths", StoreArgumentError)
    if not (len(checked_keys) == len(local) == len(sizes)):
        raise StoreArgumentError(
            f"batch lists differ in length: {len(checked_keys)} keys, {len(local)} addrs, "
            f"{len(sizes)} lengths"
        )
    registry.check_ranges(local, sizes, f"keys {checked_keys[:4]}")
    return KeyedBatch(checked_keys, local, sizes)
