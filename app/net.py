"""TCP helpers every process of the project shares: a free port, and waiting until an address answers.

Torch-free (the launchers and the store's health check call them before, or without, importing torch)::

    from app.net import free_port, wait_for_tcp
    port = free_port()                          # e.g. a MASTER_PORT for a world of one
    wait_for_tcp("rendezvous", 29400, 30)       # returns once it accepts a connection, else TcpUnreachable
"""

from __future__ import annotations

import socket
import time


class TcpUnreachable(TimeoutError):
    """``host:port`` accepted no TCP connection within the wait; ``why``: the last error ("Connection refused")."""

    def __init__(self, host: str, port: int, timeout_s: float, why: str):
        super().__init__(f"{host}:{port} unreachable for {timeout_s:g} s ({why})")
        self.host, self.port, self.timeout_s, self.why = host, port, timeout_s, why


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it: bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tcp_problem(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection now, else why not, in a few words."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def wait_for_tcp(host: str, port: int, timeout_s: float, poll_s: float = 0.25) -> None:
    """Poll until ``host:port`` accepts a TCP connection, or raise ``TcpUnreachable`` once ``timeout_s`` has passed.

    The name may not resolve yet either (a container still starting): that counts as unreachable, not as an error.
    No single attempt outlasts the deadline, so a silent address cannot stretch the wait.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        why = tcp_problem(host, port, max(min(2.0, deadline - time.monotonic()), 0.1))
        if why is None:
            return
        if time.monotonic() >= deadline:
            raise TcpUnreachable(host, port, timeout_s, why)
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
