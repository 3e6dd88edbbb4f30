"""The doctor: the ranks' flight recorder dumps merged, and what happened said in one line, then a table per rank.

    python -m app.doctor /ckpt/flight      # or the checkpoint directory itself; exit 2 on a bad or missing dump

The line is the first of these that the dumps show, in this order (a desync usually ends in a hang, so it goes
first; a hang hides any straggler):

- a desync: at the first sequence number of a process group where the ranks' rings disagree on the op, its size,
  dtype or source, "ranks disagree at #57: rank 1 issued broadcast (...), the others (ranks 0, 2) all_reduce (...)
  (desync)";
- a hang: the earliest collective still in flight when the dumps were taken, "rank 2 never entered all_reduce #1834
  (bucket 3 of our DDP, 4.2 MiB); ranks 0, 1, 3 waited there 30 s" (a rank with no dump is named as such: a frozen
  or killed rank cannot write one);
- a straggler: one rank last into most collectives that every rank completed, with how late on average and its
  worst one;
- a lost rank: no dump from it while the others dumped for a failure with nothing in flight (a rank killed between
  collectives: its peers' next one failed at once), "rank 1 left no dump (killed or frozen); ranks 0, 2 stopped
  (peer went away) after all_reduce #2698 (...), which completed";
- else that nothing is wrong, up to which sequence number.

``summary_line(directory)`` is that line alone (None where there are no dumps), for a launcher's last line.
Clocks: the hang's "waited" is each rank's own dump time minus its own start time; only the straggler compares
start times across ranks, which holds on one machine and to NTP's precision across machines.
"""

from __future__ import annotations

import statistics
import sys

from app.diagnostics.dumps import Dumps, NoDumps, load
from app.exit_codes import BAD_CONFIG, OK

# In flight at least this long when its rank dumped: shorter is a collective caught running (a SIGUSR1 mid-step).
HANG_MIN_S = 1.0
STRAGGLER_SHARE = 0.6  # last into at least this share of the matched collectives
STRAGGLER_MIN_LATE_S = 0.005  # and this late on average: below, the order is scheduling noise
STRAGGLER_MIN_MATCHED = 5


def diagnose(dumps: Dumps) -> str:
    """The one-line diagnosis of ``dumps`` (see the module docstring for the order of the checks)."""
    if not dumps.by_rank:
        return "no readable dump: nothing to diagnose"
    return (
        desync_line(dumps)
        or hang_line(dumps)
        or p2p_line(dumps)
        or straggler_line(dumps)
        or lost_line(dumps)
        or healthy_line(dumps)
    )


def summary_line(directory) -> str | None:
    """The diagnosis of the dumps in ``directory`` (or its ``flight/``), prefixed ``doctor:``; None without dumps."""
    try:
        dumps = load(directory)
    except NoDumps:
        return None
    return f"doctor: {diagnose(dumps)}"


def collectives(dumps: Dumps) -> dict[str, dict[int, dict[int, dict]]]:
    """group -> rank -> seq -> entry, point-to-point ops left out (they are matched per pair, not per group)."""
    out: dict[str, dict[int, dict[int, dict]]] = {}
    for rank, dump in dumps.by_rank.items():
        for e in dump.entries:
            if e.get("peer") is None:
                out.setdefault(e["group"], {}).setdefault(rank, {})[e["seq"]] = e
    return out


def members(group: str, dumps: Dumps) -> list[int]:
    """The global ranks of a group label (``world`` or ``ranks 0,2``)."""
    if group == "world":
        return list(range(dumps.world_size))
    return [int(r) for r in group.removeprefix("ranks ").split(",")]


def desync_line(dumps: Dumps) -> str | None:
    first = None
    for group, by_rank in collectives(dumps).items():
        if len(by_rank) < 2:
            continue
        common = set.intersection(*(set(seqs) for seqs in by_rank.values()))
        for seq in sorted(common):
            prints = {rank: _print(seqs[seq]) for rank, seqs in by_rank.items()}
            if len(set(prints.values())) > 1:
                if first is None or seq < first[0]:
                    first = (seq, group, {rank: seqs[seq] for rank, seqs in by_rank.items()}, prints)
                break
    if first is None:
        return None
    seq, group, entries, _ = first
    return disagreement(seq, group, entries)


