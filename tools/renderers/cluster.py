"""The cluster runs' blocks (``make chaos``, ``make drills``, ``bench.world_drift``): a worker killed and resumed,
worlds of two sizes against each other, a peer paused and the store killed."""

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
        f"{s['checkpoint_every']} steps, victim {s['victim']}, {dtype}; {doc.get('wall_s', '?')} s in all.",
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
    s = doc["settings"]
    lines = [
        f"{s['workers']} workers, global batch {s['effective_batch']}, checkpoint every {s['checkpoint_every']} "
        f"steps, DDP_COLLECTIVE_TIMEOUT_SECONDS={s['collective_timeout']}, LAUNCH_STORE_WAIT_SECONDS="
        f'{s["store_wait"]}; a drill that had not ended after {s["bound"]} s would read "hung".',
        "",
        "| drill | outcome | measured | exit codes (restarts) | first message |",
        "|---|---|---|---|---|",
    ]
    for name, key, measured in (
        (
            "a peer paused (`docker pause`), unpaused later",
            "pause",
            lambda d: (
                f"pause → training on {s['workers'] - 1}: {d['pause_to_step_in_smaller_world_s']} s; "
                f"unpause → on {s['workers']} again: {d['unpause_to_step_in_full_world_s']} s"
            ),
        ),
        (
            "the store killed (`docker kill`)",
            "store",
            lambda d: (
                f"kill → first exit: ≤ {max(d['kill_to_first_exit_s'].values())} s; "
                f"→ every worker gone for good: {d['kill_to_all_exited_s']} s"
            ),
        ),
    ):
        d = doc.get(key)
        if not d:
            continue
        codes = ", ".join(f"{c['exit_code']} ({c['restart_count']})" for c in d["containers"])
        first = ((d.get("messages") or d.get("messages_after_pause") or {}).get("lines") or ["—"])[0]
        first = first.split(" ERROR ", 1)[-1].split(" INFO ", 1)[-1].replace("|", "\\|")
        lines.append(f"| {name} | {d['verdict']} | {measured(d)} | {codes} | `{first}` |")
    return lines
