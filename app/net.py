"""TCP helpers every process of the project shares: a free port, and waiting until an address answers.

Torch-free (the launchers and the store's health check call them before, or without, importing torch)::

    from app.net import free_port, wait_for_tcp
    port = free_port()                          # e.g. a MASTER_PORT for a world of one; free_port(2): two in a row
    wait_for_tcp("rendezvous", 29400, 30)       # returns once it accepts a connection, else TcpUnreachable
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path


class TcpUnreachable(TimeoutError):
    """``host:port`` accepted no TCP connection within the wait; ``why``: the last error ("Connection refused")."""

    def __init__(self, host: str, port: int, timeout_s: float, why: str):
        super().__init__(f"{host}:{port} unreachable for {timeout_s:g} s ({why})")
        self.host, self.port, self.timeout_s, self.why = host, port, timeout_s, why


# Claims on ports across processes (every checkout, test and tool of this user's): one empty file per port.
PORT_RESERVATIONS = Path(tempfile.gettempdir()) / "ddp-cluster-test-ports"
_RESERVATION_S = 900  # a claimed port is not handed out again for this long (longer than any test or bench)
_LOWEST_PORT = 10000  # below: well-known services (Prometheus 9090, the metrics default 9400, ...)
# Ports the project's own tools bind by default (bench-metrics 19700+, the rendezvous 29400, MASTER_PORT 29500):
# a `make run` or a bench started beside the tests must not find its port taken by a test, nor the reverse.
_PROJECT_PORTS = (range(19700, 19800), range(29400, 29600))


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _reserve(port: int) -> bool:
    """Claim ``port`` across processes (O_EXCL file); stale claims are taken over. Where no claim can be written
    (a read-only /tmp), the bind check alone decides."""
    try:
        PORT_RESERVATIONS.mkdir(exist_ok=True)
    except OSError:
        return True
    path = PORT_RESERVATIONS / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime > _RESERVATION_S:
                path.touch()
                return True
        except OSError:
            pass
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface: the metrics server binds 0.0.0.0
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 are free, and claimed for this caller (metrics use base port + local rank).

    Chosen at random below the ephemeral range, where the kernel never assigns a port by itself: a port found free by
    binding port 0 lies in the range it hands out to every outgoing connection (gloo's mesh, store clients), and can
    be taken in the seconds before a worker, still importing torch, binds it. Claimed in ``PORT_RESERVATIONS`` so
    that other processes (parallel tests, other checkouts) skip it.

    Example::

        port = free_port(2)  # ranks 0 and 1 serve /metrics on port and port + 1
    """
    low, _ = _ephemeral_range()
    high = max(low - count, _LOWEST_PORT + 1000)
    rng = random.Random()  # its own: a caller that seeds `random` must not make every run pick the same ports
    for _ in range(500):
        base = rng.randrange(_LOWEST_PORT, high)
        ports = range(base, base + count)
        if any(p in r for p in ports for r in _PROJECT_PORTS):
            continue
        if all(_bindable(p) for p in ports) and all(_reserve(p) for p in ports):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {_LOWEST_PORT}..{high}")


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
