"""How good are the tests at catching bugs nobody listed? A seeded random sample of generated mutants, each run
against the tests of the file it changes; the score, the survivors and their triage.

    make mutants                                            # 150 mutants, a new seed each run (printed)
    .venv/bin/python -m tools.mutation --seed 7 --sample 20   # a given sample: the same mutants as another run
    .venv/bin/python -m tools.mutation --list --seed 7        # the sample and each mutant's tests, run nothing
    .venv/bin/python -m tools.mutation --seed 7 --only ID,ID  # some of that sample (did the new test kill it?)
    .venv/bin/python -m tools.mutation --only ID,ID           # any generated mutants by id (a triaged one, rerun)
    .venv/bin/python -m tools.mutation --files 'app/parallel/zero/*' --sample 20   # one area's mutants only
    make mutants-curated                                    # the hand-kept list of tools/mutants.py

The mutants come from cosmic-ray (``tools/mutation_gen.py``; the alert rules from a small PromQL operator set of our
own there, since no library mutates PromQL). cosmic-ray rather than mutmut because this tool needs three things:
(a) only the files we choose: cosmic-ray enumerates the mutants of any file we hand it, one ``MutationSpec``
(operator, occurrence) at a time; (b) a different test selection per mutant: a cosmic-ray mutant is applied to one
source text with ``mutate_code`` and we run whichever tests we like, where mutmut 3 compiles every mutant of the
package into trampolines in its own ``mutants/`` copy and picks tests from its own stats pass, with one pytest
configuration for all; (c) a sample: neither library samples, but cosmic-ray's mutants are independent items we can
draw from with a seeded ``random.Random``, where mutmut's are switched on inside one instrumented tree.

The sample is drawn by site (one place, one kind of change) and then one operator variant per site, so that the ten
replacements of one ``+`` do not crowd out the rest. The seed is random unless ``--seed`` is given; it is printed
and recorded, and ``--seed S --sample N`` reruns the same mutants while the code is unchanged.

The checkout is never mutated: its tracked and untracked-but-not-ignored files are copied to a temporary folder
(one per ``--jobs``), each mutant is applied there and its tests run with that folder as the working directory and
first on ``PYTHONPATH`` (this checkout's virtualenv is reused), and the file is restored. Outcomes: ``killed`` (a
test failed, or pytest could not even collect the tests: the module no longer imports), ``killed (timeout)`` (the
tests ran past ``--timeout``: a hang is a bug a user notices, so it counts as killed; one test past
``--test-timeout`` is a failed test, so ``killed``), ``survived``, ``not applied``
(cosmic-ray found no such position: the code changed since the sample was drawn). Every distinct test that killed a
mutant is then run once unmutated; a kill by a test that fails anyway is ``unconfirmed`` and not counted.

Survivors are judged in ``tools/mutation_triage.yaml``, keyed by the mutant's stable id: ``equivalent`` (no test
can tell, with the reason) or ``real`` (with the test that would kill it). The score is killed / (ran - equivalent);
an untriaged survivor counts as real. Writes ``bench/results/mutation.json`` (with ``tools/provenance.py``'s record)
for a run at the default settings or ``--out``, else ``runs/mutation.json``; ``make bench-report`` renders it into
docs/development.md. Exit status: 0 when the score reaches ``--target``, 1 otherwise, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from queue import Queue

import yaml

from tools.mutants import PYTHON, REPO, check_imports_from_copy, copy_tree, env_for
from tools.mutation_gen import Candidate, all_candidates, apply_alert, apply_python, draw, expand, selection_for
from tools.provenance import describe_output, git_commit, load_average, output_path, provenance

TRIAGE = REPO / "tools" / "mutation_triage.yaml"
# What no mutant's selection runs, said in the results file and the docs: a Compose cluster takes minutes to start
# and one per mutant would not fit any budget; what those tests check is also checked, per module, below them.
NOT_SELECTED = "tests/e2e (Docker Compose clusters: minutes each, so never per mutant)"
VERDICTS = ("equivalent", "real")
NOT_RUN = ("not applied", "error", "unconfirmed", "not run (budget)")


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word: a judgement written twice would hide the first."""

    def construct_mapping(self, node, deep=False):
        keys = [str(self.construct_object(k, deep=deep)) for k, _ in node.value]
        if twice := sorted({k for k in keys if keys.count(k) > 1}):
            raise SystemExit(f"mutation: {', '.join(twice)} judged twice (line {node.start_mark.line + 1}): keep one")
        return super().construct_mapping(node, deep)


