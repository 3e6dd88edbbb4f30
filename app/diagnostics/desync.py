"""The desync check: before each collective, the ranks compare what they are about to run, and stop at the first
mismatch with one line naming both ops, instead of hanging or silently reducing the wrong tensors.

What ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for PyTorch's own collectives, for ours: every collective the flight
recorder sees (``FlightRecorder.start``) is preceded by an all-gather of its fingerprint (sequence number, op,
element count, dtype, what issued it) over the same process group. Every rank then holds every fingerprint, so
every rank finds the same first mismatch and raises the same ``CollectiveDesync``, after dumping its ring. It
doubles the number of collectives (and adds a blocking one before each asynchronous bucket), so it is off unless
asked for (``desync_check`` in the trainer's config, ``enable()`` elsewhere). Point-to-point ops are not checked: only
two ranks take part, and their order differs by design between pipeline stages.

    from app.diagnostics import desync
    desync.enable()          # on every rank, after init_process_group
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from app.diagnostics.doctor import disagreement
from app.diagnostics.recorder import FIELDS, RECORDER, FlightRecorder, failure_reason

# Codes in the fingerprint; a name not listed gets one past the end (still compared, named from the entries).
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "all_gather_object", "broadcast_object")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")


class CollectiveDesync(RuntimeError):
    """The ranks are about to run different collectives; ``str()`` is the one-line diagnosis."""


def enable(recorder: FlightRecorder = RECORDER) -> None:
    """Check every recorded collective's fingerprint across its group before it runs."""
    recorder.check = lambda entry, tensor, group: check(recorder, entry, tensor, group)


def disable(recorder: FlightRecorder = RECORDER) -> None:
    recorder.check = None


def fingerprint(entry: list, tensor) -> list[int]:
    seq, op = entry[0], entry[1]
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
    numel = tensor.numel() if tensor is not None else 0
    code = OPS.index(op) if op in OPS else len(OPS)
    # The source too: two ranks all-reducing equal sizes for different reasons pair up silently, and reduce garbage.
    return [seq, code, numel, DTYPES.index(dtype) if dtype in DTYPES else -1, zlib.crc32(entry[5].encode())]


def check(recorder: FlightRecorder, entry: list, tensor, group) -> None:
    """All-gather this collective's fingerprint over ``group``; raise ``CollectiveDesync`` where they differ."""
    device = tensor.device if tensor is not None else torch.device("cpu")
    mine = torch.tensor(fingerprint(entry, tensor), dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, mine, group=group)
    rows = [tuple(r) for r in everyone.view(size, -1).tolist()]
    if len(set(rows)) == 1:
        return
    # Every rank saw the same rows: every rank takes this branch, so the object gather below is matched too.
    described: list = [None] * size
    dist.all_gather_object(described, as_dict(entry, tensor), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    line = disagreement(entry[0], entry[2], dict(zip(ranks, described)))
    error = CollectiveDesync(line)
    recorder.dump(failure_reason(error))
    raise error


def as_dict(entry: list, tensor) -> dict:
    """The entry as a dump holds it (what the doctor's line is written from)."""
    row = dict(zip(FIELDS, entry))
    row["dtype"] = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
    return row
