"""GPipe and 1F1B for one stage per rank, with every receive posted ahead and no send waited inside the step.

PyTorch's ``ScheduleGPipe`` and ``Schedule1F1B`` post a micro-batch's receive just before they compute it and wait
for it at once; 1F1B also waits for its last send together with the next receive. A gloo send completes only once
its receive is posted, so a receive posted late makes every hop wait for the receiving stage to get there, and a
send waited with a receive ties a stage to its neighbour's progress. With M micro-batches there are about 2M such
hand-offs a step: the idle beyond (S-1)/(M+S-1) grows with M (``bench.pipeline_bubble`` measures both loops).

``OverlappedSchedule`` runs the same actions in the same order (so the same arithmetic: results equal PyTorch's
schedule bit for bit, ``tests/integration/test_pipeline.py``), but

- posts the receives of every micro-batch of the step (activations in, gradients in) at its start, in the order it
  will wait for them: each lands in its own per-micro-batch buffer of PyTorch's stage as soon as the neighbour
  sends it, while this stage computes;
- fires each send right after its compute and waits for all of them only at the end of the step.

Nothing can deadlock: no wait inside the loop is on a send, and every receive it waits on is one a neighbour sends
before it waits on anything this stage has not yet sent (the schedules' orders are PyTorch's).

It also times each phase of the step (``StepPhases``): compute, waiting for a receive, handing sends to gloo, the
wait for the sends at the end, and the schedule's own Python (the rest).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

ORDERS = ("gpipe", "1f1b")


@dataclass
class StepPhases:
    """Seconds one stage spent in each phase of its last step (what is not here is schedule overhead)."""

    recv_wait: float = 0.0  # blocked until a neighbour's activations or gradients arrived
    send: float = 0.0  # handing sends (and posting receives) to gloo
    send_drain: float = 0.0  # at the end of the step, until every send of the step completed


def action_order(order: str, stage_index: int, num_stages: int, n_microbatches: int) -> list[tuple[str, int]]:
    """This stage's actions, ``("F", i)`` / ``("B", i)``, in PyTorch's order for ``order`` (GPipe: every forward,
    then every backward; 1F1B: ``num_stages - stage_index`` forwards, then one backward and one forward in turn,
    then the remaining backwards)."""
    forwards = [("F", i) for i in range(n_microbatches)]
    backwards = [("B", i) for i in range(n_microbatches)]
    if order == "gpipe":
        return forwards + backwards
    warmup = min(n_microbatches, num_stages - stage_index)
    actions = forwards[:warmup]
    for i in range(n_microbatches - warmup):
        actions += [backwards[i], forwards[warmup + i]]
    return actions + backwards[n_microbatches - warmup :]


def _post(ops: list[dist.P2POp]) -> list[dist.Work]:
    # One isend/irecv per op, as PyTorch's _batch_p2p does for a homogeneous list: gloo needs no coalescing.
    return [op.op(op.tensor, op.peer, op.group) for op in ops]


class OverlappedSchedule(PipelineScheduleSingle):
    """PyTorch's single-stage schedule base (input splitting, shape inference, losses, gradient scaling), stepping
    ``order`` (``"gpipe"`` or ``"1f1b"``) with receives posted ahead; ``phases`` holds the last step's profile."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, *, order: str, **kwargs):
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")
        if order == "1f1b" and n_microbatches < stage.num_stages:
            raise ValueError(
                f"1f1b needs n_microbatches >= stages ({n_microbatches} < {stage.num_stages}): raise n_microbatches "
                "or use gpipe"
            )
        self.order = order
        super().__init__(stage, n_microbatches, **kwargs)
        self.phases = StepPhases()

    def _step_microbatches(
        self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True, loss_kwargs=None
    ):
        stage, m = self._stage, self._n_microbatches
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None, loss_kwargs)
        phases = self.phases = StepPhases()
        actions = action_order(self.order, stage.stage_index, stage.num_stages, m)
        tick = time.perf_counter()
        # Posted in the order they will be waited for: the oldest receive still open (what the flight recorder's
        # doctor names in a hang) is then always the one this stage is blocked on.
        receives = {
            (kind, i): _post(stage.get_fwd_recv_ops(i) if kind == "F" else stage.get_bwd_recv_ops(i))
            for kind, i in actions
        }
        sends: list[dist.Work] = []
        phases.send += time.perf_counter() - tick
        for kind, i in actions:
            tick = time.perf_counter()
            for work in receives.pop((kind, i)):
                work.wait()
            phases.recv_wait += time.perf_counter() - tick
            if kind == "F":
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
                ops = stage.get_fwd_send_ops(i)
            else:
                loss = self._maybe_get_loss(stage, i)
                stage.backward_one_chunk(i, loss=loss, last_backward=i == m - 1)
                ops = stage.get_bwd_send_ops(i)
            tick = time.perf_counter()
            sends += _post(ops)
            phases.send += time.perf_counter() - tick
        tick = time.perf_counter()
        for work in sends:
            work.wait()
        phases.send_drain = time.perf_counter() - tick
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(m if self.scale_grads else 1)
