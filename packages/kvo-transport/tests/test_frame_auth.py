"""Frame authentication (frame_auth) as pure logic: sessions, MACs, replay, the deployment guard.

The real-socket version of the same attacks is in test_control_auth.py.
"""

from __future__ import annotations

import logging

import pytest

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_transport import frame_auth
from kvo_transport.frame_auth import (
    MAGIC,
    OVERHEAD,
    AuthCounters,
    ControlKey,
    DecodeSessions,
    FrameRejectedError,
    Kind,
    PrefillChannel,
    Rejection,
    control_key,
    endpoint_host,
    is_loopback,
    require_secret_beyond_loopback,
)

SECRET = "correct horse battery staple"
KEY = ControlKey.from_secret(SECRET)
PEER = b"prefill-0/abcd"


def handshake(decode: DecodeSessions, identity: bytes = PEER,
              key: ControlKey = KEY) -> PrefillChannel:
    """A prefill channel with an accepted session at ``decode``."""
    channel = PrefillChannel(key, AuthCounters())
    kind, payload = decode.open(identity, channel.seal_hello(b"meta"))
    assert (kind, bytes(payload)) == (Kind.HELLO, b"meta")
    kind, payload = channel.open(decode.seal_welcome(identity, b"welcome", accepted=True))
    assert (kind, bytes(payload)) == (Kind.WELCOME, b"welcome")
    return channel


def rejected(call: object, *args: object) -> Rejection:
    with pytest.raises(FrameRejectedError) as info:
        call(*args)  # type: ignore[operator]
    return info.value.rejection


def test_a_session_carries_frames_both_ways() -> None:
    decode = DecodeSessions(KEY)
    channel = handshake(decode)
    for n in range(3):
        frame = channel.seal(b"ready %d" % n)
        assert frame.startswith(MAGIC) and len(frame) == OVERHEAD + len(b"ready %d" % n)
        assert bytes(decode.open(PEER, frame)[1]) == b"ready %d" % n
        answer = decode.seal(PEER, b"done %d" % n)
        assert answer is not None
        assert channel.open(answer) == (Kind.TO_PREFILL, memoryview(b"done %d" % n))
    assert decode.counters.total == 0 and channel.counters.total == 0


def test_forged_replayed_wrong_session_and_macless_frames_are_refused_and_counted() -> None:
    decode = DecodeSessions(KEY)
    channel = handshake(decode)
    good = channel.seal(b"ready")
    assert bytes(decode.open(PEER, good)[1]) == b"ready"

    assert rejected(decode.open, PEER, good) is Rejection.REPLAY
    forged = bytearray(channel.seal(b"ready 2"))
    forged[-1] ^= 1
    assert rejected(decode.open, PEER, bytes(forged)) is Rejection.BAD_MAC
    stranger = handshake(decode, b"another-prefill")
    assert rejected(decode.open, PEER, stranger.seal(b"x")) is Rejection.WRONG_SESSION
    assert rejected(decode.open, PEER, b"\x85plain msgpack") is Rejection.MISSING_MAC
    wrong_key = PrefillChannel(ControlKey.from_secret("another secret of 16+"), AuthCounters())
    assert rejected(decode.open, b"p3", wrong_key.seal_hello(b"meta")) is Rejection.BAD_MAC
    assert rejected(decode.open, PEER, b"KVA1short") is Rejection.BAD_MAC
    assert decode.counters.as_dict() == {"missing_mac": 1, "bad_mac": 3, "replay": 1,
                                         "wrong_session": 1, "unexpected_mac": 0}

    # The good client keeps working: its numbering was not advanced by the refused frames.
    assert bytes(decode.open(PEER, channel.seal(b"ready 3"))[1]) == b"ready 3"


def test_prefill_refuses_replayed_forged_and_foreign_answers() -> None:
    decode = DecodeSessions(KEY)
    channel = handshake(decode)
    answer = decode.seal(PEER, b"done")
    assert answer is not None
    channel.open(answer)
    assert rejected(channel.open, answer) is Rejection.REPLAY
    welcome_again = decode.seal_welcome(PEER, b"welcome", accepted=True)
    assert rejected(channel.open, welcome_again) is Rejection.REPLAY  # no HELLO waits for it
    other_decode = DecodeSessions(KEY)
    other = handshake(other_decode, PEER)
    foreign = other_decode.seal(PEER, b"done")
    assert other.open(foreign)[1] == b"done"
    assert rejected(channel.open, foreign) is Rejection.WRONG_SESSION
    assert rejected(channel.open, b"\x84plain") is Rejection.MISSING_MAC
    assert channel.counters.as_dict()["replay"] == 2


