"""Reading the flight recorder's dumps back: every ``rank-N.json`` of a directory, checked and, where damaged, read as
far as it goes. Torch-free: the doctor runs anywhere a dump can be copied to.

``load(directory)`` returns a ``Dumps``: the good ones by rank, and one note per file that was not (truncated,
from another job, not a dump at all), each a line for the user. A truncated file keeps the entries before the cut:
the recorder writes the header on the first line and one entry per line (``app.diagnostics.recorder``).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from app.diagnostics.recorder import FIELDS, FORMAT

ENTRIES_MARK = ', "entries": ['


@dataclass
class Dump:
    header: dict
    entries: list[dict]
    path: Path
    truncated: bool = False

    @property
    def rank(self) -> int:
        return self.header["rank"]

    @property
    def time(self) -> float:
        return self.header["time"]


@dataclass
class Dumps:
    by_rank: dict[int, Dump] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one line per file left out or read in part
    world_size: int = 0

    @property
    def bad_input(self) -> bool:
        return bool(self.notes)


class NoDumps(ValueError):
    """Nothing to diagnose in that directory; ``str()`` is the one-line reason and fix."""


def find_directory(path: str | Path) -> Path:
    """``path`` itself when it holds dumps, else its ``flight/`` (a checkpoint directory was given)."""
    path = Path(path)
    if not path.is_dir():
        raise NoDumps(f"{path}: no such directory; give the flight recorder's directory (<checkpoint_dir>/flight)")
    if not any(path.glob("rank-*.json")) and (path / "flight").is_dir():
        path = path / "flight"
    if not any(path.glob("rank-*.json")):
        raise NoDumps(
            f"{path}: no rank-N.json dumps; the ranks write them on a collective timeout, a failure or SIGUSR1 "
            f"(is checkpoint_dir set, and flight_recorder_entries > 0?)"
        )
    return path


def load(path: str | Path) -> Dumps:
    """Every dump in ``path`` (or its ``flight/``); dumps of another job than most of them are left out, with a note."""
    directory = find_directory(path)
    out = Dumps()
    read: list[Dump] = []
    for file in sorted(directory.glob("rank-*.json"), key=lambda p: (len(p.name), p.name)):
        dump, note = read_dump(file)
        if note:
            out.notes.append(note)
        if dump is not None:
            read.append(dump)
    if not read:
        return out
    jobs = Counter((d.header.get("job"), d.header.get("world_id")) for d in read)
    (job, world_id), _ = jobs.most_common(1)[0]
    for d in read:
        if (d.header.get("job"), d.header.get("world_id")) != (job, world_id):
            out.notes.append(
                f"{d.path.name}: from another job (job {d.header.get('job')!r}, world {d.header.get('world_id')!r}; "
                f"the others: job {job!r}, world {world_id!r}): left out; delete stale dumps before a new run"
            )
            continue
        out.by_rank[d.rank] = d
    out.world_size = max(d.header.get("world_size", 0) for d in out.by_rank.values())
    return out


def read_dump(file: Path) -> tuple[Dump | None, str | None]:
    """One dump and, when it is not whole, the note saying so (None, note: nothing readable)."""
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        return None, f"{file.name}: cannot be read ({e.strerror}): left out"
    try:
        doc = json.loads(text)
        header, rows, truncated = doc["header"], doc["entries"], False
    except (ValueError, KeyError, TypeError):
        header, rows = _salvage(text)
        truncated = True
    if not isinstance(header, dict) or header.get("format") != FORMAT or not isinstance(header.get("rank"), int):
        return None, f"{file.name}: not a flight recorder dump (no {FORMAT} header): left out"
    entries = [dict(zip(header.get("fields", FIELDS), row)) for row in rows if isinstance(row, list)]
    dump = Dump(header, entries, file, truncated)
    if truncated:
        return dump, f"{file.name}: truncated after {len(entries)} entries: read those (the rest is lost)"
    return dump, None


def _salvage(text: str) -> tuple[dict | None, list]:
    """The header and the whole entry lines of a cut-off dump (its first line is the header, then one per line)."""
    lines = text.split("\n")
    first = lines[0]
    try:
        header = json.loads(first.removesuffix(ENTRIES_MARK) + "}")["header"]
    except (ValueError, KeyError, TypeError):
        return None, []
    rows = []
    for line in lines[1:]:
        try:
            rows.append(json.loads(line.rstrip().removesuffix(",")))
        except ValueError:
            break  # the cut: nothing after it can be trusted
    return header, rows
