"""The order in which ``OverlappedSchedule`` runs a stage's forwards and backwards (``action_order``), without process
groups: every micro-batch forward once and backward once after it, 1F1B's memory bound, the last backward last.
That it is PyTorch's own order, call for call, is checked on real ranks (tests/integration/test_pipeline.py)."""

from __future__ import annotations

import pytest

from app.parallel.pipeline.schedule import action_order


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 8), (4, 4), (4, 16), (3, 5)])
def test_every_micro_batch_runs_forward_then_backward_once(order, stages, micro):
    for stage in range(stages):
        actions = action_order(order, stage, stages, micro)
        assert sorted(actions) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(micro))
        assert actions[-1] == ("B", micro - 1)  # the backward that arms the data-parallel sync comes last
        held = peak = 0
        for kind, _ in actions:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        # GPipe holds every micro-batch's activations; 1F1B those of the stages after this one, plus its own.
        assert peak == (micro if order == "gpipe" else min(micro, stages - stage))


def test_1f1b_alternates_one_backward_one_forward_after_its_warm_up():
    assert action_order("1f1b", 0, 2, 4) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]


@pytest.mark.parametrize("stages, micro_batches, bubble", [(1, 8, 0.0), (2, 8, 1 / 9), (4, 8, 3 / 11), (8, 1, 7 / 8)])
def test_the_theoretical_bubble_is_s_minus_1_over_m_plus_s_minus_1(stages, micro_batches, bubble):
    # the line the bubble demo and docs/performance compare the measured idle share with
    from app.parallel.pipeline.stages import theoretical_bubble

    assert theoretical_bubble(stages, micro_batches) == pytest.approx(bubble)
