"""Run the real training worker from tests: under torchrun, or as plain processes given torchrun's variables.

Every run has a timeout (a hang fails the test instead of blocking CI), one BLAS thread per rank, and none of the
caller's ``DDP_*`` variables, so a developer's shell cannot change what a test sees. The plain processes are forked
from a template that has imported torch (``app.world.template``; ``LAUNCH_FORK=0``: each its own interpreter), so
they skip the seconds of CPU that import costs each; ``run_ranks`` reads their output as a ``torchrun`` run's.

When a worker fails a test, its whole output and exit code are kept: attached to the assertion message and written
to ``<pytest's tmp dir>/worker-output/<test>/`` (``keep_output``), so an intermittent failure can be read after
the fact instead of rerun.

The worker runs the integration tests repeat are declared once, as data: ``RUNS`` names each configuration (as
torchtitan's integration tests name theirs), ``worker_args(name, steps=20, checkpoint_dir=d)`` turns one into flags
with a test's own settings added or overriding, and ``run_process`` / ``start_ranks`` / ``torchrun`` launch it::

    procs = start_ranks(*worker_args("until_stopped", checkpoint_dir=tmp_path))
    outs = finish(procs)          # every process's (stdout, stderr); whatever still runs is killed

Ports come from ``app.net.free_port``, re-exported here for the tests that import it from this module: below the
kernel's ephemeral range and reserved across processes for a while (its docstring says why).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from app.net import free_port  # the project's one; the tests import it from here too
from app.world import template as world_template

REPO = world_template.REPO
# How long a run or a wait may take before it counts as a hang. Generous on purpose: it only turns a hang into a
# failure, and on a few cores shared by many processes, importing torch, forming the group and the first steps can
# take minutes. Tests that promise a time bound assert it themselves.
HANG_TIMEOUT_S = 300.0
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


# The worker configurations the integration tests run, by name: TrainConfig field -> value. A test adds what is
# its own (steps, checkpoint_dir, ...) with worker_args; a setting given there overrides the one here.
RUNS: dict[str, dict[str, object]] = {
    # One process without torchrun (a world of one, no wrapper), no metrics endpoint.
    "one_process": {"wrapper": "none", "metrics_port": 0},
    # Trains until it is stopped, a progress line every 50 steps, no checkpoint but the stop's: the signal tests.
    "until_stopped": {"steps": 100000, "checkpoint_every": 100000, "metrics_port": 0, "log_every": 50},
    # The failure drill: the last rank's loss becomes NaN at step 12, after the checkpoint of step 10.
    "nan_drill": {"steps": 40, "checkpoint_every": 5, "inject_nan_at_step": 12, "metrics_port": 0},
    # 2 ranks × micro_batch 32 × grad_accum_steps 2 = 128; 2048 samples make 16 steps an epoch, so a resume at
    # step 10 lands mid-epoch and 20 steps cross one.
    "resumable": {
        "effective_batch": 128,
        "dataset_size": 2048,
        "checkpoint_every": 5,
        "keep_checkpoints": 5,
        "metrics_port": 0,
        "log_every": 5,
    },
    # A global batch of 50 in micro-batches of <= 8: uneven shares at world 3 and 4, checkpoints to resume on.
    "fixed_global_batch": {
        "effective_batch": 50,
        "micro_batch": 8,
        "dataset_size": 1000,
        "checkpoint_every": 4,
        "keep_checkpoints": 5,
        "metrics_port": 0,
        "log_every": 4,
    },
    # A 2-stage pipeline of mini_mlp (4 micro-batches of 8), checkpointed every 10 steps.
    "pipeline": {"parallel": "pipeline", "micro_batch": 32, "checkpoint_every": 10, "log_every": 10, "metrics_port": 0},
    # What the pipeline is compared with: the same batches in one process.
    "pipeline_reference": {
        "wrapper": "none",
        "micro_batch": 32,
        "checkpoint_every": 10,
        "log_every": 10,
        "metrics_port": 0,
    },
    # Heals in place (the test gives heal_store): a global batch of 48 in micro-batches of <= 8, float64 so that a
    # step on 2 ranks equals the same step on 3 to round-off, a progress line per step, only the final checkpoint.
    "healing": {
        "heal": "in_place",
        "effective_batch": 48,
        "micro_batch": 8,
        "dataset_size": 960,
        "dtype": "float64",
        "checkpoint_every": 100000,
        "log_every": 1,
        "metrics_port": 0,
        "rendezvous_timeout_seconds": 120,  # the first world's and every quorum's deadline, on a busy machine
    },
    # Serves /metrics (the test gives metrics_port) and keeps it up after FINISHED, for the test to scrape.
    "scraped": {"metrics_linger_seconds": 60},
}


def worker_args(run: str, **settings: object) -> list[str]:
    """The flags of ``RUNS[run]`` with ``settings`` (TrainConfig field names) added or overriding, in field order.

    Example::

        worker_args("until_stopped", checkpoint_dir=tmp_path)
        # ['--steps', '100000', '--checkpoint-every', '100000', '--metrics-port', '0', '--log-every', '50',
        #  '--checkpoint-dir', '/tmp/...']
    """
    merged = {**RUNS[run], **settings}
    return [part for field, value in merged.items() for part in (f"--{field.replace('_', '-')}", str(value))]


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


OUTPUT_DIR: Callable[[], Path] | None = None  # set per test by tests/conftest.py: where keep_output writes


def keep_output(cmd, code, stdout: str, stderr: str, note: str = "") -> str:
    """Write a worker's whole output and exit code to ``OUTPUT_DIR`` and return them as text for an assertion.

    Args:
        cmd: the command line (list or string).
        code: the exit code (negative: killed by that signal), or a description such as "still running".
        stdout, stderr: everything the process printed.
        note: what the test was waiting for.

    Example::

        assert result.returncode == 0, keep_output(result.args, result.returncode, result.stdout, result.stderr)
    """
    if isinstance(code, int) and code < 0:
        code = f"{code} (killed by {signal.Signals(-code).name})"
    text = (
        f"command: {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))}\nexit: {code}\n"
        + (f"{note}\n" if note else "")
        + f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n"
    )
    where = ""
    if OUTPUT_DIR is not None:
        folder = OUTPUT_DIR()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{time.strftime('%H%M%S')}-{os.getpid()}-{len(list(folder.iterdir()))}.log"
        path.write_text(text)
        where = f"(whole output also in {path})\n"
    return where + text


# -- the workers' start: app.world.template forks each from a process that has imported torch (LAUNCH_FORK=0: each
# its own interpreter). One template per rank index, so the ranks of one run differ in their string-hash seed.
def start_module(module: str, *args: str, env: dict[str, str] | None = None, slot: int = 0):
    """``python -m MODULE ARGS``, running, with text pipes: a ``ForkedWorker`` (``Popen`` if LAUNCH_FORK=0)."""
    return world_template.start_module(module, *args, env=env or clean_env(), slot=slot)


def torchrun(
    *args: str, nproc: int = 2, timeout: float = HANG_TIMEOUT_S, env: dict[str, str] | None = None, **popen
) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "app.train", *args]
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        **popen,
    )


def run_process(*args: str, timeout: float = HANG_TIMEOUT_S, env: dict[str, str] | None = None, **popen):
    """The worker as one plain process (``python -m app.train``), to its end: a world of one, or one rank given
    torchrun's variables in ``env``."""
    if not popen:
        return run_module("app.train", *args, timeout=timeout, env=env)
    return subprocess.run(
        [PYTHON, "-m", "app.train", *args],
        cwd=REPO,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        **popen,
    )


