"""Model descriptions for the planner: what KV cache each layer of a model carries.

Only the attention facts that size the KV cache matter here (layer count, MTP layers, MLA
latent/rope widths or dense KV heads, the sparse-attention indexer). They come from a Hugging
Face ``config.json`` mapping (:func:`model_from_hf_config`) or from a built-in preset
(:func:`preset`); :meth:`ModelDescription.layer_specs` turns them into the
:class:`~kvo_core.specs.LayerSpec` list that the buffer planner consumes.

Per-rank conventions under tensor parallelism (as vLLM allocates caches):

- MLA latent KV (``kv_lora_rank + qk_rope_head_dim`` per token) is replicated on every TP rank.
- The indexer key cache (one ``index_head_dim`` key per token) is replicated on every TP rank.
- Dense (GQA) KV heads are sharded: ``heads / tp`` per rank, or one head per rank, replicated,
  when ``tp`` exceeds the head count (``tp`` must then be a multiple of the head count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch

from kvo_core.errors import ConfigError
from kvo_core.layers import layer_index
from kvo_core.specs import CacheSpec, LayerSpec

DEFAULT_BLOCK_SIZE = 128
DEFAULT_TOP_K = 2048
IndexerKVDtype = Literal["bfloat16", "int8"]

_ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "attention", "full", "indexed_attention", "sparse_attention", "dsa"})


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"model {attribute.name} must be an integer >= 0, got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute[int | None],
                       value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value <= 0):
        raise ConfigError(f"model {attribute.name} must be a positive integer or absent, "
                          f"got {value!r}")


def _to_frozenset_or_none(value: Any) -> frozenset[int] | None:
    return None if value is None else frozenset(value)


@attrs.frozen
class ModelDescription:
    """The KV-cache-relevant shape of a decoder model (see the module docstring).

    ``attention`` is ``"mla"`` (latent KV of ``kv_lora_rank + rope_head_dim`` per token) or
    ``"gqa"`` (K and V of ``num_kv_heads x head_dim``). ``indexer_layers`` lists the base layers
    that keep their own indexer cache when only some do (``None``: all layers, when the model
    has an indexer). MTP layers follow the base layers and carry the same caches.
    """

    name: str
    attention: Literal["mla", "gqa"]
    num_layers: int = attrs.field(validator=_non_negative)
    num_mtp_layers: int = attrs.field(default=0, validator=_non_negative)
    kv_lora_rank: int = attrs.field(default=0, validator=_non_negative)
    rope_head_dim: int = attrs.field(default=0, validator=_non_negative)
    num_kv_heads: int = attrs.field(default=0, validator=_non_negative)
    head_dim: int = attrs.field(default=0, validator=_non_negative)
    index_head_dim: int | None = attrs.field(default=None, validator=_optional_positive)
    index_n_heads: int | None = attrs.field(default=None, validator=_optional_positive)
    index_topk: int | None = attrs.field(default=None, validator=_optional_positive)
    indexer_layers: frozenset[int] | None = attrs.field(default=None,
                                                        converter=_to_frozenset_or_none)
    block_size: int = attrs.field(default=DEFAULT_BLOCK_SIZE, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"model {self.name!r}: num_layers must be >= 1, "
                              f"got {self.num_layers}")
        if self.block_size < 1:
            raise ConfigError(f"model {self.name!r}: block_size must be >= 1, "
                              f"got {self.block_size}")
        if self.attention == "mla":
            if self.kv_lora_rank < 1:
                raise ConfigError(f"model {self.name!r}: an MLA model needs kv_lora_rank >= 1, "
                                  f"got {self.kv_lora_rank}")
        elif self.attention == "gqa":
            if self.num_kv_heads < 1 or self.head_dim < 1:
                raise ConfigError(
                    f"model {self.name!r}: a dense model needs num_kv_heads >= 1 and "
                    f"head_dim >= 1, got {self.num_kv_heads} and {self.head_dim}")
        else:
            raise ConfigError(f"model {self.name!r}: attention must be 'mla' or 'gqa', "
                              f"got {self.attention!r}")
        if self.indexer_layers is not None:
            if self.index_head_dim is None:
                raise ConfigError(f"model {self.name!r}: indexer_layers given without "
                                  f"index_head_dim")
            outside = sorted(i for i in self.indexer_layers
                             if not 0 <= i < self.num_layers)
            if outside:
                raise ConfigError(f"model {self.name!r}: indexer_layers {outside} are outside "
                                  f"the base layers 0..{self.num_layers - 1}")

    # -- facts --------------------------------------------------------------------------

    @property
    def total_layers(self) -> int:
        """Cache-bearing layers: the base layers plus the MTP layers after them."""
        return self.num_layers + self.num_mtp_layers

    @property
    def has_indexer(self) -> bool:
        """True for sparse-attention models (DeepSeek-V3.2 / GLM-5 lightning indexer)."""
        return self.index_head_dim is not None

    @property
    def default_top_k(self) -> int:
        return self.index_topk if self.index_topk is not None else DEFAULT_TOP_K

    def kv_heads_per_rank(self, tp: int) -> int:
        """Dense KV heads one TP rank holds (sharded; replicated once tp exceeds the heads)."""
        _check_tp(tp)
        if self.attention == "mla":
            return 1
        heads = self.num_kv_heads
        if tp <= heads:
            if heads % tp != 0:
                raise ConfigError(f"TP size {tp} does not divide the {heads} KV heads of "
                                  f"{self.name!r}; allowed: a divisor of {heads} or a "
                                  f"multiple of it")
            return heads // tp
        if tp % heads != 0:
            raise ConfigError(f"TP size {tp} exceeds the {heads} KV heads of {self.name!r} "
                              f"but is not a multiple of {heads}; allowed: a divisor or a "
                              f"multiple of {heads}")
        return 1

    def main_spec(self, tp: int = 1, block_size: int | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> CacheSpec:
        """One rank's main-KV cache spec of one layer."""
        block = self.block_size if block_size is None else block_size
        if self.attention == "mla":
            _check_tp(tp)
            shape: tuple[int, ...] = (1, self.kv_lora_rank + self.rope_head_dim)
        else:
            shape = (2, self.kv_heads_per_rank(tp), self.head_dim)
        return CacheSpec(block_size=block, token_shape=shape, dtype=dtype)

    def indexer_specs(self, block_size: int | None = None,
                      indexer_kv_dtype: IndexerKVDtype = "bfloat16",
                      ) -> tuple[CacheSpec | None, CacheSpec | None]:
        """The indexer key spec and (int8 "C8" only) its fp16 per-token scale spec."""
        if self.index_head_dim is None:
            return None, None
        block = self.block_size if block_size is None else block_size
        if indexer_kv_dtype == "bfloat16":
            return CacheSpec(block, (self.index_head_dim,), torch.bfloat16), None
        if indexer_kv_dtype == "int8":
            return (CacheSpec(block, (self.index_head_dim,), torch.int8),
                    CacheSpec(block, (1,), torch.float16))
        raise ConfigError(f"indexer_kv_dtype must be 'bfloat16' or 'int8', "
                          f"got {indexer_kv_dtype!r}")

    def layer_has_indexer(self, index: int) -> bool:
        if not self.has_indexer:
            return False
        if index >= self.num_layers or self.indexer_layers is None:
            return True
        return index in self.indexer_layers

    def layer_specs(self, *, tp: int = 1, block_size: int | None = None,
                    kv_dtype: torch.dtype = torch.bfloat16,
                    indexer_kv_dtype: IndexerKVDtype = "bfloat16",
                    include_mtp: bool = True) -> list[LayerSpec]:
        """One TP rank's cache specs for every cache-bearing layer, ascending by index."""
        main = self.main_spec(tp, block_size, kv_dtype)
        indexer, scale = self.indexer_specs(block_size, indexer_kv_dtype)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]
        if include_mtp:
            names += [f"mtp.layers.{j}.self_attn.attn" for j in range(self.num_mtp_layers)]
        specs = []
        for name in names:
            index = layer_index(name, self.num_layers)
            with_indexer = self.layer_has_indexer(index)
            specs.append(LayerSpec(name=name, index=index, main=main,
                                   indexer=indexer if with_indexer else None,
                                   indexer_scale=scale if with_indexer else None))
        return specs

    def describe(self) -> str:
        """One line for tables: attention kind, layers and per-token widths."""
        layers = f"{self.num_layers} layers" + (
            f" + {self.num_mtp_layers} MTP" if self.num_mtp_layers else "")
        if self.attention == "mla":
            attention = f"MLA latent {self.kv_lora_rank} + rope {self.rope_head_dim}"
        else:
            attention = f"GQA {self.num_kv_heads} KV heads x {self.head_dim}"
        if self.has_indexer:
            share = ("" if self.indexer_layers is None
                     else f" on {len(self.indexer_layers)} base layers")
            indexer = (f", indexer key {self.index_head_dim}{share}, "
                       f"top-k {self.default_top_k}")
        else:
            indexer = ", no indexer"
        return f"{self.name}: {layers}, {attention}{indexer}"


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"TP size must be an integer >= 1, got {tp!r}")


