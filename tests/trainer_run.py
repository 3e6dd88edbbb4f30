"""Run the real training worker from tests: under torchrun, or as plain processes given torchrun's variables.

Every run has a timeout (a hang fails the test instead of blocking CI), one BLAS thread per rank, and none of the
caller's ``DDP_*`` variables, so a developer's shell cannot change what a test sees.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DDP_", "TORCHELASTIC_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 were all free a moment ago (metrics use base port + local rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 120, env: dict[str, str] | None = None, **popen
) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "app.train", *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout, **popen
    )


def start_torchrun(*args: str, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "app.train", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def start_ranks(*args: str, world_size: int = 2, port: int | None = None, **extra_env: str) -> list[subprocess.Popen]:
    """The worker as ``world_size`` plain processes with torchrun's variables (rank 0 hosts the store)."""
    port = port or free_port()
    procs = []
    for rank in range(world_size):
        env = clean_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **extra_env,
        )
        procs.append(
            subprocess.Popen(
                [PYTHON, "-m", "app.train", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def wait_for_lines(proc: subprocess.Popen, stream, wanted: str, count: int = 1, timeout: float = 90) -> list[str]:
    """Read ``stream`` (``proc.stdout`` or ``proc.stderr``) until ``count`` lines contain ``wanted``; return the
    lines read. Stops reading right after the last match, so the rest stays in the pipe for ``communicate()``.

    The reading happens in a thread, the waiting on a queue with a timeout: a worker that hangs without printing
    anything blocks ``readline()`` forever, and a deadline checked between reads would never be reached.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        found = 0
        try:
            for line in iter(stream.readline, ""):
                found += wanted in line
                lines.put(line)
                if found >= count:
                    return  # no further readline: what follows belongs to communicate()
        finally:
            lines.put(None)  # end of output (or done): wakes the waiter

    threading.Thread(target=pump, name="wait-for-lines", daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError(
                f"{count}× {wanted!r} not seen within {timeout:g}s; last output:\n{''.join(seen[-20:])}"
            ) from None
        if line is None:
            break
        seen.append(line)
    if sum(wanted in line for line in seen) < count:
        try:
            code, other = proc.wait(timeout=10), proc.stderr if stream is proc.stdout else proc.stdout
            tail = (other.read() if other else "")[-3000:]  # safe: the process is gone, read() cannot block
        except subprocess.TimeoutExpired:
            code, tail = "nothing (still running)", ""
        raise AssertionError(
            f"worker closed its output and exited {code} before printing {count}× {wanted!r}; "
            f"last output:\n{''.join(seen[-20:])}{tail}"
        )
    return seen


def finished(stdout: str) -> dict[int, dict[str, str]]:
    """The FINISHED lines, by rank: {rank: {"world_size": ..., "step": ..., "checksum": ...}}."""
    out = {}
    for m in re.finditer(
        r"^FINISHED rank=(\d+) world_size=(\d+) step=(\d+) checksum=([0-9a-f]{16})$", stdout, re.MULTILINE
    ):
        out[int(m.group(1))] = {"world_size": m.group(2), "step": m.group(3), "checksum": m.group(4)}
    return out


def losses(log: str) -> dict[int, float]:
    """Rank 0's progress lines: {step: loss}."""
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+)/\d+ \| loss ([0-9.naif]+)", log)}


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}"