def load_triage(path: Path = TRIAGE) -> dict[str, dict]:
    """``{id: {"verdict": "equivalent" | "real", "reason": ..., ...}}``; a bad entry is a one-line error."""
    if not path.exists():
        return {}
    entries = (yaml.load(path.read_text(), Loader=_UniqueKeys) or {}).get("mutants") or {}
    for key, e in entries.items():
        if not isinstance(e, dict) or e.get("verdict") not in VERDICTS or not e.get("reason"):
            raise SystemExit(f"mutation: {path.name}: {key}: needs verdict ({' or '.join(VERDICTS)}) and a reason")
    return {str(k): v for k, v in entries.items()}


def run_group(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own, which is killed whole when it ends or times out: a mutant
    that hangs a gloo test leaves its rank processes behind otherwise, and they hold a shared machine's cores. The
    output goes to a file, not a pipe: a leftover process holding the pipe open would keep the reader waiting."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=cwd, env=env_for(cwd), stdout=out, stderr=out, text=True, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            _kill_group(p.pid)  # on a timeout, the selection; else what the tests left running
            p.wait()
        out.seek(0)
        return subprocess.CompletedProcess(cmd, p.returncode, out.read(), "")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def pytest_cmd(selection: list[str], test_timeout: float) -> list[str]:
    """pytest on one mutant's selection: stop at the first failure (``-x``), no cache written into the copy, and
    pytest-timeout's per-test limit, so that a mutant that hangs one test is killed in ``test_timeout`` seconds
    rather than at the whole selection's ``--timeout``."""
    return [
        PYTHON,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        *per_test_limit(test_timeout),
        *selection,
    ]


def per_test_limit(test_timeout: float) -> list[str]:
    """pytest's arguments for a per-test limit that also caps the tests' own ``timeout`` markers."""
    return ["-p", "tools.mutation_timeout", "--timeout", str(round(test_timeout))] if test_timeout else []


def run_selection(copy: Path, c: Candidate, timeout: float, test_timeout: float = 0) -> tuple[str, float, str, list]:
    """(outcome, seconds, output tail, the failed tests) of mutant ``c``'s tests, already applied in ``copy``: its
    ``promtool`` commands, then pytest on the rest of the selection, stopping at the first that fails."""
    tests = c.tests()
    cmds = [t.split() for t in tests if t.startswith("promtool ")]
    rest = expand(tuple(t for t in tests if not t.startswith("promtool ")), copy)
    if rest:
        cmds.append(pytest_cmd(rest, test_timeout))
    started, out = time.monotonic(), ""
    for cmd in cmds:
        left = timeout - (time.monotonic() - started)
        try:
            r = run_group(cmd, copy, left)
        except subprocess.TimeoutExpired:
            return "killed (timeout)", time.monotonic() - started, "", []
        out = r.stdout + r.stderr
        if cmd[0] == "promtool" and r.returncode:
            return "killed", time.monotonic() - started, out[-1200:], ["promtool"]
        if cmd[0] != "promtool" and r.returncode:
            # pytest: 1 = a test failed, 2 = collection failed (the mutated module no longer imports); else ours.
            failed = [f.split("[")[0] for f in re.findall(r"^(?:FAILED|ERROR) (\S+?)(?: - .*)?$", out, re.M)]
            outcome = "killed" if r.returncode in (1, 2) else "error"
            return outcome, time.monotonic() - started, out[-1200:], failed
    return "survived", time.monotonic() - started, out[-1200:], []


def run_mutant(copy: Path, c: Candidate, timeout: float, test_timeout: float = 0) -> dict:
    target = copy / c.path
    original = target.read_text()
    mutated = (apply_alert if c.path.endswith(".yml") else apply_python)(c, original)
    row = {**asdict(c), "tests": list(c.tests())}
    del row["site"], row["occurrence"]
    if mutated is None or mutated == original:
        return {**row, "outcome": "not applied", "seconds": 0.0, "killed_by": []}
    target.write_text(mutated)
    try:
        outcome, took, tail, failed = run_selection(copy, c, timeout, test_timeout)
    finally:
        target.write_text(original)
    row.update(after=c.after, outcome=outcome, seconds=round(took, 1), killed_by=failed[:3])
    if outcome in ("survived", "error"):
        row["detail"] = tail[-600:]
    return row


def confirm_kills(copies: Queue[Path], rows: list[dict], timeout: float, jobs: int, test_timeout: float = 0) -> None:
    """Rerun unmutated each distinct test that killed a mutant, and each selection that timed out: a test that fails
    (or a selection that is as slow) anyway proves nothing about its mutants, which become ``unconfirmed``."""
    tests = sorted({t for r in rows if r["outcome"] == "killed" for t in r["killed_by"] if t != "promtool"})
    checks = [(t,) for t in tests] + sorted({tuple(r["tests"]) for r in rows if r["outcome"] == "killed (timeout)"})

    def fails_unmutated(t: tuple[str, ...]) -> bool:
        copy = copies.get()
        try:
            collect = ["--collect-only"] if len(t) == 1 and "::" not in t[0] else []  # a file that failed to import
            selection = expand(t, copy)
            if not selection:  # pytest with no argument would run the whole suite
                return False
            cmd = [
                PYTHON,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *per_test_limit(test_timeout),
                *collect,
                *selection,
            ]
            r = run_group(cmd, copy, timeout)
            return r.returncode != 0
        except subprocess.TimeoutExpired:
            return True
        finally:
            copies.put(copy)

    with ThreadPoolExecutor(jobs) as pool:
        bad = {t for t, failed in zip(checks, pool.map(fails_unmutated, checks)) if failed}
    print(f"kills confirmed: {len(checks) - len(bad)} of {len(checks)} checks pass unmutated", flush=True)
    for r in rows:
        by = [(t,) for t in r.get("killed_by", [])] if r["outcome"] == "killed" else [tuple(r["tests"])]
        if r["outcome"].startswith("killed") and by and all(t in bad for t in by):
            r["outcome"] = "unconfirmed"


def score(rows: list[dict], triage: dict[str, dict]) -> dict:
    """Killed over the mutants that ran and are not judged equivalent; survivors listed with their triage."""
    ran = [r for r in rows if r["outcome"] in ("killed", "killed (timeout)", "survived")]
    for r in ran:
        if r["outcome"] == "survived":
            r["triage"] = triage.get(r["id"], {"verdict": "untriaged"})
    killed = sum(r["outcome"].startswith("killed") for r in ran)
    equivalent = sum(r.get("triage", {}).get("verdict") == "equivalent" for r in ran)
    counted = len(ran) - equivalent
    by_area: dict[str, list[int]] = {}
    for r in ran:
        if r.get("triage", {}).get("verdict") != "equivalent":
            area = by_area.setdefault("/".join(r["path"].split("/")[:2]), [0, 0])
            area[0] += r["outcome"].startswith("killed")
            area[1] += 1
    return {
        "killed": killed,
        "ran": len(ran),
        "equivalent": equivalent,
        "score": round(killed / counted, 4) if counted else None,
        "by_area": {k: {"killed": v[0], "counted": v[1]} for k, v in sorted(by_area.items())},
        "not_run": {o: sum(r["outcome"] == o for r in rows) for o in NOT_RUN},
    }


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=int, default=150, help="mutants to draw (default 150)")
    p.add_argument("--seed", type=int, default=None, help="the sample's seed (default: a new one, printed)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per mutant's tests; past it: killed (timeout)")
    p.add_argument(
        "--test-timeout", type=float, default=120, help="seconds per test, its own timeout marker capped; 0: none"
    )
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    p.add_argument("--budget", type=float, default=0, help="minutes; mutants not started by then are not run")
    p.add_argument("--target", type=float, default=0.90, help="score to reach for exit status 0 (default 0.90)")
    p.add_argument(
        "--only", metavar="ID,ID", help="run only these mutants: of the seed's sample, or of all without --seed"
    )
    p.add_argument(
        "--files", metavar="GLOB,GLOB", help="draw only from the mutants of these files (an area's own score)"
    )
    p.add_argument("--list", action="store_true", help="print the sample and each mutant's tests, run nothing")
    p.add_argument("--out", type=Path, default=None, help="JSON to write (default: bench/results/ at the defaults)")
    p.add_argument("--show", metavar="ID", help="print one mutant (file, line, the change, its tests), run nothing")
    p.add_argument("--rescore", type=Path, metavar="JSON", help="apply the triage file anew to a result, run nothing")
    args = p.parse_args(argv)
    if args.sample < 1 or args.jobs < 1 or args.timeout <= 0 or args.budget < 0 or args.test_timeout < 0:
        p.error("--sample and --jobs must be at least 1, --timeout positive, --budget and --test-timeout 0 or more")
    return p, args


