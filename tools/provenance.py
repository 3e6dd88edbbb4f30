"""Where a benchmark result comes from: the commit, the date, the settings and the machine, recorded in its JSON.

A number in ``bench/results/`` is only worth comparing with another when both say which code made them, with which
flags, on how many cores and under how much load from elsewhere. Every bench calls::

    before = load_average()
    ...measure...
    doc = {"schema": ..., **provenance(args, load_before=before), ...results...}

and writes where ``output_path`` says: the committed file ``bench/results/<name>.json`` for the documented run
(every flag at its default) or when ``--out`` names it, ``runs/<name>.json`` (not committed) otherwise, so that a
quick trial with other flags never replaces the numbers the docs are generated from (``tools/report.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRIALS = REPO / "runs"  # git-ignored: results of non-default settings


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (what else ran on the machine)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return []


def git_commit(repo: Path = REPO) -> dict:
    """``{"commit": <HEAD sha>, "dirty": bool, "dirty_files": [...]}``; dirty = tracked files other than results
    differ from HEAD."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=True
        ).stdout.rstrip("\n")  # not strip(): porcelain lines start with a status column that may be a space

    try:
        commit = git("rev-parse", "HEAD")
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
        # Results written by an earlier bench of the same session change no code: not "dirty".
        changed = [path for path in changed if not path.startswith(("bench/results/", "runs/"))]
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown (not a git checkout)", "dirty": None, "dirty_files": []}
    return {"commit": commit, "dirty": bool(changed), "dirty_files": changed[:20]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def provenance(settings, load_before: list[float] | None = None, repo: Path = REPO) -> dict:
    """What made a result: commit (+ dirty), UTC date, the settings, the machine and its load before/after.

    Args:
        settings: the bench's parsed arguments (``argparse.Namespace``) or a dict of them.
        load_before: ``load_average()`` taken before measuring; the load now is taken as "after".
        repo: the checkout whose commit is recorded.

    Example::

        before = load_average()
        result = measure()
        doc = {"schema": "x.v1", **provenance(args, load_before=before), "result": result}
    """
    import torch

    if isinstance(settings, argparse.Namespace):
        settings = vars(settings)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        **git_commit(repo),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": _plain(dict(settings)),
        "machine": {
            "cores": os.cpu_count(),
            "usable_cores": usable,
            "cpu_model": cpu_model(),
            "load_average_before": load_before if load_before is not None else [],
            "load_average_after": load_average(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def output_path(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, suffix: str = ".json") -> Path:
    """Where a bench writes: ``args.out`` if given; else the committed ``bench/results/<name>.json`` when every
    other flag is at its default (the documented run), else ``runs/<name>.json``.

    Args:
        parser: the bench's parser (for its defaults); ``--out`` must default to None.
        args: the parsed arguments.
        name: the result's name, e.g. ``"metrics-overhead"``.
        suffix: the file's extension.

    Example::

        path = output_path(parser, args, "accum-curve")  # bench/results/accum-curve.json for `make accum`
    """
    if getattr(args, "out", None) is not None:
        return Path(args.out)
    defaults = {a.dest: a.default for a in parser._actions if a.dest not in ("help", "out")}
    documented = all(getattr(args, dest, default) == default for dest, default in defaults.items())
    return (RESULTS if documented else TRIALS) / f"{name}{suffix}"


def write_result(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, result: dict, load_before: list[float]
) -> tuple[Path, dict]:
    """Write ``result`` with its provenance to ``output_path(parser, args, name)`` as schema ``<name>/1``; return
    the path and the document as written (JSON's types: what a renderer reading the file back gets)."""
    path = output_path(parser, args, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(json.dumps({"schema": f"{name}/1", **provenance(args, load_before=load_before), **result}))
    path.write_text(json.dumps(doc, indent=1))
    return path, doc


def describe_output(path: Path) -> str:
    """One line saying where a result went and whether it replaced a committed file."""
    try:
        shown = path.resolve().relative_to(REPO)
    except ValueError:
        shown = path
    if path.resolve().parent == RESULTS.resolve():
        return f"wrote {shown} (a committed result: review the diff, then `make bench-report` to update the docs)"
    return f"wrote {shown} (bench/results/ left as it is: only the documented run or --out replaces it)"


if __name__ == "__main__":
    json.dump(provenance({"argv": sys.argv[1:]}, load_average()), sys.stdout, indent=2)
    print()
