"""app.net on real loopback sockets: ``wait_for_tcp`` returns once something listens, gives up within its timeout
with the last reason, and treats a name that does not resolve (a container not started yet) as unreachable;
``free_port`` gives ports in a row that the kernel does not hand out, claimed for other processes."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from app.net import PORT_RESERVATIONS, TcpUnreachable, free_port, tcp_problem, wait_for_tcp


def test_a_listener_that_comes_late_is_waited_for():
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    later = threading.Timer(0.6, lambda: (server.bind(("127.0.0.1", port)), server.listen()))
    later.start()
    try:
        assert tcp_problem("127.0.0.1", port) == "Connection refused"
        started = time.monotonic()
        wait_for_tcp("127.0.0.1", port, timeout_s=20)
        assert 0.5 <= time.monotonic() - started < 15  # it waited for the listener, then returned
        assert tcp_problem("127.0.0.1", port) is None
    finally:
        later.join()
        server.close()


@pytest.mark.parametrize(("host", "why"), [("127.0.0.1", "Connection refused"), ("no-such-host.invalid", None)])
def test_nothing_there_ends_within_the_timeout_naming_the_address_and_the_reason(host, why):
    port = free_port()  # nobody listens on it
    started = time.monotonic()
    with pytest.raises(TcpUnreachable) as e:
        wait_for_tcp(host, port, timeout_s=1.5)
    took = time.monotonic() - started
    assert 1.5 <= took < 4, took  # the whole timeout, and not much more: a poll and a lookup beyond it
    assert str(e.value).startswith(f"{host}:{port} unreachable for 1.5 s (")
    assert e.value.why == why or (why is None and e.value.why)  # a name that does not resolve: unreachable, why


def test_free_ports_come_in_a_row_below_the_ephemeral_range_and_claimed_for_other_processes():
    base = free_port(3)
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert base >= 10000 and base + 2 < ephemeral_low  # the kernel hands none of them out by itself
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("", port))  # free, on every interface (the metrics server binds 0.0.0.0)
        assert (PORT_RESERVATIONS / str(port)).exists()  # another process's free_port skips it
