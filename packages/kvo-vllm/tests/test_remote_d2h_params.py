"""kv_transfer_params and proxy notifications: round trips and refusals naming the bad key."""

from __future__ import annotations

import pytest

from kvo_vllm.remote_d2h.params import (
    DecodePullParams,
    DecodeReady,
    PrefillFailed,
    PrefillSendParams,
    TransferParamsError,
    parse_notification,
)

ENDPOINTS = ("tcp://127.0.0.1:20100", "tcp://127.0.0.1:20101")


def test_decode_params_round_trip_and_absence() -> None:
    params = DecodePullParams(transfer_id="kvo-1", notify_url="http://127.0.0.1:8000/kvo/v1/notify")
    assert DecodePullParams.from_params(params.to_params()) == params
    assert DecodePullParams.from_params(None) is None
    assert DecodePullParams.from_params({"do_remote_prefill": False, "kvo_transfer_id": "x"}) \
        is None


def test_prefill_params_round_trip() -> None:
    params = PrefillSendParams(transfer_id="kvo-2", decode_endpoints=ENDPOINTS, stop_block=9,
                               skip_blocks=3)
    assert params.decode_tp == 2
    assert PrefillSendParams.from_params(params.to_params()) == params
    assert PrefillSendParams.from_params({"do_remote_prefill": True}) is None
    at_once = PrefillSendParams(transfer_id="kvo-2", decode_endpoints=ENDPOINTS, stop_block=None)
    assert "kvo_stop_block" not in at_once.to_params()
    assert PrefillSendParams.from_params(at_once.to_params()) == at_once


@pytest.mark.parametrize(("change", "named"), [
    ({"kvo_transfer_id": "bad id with spaces"}, "kvo_transfer_id"),
    ({"kvo_transfer_id": 7}, "kvo_transfer_id"),
    ({"kvo_decode_endpoints": []}, "kvo_decode_endpoints"),
    ({"kvo_decode_endpoints": ["ipc:///tmp/x"]}, "kvo_decode_endpoints[0]"),
    ({"kvo_decode_endpoints": ["tcp://127.0.0.1:70000"]}, "kvo_decode_endpoints[0]"),
    ({"kvo_decode_tp": 3}, "kvo_decode_tp"),
    ({"kvo_stop_block": 0}, "kvo_stop_block"),
    ({"kvo_skip_blocks": -1}, "kvo_skip_blocks"),
    ({"kvo_skip_blocks": 9}, "kvo_skip_blocks"),
    ({"kvo_notify_url": "file:///etc/passwd"}, "kvo_notify_url"),
])
def test_prefill_params_refusals_name_the_key(change: dict[str, object], named: str) -> None:
    base = PrefillSendParams(transfer_id="kvo-3", decode_endpoints=ENDPOINTS[:1],
                             stop_block=9).to_params()
    with pytest.raises(TransferParamsError, match=named.replace("[", r"\[")):
        PrefillSendParams.from_params({**base, **change})


def test_notifications_parse_and_refuse() -> None:
    ready = DecodeReady(transfer_id="kvo-4", d_rank=1, decode_tp=2, endpoint=ENDPOINTS[1],
                        skip_blocks=2, num_blocks=5)
    assert parse_notification(ready.to_json()) == ready
    failed = PrefillFailed(transfer_id="kvo-4", error="refused")
    assert parse_notification(failed.to_json()) == failed
    with pytest.raises(TransferParamsError, match="kind"):
        parse_notification({"kind": "hello"})
    with pytest.raises(TransferParamsError, match="d_rank"):
        parse_notification({**ready.to_json(), "d_rank": 2})
    with pytest.raises(TransferParamsError, match="skip_blocks"):
        parse_notification({**ready.to_json(), "skip_blocks": 5})
    with pytest.raises(TransferParamsError, match="JSON object"):
        parse_notification(["not", "a", "dict"])


def test_a_decode_ready_names_its_dp_rank_checked_against_the_dp_size() -> None:
    ready = DecodeReady(transfer_id="kvo-5", d_rank=0, decode_tp=1, endpoint=ENDPOINTS[0],
                        skip_blocks=0, num_blocks=3, dp_rank=1, dp_size=2)
    assert parse_notification(ready.to_json()) == ready
    legacy = {k: v for k, v in ready.to_json().items() if k not in ("dp_rank", "dp_size")}
    assert (parse_notification(legacy).dp_rank, parse_notification(legacy).dp_size) == (0, 1)
    with pytest.raises(TransferParamsError, match=r"dp_rank must be an integer in \[0, 1\], "
                                                  r"got 2"):
        parse_notification({**ready.to_json(), "dp_rank": 2})
    with pytest.raises(TransferParamsError, match="dp_size must be an integer in"):
        parse_notification({**ready.to_json(), "dp_size": 0})
