"""The cluster runs' blocks (``make chaos``, ``make drills``, ``make world-drift``): a worker killed and resumed
(under DDP and ZeRO stage 2), worlds of two sizes against each other, the failure-drill table."""

from __future__ import annotations


def render_chaos(doc: dict) -> list[str]:
    s = doc["settings"]
    codes, dtype = doc["exit_codes"], doc.get("dtype", "float32")  # results before the dtype setting: float32
    rows = [
        ("verdict", f"**{doc['verdict']}**"),
        ("killed at step / resumed from", f"{doc['killed_at_step']} / {doc['resumed_from_step']}"),
        (f"steps redone (≤ one checkpoint interval, {s['checkpoint_every']})", doc["steps_redone"]),
        (f"failure → first step of the world of {s['workers'] - 1}", f"{doc['failure_to_next_step_s']} s"),
        (f"scale-up → first step of the world of {s['workers']}", f"{doc['scale_up_to_next_step_s']} s"),
        ("checkpoint write (median)", f"{doc['checkpoint_ms_median']} ms ({doc['checkpoints_written']} writes)"),
        ("exit codes A / B", f"{sorted(set(codes['A'].values()))} / {sorted(set(codes['B'].values()))}"),
        ("final loss A / B", f"{doc['final_loss']['A']} / {doc['final_loss']['B']}"),
        (
            f"max \\|Δparam\\| B vs A ({dtype}; tolerance {doc['tolerance']:g})",
            f"{doc['max_abs_param_diff']:.2g}",
        ),
        ("\\|θA − θB\\| / \\|θA\\|", f"{doc['relative_param_distance']:.2g}"),
    ]
    lines = [
        f"{s['workers']} workers, {s['steps']} steps, global batch {s['effective_batch']} samples, checkpoint every "
        f"{s['checkpoint_every']} steps, victim {s['victim']}, {dtype}, parallel={s.get('parallel', 'ddp')}; "
        f"{doc.get('wall_s', '?')} s in all.",
        "",
        "| | run B against run A |",
        "|---|---|",
    ]
    return lines + [f"| {name} | {value} |" for name, value in rows]


def render_world_drift(doc: dict) -> list[str]:
    s = doc["settings"]
    dtypes = s["dtypes"]
    head = "| step | " + " | ".join(f"{d} max \\|Δparam\\| | {d} \\|Δθ\\|/\\|θ\\|" for d in dtypes) + " |"
    lines = [
        f"World {s['worlds'][0]} against world {s['worlds'][1]}, no failure, global batch {s['effective_batch']} "
        f"samples in micro-batches of at most {s['micro_batch']}, AdamW, `torchrun --standalone`.",
        "",
        head,
        "|---:|" + "---:|---:|" * len(dtypes),
    ]
    for row in doc["rows"]:
        cells = " | ".join(f"{row[d]['max_abs']:.2g} | {row[d]['relative']:.2g}" for d in dtypes)
        lines.append(f"| {row['step']} | {cells} |")
    return lines


def render_drills(doc: dict) -> list[str]:
    """The drill table (``make drills``, schema drills/2): one row per planned drill, "not run" where none ran."""
    s = doc["settings"]
    lines = [
        f"{s['workers']} workers, {s['steps']} steps, global batch {s['effective_batch']}, checkpoint every "
        f"{s['checkpoint_every']} steps, fault at step {s['at_step']}, DDP_COLLECTIVE_TIMEOUT_SECONDS="
        f"{s['collective_timeout']:g}, LAUNCH_STORE_WAIT_SECONDS={s['store_wait']:g}; a drill whose workers had not "
        f'all exited {s["bound"]:g} s after the fault reads "hung". Alerts: the project\'s Prometheus '
        "(/api/v1/alerts, polled every 5 s), seconds after the fault"
        + (
            f"; a drill that must page trains {doc['page_steps_factor']}× the steps, so that its run outlasts the "
            "page's deadline."
            if doc.get("page_steps_factor")
            else "."
        ),
        "",
        "| drill | verdict | fault → step of a new world | steps redone | exit codes (restarts) | FINISHED "
        "| alerts fired | first line after the fault |",
        "|---|---|---|---|---|---|---|---|",
    ]
    drills = doc.get("drills", {})
    for name, what in doc.get("planned", {}).items():
        d = drills.get(name)
        if d is None:
            lines.append(f"| {what} | not run | | | | | | |")
            continue
        row = drill_row(d)
        if d.get("commit") and d["commit"] != doc.get("commit"):  # kept from an earlier run (drills.py --add)
            row = row.replace(" | ", f" (measured at `{d['commit'][:7]}`) | ", 1)
        lines.append(f"| {what} | {row} |")
    failed = [
        f"{name}: " + "; ".join(c for c, ok in d["checks"].items() if not ok)
        for name, d in drills.items()
        if not d["passed"]
    ]
    return lines + ([""] + [f"- failed {line}" for line in failed] if failed else [])


# A drill's own phases (tests/e2e/drills/drill_faults.py notes), shown beside fault -> step of a new world.
PHASES = {
    "store_back_s": "store back after",
    "stop_took_s": "stop took",
    "start_to_step_s": "start → step",
    "down_to_step_s": "scale-down → step on one fewer",
    "up_to_step_s": "scale-up → step on all",
    "pause_to_smaller_world_s": "pause → step on one fewer",
    "unpause_to_full_world_s": "unpause → step on all",
    "cut_to_smaller_world_s": "cut → step on one fewer",
    "reconnect_to_full_world_s": "reconnect → step on all",
    "kill_to_next_step_s": "healed in place: kill → survivors' next step",
    "start_to_newcomer_step_s": "healed in: container start → its first step",
    "pause_to_next_step_s": "healed in place: pause → the others' next step",
    "unpause_to_step_s": "unpause → a step of the world it rejoined",
}

