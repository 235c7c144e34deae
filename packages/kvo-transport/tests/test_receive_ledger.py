"""The decode receiver's per-request rules, without sockets (kvo_transport.receive_ledger)."""

from __future__ import annotations

from kvo_transport.receive_ledger import InvalidBlocks, ReceiveLedger

PARTS = frozenset({"p/p0", "p/p1"})


def settled(invalid: InvalidBlocks) -> bool:
    return True


def test_finished_once_every_contributor_delivered_every_layer() -> None:
    ledger = ReceiveLedger()
    assert ledger.expect("r", "p", PARTS) is None
    assert ledger.expect("r", "other", PARTS) == "p"  # started from "p": warn, keep going
    for part in sorted(PARTS):
        ledger.layer_done("r", part, 0, 2, last=False, label=part)
    ledger.layer_done("r", "p/p0", 1, 2, last=True, label="p0")
    assert ledger.pop_finished(settled) == (set(), {})
    ledger.layer_done("r", "p/p1", 1, 2, last=True, label="p1")
    assert ledger.pop_finished(settled) == ({"r"}, {})


def test_a_last_layer_with_gaps_fails_naming_them() -> None:
    ledger = ReceiveLedger()
    ledger.expect("r", "p", frozenset({"p/p0"}))
    ledger.layer_done("r", "p/p0", 3, 4, last=True, label="prefill p0")
    finished, failed = ledger.pop_finished(settled)
    assert not finished and "prefill p0 sent its last layer without layers [0, 1, 2]" \
        in failed["r"]


def test_a_failure_waits_until_its_invalid_blocks_settled() -> None:
    ledger = ReceiveLedger()
    ledger.expect("r", "p", frozenset({"p/p0"}))
    ledger.layer_failed("r", "p/p0", "layer 2: read failed")
    ledger.invalidate("r", (3, 4), ())
    ledger.invalidate("r", (5,), (1,))
    assert ledger.invalid("r") == InvalidBlocks(frozenset({3, 4, 5}), frozenset({1}))
    quiet = {"now": False}
    assert ledger.pop_finished(lambda invalid: quiet["now"]) == (set(), {})
    quiet["now"] = True
    assert ledger.pop_finished(lambda invalid: quiet["now"]) == (
        set(), {"r": "p/p0: layer 2: read failed"})
    assert ledger.pop_finished(settled) == (set(), {})  # reported once


def test_forgotten_requests_are_never_reported() -> None:
    ledger = ReceiveLedger()
    ledger.expect("r", "p", frozenset({"p/p0"}))
    ledger.forget("r")
    ledger.expect("s", "p", frozenset({"p/p0"}))
    ledger.layer_failed("s", "p/p0", "x")
    ledger.forget("s")  # failed but held back, then forgotten: not reported either
    assert ledger.pop_finished(settled) == (set(), {})
    assert ledger.invalid("r") == InvalidBlocks()


def test_a_failure_held_back_keeps_its_first_reason_when_later_layers_fail_again() -> None:
    """A prefill that renewed its session may send later layers of a request decode already
    failed (and holds back until its blocks settle): their failure must not replace the reason."""
    ledger = ReceiveLedger()
    ledger.expect("r", "p", frozenset({"p/p0"}))
    ledger.layer_failed("r", "p/p0", "layer 0: fence: the prefill reused the source")
    quiet = {"now": False}
    assert ledger.pop_finished(lambda invalid: quiet["now"]) == (set(), {})
    ledger.expect("r", "p", frozenset({"p/p0"}))  # layer 3 arrives on the new session
    ledger.layer_done("r", "p/p0", 3, 4, last=True, label="prefill p0")
    assert ledger.pop_finished(lambda invalid: quiet["now"]) == (set(), {})
    quiet["now"] = True
    assert ledger.pop_finished(lambda invalid: quiet["now"]) == (
        set(), {"r": "p/p0: layer 0: fence: the prefill reused the source"})
