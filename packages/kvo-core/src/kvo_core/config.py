"""Configuration of the offload connectors, validated when built.

vLLM hands each connector a ``kv_connector_extra_config`` dict; :meth:`from_extra_config`
turns it into one of these frozen objects. Every value is checked on construction, so a typo
or an impossible setting fails at start-up with a message naming the key, the value and what
is allowed, instead of surfacing as a hang or a wrong size deep inside a transfer. Key names
in the dict are exactly the field names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

import attrs

from kvo_core.errors import ConfigError

MAX_HOT_CAPACITY = 32640
"""Largest hot-buffer capacity the fused ops address (15-bit slot ids, block aligned)."""
MAX_QUERY_ROWS = 14
"""Most query rows per request the fused ops accept (1 + speculative tokens)."""
MAX_READ_RETRIES = 16
MIN_SEGMENT_BYTES = 16 * 1024 * 1024
"""Mooncake Store rejects client segments below 16 MiB."""

STORE_BACKENDS = ("mooncake", "memcache")
TRANSFER_BACKENDS = ("mooncake", "memfabric")
MEMFABRIC_PROTOCOLS = ("sdma", "device_rdma", "device_urma")
MEMFABRIC_ROLES = ("Prefill", "Decode")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
INDEXER_KV_DTYPES = ("bfloat16", "int8")
KERNEL_BACKENDS = ("auto", "reference", "triton", "native", "fused")
RESIDENCY_BACKENDS = ("torch", "native")
CONTROL_SECRET_ENV = "KVO_CONTROL_SECRET"
"""Environment variable holding the control plane's shared secret (the config key wins)."""
MIN_CONTROL_SECRET_CHARS = 16
SPARSE_MODES = ("resident", "offload")
"""``resident``: main KV stays in the serving engine's own paged cache; ``offload``: it lives in
a kvo host pool and only the selected rows are copied to device hot buffers."""

_T = TypeVar("_T", bound=attrs.AttrsInstance)
_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


# -- validators: each error names the field, the value and what is allowed -----------------

@attrs.frozen
class Described:
    """A field validator that can also say what it allows, so documentation (the table of
    config keys in docs/configuration.md) is generated from the same object that enforces the
    rule."""

    allowed: str
    check: _Validator

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        self.check(instance, attribute, value)


def _int_in(minimum: int, maximum: int | None = None) -> Described:
    allowed = (f"an integer >= {minimum}" if maximum is None
               else f"an integer in [{minimum}, {maximum}]")

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
                or (maximum is not None and value > maximum)):
            raise ConfigError(f"{attribute.name} must be {allowed}, got {value!r}")
    return Described(allowed, check)


def _optional_int_in(minimum: int) -> Described:
    inner = _int_in(minimum)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            inner(instance, attribute, value)
    return Described(f"null or {inner.allowed}", check)


def _one_of(choices: tuple[str, ...]) -> Described:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{attribute.name} must be one of {', '.join(choices)}; "
                              f"got {value!r}")
    return Described("one of " + ", ".join(repr(c) for c in choices), check)


def _to_float(value: Any) -> Any:
    """Accept ints for float fields (JSON writes 100 for 100.0); the check sees anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _check_positive_float(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, float) or not value > 0 or value == float("inf"):
        raise ConfigError(f"{attribute.name} must be a finite number of seconds > 0, "
                          f"got {value!r}")


def _check_non_negative_float(instance: Any, attribute: attrs.Attribute[Any],
                              value: Any) -> None:
    if not isinstance(value, float) or not value >= 0 or value == float("inf"):
        raise ConfigError(f"{attribute.name} must be a finite number of seconds >= 0, "
                          f"got {value!r}")


def _check_non_empty_str(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _check_optional_non_empty_str(instance: Any, attribute: attrs.Attribute[Any],
                                  value: Any) -> None:
    if value is not None:
        _check_non_empty_str(instance, attribute, value)


def check_tcp_url(name: str, value: object) -> str:
    """``tcp://host:port`` (port 1..65535), or ConfigError naming ``name``; returns the value.

    The one owner of this rule: the MemFabric engine's options use it as well."""
    if isinstance(value, str):
        scheme, _, rest = value.partition("://")
        host, _, port = rest.rpartition(":")
        if scheme == "tcp" and host and port.isdigit() and 0 < int(port) < 65536:
            return value
    raise ConfigError(f"{name}={value!r} must be tcp://host:port")


