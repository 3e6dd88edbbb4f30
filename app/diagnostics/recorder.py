"""The flight recorder: every collective this process issues, in a bounded ring, dumped when something goes wrong.

One recorder per process (``RECORDER``). The call sites record explicitly, around the collective they issue::

    entry = RECORDER.start("all_reduce", group, bucket, "bucket 3 of our DDP")
    work = dist.all_reduce(bucket, group=group, async_op=True)
    ...
    RECORDER.end(entry)  # once the work's wait returned

An entry is a plain list ``[seq, op, group, bytes, dtype, source, start, end, peer]``: ``seq`` counts the
collectives of its process group (a collective is matched by its position in that sequence on every rank, which is
what the doctor lines up), point-to-point ops count per (group, peer, op) instead (``peer`` is the other rank: a
rank's send #k to a peer is that peer's recv #k from it). ``start``
and ``end`` are ``time.time()`` so that ranks on one machine (or NTP-synced ones) can be compared; ``end`` stays None
while the op is in flight, which is what a dump taken during a hang shows. No tensor is kept or copied.

``dump(reason)`` writes ``<dump_dir>/rank-<r>.json`` atomically (a temp file, then ``os.replace``): a header (job,
world id, rank, world size, pid, host, time, reason) and the entries, one per line, so that the doctor
(``app.diagnostics.doctor``) can still read a truncated file. A dump happens on a collective timeout or any failure
of the training loop (``app.worker.trainer``), on SIGUSR1 (``install_dump_signal``), and on a desync
(``app.diagnostics.desync``). Read ``docs/diagnostics.md`` for the whole story.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger("app.diagnostics")
FORMAT = "ddp-flight-recorder/1"  # the header's "format": a dump of another shape is refused by name
FIELDS = ("seq", "op", "group", "bytes", "dtype", "source", "start", "end", "peer")
DEFAULT_CAPACITY = 4096  # entries kept per rank: a few hundred steps of a model with a few buckets
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


class FlightRecorder:
    """A ring of the last ``capacity`` collectives of this process (``capacity=0``: records nothing).

    ``start``/``end`` are on the hot path (once per bucket per step): a list append, a dict update, two clock reads.
    A fingerprint check (``check``, set by ``app.diagnostics.desync.enable``) runs before each collective when set.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.configure(capacity=capacity)

    def configure(
        self,
        *,
        capacity: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        dump_dir: str | os.PathLike | None = None,
        job: str = "",
        world_id: str = "",
    ) -> None:
        """Set who this process is and where its dump goes; a new capacity starts an empty ring."""
        if capacity is not None:
            self.capacity = capacity
            self._ring: collections.deque = collections.deque(maxlen=max(capacity, 1))
            self._seq: dict = {}
            self._labels: dict[int, str] = {}
            self.recorded = 0  # entries ever started (the ring keeps the last `capacity`)
            self.check = None  # the desync check: called with the entry and the tensor before the collective
        self.rank, self.world_size, self.job, self.world_id = rank, world_size, job, world_id
        self.dump_dir = Path(dump_dir) if dump_dir else None

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def start(self, op: str, group, tensor, source: str, peer: int | None = None) -> list | None:
        """Record a collective about to be issued; the entry to hand to ``end`` (None when the recorder is off)."""
        if not self.capacity:
            return None
        label = self._labels.get(id(group)) or self._label(group)
        key = label if peer is None else (label, peer, op)  # a send #k to a peer is its recv #k from us
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        entry = [seq, op, label, nbytes, tensor.dtype if tensor is not None else None, source, time.time(), None, peer]
        self._ring.append(entry)
        self.recorded += 1
        if self.check is not None and peer is None:
            self.check(entry, tensor, group)
        return entry

    @staticmethod
    def end(entry: list | None) -> None:
        """The collective of ``entry`` completed (its wait returned); a second call keeps the first time."""
        if entry is not None and entry[7] is None:
            entry[7] = time.time()

    def last_seq(self, group=None) -> int:
        """Collectives issued so far in ``group`` (None: the default group), the last entry's ``seq``."""
        return self._seq.get(self._labels.get(id(group)) or self._label(group), 0)

    def _label(self, group) -> str:
        # "world" for the default group, else its global ranks: the same string on every member, so dumps line up.
        import torch.distributed as dist

        label = "world"
        if group is not None and dist.is_initialized() and group is not dist.group.WORLD:
            ranks = dist.get_process_group_ranks(group)
            if len(ranks) != dist.get_world_size():
                label = "ranks " + ",".join(map(str, ranks))
        self._labels[id(group)] = label
        return label

    def entries(self) -> list[list]:
        """A snapshot of the ring, oldest first, dtypes as their names (``torch.float32`` -> ``float32``)."""
        out = []
        for e in list(self._ring):
            out.append([*e[:4], str(e[4]).removeprefix("torch.") if e[4] is not None else None, *e[5:]])
        return out

    def header(self, reason: str) -> dict:
        return {
            "format": FORMAT,
            "job": self.job,
            "world_id": self.world_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "reason": reason,
            "capacity": self.capacity,
            "recorded": self.recorded,
            "fields": list(FIELDS),
        }

    def dump(self, reason: str, directory: str | os.PathLike | None = None) -> Path | None:
        """Write this rank's dump (atomically); its path, or None when there is nowhere to write or nothing on."""
        target = Path(directory) if directory else self.dump_dir
        if target is None or not self.capacity:
            return None
        lines = [json.dumps({"header": self.header(reason)})[:-1] + ', "entries": [']
        body = [json.dumps(e) for e in self.entries()]
        text = "\n".join(lines + [",\n".join(body), "]}\n"])
        path = target / f"rank-{self.rank}.json"
        try:
            target.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:  # a dump must never turn a failure into another one
            log.warning("flight recorder: cannot write %s (%s)", path, e.strerror)
            return None
        log.warning("flight recorder: %s: %d collectives written to %s", reason, len(body), path)
        return path


RECORDER = FlightRecorder()


def failure_reason(error: BaseException) -> str:
    """A dump's reason for a failure: what the doctor's table shows in a word or three."""
    text = str(error)
    if type(error).__name__ == "CollectiveDesync":
        return "desync"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "collective timeout"
    if "connection closed" in text.lower() or "connection reset" in text.lower() or "read error" in text.lower():
        return "peer went away"
    return f"failure: {type(error).__name__}"


def install_dump_signal(recorder: FlightRecorder = RECORDER, signum: int = signal.SIGUSR1) -> None:
    """SIGUSR1 dumps the ring, even while the main thread is blocked inside a collective.

    A Python handler runs only in the main thread between bytecodes, never during a gloo wait: so the handler only
    marks the signal, and the C-level part of it writes the signal's number to a wakeup pipe that a thread reads.
    Call from the main thread (``signal`` requires it); a second call does nothing.
    """
    if getattr(recorder, "_signal_thread", None) is not None:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def wait() -> None:
        while True:
            data = os.read(read_fd, 64)
            if signum in data:
                recorder.dump(signal.Signals(signum).name)

    recorder._signal_thread = threading.Thread(target=wait, name="flight-dump", daemon=True)
    recorder._signal_thread.start()
