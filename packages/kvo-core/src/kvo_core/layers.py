"""Layer names to layer indices, including MTP layers placed after the base model's layers."""

from __future__ import annotations

import re

from kvo_core.errors import ConfigError

_MTP = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)(?:\.|$)")
_BASE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str, num_base_layers: int | None = None) -> int:
    """Index of the layer a module name belongs to.

    ``model.layers.12.self_attn.attn`` -> 12. ``mtp.layers.N...`` (multi-token-prediction heads)
    -> ``num_base_layers + N``, so MTP layers take part in the same buffer plan after the base
    layers; ``num_base_layers`` is required for them.
    """
    mtp = _MTP.search(name)
    if mtp is not None:
        if num_base_layers is None or num_base_layers < 0:
            raise ConfigError(
                f"layer name {name!r} is an MTP layer; num_base_layers must be given "
                f"(a non-negative integer), got {num_base_layers!r}")
        return num_base_layers + int(mtp.group(1))
    base = _BASE.search(name)
    if base is None:
        raise ConfigError(
            f"cannot find a layer index in {name!r}: expected '...layers.<N>...' "
            f"or 'mtp.layers.<N>...'")
    return int(base.group(1))