def run_all(sample: list[Candidate], args) -> tuple[list[dict], dict]:
    """Run the sample, ``args.jobs`` at a time, each worker in its own copy of the checkout."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copied_at = git_commit()  # the code the mutants ran on, not HEAD at the end
        copies: Queue[Path] = Queue()
        for j in range(args.jobs):
            copy = Path(tmp) / str(j)
            copy_tree(copy)
            check_imports_from_copy(copy, "app/worker/trainer.py")
            copies.put(copy)
        done, deadline = [0], time.monotonic() + args.budget * 60 if args.budget else float("inf")

        def one(c: Candidate) -> dict:
            if time.monotonic() > deadline:  # the sample is in random order: what ran is a smaller random sample
                return {**asdict(c), "tests": list(c.tests()), "outcome": "not run (budget)", "seconds": 0.0}
            copy = copies.get()
            try:
                row = run_mutant(copy, c, args.timeout, args.test_timeout)
            finally:
                copies.put(copy)
            done[0] += 1
            print(f"[{done[0]:>3}/{len(sample)}] {row['outcome']:<16} {row['seconds']:>5.0f}s {c.id} "
                  f"{c.path}:{c.line} {c.operator}", flush=True)  # fmt: skip
            return row

        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(one, sample))
        confirm_kills(copies, rows, args.timeout, args.jobs, args.test_timeout)
    return rows, copied_at


def rescore(path: Path, triage: dict[str, dict]) -> int:
    """A triage judgement made after the run, applied to its result (the mutants' outcomes are kept)."""
    doc = json.loads(path.read_text())
    for r in doc["mutants"]:
        r.pop("triage", None)
    doc.update(score(doc["mutants"], triage))
    path.write_text(json.dumps(doc, indent=1) + "\n")
    untriaged = [r["id"] for r in doc["mutants"] if r.get("triage", {}).get("verdict") == "untriaged"]
    print(f"{path}: score {doc['score']}, {doc['equivalent']} equivalent, untriaged: {' '.join(untriaged) or 'none'}")
    return 0


def of_files(candidates: list[Candidate], globs: list[str]) -> list[Candidate]:
    """The mutants of the files the globs match (``app/parallel/zero/*``); none matched is a one-line error."""
    chosen = [c for c in candidates if any(fnmatch.fnmatch(c.path, g) for g in globs)]
    if not chosen:
        raise SystemExit(f"mutation: --files {','.join(globs)} matches no mutated file")
    return chosen


def show(candidates: list[Candidate], mutant_id: str) -> int:
    c = next((c for c in candidates if c.id == mutant_id), None)
    if c is None:
        raise SystemExit(f"mutation: no generated mutant has the id {mutant_id} (the code changed?)")
    (apply_alert if c.path.endswith(".yml") else apply_python)(c, (REPO / c.path).read_text())
    print(f"{c.id} {c.path}:{c.line} in {c.where} ({c.operator})\n  - {c.before}\n  + {c.after}")
    print(f"  tests: {' '.join(selection_for(c.path))}")
    return 0


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    triage = load_triage()
    if args.rescore:
        return rescore(args.rescore, triage)
    seed = args.seed if args.seed is not None else secrets.randbelow(10**6)
    candidates = all_candidates(REPO)
    if args.show:
        return show(candidates, args.show)
    if args.files:  # after all_candidates: an id counts identical changes over the whole area, so enumerate it all
        candidates = of_files(candidates, args.files.split(","))
    sample = draw(candidates, args.sample, seed)
    rerun = f"--seed {seed}" + (f" --files {args.files}" if args.files else "")
    print(f"seed {seed}: {len(sample)} of {len(candidates)} generated mutants (rerun: {rerun})", flush=True)
    if args.only:  # of the seed's sample when a seed is given; else of every generated mutant (a triaged id)
        wanted = set(args.only.split(","))
        pool = sample if args.seed is not None else candidates
        if missing := wanted - {c.id for c in pool}:
            where = f"the sample of seed {seed}" if args.seed is not None else "the generated mutants (code changed?)"
            parser.error(f"--only: {' '.join(sorted(missing))} not in {where}")
        sample = [c for c in pool if c.id in wanted]
    if args.list:
        for c in sample:
            print(f"{c.id} {c.path}:{c.line} {c.operator} {c.before!r} -> tests {' '.join(selection_for(c.path))}")
        return 0
    out_path = output_path(parser, args, "mutation")
    load_before = load_average()
    started = time.monotonic()
    rows, copied_at = run_all(sample, args)
    result = score(rows, triage)
    doc = {
        "schema": "mutation.v1",
        **provenance({**vars(args), "seed": seed}, load_before),
        **copied_at,
        "library": "cosmic-ray " + _version("cosmic-ray"),
        "seed": seed,
        "generated": len(candidates),
        "sample": len(sample),
        "wall_seconds": round(time.monotonic() - started),
        "not_selected": NOT_SELECTED,
        **result,
        "mutants": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        if r["outcome"] == "survived" and r["triage"]["verdict"] != "equivalent":
            print(
                f"SURVIVED ({r['triage']['verdict']}) {r['id']} {r['path']}:{r['line']}: {r['before']} -> {r['after']}"
            )
    shown = f"{result['score']:.0%}" if result["score"] is not None else "n/a"
    print(
        f"\nseed {seed}: killed {result['killed']} of {result['ran']} run, {result['equivalent']} equivalent: {shown}"
    )
    print(describe_output(out_path))
    return 0 if result["score"] is not None and result["score"] >= args.target else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