# heal=restart's drill beside heal=in_place's for the same fault (docs/cluster.md, "Heal in place").
HEAL_PAIRS = [
    ("a worker killed", "worker-kill", "heal-in-place-kill"),
    ("rank 0's container killed", "rank0-kill", "heal-in-place-rank0"),
    ("a container comes (2 → 3)", "scale-down-up", "heal-in-place-scale-up"),
    ("two kills in a row", None, "heal-in-place-two-kills"),
    ("a peer paused past the collective timeout, then unpaused", "pause", "heal-in-place-pause"),
]


def render_heal_comparison(doc: dict) -> list[str]:
    """heal=restart vs heal=in_place, fault by fault, from the drills' rows (``make drills``)."""
    drills = doc.get("drills", {})
    lines = [
        "| fault | heal=restart: torchrun restarts the world | heal=in_place: the trainers stay up |",
        "|---|---|---|",
    ]
    for what, restart, in_place in HEAL_PAIRS:
        cells = restart_cell(drills.get(restart), restart), in_place_cell(drills.get(in_place))
        lines.append(f"| {what} | {cells[0]} | {cells[1]} |")
    return lines


def restart_cell(d: dict | None, name: str | None) -> str:
    if name is None:
        return "no drill"
    if d is None or "error" in d:
        return f"`{name}`: not run"
    verdict = "PASS" if d["passed"] else "FAIL"
    new_world = d.get("fault_to_new_world_step_s")
    up = d.get("up_to_step_s") or d.get("unpause_to_full_world_s")
    took = f"fault → step of a new world {new_world} s" + (f", back → step on all {up} s" if up is not None else "")
    at = f" (measured at `{d['commit'][:7]}`)" if d.get("commit") else ""
    return f"`{name}`{at} {verdict}: {took}, {d.get('steps_redone') or 0} step(s) redone"


def in_place_cell(d: dict | None) -> str:
    if d is None or "error" in d:
        return "not run"
    verdict = "PASS" if d["passed"] else "FAIL"
    parts = []
    if d.get("kill_to_next_step_s") is not None:
        parts.append(f"kill → survivors' next step {d['kill_to_next_step_s']} s")
    if d.get("start_to_newcomer_step_s") is not None:
        parts.append(f"container start → its first step {d['start_to_newcomer_step_s']} s")
    if d.get("pause_to_next_step_s") is not None:
        parts.append(f"pause → the others' next step {d['pause_to_next_step_s']} s")
    if d.get("unpause_to_step_s") is not None:
        parts.append(f"unpause → a step with it back {d['unpause_to_step_s']} s")
    parts.append(f"{d.get('steps_redone_beyond_failed')} redone beyond the failed step")
    parts.append(f"final parameters {'equal' if d.get('params_equal') else 'NOT equal'} (max diff "
                 f"{d.get('max_abs_param_diff', float('nan')):.1e})")  # fmt: skip
    return f"{verdict}: " + ", ".join(parts)


def drill_row(d: dict) -> str:
    if "error" in d:
        return f"**FAIL** (did not run through: {cell(d['error'][:120])}) | | | | | | "
    verdict = "**PASS**" if d["passed"] else "**FAIL**"
    new_world = f"{d['fault_to_new_world_step_s']} s" if d.get("fault_to_new_world_step_s") is not None else "—"
    extra = [f"{label} {'never' if d[key] is None else f'{d[key]} s'}" for key, label in PHASES.items() if key in d]
    new_world += f" ({'; '.join(extra)})" if extra else ""
    redone = "—" if d.get("steps_redone") is None else str(d["steps_redone"])
    if (d.get("steps_redone") or 0) < 0:  # trained on while the fault was under way (a stop), saved, resumed there
        redone = f"0 (resumed from step {d['resumed_from_step']}, saved after the fault)"
    if d.get("steps_redone_beyond_failed") is not None:  # heal=in_place: no resume, the failed step alone again
        redone = f"{d['steps_redone_beyond_failed']} beyond the failed step"
    codes = ", ".join(f"{c['exit_code']} ({c['restart_count']})" for c in d["containers"])
    store = d.get("store") or []
    if store and store[0]["restart_count"]:
        codes += f"; store restarted {store[0]['restart_count']}x"
    f = d["finished"]
    finished = f"{f['lines']} (world {', '.join(map(str, f['worlds']))})" if f["lines"] else "none"

    def named(a: dict) -> str:
        return a["alert"] + (f" rank {a['rank']}" if a["rank"] else "")

    first = (d["problems"]["first"] or ["—"])[0]
    first = first.split(" ERROR ", 1)[-1].split(" WARNING ", 1)[-1]
    if d.get("alerts") is None:  # measured before the drills read Prometheus
        alerts = "not measured"
    else:
        alerts = ", ".join(f"{named(a)} ({a['after_fault_s']} s)" for a in d["alerts"] if a["fired"]) or "none"
        pending = ", ".join(named(a) for a in d["alerts"] if not a["fired"])
        alerts += f"; pending only: {pending}" if pending else ""
        if d.get("victim_rank") is not None:  # the rank a DDPRankDown must name
            alerts = f"(the fault's rank: {d['victim_rank']}) {alerts}"
    return f"{verdict} | {new_world} | {redone} | {codes} | {finished} | {alerts} | `{cell(first[:160])}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")
