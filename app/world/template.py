"""``python -m MODULE ARGS`` on this machine, forked from a template process that has imported torch.

    proc = start_module("app.train", "--steps", "3", env=env)          # a Popen-like process, text pipes
    out, err = proc.communicate(timeout=300)
    start_module("app.world.ranks", ..., env=env, slot=1, pipes=False)  # a rank of a local world: this stdout

Every process that runs torch code pays ``import torch`` (seconds of CPU) before it does anything, and a local world
starts several at once on the same cores. So each is forked from a template (a "zygote") that did that import once,
then runs ``python -m MODULE`` as a fresh interpreter would: its own argv, environment, cwd, stdio, rlimits and exit
code, real signals to its pid; what it starts itself (the launcher's trainers) is exec'd as ever. One template per
slot (rank r of every world comes from template r): as with separate interpreters, the ranks of one world differ in
their string-hash seed, so a set iterated in hash order on one rank and not another still shows. The template is
started on first use, imports nothing but torch (CUDA is not initialised: an NCCL rank can still pick its GPU), and
ends with the process that started it.

``LAUNCH_FORK=0`` (app.worker.config.launch) starts every process as its own interpreter (``subprocess.Popen``)
instead; ``make bench-startup`` measures what the fork saves (bench/results/startup.json).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import resource
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from app.worker.config.launch import LaunchConfig

REPO = Path(__file__).resolve().parents[2]  # the checkout: the cwd of every process started here
PYTHON = sys.executable
_TEMPLATES: dict[int, subprocess.Popen] = {}
_TEMPLATE_DIR: list[str] = []  # made on first use: not every process importing this module starts one
_RLIMITS = [getattr(resource, n) for n in ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_AS")]


def fork_enabled() -> bool:
    """``LAUNCH_FORK`` as this process's environment says it now (a bad LAUNCH_* value raises ConfigError)."""
    return LaunchConfig.from_environ().fork


def start_module(
    module: str, *args: str, env: dict[str, str], slot: int = 0, pipes: bool = True
) -> ForkedWorker | subprocess.Popen:
    """``python -m MODULE ARGS`` with ``env``, running: forked from template ``slot`` (``Popen`` if LAUNCH_FORK=0).

    ``pipes``: its stdout and stderr are text pipes to read (``proc.stdout``), as ``Popen(..., stdout=PIPE)``;
    otherwise it writes to this process's own.
    """
    if fork_enabled():
        return ForkedWorker(module, args, env, slot=slot, pipes=pipes)
    stdio = subprocess.PIPE if pipes else None
    return subprocess.Popen(
        [PYTHON, "-m", module, *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdio,
        stderr=stdio,
        text=True,
        errors="replace",  # a stray undecodable byte must not end the reading as if the output had closed
    )


def _template(slot: int) -> str:
    """The socket of template ``slot``, started (and waited ready) on first use; it exits when this process does."""
    if not _TEMPLATE_DIR:
        _TEMPLATE_DIR.append(tempfile.mkdtemp(prefix="ddp-cluster-template-"))
    path = os.path.join(_TEMPLATE_DIR[0], f"slot-{slot}")
    if slot not in _TEMPLATES or _TEMPLATES[slot].poll() is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a template that died: its successor binds the same path
        proc = subprocess.Popen(
            [PYTHON, "-c", f"from app.world.template import serve_forks; serve_forks({path!r})"],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},  # read as torch loads
            stdin=subprocess.PIPE,  # its end of file (this process gone) ends the template
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = proc.stdout.readline()
        assert ready == "ready\n", f"the process template did not start: {ready!r}, exit {proc.poll()}"
        _TEMPLATES[slot] = proc
    return path


@atexit.register
def close_templates() -> None:
    for proc in _TEMPLATES.values():
        proc.stdin.close()
        proc.wait(30)  # waited for: its children's CPU time counts in this process's, as a direct child's would
    _TEMPLATES.clear()
    for folder in _TEMPLATE_DIR:
        shutil.rmtree(folder, ignore_errors=True)


def serve_forks(path: str) -> None:
    """The template's loop: import torch once, then fork a process per request and report each one's exit status."""
    import torch  # noqa: F401 - the point: every process forked from here has it

    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes back on
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [], 0.05)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _tell(waiting.pop(pid), os.waitstatus_to_exitcode(status))
        if sys.stdin in readable and not sys.stdin.readline():
            # The starting process is gone (an xdist worker need not run its atexit): its children are killed or
            # will be.
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))  # the last template of that process out removes the folder
            return
        if server in readable:
            conn, _ = server.accept()
            request, fds = _receive(conn)
            pid = os.fork()
            if pid == 0:
                _become_module(request, fds, [server, conn, *waiting.values()])  # raises SystemExit at its end
            for fd in fds:
                os.close(fd)
            _tell(conn, pid, close=False)
            waiting[pid] = conn


