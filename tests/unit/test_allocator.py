"""app.worker.allocator: with glibc's mmap threshold pinned, memory a process frees goes back to the OS, so its
resident set follows its tensors; without it, blocks freed below glibc's moved threshold stay resident. Each case
runs in a fresh interpreter (the threshold is process-wide, and glibc's moves are one-way)."""

from __future__ import annotations

import os
import subprocess
import sys

from app.worker.allocator import MMAP_THRESHOLD_BYTES, return_freed_memory_to_the_os
from tests.trainer_run import REPO

# Frees one 8 MiB block (an unpinned threshold rises to 8 MiB), then holds 50 blocks of 2 MiB and frees all but the
# last (which keeps the heap's top in place, so nothing below it is trimmed): prints the MiB still resident.
HOLES = """
import os, sys
from app.worker.allocator import return_freed_memory_to_the_os, trim

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

if sys.argv[1] != "none":
    assert return_freed_memory_to_the_os(int(sys.argv[1])) is True
block = bytearray(8 << 20)
del block
before = rss()
blocks = [bytearray(2 << 20) for _ in range(50)]
last = blocks[-1]
del blocks
if len(sys.argv) > 2:  # the holes made: give them back now
    assert return_freed_memory_to_the_os() is True if sys.argv[2] == "pin" else trim() is None
print((rss() - before) >> 20)
"""


def resident_mib_after_freeing(threshold: str, *then: str) -> int:
    # glibc's own defaults: no tunable from this environment moves its threshold
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", HOLES, threshold, *then],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout)


def test_a_pinned_threshold_gives_freed_blocks_back_and_glibcs_moving_one_keeps_them():
    assert resident_mib_after_freeing(str(MMAP_THRESHOLD_BYTES)) < 20  # the one block still held, about
    assert resident_mib_after_freeing("none") > 80  # 49 freed blocks of 2 MiB still resident
    assert resident_mib_after_freeing(str(4 << 20)) > 80  # pinned above the blocks' size: they are heap blocks too


def test_pinning_or_trimming_after_the_holes_are_made_gives_them_back():
    assert resident_mib_after_freeing("none", "pin") < 20  # it trims the heap as it pins
    assert resident_mib_after_freeing("none", "trim") < 20


def test_glibcs_own_setting_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_memory_to_the_os() is False