def _check_optional_tcp_url(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_tcp_url(attribute.name, value)


def _check_str(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name} must be a string, got {value!r}")


_positive_float = Described("a finite number of seconds > 0", _check_positive_float)
_optional_tcp_url = Described("null or tcp://host:port", _check_optional_tcp_url)
_str = Described("a string", _check_str)
_non_negative_float = Described("a finite number of seconds >= 0", _check_non_negative_float)


def _check_optional_switch_interval(instance: Any, attribute: attrs.Attribute[Any],
                                    value: Any) -> None:
    if value is not None and (not isinstance(value, float) or not 0 < value <= 0.1):
        raise ConfigError(f"{attribute.name} must be null or a number of seconds in (0, 0.1], "
                          f"got {value!r}")


_optional_switch_interval = Described("null or a number of seconds in (0, 0.1]",
                                      _check_optional_switch_interval)
_non_empty_str = Described("a non-empty string", _check_non_empty_str)
_optional_non_empty_str = Described("null or a non-empty string", _check_optional_non_empty_str)


def _check_optional_secret(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A secret is never echoed back: the message names its type and length only."""
    if value is None:
        return
    if not isinstance(value, str) or len(value.encode()) < MIN_CONTROL_SECRET_CHARS:
        shown = (f"{len(value.encode())} characters" if isinstance(value, str)
                 else type(value).__name__)
        raise ConfigError(f"{attribute.name} must be a string of at least "
                          f"{MIN_CONTROL_SECRET_CHARS} characters (or absent, to use "
                          f"{CONTROL_SECRET_ENV}), got {shown}")


_optional_secret = Described(
    f"null (then ${CONTROL_SECRET_ENV}, else unauthenticated: loopback only) or a string of "
    f">= {MIN_CONTROL_SECRET_CHARS} characters", _check_optional_secret)


def _to_independent_layers(value: Any) -> Any:
    """Lists (as JSON gives them) become tuples; "all" and anything invalid pass through."""
    if isinstance(value, list):
        return tuple(value)
    return value


_INDEPENDENT_LAYERS_ALLOWED = ("a list of layer indices (integers; negative counts from the "
                               "end) or 'all'")


def _check_independent_layers(instance: Any, attribute: attrs.Attribute[Any],
                              value: Any) -> None:
    allowed = _INDEPENDENT_LAYERS_ALLOWED
    if value == "all":
        return
    if not isinstance(value, tuple):
        raise ConfigError(f"{attribute.name} must be {allowed}, got {value!r}")
    for entry in value:
        if not isinstance(entry, int) or isinstance(entry, bool):
            raise ConfigError(f"{attribute.name} must be {allowed}; entry {entry!r} of "
                              f"{list(value)!r} is not an integer")
    if len(set(value)) != len(value):
        raise ConfigError(f"{attribute.name} must list each layer once, got {list(value)!r}")


_independent_layers = Described(_INDEPENDENT_LAYERS_ALLOWED, _check_independent_layers)


# -- documentation of the keys, generated from the fields ----------------------------------

@attrs.frozen
class ConfigKey:
    """One key of a config class as users write it: name, default (as JSON) and what is
    allowed."""

    name: str
    default: str
    allowed: str


def config_keys(cls: type[attrs.AttrsInstance]) -> list[ConfigKey]:
    """The keys of a config class, in declaration order, described from its validators."""
    keys = []
    for field in attrs.fields(cls):
        if field.default is attrs.NOTHING:
            default = "required"
        else:
            value = field.default
            default = json.dumps(list(value) if isinstance(value, tuple) else value)
        validator = field.validator
        allowed = validator.allowed if isinstance(validator, Described) else "any value"
        keys.append(ConfigKey(field.name, default, allowed))
    return keys


# -- building from vLLM's kv_connector_extra_config -----------------------------------------

def _from_mapping(cls: type[_T], extra: Mapping[str, Any], ignore_keys: Iterable[str]) -> _T:
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{cls.__name__}: kv_connector_extra_config must be a mapping of "
                          f"option names to values, got {type(extra).__name__}")
    fields = attrs.fields(cls)
    known = [field.name for field in fields]
    ignored = set(ignore_keys)
    kwargs: dict[str, Any] = {}
    for key, value in extra.items():
        if key in ignored:
            continue
        if key not in known:
            raise ConfigError(f"{cls.__name__}: unknown kv_connector_extra_config key {key!r}; "
                              f"known keys: {', '.join(known)}")
        kwargs[key] = value
    missing = [field.name for field in fields
               if field.default is attrs.NOTHING and field.name not in kwargs]
    if missing:
        raise ConfigError(f"{cls.__name__}: kv_connector_extra_config is missing the required "
                          f"key(s) {', '.join(missing)}")
    return cls(**kwargs)


def _to_mapping(instance: attrs.AttrsInstance) -> dict[str, Any]:
    """The inverse of ``from_extra_config``: JSON-friendly values (tuples become lists)."""
    result: dict[str, Any] = {}
    for field in attrs.fields(type(instance)):
        value = getattr(instance, field.name)
        result[field.name] = list(value) if isinstance(value, tuple) else value
    return result


@attrs.frozen
class LayerwiseOffloadConfig:
    """Layerwise prefill offload: few reusable device layer buffers, full KV in a host store.

    ``shared_buffers`` physical buffers are reused round robin by the non-independent layers;
    ``independent_layers`` keep a buffer of their own. ``layer_deadline_s`` bounds the wait for a
    buffer's previous save (and remote reads) before it is reused, so a lost acknowledgement fails
    the request instead of hanging prefill.
    """

    shared_buffers: int = attrs.field(default=2, validator=_int_in(1))
    independent_layers: tuple[int, ...] | Literal["all"] = attrs.field(
        default=(0,), converter=_to_independent_layers, validator=_independent_layers)
    prefetch_depth: int = attrs.field(default=1, validator=_int_in(0, 64))
    store_backend: str = attrs.field(default="mooncake", validator=_one_of(STORE_BACKENDS))
    store_master_address: str | None = attrs.field(default=None,
                                                   validator=_optional_non_empty_str)
    store_protocol: str = attrs.field(default="tcp", validator=_one_of(MOONCAKE_PROTOCOLS))
    store_segment_bytes: int = attrs.field(default=256 * 1024 * 1024,
                                           validator=_int_in(MIN_SEGMENT_BYTES))
    local_hostname: str = attrs.field(default="127.0.0.1", validator=_non_empty_str)
    layer_deadline_s: float = attrs.field(default=60.0, converter=_to_float,
                                          validator=_positive_float)
    save_staging_bytes: int = attrs.field(default=64 * 2**20, validator=_int_in(0))
    """Host area (registered memory, default 64 MiB) a layer's save is copied into so its
    buffer is free at once; the store put runs after the forward. 0: put straight from the
    device buffer, as a layer that does not fit is."""
    flush_nice: int = attrs.field(default=19, validator=_int_in(0, 19))
    """Niceness of the thread that puts a step's staged blocks after the forward (Linux;
    0: as the engine's). It runs while vLLM samples and returns the step's output, and on a
    CPU the engine's own threads need it would delay that output; at 19 it takes the CPU only
    when they leave it (at the latest when the next step waits for the put); measured
    against 0 in docs/benchmarks.md."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *,
                          ignore_keys: Iterable[str] = ()) -> LayerwiseOffloadConfig:
        """Build from ``kv_connector_extra_config``; unknown keys are an error.

        ``ignore_keys`` names keys that belong to another component sharing the dict.
        """
        return _from_mapping(cls, extra, ignore_keys)

    def to_extra_config(self) -> dict[str, Any]:
        return _to_mapping(self)


@attrs.frozen
class SparseDecodeOffloadConfig:
    """Sparse decode offload: full main KV in host memory, top-k hot buffers on the device.

    The hot buffer of a decode row must hold one step's whole top-k (``hot_capacity >= top_k``),
    is allocated in cache blocks (a multiple of ``block_size``) and is addressed with 15-bit slot
    ids (``<= 32640``). ``host_pool_bytes`` None sizes the host pool from the model length and
    the scheduler's row count at start-up.
    """

    top_k: int = attrs.field(default=2048, validator=_int_in(1))
    block_size: int = attrs.field(default=128, validator=_int_in(1))
    hot_capacity: int = attrs.field(default=8192, validator=_int_in(1, MAX_HOT_CAPACITY))
    host_pool_bytes: int | None = attrs.field(default=None, validator=_optional_int_in(1))
    max_query_rows: int = attrs.field(default=MAX_QUERY_ROWS,
                                      validator=_int_in(1, MAX_QUERY_ROWS))
    indexer_kv_dtype: str = attrs.field(default="bfloat16", validator=_one_of(INDEXER_KV_DTYPES))
    kernel_backend: str = attrs.field(default="auto", validator=_one_of(KERNEL_BACKENDS))
    residency_backend: str = attrs.field(default="native", validator=_one_of(RESIDENCY_BACKENDS))
    mode: str = attrs.field(default="resident", validator=_one_of(SPARSE_MODES))

    def __attrs_post_init__(self) -> None:
        if self.hot_capacity < self.top_k:
            raise ConfigError(
                f"hot_capacity must be >= top_k ({self.top_k}) so one step's selection fits, "
                f"got {self.hot_capacity}")
        if self.hot_capacity % self.block_size != 0:
            lower = self.hot_capacity - self.hot_capacity % self.block_size
            raise ConfigError(
                f"hot_capacity must be a multiple of block_size ({self.block_size}), got "
                f"{self.hot_capacity}; nearest allowed: {max(lower, self.block_size)} or "
                f"{lower + self.block_size}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *,
                          ignore_keys: Iterable[str] = ()) -> SparseDecodeOffloadConfig:
        """Build from ``kv_connector_extra_config``; unknown keys are an error."""
        return _from_mapping(cls, extra, ignore_keys)

    def to_extra_config(self) -> dict[str, Any]:
        return _to_mapping(self)


@attrs.frozen
class RemoteD2HConfig:
    """Remote device-to-host pulls between prefill and decode (the P/D control and data plane).

    ``kv_port`` is the first decode control port (``kv_port + dp_rank * decode_tp + tp_rank``).
    ``handshake_timeout_s`` bounds the MF_META exchange, ``layer_deadline_s`` one layer's
    completion (all reads acknowledged); a failed read is retried up to ``read_retries`` times,
    ``retry_backoff_s`` apart. ``memfabric_transfer_protocol`` only matters for the memfabric
    backend and must be equal on prefill and decode; ``mooncake_protocol`` likewise for mooncake.
    The memfabric backend also needs ``memfabric_store_url`` (its config store, created by the
    instance whose role is ``memfabric_store_server_role``; prefill is "Prefill", decode
    "Decode"), ``memfabric_device_id`` (the NPU; default: the worker's local rank on its node,
    local DP rank * TP size + TP rank) and ``memfabric_nic`` ("" lets MemFabric choose); these
    keys are refused with another backend.
    ``control_secret`` authenticates every control frame (HMAC-SHA256, kvo_transport.frame_auth);
    when absent, the ``KVO_CONTROL_SECRET`` environment variable is used; with neither, the
    control socket is refused on a non-loopback ``local_hostname``. It is kept out of ``repr``.
    ``gil_switch_interval_s`` (opt-in) shortens the worker process's GIL switch interval so
    that the hand-off threads run while vLLM's forward holds the GIL
    (kvo_vllm.remote_d2h.switch_interval); null, the default, leaves the interpreter's own (5 ms):
    on a quiet host the shorter interval did not change TTFT.
    ``destination_wait_s`` (decode) is how long a READY may wait for its request's destination
    to be registered (the proxy posts prefill and decode at once, so a layer can arrive
    first); the read that follows is fenced like any other.
    """

    kv_port: int = attrs.field(validator=_int_in(1, 65535))
    handshake_timeout_s: float = attrs.field(default=100.0, converter=_to_float,
                                             validator=_positive_float)
    layer_deadline_s: float = attrs.field(default=60.0, converter=_to_float,
                                          validator=_positive_float)
    read_retries: int = attrs.field(default=2, validator=_int_in(0, MAX_READ_RETRIES))
    retry_backoff_s: float = attrs.field(default=0.05, converter=_to_float,
                                         validator=_non_negative_float)
    transfer_backend: str = attrs.field(default="mooncake", validator=_one_of(TRANSFER_BACKENDS))
    memfabric_transfer_protocol: str = attrs.field(default="sdma",
                                                   validator=_one_of(MEMFABRIC_PROTOCOLS))
    memfabric_store_url: str | None = attrs.field(default=None, validator=_optional_tcp_url)
    memfabric_store_server_role: str = attrs.field(default="Prefill",
                                                   validator=_one_of(MEMFABRIC_ROLES))
    memfabric_device_id: int | None = attrs.field(default=None, validator=_optional_int_in(0))
    memfabric_nic: str = attrs.field(default="", validator=_str)
    mooncake_protocol: str = attrs.field(default="tcp", validator=_one_of(MOONCAKE_PROTOCOLS))
    local_hostname: str = attrs.field(default="127.0.0.1", validator=_non_empty_str)
    control_secret: str | None = attrs.field(default=None, repr=False,
                                             validator=_optional_secret)
    gil_switch_interval_s: float | None = attrs.field(
        default=None, converter=_to_float, validator=_optional_switch_interval)
    destination_wait_s: float = attrs.field(default=10.0, converter=_to_float,
                                            validator=_non_negative_float)

    def __attrs_post_init__(self) -> None:
        if self.transfer_backend == "memfabric":
            if self.memfabric_store_url is None:
                raise ConfigError(
                    "transfer_backend 'memfabric' needs memfabric_store_url (tcp://host:port of "
                    "the MemFabric config store, created by the memfabric_store_server_role "
                    "instance)")
            return
        given = [name for name, default in (("memfabric_store_url", None),
                                            ("memfabric_device_id", None),
                                            ("memfabric_nic", ""))
                 if getattr(self, name) != default]
        if given:
            raise ConfigError(f"{', '.join(given)} set, but transfer_backend is "
                              f"{self.transfer_backend!r}; these keys are for 'memfabric'")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *,
                          ignore_keys: Iterable[str] = ()) -> RemoteD2HConfig:
        """Build from ``kv_connector_extra_config``; ``kv_port`` is required."""
        return _from_mapping(cls, extra, ignore_keys)

    def to_extra_config(self) -> dict[str, Any]:
        return _to_mapping(self)