def run_module(
    module: str, *args: str, timeout: float = HANG_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` to its end, as ``subprocess.run`` with captured text output (killed and
    ``TimeoutExpired`` past ``timeout``), forked from a template unless LAUNCH_FORK=0: the launcher's tests
    use it."""
    proc = start_module(module, *args, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill([proc])
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The worker as one plain process, running: read it with ``wait_for_log`` and ``finish``."""
    return start_module("app.train", *args, env=env)


def start_torchrun(*args: str, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "app.train", *args]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",  # a stray undecodable byte must not end the reading as if the output had closed
    )


def start_ranks(
    *args: str, world_size: int = 2, port: int | None = None, nodes: int = 1, **extra_env: str
) -> list[subprocess.Popen]:
    """The worker as ``world_size`` plain processes with torchrun's variables (rank 0 hosts the store), as torchrun
    numbers them on ``nodes`` machines (``nodes=2``, 2 ranks: each is local rank 0 of its node)."""
    port = port or free_port()
    per_node = world_size // nodes
    procs = []
    for rank in range(world_size):
        env = clean_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank % per_node),
            WORLD_SIZE=str(world_size),
            GROUP_RANK=str(rank // per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **extra_env,
        )
        procs.append(start_module("app.train", *args, env=env, slot=rank))
    return procs


def run_ranks(*args: str, world_size: int = 2, timeout: float = HANG_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``start_ranks`` to their end, read as a ``torchrun`` run is: every rank's output in one stdout and one stderr,
    exit 0 only when every rank exited 0 (else the first rank's failing code). For the tests that are not about
    torchrun: its agent is one more interpreter importing torch, and it starts the ranks without the template."""
    procs = start_ranks(*args, world_size=world_size)
    outs = finish(procs, timeout=timeout)
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    cmd = [f"{world_size} ranks:", PYTHON, "-m", "app.train", *args]
    return subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in outs), "".join(e for _, e in outs))


def finish(procs: Sequence[subprocess.Popen], timeout: float = HANG_TIMEOUT_S) -> list[tuple[str, str]]:
    """Every process's ``(stdout, stderr)`` once it has exited; any still running after that (or after a failure
    on the way) is killed, so a test never leaves a worker behind."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        kill(procs)


def kill(procs: Sequence[subprocess.Popen]) -> None:
    """Kill whatever in ``procs`` still runs. SIGKILL ends a frozen (SIGSTOPped) process too; continuing it first
    would let it run for a moment, see its peers gone and write a flight-recorder dump a drill says it never left."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.send_signal(signal.SIGCONT)
            p.wait()


def wait_for_log(proc: subprocess.Popen, text: str, timeout: float = 90) -> None:
    """Wait for ``text`` in the worker's log (stderr); the rest stays in the pipe for ``finish``/communicate."""
    wait_for_lines(proc, proc.stderr, text, timeout=timeout)


def wait_for_lines(
    proc: subprocess.Popen, stream, wanted: str, count: int = 1, timeout: float = HANG_TIMEOUT_S
) -> list[str]:
    """Read ``stream`` (``proc.stdout`` or ``proc.stderr``) until ``count`` lines contain ``wanted``; return the
    lines read. Stops reading right after the last match, so the rest stays in the pipe for ``communicate()``.

    The reading happens in a thread, the waiting on a queue with a timeout: a worker that hangs without printing
    anything blocks ``readline()`` forever, and a deadline checked between reads would never be reached.
    """
    lines: queue.Queue[str | BaseException | None] = queue.Queue()

    def pump() -> None:
        found = 0
        try:
            for line in iter(stream.readline, ""):
                found += wanted in line
                lines.put(line)
                if found >= count:
                    return  # no further readline: what follows belongs to communicate()
        except BaseException as e:  # reported as what it is, not mistaken for the end of the output
            lines.put(e)
        finally:
            lines.put(None)  # end of output (or done): wakes the waiter

    threading.Thread(target=pump, name="wait-for-lines", daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            which = "stdout" if stream is proc.stdout else "stderr"
            raise AssertionError(
                f"{count}× {wanted!r} not seen within {timeout:g}s\n"
                + keep_output(
                    proc.args,
                    "nothing (still running)" if proc.poll() is None else proc.returncode,
                    "",
                    "",
                    note=f"{which} so far (the other stream unread):\n{''.join(seen)}",
                )
            ) from None
        if line is None:
            break
        if isinstance(line, BaseException):
            raise AssertionError(f"reading the worker's output failed: {line!r}") from line
        seen.append(line)
    if sum(wanted in line for line in seen) < count:
        # The stream reached its end: the process closed it, so it is exiting; everything it wrote is in `seen`
        # and in the other pipe, which read() drains without blocking once the process is gone.
        try:
            code = proc.wait(timeout=10)
            other = proc.stderr if stream is proc.stdout else proc.stdout
            rest = other.read() if other else ""
        except subprocess.TimeoutExpired:
            code, rest = "nothing (still running, output closed)", ""
        read, unread = "".join(seen), rest
        out, err = (read, unread) if stream is proc.stdout else (unread, read)
        raise AssertionError(
            f"worker closed its output and exited {code} before printing {count}× {wanted!r}\n"
            + keep_output(proc.args, code, out, err, note=f"waited for {count}× {wanted!r}")
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
    """A failed run for an assertion message: exit code and the whole output (also kept in a file)."""
    return keep_output(result.args, result.returncode, result.stdout or "", result.stderr or "")
