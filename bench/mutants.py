"""Do the tests catch the bugs a user would notice? One-line mutants of the load-bearing lines, each run against
the tests that should catch it.

    make mutants                                          # every mutant; tens of minutes on 2 cores
    .venv/bin/python -m bench.mutants --only ckpt-no-fsync,loss-not-divided-by-k   # a few, by name
    .venv/bin/python -m bench.mutants --list              # the mutants and whether each snippet is still found

Each mutant names a file, a snippet of code that occurs in it exactly once, its replacement, and the tests that
should fail with it. The snippet, not a line number, locates it, so the list survives code moving around; a snippet
no longer found (or found twice) is reported as "stale" and counts as not caught, so a rename shows up in the
score instead of silently shrinking the list (``tests/unit/test_mutants.py`` checks every snippet on each commit).

The repository is never mutated in place: the tracked and untracked-but-not-ignored files are copied to a temporary
folder once, each mutant is applied there, its tests run with that folder as the working directory and first on
``PYTHONPATH`` (the virtualenv of this checkout is reused; the script checks that the mutated module is imported from
the copy), and the file is restored before the next mutant. First the selected tests run once unmutated: a test that
already fails would "catch" every mutant.

Outcomes: ``caught`` (a selected test failed), ``caught (timeout)`` (the tests hung past ``--timeout``: a user
would notice that too), ``survived`` (every selected test passed: a gap in the tests), ``stale`` (snippet not found
exactly once), ``error`` (pytest could not run the selection: a bad test id). The score is caught / total. Writes
``bench/results/mutants.json`` (with ``bench/provenance.py``'s record) for the full list, ``runs/mutants.json`` for a
subset, or ``--out``. Exit status: 0 when every mutant was caught, 1 otherwise, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.provenance import describe_output, load_average, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Mutant:
    name: str  # short id, for --only
    what: str  # the bug, as a user would notice it
    path: str  # file, relative to the repository root
    find: str  # code that occurs exactly once in that file
    replace: str  # what it becomes
    tests: tuple[str, ...]  # pytest arguments: node ids, files, or "-k", "expr"


def T(*tests: str) -> tuple[str, ...]:
    return tests


# The curated list. Keep each `find` as short as stays unique, and the tests as few as catch it (speed).
MUTANTS: list[Mutant] = [
    Mutant(
        "config-no-positive-check",
        "a zero or negative setting (steps, batch, lr, ...) is accepted instead of a one-line error",
        "app/config.py",
        'raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")',
        "pass",
        T("tests/unit/test_config.py"),
    ),
]


def count(m: Mutant, root: Path = REPO) -> int:
    """How often the mutant's snippet occurs in its file (1 = applicable)."""
    path = root / m.path
    return path.read_text().count(m.find) if path.is_file() else 0


def copy_tree(dst: Path) -> None:
    """Copy tracked and untracked-but-not-ignored files (what a clone plus the work in progress would have)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():  # deleted in the work tree but still in the index
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)


def env_for(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}
    env.update(PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)  # a missing tool should skip here, not fail the selection for an unrelated reason
    return env


def module_of(path: str) -> str | None:
    return path[:-3].replace("/", ".") if path.endswith(".py") and path.startswith("app/") else None


def check_imports_from_copy(copy: Path, path: str) -> None:
    """The package is installed editable from the checkout: make sure the copy's module is the one imported."""
    module = module_of(path)
    if module is None:
        return
    code = f"import {module} as m; print(m.__file__)"
    out = subprocess.run([PYTHON, "-c", code], cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=120)
    where = out.stdout.strip()
    if out.returncode != 0 or not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutants: {module} is imported from {where or out.stderr.strip()[-300:]}, not from {copy}")


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout' | 'error', seconds, the output's tail)."""
    cmd = [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    started = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", time.monotonic() - started, out[-1500:]
    took = time.monotonic() - started
    outcome = {0: "passed", 1: "failed"}.get(r.returncode, "error")
    return outcome, took, (r.stdout + r.stderr)[-1500:]


def run_mutant(copy: Path, m: Mutant, timeout: float) -> dict:
    target = copy / m.path
    found = count(m, copy)
    row = {**asdict(m), "tests": list(m.tests)}
    if found != 1:
        return {**row, "outcome": "stale", "detail": f"snippet found {found}× in {m.path} (must be exactly once)"}
    original = target.read_text()
    target.write_text(original.replace(m.find, m.replace))
    try:
        check_imports_from_copy(copy, m.path)
        result, took, tail = run_tests(copy, m.tests, timeout)
    finally:
        target.write_text(original)
    outcome = {"failed": "caught", "timeout": "caught (timeout)", "passed": "survived"}.get(result, "error")
    return {**row, "outcome": outcome, "seconds": round(took, 1), "detail": tail if outcome != "caught" else ""}


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the selected tests unmutated first")
    p.add_argument("--list", action="store_true", help="list the mutants and whether each applies, run nothing")
    p.add_argument("--out", type=Path, default=None, help="JSON to write (default: bench/results/ for all mutants)")
    args = p.parse_args(argv)
    names = {m.name for m in MUTANTS}
    unknown = [n for n in args.only.split(",") if n and n not in names]
    if unknown:
        p.error(f"--only: no mutant named {', '.join(unknown)} (see --list)")
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            found = count(m)
            state = "ok" if found == 1 else f"STALE (found {found}×)"
            print(f"{m.name:<32} {state:<18} {m.path}: {m.what}")
        return 0
    out_path = output_path(parser, args, "mutants")
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        if not args.skip_baseline:
            selection = tuple(dict.fromkeys(t for m in chosen if count(m, copy) == 1 for t in m.tests))
            result, took, tail = run_tests(copy, selection, args.timeout * 3)
            print(f"baseline (unmutated, {len(selection)} selections): {result} in {took:.0f}s", flush=True)
            if result != "passed":
                print(f"mutants: the selected tests do not pass unmutated, so no score:\n{tail}", file=sys.stderr)
                return 1
        rows = []
        for i, m in enumerate(chosen, 1):
            row = run_mutant(copy, m, args.timeout)
            rows.append(row)
            print(
                f"[{i:>2}/{len(chosen)}] {row['outcome']:<17} {m.name:<32} {row.get('seconds', 0):>5.0f}s", flush=True
            )
    caught = sum(r["outcome"].startswith("caught") for r in rows)
    doc = {
        "schema": "mutants.v1",
        **provenance(args, load_before),
        "score": f"{caught}/{len(rows)}",
        "caught": caught,
        "total": len(rows),
        "mutants": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        if not r["outcome"].startswith("caught"):
            print(f"\n{r['outcome'].upper()}: {r['name']} ({r['path']}): {r['what']}\n{r['detail']}")
    print(f"\nscore: {caught}/{len(rows)} mutants caught")
    print(describe_output(out_path))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
