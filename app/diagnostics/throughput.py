"""How fast a rank trains against what its hardware can do, and the memory it holds: the figures behind MFU.

- ``StepFlops``: the FLOPs of one optimizer step on this rank, counted once, on the first step it wraps, with
  ``torch.utils.flop_counter``'s formulas (matmuls, convolutions and attention, forward and backward; whatever
  the step kind: DDP, ZeRO, a pipeline stage each count their own work). Steps repeat, so one count serves all.
- ``measure_matmul_peak``: this machine's float32 matmul rate as one rank sees it, timed once (the "peak" of MFU:
  what this process gets from its share of the cores, or its GPU; not a datasheet's number).
- ``tokens_per_sample``: a token-id input's sequence length; one "token" per sample for any other input.
- ``memory``: resident set size now and at its peak, and CUDA's allocated and reserved bytes where there is a GPU.

MFU = FLOPs per step / step seconds / peak FLOP/s (PaLM's model FLOPs utilisation, with a measured peak).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

PEAK_MATMUL_SIZE = 512  # n of the n x n float32 matmuls timed: large enough to reach the BLAS's steady rate
PEAK_MATMUL_SIZE_CUDA = 4096  # a GPU's steady rate needs far larger matmuls than a CPU core's
PEAK_SECONDS = 0.2  # timed for about this long in all, after one warm-up matmul
PEAK_WINDOWS = 4  # ...split into this many windows, of which the fastest counts


class StepFlops:
    """``with flops.measure(): step()`` counts the FLOPs of the first step it wraps; ``per_step`` holds them."""

    def __init__(self) -> None:
        self.per_step: int | None = None

    @contextlib.contextmanager
    def measure(self):
        if self.per_step is not None:
            yield
            return
        counter = _CountFlops()
        with counter:
            yield
        self.per_step = counter.total


class _CountFlops(TorchDispatchMode):
    """``torch.utils.flop_counter``'s formulas over every op dispatched, without ``FlopCounterMode``'s module tracker:
    its backward hooks fail under ``autograd.grad`` (what the pipeline schedules' backward calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # dynamo skips a frame first met under a dispatch mode that does not say this, and from then on runs it
        # eager: the first step, counted here, left `compile` compiling nothing (tests/integration/test_train_compile).
        # Said, dynamo compiles under it, and the compiled graphs' ops are still counted where they reach the
        # dispatcher (matrix multiplies do, inductor's fused pointwise kernels do not).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def measure_matmul_peak(device: torch.device | str = "cpu", n: int | None = None) -> float:
    """FLOP/s of repeated ``n x n`` float32 matmuls on ``device``, as this process gets them now: the best of a few
    short windows, since a core shared with other processes only ever slows a window down."""
    device = torch.device(device)
    n = n or (PEAK_MATMUL_SIZE_CUDA if device.type == "cuda" else PEAK_MATMUL_SIZE)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = 0.0
    for _ in range(PEAK_WINDOWS):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < PEAK_SECONDS / PEAK_WINDOWS or reps < 2:
            torch.mm(a, b)
            reps += 1
            if device.type == "cuda" and reps % 16 == 0:
                sync()
        sync()
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - start))
    return best


def tokens_per_sample(inputs: torch.Tensor) -> int:
    """Token ids (an integer input of shape (batch, sequence, ...)): elements per sample; anything else: 1."""
    if inputs.is_floating_point() or inputs.dim() < 2:
        return 1
    return inputs[0].numel()


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size now (``/proc/self/statm``; the peak where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return _max_rss()


def peak_rss_bytes() -> int:
    # The kernel's high-water mark is updated lazily, so it can trail the resident size read a moment later.
    return max(_max_rss(), rss_bytes())


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux reports KiB)


def memory(device: torch.device) -> dict[str, int]:
    """``rss``, ``peak_rss``, and on a GPU ``cuda_allocated``, ``cuda_reserved``, ``cuda_peak_allocated`` bytes."""
    out = {"rss": rss_bytes(), "peak_rss": peak_rss_bytes()}
    if device.type == "cuda":
        out["cuda_allocated"] = torch.cuda.memory_allocated(device)
        out["cuda_reserved"] = torch.cuda.memory_reserved(device)
        out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return out
