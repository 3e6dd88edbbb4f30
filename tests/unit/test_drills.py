"""The failure drills' judgement without Docker (tests/e2e/drills/drill_kit.py, drills.py, tools/renderers/cluster.py):
a second world's FINISHED, a restart storm or a missing line fails a drill; a drill not run reads "not run"."""

from __future__ import annotations

from tests.e2e.drills.drill_faults import Scenario, scenarios
from tests.e2e.drills.drill_kit import first_finished, one_finish
from tests.e2e.drills.drills import PAGE_STEPS_FACTOR, build_parser, drill_env, judge
from tools.renderers.cluster import render_drills


def test_one_finish_is_one_line_per_rank_of_one_world():
    assert one_finish([(1, 3), (0, 3), (2, 3)])
    assert not one_finish([(0, 3), (1, 3), (2, 3), (0, 2), (1, 2)])  # a second world finished too
    assert not one_finish([(0, 3), (1, 3)]) and not one_finish([(0, 2), (0, 2)]) and not one_finish([])


def test_the_finish_is_timed_from_the_fault_and_only_a_finish_after_it_counts():
    lines = [
        (5.0, "worker-1: FINISHED rank=0 world_size=3 step=150"),  # an earlier job's, before the fault
        (12.0, "worker-1: step 40/150 | loss 0.1"),
        (47.5, "worker-2: FINISHED rank=1 world_size=2 step=150"),
        (48.0, "worker-1: FINISHED rank=0 world_size=2 step=150"),
    ]
    assert first_finished(lines, since=10.0) == 37.5
    assert first_finished(lines[:2], since=10.0) is None


def result(**changes) -> dict:
    row = {"name": "worker-1", "id": "a", "state": "exited", "exit_code": 0, "restart_count": 0}
    r = {
        "ended": True,
        "bound": 300,
        "one_finish": True,
        "containers": [dict(row), dict(row, name="worker-2")],
        "finished": {"lines": 2, "worlds": [2], "ranks": 2},
        "traceback_lines": 0,
        "alerts": [],
    }
    return {**r, **changes}


def test_a_drill_fails_on_a_restart_storm_or_an_ending_without_its_line():
    finish = Scenario("x", lambda d: None, max_restarts=1)
    assert all(judge(result(), finish, []).values())
    storm = result(containers=[dict(c, restart_count=3) for c in result()["containers"]])
    assert not judge(storm, finish, [])["no container restarted more than 1x"]
    disk = Scenario("x", lambda d: None, expect=1, says="could not take the checkpoint", max_restarts=3)
    ended = result(containers=[dict(c, exit_code=1) for c in result()["containers"]], finished={"lines": 0})
    said = [
        "worker-1: [rank 0] ERROR could not take the checkpoint",
        "worker-2: [rank 1] ERROR could not take the checkpoint",
    ]
    assert all(judge(ended, disk, said).values())
    assert not all(judge(ended, disk, said[:1]).values())  # one worker ended without the line


def alert(name: str, rank: str, after: float | None, fired: bool = True) -> dict:
    return {"alert": name, "rank": rank, "fired": fired, "after_fault_s": after}


def test_a_drill_fails_when_the_page_names_the_wrong_rank_or_comes_late_or_a_healthy_run_pages():
    kill = Scenario("x", lambda d: None, victims=1, pages=True)
    on_time = result(victim_rank=1, alerts=[alert("DDPRankDown", "1", 46.2), alert("DDPWorldShrank", "", 36.0)])
    assert all(judge(on_time, kill, []).values())
    late = result(victim_rank=1, alerts=[alert("DDPRankDown", "1", 75.0)])
    assert not judge(late, kill, [])["DDPRankDown named rank 1 within 60 s"]
    survivor = result(victim_rank=1, alerts=[alert("DDPRankDown", "1", 40.0), alert("DDPRankDown", "0", 40.0)])
    assert not judge(survivor, kill, [])["DDPRankDown named no other rank"]
    wrong = result(victim_rank=1, alerts=[alert("DDPRankDown", "0", 40.0)])  # a survivor paged, the lost one not
    assert not judge(wrong, kill, [])["DDPRankDown named rank 1 within 60 s"]
    early = result(victim_rank=1, fault_to_finished_s=45.0, alerts=[alert("DDPWorldShrank", "", 31.0)])
    lasted = "the run lasted 60 s past the fault (a page was due)"
    assert not judge(early, kill, [])[lasted]
    assert judge(on_time | {"fault_to_finished_s": 90.0}, kill, [])[lasted]
    pending = result(victim_rank=1, alerts=[alert("DDPRankDown", "1", None, fired=False)])
    assert not all(judge(pending, kill, []).values())
    planned = Scenario("x", lambda d: None, victims=1)  # a scale-down: no page at all
    assert not all(judge(result(alerts=[alert("DDPRankDown", "2", 30.0)]), planned, []).values())
    assert all(judge(result(alerts=[alert("DDPRankDown", "2", 30.0)]), planned, [], alerts=False).values())

    control = Scenario("x", lambda d: None, control=True)
    assert all(judge(result(alerts=[alert("DDPStraggler", "1", None, fired=False)]), control, []).values())
    assert not all(judge(result(alerts=[alert("DDPStraggler", "1", 9.0)]), control, []).values())
    assert scenarios(3)["healthy"].control and not any(s.control for n, s in scenarios(3).items() if n != "healthy")