def test_a_welcome_for_another_hello_fails_its_mac() -> None:
    decode = DecodeSessions(KEY)
    first = PrefillChannel(KEY, AuthCounters())
    decode.open(PEER, first.seal_hello(b"meta"))
    welcome = decode.seal_welcome(PEER, b"ok", accepted=True)
    second = PrefillChannel(KEY, AuthCounters())
    second.seal_hello(b"meta")  # its own nonce: the welcome is bound to the first one's
    assert rejected(second.open, welcome) is Rejection.BAD_MAC


def test_a_replayed_hello_is_refused() -> None:
    decode = DecodeSessions(KEY)
    hello = PrefillChannel(KEY, AuthCounters()).seal_hello(b"meta")
    decode.open(PEER, hello)
    assert rejected(decode.open, b"attacker", hello) is Rejection.REPLAY


def test_reset_tells_the_prefill_its_session_is_gone() -> None:
    decode = DecodeSessions(KEY)
    channel = handshake(decode)
    restarted = DecodeSessions(KEY)
    frame = channel.seal(b"ready")
    with pytest.raises(FrameRejectedError) as info:
        restarted.open(PEER, frame)
    assert info.value.rejection is Rejection.WRONG_SESSION
    reset = restarted.seal_reset(info.value.session, info.value.seq)
    assert channel.open(reset)[0] is Kind.RESET
    # A RESET naming another session is refused, a forged one too.
    assert rejected(handshake(decode, b"other").open, reset) is Rejection.WRONG_SESSION
    forged = bytearray(reset)
    forged[30] ^= 1
    assert rejected(channel.open, bytes(forged)) is Rejection.BAD_MAC


def test_without_a_secret_frames_pass_plain_and_envelopes_are_refused() -> None:
    decode = DecodeSessions(None)
    channel = PrefillChannel(None, AuthCounters())
    assert channel.seal_hello(b"\x85meta") == b"\x85meta"
    assert decode.open(PEER, channel.seal(b"\x85ready")) == (Kind.TO_DECODE, b"\x85ready")
    sealed = handshake(DecodeSessions(KEY)).seal(b"ready")
    assert rejected(decode.open, PEER, sealed) is Rejection.UNEXPECTED_MAC
    assert rejected(channel.open, sealed) is Rejection.UNEXPECTED_MAC


def test_sealing_data_before_the_handshake_is_an_error() -> None:
    with pytest.raises(frame_auth.ProtocolError, match="handshake must finish"):
        PrefillChannel(KEY, AuthCounters()).seal(b"ready")
    assert DecodeSessions(KEY).seal(b"nobody", b"done") is None


def test_the_config_secret_wins_over_the_environment() -> None:
    env = {"KVO_CONTROL_SECRET": "environment secret 1234"}
    from_config = control_key("configured secret 12345", env)
    assert from_config == ControlKey.from_secret("configured secret 12345")
    assert control_key(None, env) == ControlKey.from_secret("environment secret 1234")
    assert control_key(None, {}) is None
    with pytest.raises(ConfigError, match="KVO_CONTROL_SECRET must have at least 16"):
        control_key(None, {"KVO_CONTROL_SECRET": "short"})
    assert "secret" not in repr(from_config)


def test_the_connector_config_validates_and_hides_the_secret() -> None:
    config = RemoteD2HConfig.from_extra_config({"kv_port": 1, "control_secret": SECRET})
    assert config.control_secret == SECRET and SECRET not in repr(config)
    with pytest.raises(ConfigError, match="control_secret must be a string of at least 16") as e:
        RemoteD2HConfig(kv_port=1, control_secret="tooshort")
    assert "tooshort" not in str(e.value)
    with pytest.raises(ConfigError, match="got int"):
        RemoteD2HConfig(kv_port=1, control_secret=12345678901234567)  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["10.77.0.1", "0.0.0.0", "*", "::", "192.168.1.5"])
def test_a_non_loopback_address_without_a_secret_is_refused(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match="not a loopback address and no control secret"):
        require_secret_beyond_loopback(None, host, "test socket")
    require_secret_beyond_loopback(KEY, host, "test socket")  # with a secret: fine


def test_loopback_without_a_secret_warns_once(caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frame_auth, "_warned_unauthenticated", False)
    with caplog.at_level(logging.WARNING, logger="kvo.transport.auth"):
        for host in ("127.0.0.1", "localhost", "::1", "127.0.0.1"):
            assert is_loopback(host)
            require_secret_beyond_loopback(None, host, "test socket")
    warnings = [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(warnings) == 1


def test_endpoint_host() -> None:
    assert endpoint_host("tcp://10.77.0.2:5555") == "10.77.0.2"
    assert endpoint_host("tcp://[::1]:5555") == "::1"
    assert endpoint_host("tcp://localhost:1") == "localhost"
