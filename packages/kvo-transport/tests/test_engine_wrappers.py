"""DelegatingEngine and AddressSpans: the shared base of engine wrappers (time, faults, counts)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvo_transport.address_spans import AddressSpans
from kvo_transport.engine import DelegatingEngine
from kvo_transport.errors import TransferError


class RecordingEngine:
    """A stand-in engine for the wrapper's own logic: records each call it gets."""

    backend = "mooncake"
    protocol = "tcp"
    session_id = "127.0.0.1:1234"
    extra = "only the inner engine has this"

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def register(self, ptr: int, length: int) -> None:
        self.calls.append(("register", ptr, length))

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> None:
        self.calls.append(("read", peer, list(local), list(remote), list(lengths)))

    def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> None:
        self.calls.append(("write", peer, list(local), list(remote), list(lengths)))

    def close(self) -> None:
        self.calls.append(("close",))


class FailingWrites(DelegatingEngine):
    def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> None:
        raise TransferError("this wrapper only reads")


def test_a_wrapper_forwards_what_it_does_not_override() -> None:
    inner = RecordingEngine()
    engine = FailingWrites(inner)  # type: ignore[arg-type]
    assert (engine.backend, engine.protocol, engine.session_id) == ("mooncake", "tcp",
                                                                     "127.0.0.1:1234")
    assert engine.inner is inner
    assert engine.extra == "only the inner engine has this"  # a backend's extras stay visible
    engine.register(4096, 64)
    engine.read("peer", [4096], [8192], [64])
    with pytest.raises(TransferError, match="only reads"):
        engine.write("peer", [4096], [8192], [64])
    engine.unregister(4096)
    engine.close()
    assert inner.calls == [("register", 4096, 64), ("read", "peer", [4096], [8192], [64]),
                           ("unregister", 4096), ("close",)]


def test_an_unknown_attribute_still_raises() -> None:
    engine = DelegatingEngine(RecordingEngine())  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        _ = engine.no_such_thing


def test_spans_find_the_span_an_address_falls_in() -> None:
    spans = AddressSpans([(200, 300, "b"), (100, 150, "a")])
    assert len(spans) == 2
    assert [spans.find(a) for a in (99, 100, 149, 150, 199, 200, 299, 300)] == [
        None, "a", "a", None, None, "b", "b", None]