# -- Hugging Face config.json -------------------------------------------------------------

def _get_int(config: Mapping[str, Any], key: str, *, default: int | None = None,
             minimum: int = 1, source: str) -> int:
    value = config.get(key, default)
    if value is None:
        raise ConfigError(f"{source}: missing {key!r} (an integer >= {minimum})")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{source}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _get_optional_int(config: Mapping[str, Any], key: str, *, source: str) -> int | None:
    if config.get(key) is None:
        return None
    return _get_int(config, key, source=source)


def model_from_hf_config(config: Mapping[str, Any], name: str = "custom") -> ModelDescription:
    """Read the KV-cache facts out of a Hugging Face ``config.json`` mapping.

    MLA when ``kv_lora_rank`` is set (DeepSeek-V3/V3.2, GLM-5 style), else dense attention from
    ``num_key_value_heads`` (default ``num_attention_heads``) and ``head_dim`` (default
    ``hidden_size / num_attention_heads``). An indexer when ``index_head_dim`` is set; a GLM-style
    ``indexer_types`` list keeps indexer caches on its ``"full"`` layers only. MTP layers from
    ``num_nextn_predict_layers``. Multimodal configs are read from their ``text_config``.
    Hybrid layouts (sliding-window or linear-attention layers) are rejected: out of scope.
    """
    source = f"model config {name!r}"
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, Mapping):
        config = text
    num_layers = _get_int(config, "num_hidden_layers", source=source)
    num_mtp = _get_int(config, "num_nextn_predict_layers", default=0, minimum=0, source=source)

    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError(f"{source}: 'layer_types' must be a list, got {layer_types!r}")
        other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
        if other:
            raise ConfigError(
                f"{source}: layer types {other} are not supported (hybrid KV layouts are out "
                f"of scope); allowed: {', '.join(sorted(_ATTENTION_LAYER_TYPES))}")

    index_head_dim = _get_optional_int(config, "index_head_dim", source=source)
    indexer_layers = _indexer_layers(config.get("indexer_types"), num_layers,
                                     index_head_dim, source)
    common: dict[str, Any] = dict(
        name=name, num_layers=num_layers, num_mtp_layers=num_mtp,
        index_head_dim=index_head_dim,
        index_n_heads=_get_optional_int(config, "index_n_heads", source=source)
        if index_head_dim is not None else None,
        index_topk=_get_optional_int(config, "index_topk", source=source)
        if index_head_dim is not None else None,
        indexer_layers=indexer_layers)

    if config.get("kv_lora_rank") is not None:
        return ModelDescription(
            attention="mla",
            kv_lora_rank=_get_int(config, "kv_lora_rank", source=source),
            rope_head_dim=_get_int(config, "qk_rope_head_dim", minimum=0, source=source),
            **common)

    heads = _get_int(config, "num_attention_heads", source=source)
    kv_heads = _get_int(config, "num_key_value_heads", default=heads, source=source)
    if config.get("head_dim") is not None:
        head_dim = _get_int(config, "head_dim", source=source)
    else:
        hidden = _get_int(config, "hidden_size", source=source)
        if hidden % heads != 0:
            raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads}; give 'head_dim'")
        head_dim = hidden // heads
    return ModelDescription(attention="gqa", num_kv_heads=kv_heads, head_dim=head_dim, **common)


