"""Compare the ranks with the reference step by step, and say from what was observed why they differ.

``compare`` turns the records of both sides into the table's rows and the parameters that diverge (first step each).
``observe`` runs the single-process probes; ``likely_causes`` turns what they and the comparison saw into advice:

- a parameter some rank's micro-batch leaves without a gradient  -> ``find_unused_parameters=True``, or remove it
- parameters that exist after the first forward but not before    -> create them in ``__init__``
- two identical single-process runs that differ                   -> non-deterministic ops
- two forwards of one input that differ, equal when reseeded      -> dropout etc.: ``--eval`` or a tolerance
- buffers that differ across ranks after a step                   -> BatchNorm: ``SyncBatchNorm``; others: buffers
- buffers equal across ranks but not one process's (the pipeline) -> BatchNorm: no batch statistics, or eval mode

Under ``--parallel pipeline`` a parameter without a gradient is no cause: no gradient is reduced across ranks, and
each stage's optimizer leaves it alone as one process's does.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from app.check.runs import Setup, StepRecord, micro_batches, run_reference

ADAMW_EPS = 1e-8  # torch.optim.AdamW's default, the one the check uses


@dataclass
class Comparison:
    rows: list[tuple] = field(default_factory=list)  # step, ref loss, rank0 loss, worst gap, max |dp|, same, digest
    diverged: dict[str, int] = field(default_factory=dict)  # parameter -> first step beyond the tolerance
    ranks_differ: dict[str, int] = field(default_factory=dict)  # parameter -> first step not equal on all ranks
    buffers_differ: dict[str, int] = field(default_factory=dict)  # buffer -> first step not equal on all ranks
    buffers_diverged: dict[str, int] = field(default_factory=dict)  # buffer -> first step not one process's
    # parameter -> the reference's |gradient| at its worst element, the step it first diverged (AdamW's noise case)
    worst_grad: dict[str, float] = field(default_factory=dict)
    worst_dp: float = 0.0
    worst_gap: float = 0.0

    @property
    def ok(self) -> bool:
        # Buffers that differ across ranks (BatchNorm's running stats without SyncBatchNorm) are a difference too,
        # whatever the tolerance: under autocast one as wide as BatchNorm's effect on the parameters.
        return not (self.diverged or self.ranks_differ or self.buffers_differ or self.buffers_diverged)


def compare(reference: list[StepRecord], ranks: list[list[StepRecord]], tolerance: float) -> Comparison:
    c = Comparison()
    for step, ref in enumerate(reference):
        mine = [records[step] for records in ranks]
        rank0 = mine[0]
        max_dp = 0.0
        for name in sorted(set(ref.params) | set(rank0.params)):
            a, b = ref.params.get(name), rank0.params.get(name)
            dp = math.inf if a is None or b is None or a.shape != b.shape else (a - b).abs().max().item()
            max_dp = max(max_dp, dp)
            if not dp <= tolerance and name not in c.diverged:  # NaN counts as diverged
                c.diverged[name] = step
                if math.isfinite(dp) and name in ref.grads:
                    worst = (a - b).abs().argmax()
                    c.worst_grad[name] = ref.grads[name].flatten()[worst].abs().item()
        for name in ref.buffers:
            if not _buffer_equal(ref.buffers[name], rank0.buffers.get(name), tolerance):
                c.buffers_diverged.setdefault(name, step)
        for digests, differ in (
            (lambda r: r.param_digests, c.ranks_differ),
            (lambda r: r.buffer_digests, c.buffers_differ),
        ):
            for name in digests(rank0):
                if len({digests(r).get(name) for r in mine}) > 1:
                    differ.setdefault(name, step)
        gap = max(abs(r.loss - ref.shard_losses[i]) for i, r in enumerate(mine))
        same = len({r.digest for r in mine}) == 1
        c.worst_dp, c.worst_gap = max(c.worst_dp, max_dp), max(c.worst_gap, gap)
        if not gap <= tolerance:
            c.diverged.setdefault("(loss)", step)
        c.rows.append((step, ref.loss, rank0.loss, gap, max_dp, same, rank0.digest))
    return c


def _buffer_equal(a: torch.Tensor, b: torch.Tensor | None, tolerance: float) -> bool:
    # A counter (BatchNorm's num_batches_tracked) must be exact; a float buffer within the tolerance.
    if b is None or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool((a.double() - b.double()).abs().max() <= tolerance) if a.numel() else True


@dataclass
class Observations:
    created_in_forward: list[str] = field(default_factory=list)
    forward_random: str | None = None  # "seeded": differs, equal when reseeded (dropout); "unseeded": even then
    rerun_max_diff: float = 0.0  # max |parameter| difference between two identical single-process runs
    rerun_first_step: int | None = None
    no_grad: dict[str, tuple[int, int]] = field(default_factory=dict)  # parameter -> (step, rank) with no gradient


def observe(setup: Setup, model: nn.Module, reference: list[StepRecord]) -> Observations:
    """The single-process probes; ``reference`` is the first reference run, another one is made here."""
    obs = Observations()
    probe = copy.deepcopy(model)
    probe.train(not setup.eval_mode)
    x, _ = micro_batches(setup, 0, 0)[0]
    before = {n for n, _ in probe.named_parameters()}
    with torch.no_grad():
        first = probe(x)
    obs.created_in_forward = [n for n, _ in probe.named_parameters() if n not in before]
    with torch.no_grad():
        second = probe(x)
        torch.manual_seed(0)
        seeded_a = probe(x)
        torch.manual_seed(0)
        seeded_b = probe(x)
    if not torch.equal(seeded_a, seeded_b):
        obs.forward_random = "unseeded"
    elif not torch.equal(first, second):
        obs.forward_random = "seeded"

    again = run_reference(setup, probe=False)
    for step, (a, b) in enumerate(zip(reference, again)):
        diff = max(((a.params[n] - b.params[n]).abs().max().item() for n in a.params if n in b.params), default=0.0)
        if diff > 0 and obs.rerun_first_step is None:
            obs.rerun_first_step = step
        obs.rerun_max_diff = max(obs.rerun_max_diff, diff)
    for step, record in enumerate(reference):
        for name, rank in record.no_grad.items():
            obs.no_grad.setdefault(name, (step, rank))
    return obs


def _names(d: dict, limit: int = 4) -> str:
    names = list(d)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def likely_causes(
    obs: Observations, comp: Comparison | None, model: nn.Module, optimizer: str, parallel: str = "ddp"
) -> list[str]:
    """Advice lines, most specific first; empty when nothing observed explains a difference."""
    causes = []
    if obs.created_in_forward:
        causes.append(
            f"parameters created in forward: {_names(dict.fromkeys(obs.created_in_forward))} exist only after the "
            f"first forward, so DDP (built before it) never syncs them and each rank creates its own -> create them "
            f"in __init__"
        )
    if obs.no_grad and parallel != "pipeline":
        name, (step, rank) = next(iter(obs.no_grad.items()))
        causes.append(
            f"parameters without a gradient: {_names(obs.no_grad)} (first: {name}, step {step}, rank {rank}'s "
            + (
                "micro-batch); DDP waits for every parameter's gradient -> pass find_unused_parameters=True "
                "(--find-unused-parameters here), or remove them from the model"
                if parallel in ("ddp", "zero1")
                else f"micro-batch); {parallel} reduce-scatters every parameter's gradient and has no "
                "find_unused_parameters -> remove them from the model or freeze them (requires_grad=False)"
            )
        )
    if obs.rerun_first_step is not None:
        causes.append(
            f"non-deterministic ops: two identical single-process runs differ (by up to {obs.rerun_max_diff:.2e}, "
            f"from step {obs.rerun_first_step}), so N ranks cannot match one process either -> "
            f"torch.use_deterministic_algorithms(True), or a tolerance above that difference (--tolerance)"
        )
    if obs.forward_random == "seeded":
        causes.append(
            "randomness in forward: two forwards of the same input in train mode differ (dropout or other torch "
            "random ops); each rank draws its own numbers, as it should, and one process draws others -> compare "
            "in eval mode (--eval) or accept a tolerance (--tolerance)"
        )
    elif obs.forward_random == "unseeded" and obs.rerun_first_step is None:
        causes.append(
            "randomness in forward that torch.manual_seed does not control (two forwards differ even when reseeded)"
            " -> draw it from torch's generator, or compare in eval mode (--eval)"
        )
    if comp is not None and comp.buffers_differ:
        causes.append(_buffer_cause(comp.buffers_differ, model))
    elif comp is not None and comp.buffers_diverged:
        causes.append(_diverged_buffer_cause(comp.buffers_diverged, model, parallel))
    if not causes and comp is not None and optimizer == "adamw":
        causes += _adam_noise_cause(comp)
    return causes


def _adam_noise_cause(comp: Comparison) -> list[str]:
    """Where the exact gradient is zero (attention's key bias: softmax ignores a constant added to every key), the
    computed one is rounding noise; AdamW divides by sqrt(v) + eps, so noise below eps becomes an update of up to
    lr * noise / eps, different on N ranks than in one process. Named only when every diverged element is such."""
    tiny = {n: g for n, g in comp.worst_grad.items() if g < 10 * ADAMW_EPS}
    diverged = [n for n in comp.diverged if n != "(loss)"]
    if not diverged or set(diverged) != set(tiny):
        return []
    return [
        f"float32 rounding amplified by AdamW: where {_names(tiny)} differ most, the reference's gradient is "
        f"~0 (|g| = {max(tiny.values()):.1e} < 10 x eps), i.e. rounding noise that Adam normalises into an update "
        f"-> confirm with --dtype float64 (the difference should shrink to ~1e-12), or raise --tolerance"
    ]


def _buffer_cause(buffers: dict[str, int], model: nn.Module) -> str:
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in buffers}
    batch_norms = sorted({f"{type(m).__name__} {n.rpartition('.')[0]}" for n, m in owners.items() if _is_bn(m)})
    step = min(buffers.values())
    if batch_norms:
        return (
            f"buffers differ across ranks after step {step}: {_names(buffers)} ({', '.join(batch_norms)}): in train "
            f"mode each rank normalises with its own micro-batch's statistics, one process with the whole batch's -> "
            f"nn.SyncBatchNorm.convert_sync_batchnorm(model) for batch statistics over all ranks (GPU only in "
            f"PyTorch; per micro-batch still, with --accum > 1); broadcast_buffers (on by default) only copies rank "
            f"0's running stats at each forward, which keeps eval equal across ranks but not training; or --eval"
        )
    return (
        f"buffers differ across ranks after step {step}: {_names(buffers)}: forward updates them from each rank's own "
        f"data -> make that update the same on every rank, or keep broadcast_buffers=True (rank 0's win at each "
        f"forward) if only their use in the next forward matters"
    )


def _diverged_buffer_cause(buffers: dict[str, int], model: nn.Module, parallel: str) -> str:
    """Buffers equal on every rank but not one process's: the pipeline's merged model, whose BatchNorm normalised
    each micro-batch with its own statistics and counted every micro-batch's forward."""
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in buffers}
    batch_norms = sorted({f"{type(m).__name__} {n.rpartition('.')[0]}" for n, m in owners.items() if _is_bn(m)})
    step = min(buffers.values())
    if batch_norms and parallel == "pipeline":
        return (
            f"BatchNorm under the pipeline: {', '.join(batch_norms)} normalises each micro-batch with that "
            f"micro-batch's statistics and updates its running stats once per micro-batch, one process once with "
            f"the whole batch's ({_names(buffers)} differ from one process's after step {step}); a pipeline streams "
            f"the batch through a stage one micro-batch after another, so no sync can give it the whole batch "
            f"(SyncBatchNorm syncs ranks, not micro-batches) -> a normalisation without batch statistics (LayerNorm, "
            f"GroupNorm), BatchNorm in eval mode (--eval here), or data parallelism with SyncBatchNorm"
        )
    return (
        f"buffers differ from one process's after step {step}: {_names(buffers)}: forward updates them once per "
        f"{'micro-batch' if parallel == 'pipeline' else 'forward'}, from other samples than one process's whole "
        f"batch -> make that update independent of how the batch is cut, or compare in eval mode (--eval)"
    )


def _is_bn(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)
