"""free_loopback_port: ports a test can hand to a server without racing port-0 binds."""

from __future__ import annotations

import socket

from kvo_transport.mooncake_master import _ephemeral_range, free_loopback_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = _ephemeral_range()
    ports = [free_loopback_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    if low > 21000:   # a range below the kernel's exists (Linux default 32768)
        assert all(20000 <= port < low for port in ports)   # above Mooncake's own picks
    for port in ports[:8]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))


def test_a_port_bound_as_0_is_never_handed_out_while_held() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in {free_loopback_port() for _ in range(64)}