def _tell(conn: socket.socket, number: int, close: bool = True) -> None:
    with contextlib.suppress(OSError):  # the starter no longer asks (its process gone, or the object dropped)
        conn.sendall(f"{number}\n".encode())
    if close:
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size, _, body = data.partition(b"\n")
    while len(body) < int(size):
        body += conn.recv(1 << 20)
    return json.loads(body), fds


def _become_module(request: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` as asked. Never returns: it ends as that interpreter
    would, by the module's own exit (app.train and the launcher end in os._exit) or its SystemExit or exception
    leaving the interpreter (atexit handlers, a traceback and exit 1)."""
    for s in inherited:
        s.close()
    for target, fd in enumerate(fds):  # stdin, stdout, stderr
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.umask(request["umask"])
    for which, limits in zip(_RLIMITS, request["rlimits"]):
        resource.setrlimit(which, tuple(limits))
    random.seed()  # the template's state would otherwise be every child's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *request["args"]]
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # the module's end: the interpreter's exit, not back into the template's loop


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for a moment, for every thread)."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)


class ForkedWorker:
    """A process forked by a template, used as a ``subprocess.Popen`` of ``python -m MODULE ARGS`` is (text pipes):
    ``pid``, ``args``, ``stdout``/``stderr``, ``returncode``, ``poll``/``wait``/``communicate``, signals."""

    def __init__(self, module: str, args: Sequence[str], env: dict[str, str], slot: int = 0, pipes: bool = True):
        self.args = [PYTHON, "-m", module, *args]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX)
        self._conn.connect(_template(slot))
        body = json.dumps(
            {
                "module": module,
                "args": list(args),
                "env": env,
                "cwd": str(REPO),
                "umask": _umask(),
                "rlimits": [resource.getrlimit(r) for r in _RLIMITS],
            }
        ).encode()
        # Without pipes, this process's file descriptors 1 and 2: sys.stdout may be a stand-in (pytest's capsys).
        out_r, out_w = os.pipe() if pipes else (None, 1)
        err_r, err_w = os.pipe() if pipes else (None, 2)
        with open(os.devnull, "rb") as null:
            socket.send_fds(self._conn, [f"{len(body)}\n".encode() + body], [null.fileno(), out_w, err_w])
        self.stdout = self.stderr = None
        if pipes:
            os.close(out_w)
            os.close(err_w)
            # Open as long as the object is: read by the caller, closed by communicate (as Popen's are).
            self.stdout = open(out_r, errors="replace")  # noqa: SIM115
            self.stderr = open(err_r, errors="replace")  # noqa: SIM115
        self._buffer = b""
        self.pid = int(self._line(None))
        self._read: dict[str, list[str]] = {}
        self._readers: list[threading.Thread] = []

    def _line(self, timeout: float | None) -> str | None:
        """The template's next line (a pid, then an exit status); None at its end; TimeoutExpired if none yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            self.returncode = int(line) if line is not None else -signal.SIGKILL  # the template gone with it
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything both pipes still hold, once the process has exited (``TimeoutExpired`` if not within
        ``timeout``; a later call goes on reading where this one stopped)."""
        if not self._readers:
            for name in ("stdout", "stderr"):
                self._read[name] = []
                stream, into = getattr(self, name), self._read[name]
                if stream is None:
                    continue
                reader = threading.Thread(target=lambda s=stream, i=into: i.append(s.read()), daemon=True)
                reader.start()
                self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return "".join(self._read["stdout"]), "".join(self._read["stderr"])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited since: as Popen, nothing to signal
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