def test_a_drill_that_must_page_trains_long_enough_to_be_paged():
    args = build_parser().parse_args(["--steps", "400"])
    paging = Scenario("x", lambda d: None, victims=1, pages=True)
    assert drill_env(paging, args)["DDP_STEPS"] == str(400 * PAGE_STEPS_FACTOR) and PAGE_STEPS_FACTOR > 1
    assert "DDP_STEPS" not in drill_env(Scenario("x", lambda d: None, env={"DDP_LR": "-1"}), args)
    quiet = build_parser().parse_args(["--no-alerts"])  # nothing judges a page: no longer run
    assert "DDP_STEPS" not in drill_env(paging, quiet)


def test_the_table_says_not_run_for_a_drill_that_did_not_run():
    settings = {"workers": 2, "steps": 9, "effective_batch": 8, "checkpoint_every": 5, "at_step": 3}
    settings.update(collective_timeout=30, store_wait=30, bound=300)
    ran = result(passed=False, checks={"no traceback": False}, problems={"first": []}, store=[])
    doc = {"settings": settings, "planned": {"a": "drill a", "b": "drill b"}, "drills": {"a": ran}}
    rows = [line for line in render_drills(doc) if line.startswith("| drill ") and "verdict" not in line]
    assert rows[0].startswith("| drill a | **FAIL** |") and rows[1] == "| drill b | not run | | | | | | |"


def test_steps_redone_count_the_logged_steps_past_the_checkpoint_and_never_go_negative():
    from tools.compose_project import steps_redone

    assert steps_redone(21, 15) == 6
    # Step 20's line reached Docker after the fault though its checkpoint was written: resumed at 20, last line 19.
    assert steps_redone(19, 20) == 0


def test_the_heal_in_place_drill_fails_on_a_late_step_a_redone_step_a_slow_exit_or_other_parameters():
    from tests.e2e.drills.drill_faults import EXIT_WITHIN_S, HEAL_WITHIN_S

    s = scenarios(3)["heal-in-place-kill"]
    victim = {"name": "worker-3", "id": "c", "state": "exited", "exit_code": 137, "restart_count": 0}
    kill = {"fault": "kill rank 2 (worker-3)", "kind": "kill", "fault_to_next_step_s": 2.4}
    healed = result(
        containers=[*result()["containers"], victim],
        reference_exit_codes=[0, 0, 0],
        faults=[kill],
        healed=True,
        new_torchrun_world=False,
        resumed_from_step=None,
        kill_to_next_step_s=2.4,
        steps_redone_beyond_failed=0,
        finished_to_exit_s=1.0,
        params_equal=True,
    )
    assert all(judge(healed, s, [], alerts=False).values())
    for broken in (
        {"faults": [{**kill, "fault_to_next_step_s": HEAL_WITHIN_S + 0.1}]},
        {"faults": [{**kill, "fault_to_next_step_s": None}]},  # a survivor never finished a step after the kill
        {"steps_redone_beyond_failed": 1},
        {"finished_to_exit_s": EXIT_WITHIN_S + 270},  # torch's exit barrier waited out for the lost launcher
        {"params_equal": False},
        {"resumed_from_step": 185},  # the world restarted and resumed from the checkpoint
        {"new_torchrun_world": True},
        {"healed": False},  # a member of the new world did not heal in place
        {"reference_exit_codes": [0, 0, 1]},
    ):
        checks = judge({**healed, **broken}, s, [], alerts=False)
        assert not all(checks.values()), broken
    # 3 -> 2 -> 3: the container brought back must train within the bound of its start, as a newcomer, and exit 0.
    up = {"fault": "worker-3 started again", "kind": "up", "fault_to_next_step_s": 3.1, "start_to_newcomer_step_s": 3.3}
    back = {**victim, "state": "exited", "exit_code": 0}
    scaled = {**healed, "faults": [kill, up], "newcomer_launches": 1, "containers": [*result()["containers"], back]}
    scale_up = scenarios(3)["heal-in-place-scale-up"]
    assert all(judge(scaled, scale_up, [], alerts=False).values())
    for broken in (
        {"faults": [kill, {**up, "start_to_newcomer_step_s": HEAL_WITHIN_S + 0.1}]},
        {"faults": [kill, {**up, "start_to_newcomer_step_s": None}]},  # it never trained as a newcomer
        {"newcomer_launches": 0},  # it entered torchrun's rendezvous instead
        {"containers": [*result()["containers"], {**back, "exit_code": 1}]},
    ):
        assert not all(judge({**scaled, **broken}, scale_up, [], alerts=False).values()), broken
    settings = {"workers": 3, "steps": 9, "effective_batch": 8, "checkpoint_every": 5, "at_step": 3}
    settings.update(collective_timeout=30, store_wait=30, bound=300)
    row = {**healed, "passed": True, "problems": {"first": []}, "store": []}
    doc = {"settings": settings, "planned": {"heal-in-place-kill": s.what}, "drills": {"heal-in-place-kill": row}}
    rendered = "\n".join(render_drills(doc))
    assert "kill → survivors' next step 2.4 s" in rendered and "0 beyond the failed step" in rendered