def disagreement(seq: int, group: str, entries: dict[int, dict]) -> str:
    """The line for ranks whose collective ``seq`` differs: the majority's op is "the others'", the odd ranks are
    named with theirs (also the desync check's error, ``app.diagnostics.desync``)."""
    by_print: dict[tuple, list[int]] = {}
    for rank in sorted(entries):
        by_print.setdefault(_print(entries[rank]), []).append(rank)
    majority = max(by_print.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    odd = "; ".join(f"{ranks_text(r)} issued {describe(entries[r[0]])}" for r in by_print.values() if r is not majority)
    where = f"#{seq}" if group == "world" else f"#{seq} of group {group}"
    others = f"the others ({ranks_text(majority)}) {describe(entries[majority[0]])}"
    return f"ranks disagree at {where}: {odd}, {others} (desync)"


def hang_line(dumps: Dumps) -> str | None:
    stuck = None  # the earliest-started collective still in flight on some rank
    for group, by_rank in collectives(dumps).items():
        for rank, seqs in by_rank.items():
            for seq, e in seqs.items():
                waited = dumps.by_rank[rank].time - e["start"]
                if e["end"] is None and waited >= HANG_MIN_S and (stuck is None or e["start"] < stuck[2]["start"]):
                    stuck = (group, seq, e)
    if stuck is None:
        return None
    group, seq, entry = stuck
    by_rank = collectives(dumps)[group]
    waiting, absent, silent = [], [], []
    for rank in members(group, dumps):
        e = by_rank.get(rank, {}).get(seq)
        if rank not in dumps.by_rank:
            silent.append(rank)
        elif e is not None and e["end"] is None:  # in flight where another rank waited HANG_MIN_S: waiting too
            waiting.append(rank)
        elif e is None and max(by_rank.get(rank, {0: None})) < seq:
            absent.append(rank)
    what = f"{entry['op']} #{seq}" + ("" if group == "world" else f" of group {group}") + f" ({_what(entry)})"
    waited = max(dumps.by_rank[r].time - by_rank[r][seq]["start"] for r in waiting)
    parts = []
    if absent:
        lasts = ", ".join(_last(by_rank.get(r, {}), dumps.by_rank[r].time) for r in absent)
        parts.append(f"{ranks_text(absent)} never entered {what} ({lasts})")
    if silent:
        parts.append(f"{ranks_text(silent)} left no dump (frozen or killed) and never completed {what}")
    if not parts:
        return f"every rank entered {what} and none completed it in {_seconds(waited)}: the transport failed"
    return f"{'; '.join(parts)}; {ranks_text(waiting)} waited there {_seconds(waited)}"


def p2p_line(dumps: Dumps) -> str | None:
    """The earliest send or recv in flight (pipeline stages), and whether its peer posted the other side."""
    stuck = None
    for rank, dump in dumps.by_rank.items():
        for e in dump.entries:
            late = e.get("peer") is not None and e["end"] is None and dump.time - e["start"] >= HANG_MIN_S
            if late and (stuck is None or e["start"] < stuck[1]["start"]):
                stuck = (rank, e)
    if stuck is None:
        return None
    rank, e = stuck
    peer, other = e["peer"], "send" if e["op"] == "recv" else "recv"
    waited = _seconds(dumps.by_rank[rank].time - e["start"])
    what = f"{e['op']} #{e['seq']} {'from' if e['op'] == 'recv' else 'to'} rank {peer} ({_what(e)})"
    if peer not in dumps.by_rank:
        return f"rank {peer} left no dump (frozen or killed); rank {rank} waited {waited} in {what}"
    match = [x for x in dumps.by_rank[peer].entries if (x.get("peer"), x["op"], x["seq"]) == (rank, other, e["seq"])]
    if not match:
        return f"rank {peer} never posted its {other} #{e['seq']}; rank {rank} waited {waited} in {what}"
    return f"rank {rank} waited {waited} in {what}; rank {peer} posted its {other} ({describe(match[0])})"


def straggler_line(dumps: Dumps) -> str | None:
    for group, by_rank in collectives(dumps).items():
        ranks = members(group, dumps)
        if len(ranks) < 2 or any(r not in by_rank for r in ranks):
            continue
        common = set.intersection(*(set(seqs) for seqs in by_rank.values()))
        lateness: dict[int, list[tuple[float, int]]] = {r: [] for r in ranks}
        matched = 0
        for seq in common:
            starts = {r: by_rank[r][seq]["start"] for r in ranks}
            if any(by_rank[r][seq]["end"] is None for r in ranks):
                continue
            matched += 1
            last = max(starts, key=starts.get)
            others = [t for r, t in starts.items() if r != last]
            lateness[last].append((starts[last] - statistics.median(others), seq))
        if matched < STRAGGLER_MIN_MATCHED:
            continue
        rank = max(lateness, key=lambda r: len(lateness[r]))
        late = lateness[rank]
        mean = sum(t for t, _ in late) / max(len(late), 1)
        if len(late) < STRAGGLER_SHARE * matched or mean < STRAGGLER_MIN_LATE_S:
            continue
        worst, seq = max(late)
        e = by_rank[rank][seq]
        return (
            f"rank {rank} is the straggler: last into {len(late)} of {matched} collectives "
            f"({len(late) / matched:.0%}), "
            f"{mean * 1e3:.0f} ms after the others on average; the worst, {e['op']} #{seq} ({_what(e)}), "
            f"{worst * 1e3:.0f} ms late"
        )
    return None


# Dump reasons that say nothing went wrong: a rank without a dump beside them may simply not have been asked.
UNFAILED_REASONS = ("SIGUSR1", "finished")


def lost_line(dumps: Dumps) -> str | None:
    """Ranks that left no dump while the others dumped for a failure, every collective done: a rank killed between
    collectives (its peers' next one failed at once, so nothing was left in flight for the hang line to name)."""
    missing = [r for r in range(dumps.world_size) if r not in dumps.by_rank]
    reasons = sorted({d.header.get("reason", "?") for d in dumps.by_rank.values()} - set(UNFAILED_REASONS))
    if not missing or not reasons:
        return None
    world = collectives(dumps).get("world", {})
    last = max((seqs[max(seqs)] for seqs in world.values() if seqs), key=lambda e: e["seq"], default=None)
    after = f" after {last['op']} #{last['seq']} ({_what(last)}), which completed" if last else ""
    return (
        f"{ranks_text(missing)} left no dump (killed or frozen); {ranks_text(sorted(dumps.by_rank))} stopped "
        f"({', '.join(reasons)}){after}"
    )


def healthy_line(dumps: Dumps) -> str:
    world = collectives(dumps).get("world", {})
    top = min((max(seqs) for seqs in world.values() if seqs), default=0)
    return (
        f"no hang, desync or straggler in {len(dumps.by_rank)} of {dumps.world_size} ranks' dumps: "
        f"every collective up to #{top} completed"
    )


def table(dumps: Dumps) -> str:
    """One row per rank: why it dumped, how many entries, its last collective and whether it is still in flight."""
    rows = [("rank", "reason", "entries", "last collective", "state")]
    for rank in range(max(dumps.world_size, max(dumps.by_rank, default=-1) + 1)):
        d = dumps.by_rank.get(rank)
        if d is None:
            rows.append((str(rank), "no dump", "-", "-", "-"))
            continue
        e = max((x for x in d.entries if x.get("peer") is None), key=lambda x: x["start"], default=None)
        last = f"{e['op']} #{e['seq']} ({_what(e)})" if e else "-"
        state = "-" if e is None else "done" if e["end"] is not None else f"in flight {_seconds(d.time - e['start'])}"
        reason = d.header.get("reason", "?") + (" (truncated)" if d.truncated else "")
        rows.append((str(rank), reason, str(len(d.entries)), last, state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe(e: dict) -> str:
    return f"{e['op']} ({_what(e)})"


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


def _print(e: dict) -> tuple:
    return e["op"], e["bytes"], e["dtype"], e["source"]


def _what(e: dict) -> str:
    size = f", {format_bytes(e['bytes'])}" if e["bytes"] else ""
    dtype = f" {e['dtype']}" if e.get("dtype") else ""
    return f"{e['source']}{size}{dtype}"


def _last(seqs: dict, dump_time: float) -> str:
    if not seqs:
        return "it issued none in this group"
    e = seqs[max(seqs)]
    state = "done" if e["end"] is not None else "in flight"
    return f"its last: {e['op']} #{e['seq']}, {state}, {_seconds(dump_time - e['start'])} before its dump"


def format_bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    """``python -m app.doctor DIR``: the notes on bad dumps, the line, the table; exit 2 if any dump was bad."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m app.doctor DIR  (the flight recorder's dumps, or the checkpoint directory)",
            file=sys.stderr,
        )
        return BAD_CONFIG
    try:
        dumps = load(argv[0])
    except NoDumps as e:
        print(f"doctor: {e}", file=sys.stderr)
        return BAD_CONFIG
    for note in dumps.notes:
        print(f"doctor: {note}", file=sys.stderr)
    print(f"doctor: {diagnose(dumps)}")
    if dumps.by_rank:
        print(table(dumps))
    return BAD_CONFIG if dumps.bad_input else OK