def _indexer_layers(indexer_types: Any, num_layers: int, index_head_dim: int | None,
                    source: str) -> frozenset[int] | None:
    if indexer_types is None or index_head_dim is None:
        return None
    if not isinstance(indexer_types, list) or len(indexer_types) != num_layers:
        raise ConfigError(f"{source}: 'indexer_types' must list one entry per layer "
                          f"({num_layers}), got {indexer_types!r}")
    unknown = sorted({str(t) for t in indexer_types} - {"full", "shared"})
    if unknown:
        raise ConfigError(f"{source}: 'indexer_types' entries must be 'full' or 'shared', "
                          f"got {unknown}")
    full = frozenset(i for i, kind in enumerate(indexer_types) if kind == "full")
    return None if len(full) == num_layers else full


# -- built-in presets ---------------------------------------------------------------------

PRESETS: Mapping[str, Mapping[str, Any]] = {
    # DeepSeek-V3.2(-Exp) config.json: 61 layers, MLA kv_lora_rank 512 + rope 64, lightning
    # indexer with 64 heads of 128 (one 128-wide key cached per token), top-k 2048, one MTP layer.
    "deepseek-v3.2": {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                      "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
                      "num_nextn_predict_layers": 1},
    # GLM-5 (zai-org/GLM-5, GlmMoeDsaForCausalLM): 78 layers, MLA kv_lora_rank 512 + rope 64,
    # DSA indexer 32 heads x 128, top-k 2048, one MTP layer (GLM-5 technical report table;
    # transformers' GlmMoeDsaConfig defaults). Every layer runs its own indexer (GLM-5.2's
    # shared-indexer layers are read from a config.json's 'indexer_types', not this preset).
    "glm-5": {"num_hidden_layers": 78, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
              "num_nextn_predict_layers": 1},
    # DeepSeek-V3: the same MLA cache as V3.2 without the indexer (dense attention), for contrast.
    "deepseek-v3": {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "num_nextn_predict_layers": 1},
    # Llama-3.1-8B: 32 layers, GQA with 8 KV heads of 128 (32 query heads, hidden 4096).
    "llama-3.1-8b": {"num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128},
}
"""Built-in model facts in Hugging Face ``config.json`` terms (see the comments per entry)."""


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def preset(name: str) -> ModelDescription:
    """A built-in model by name (case-insensitive)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: "
                          f"{', '.join(PRESETS)} (or give the path of a config.json)")
    return model_from_hf_config(PRESETS[key], name=key)
