"""What fits before launch: each kind's predicted peak memory per rank (ddp, ZeRO 1-3), for a model, per world size.

    python -m app.plan bench.models.residual:ResidualStack --model-kwargs '{"width": 1536, "depth": 16}' \\
        --data teacher_classification --world 2,4 --memory 1300m
    python -m app.plan tiny_transformer --world 2,4,8 --memory 2g --micro-batch 16

A rank's peak is its model state, by ZeRO's formula (Rajbhandari et al. 2020), plus what the step keeps in flight,
the activations and the process's own base. Per rank, for Ψ parameters of ``p`` bytes (fp32: 4), gradients alike,
and ``K`` bytes of optimizer state per parameter (AdamW: two fp32 moments, 8; SGD with momentum: 4):

    ddp     Ψ·(p + p + K)            zero2   Ψ·(p + (p + K)/N)
    zero1   Ψ·(p + p + K/N)          zero3   Ψ·(p + p + K)/N

What the step adds (``in flight``): ddp's reducer fills one bucket at a time (``bucket_cap_mb``); zero1
broadcasts the updated parameters in flats of at most 25 MiB, two at a time; zero2 keeps up to two buckets' flat
gradients (the one filling, one reduce-scattering: 2 × ``bucket_cap_mb``); zero3 gathers one unit (the ``largest
unit``, its parameters) and keeps its flat gradient and one more in flight (3 × that unit). ``activations``: measured
here, one forward and backward of one micro-batch on the CPU (the bytes autograd saves for backward, each storage
once, and the output); with ``--activation-checkpointing units`` measured again with each unit checkpointed (what
is saved outside the units, their inputs, and the largest unit's own, rebuilt in backward). The last lines say how
far checkpointing and an offload of the optimizer state (its column: not built) would each lower the line.
``base``: the idle worker's peak (torch, gloo, threads, the data), measured by ``python -m bench.memory_bench``
(``bench/results/memory.json``) or given with ``--base``. Every kind also builds the whole model once (the worker
builds it, then shards it): ``construction`` = base + Ψ·p; the peak of a fresh start is the larger of the two.

A *resume* may peak in the load instead: a sharded rank holds the optimizer state it fills, KΨ/N, and one checkpoint
file of at most 64 MiB at a time, beside its parameters (and zero1's gradient buckets), into which it copies straight
from the file. ddp's rank maps its file and copies it out tensor by tensor: it holds what training holds.

A bad spec or memory string is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from app import exit_codes
from app.cli import OneLineParser, first_line

KINDS = ("ddp", "zero1", "zero2", "zero3")
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # state per fp32 parameter (SGD: its momentum buffer)
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "memory.json"
DEFAULT_BASE_BYTES = 256 * 2**20  # an idle worker's peak when no results file says (torch + gloo + threads)
DEFAULT_BUCKET_CAP_MB = 25  # the worker's (and PyTorch's) default
BROADCAST_BUCKET_BYTES = 25 * 2**20  # app.parallel.zero.stage1's: this module imports no torch, so it is repeated
SHARD_FILE_BYTES = 64 * 2**20  # app.parallel.zero.checkpoint's, repeated for the same reason
MIB = 2**20
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class PlanError(ValueError):
    """A spec, memory string or world list the planner cannot use: one line."""


def state_bytes(kind: str, psi: int, world_size: int, param_bytes: int = 4, optimizer_bytes: int = 8) -> int:
    """Bytes of parameters + gradients + optimizer state one rank holds under ``kind`` (the formula above)."""
    p, g, k = split_state(kind, psi, world_size, param_bytes, optimizer_bytes)
    return p + g + k


def split_state(kind: str, psi: int, world_size: int, param_bytes: int = 4, optimizer_bytes: int = 8):
    """``(parameters, gradients, optimizer state)`` bytes one rank holds under ``kind``."""
    if kind not in KINDS:
        raise PlanError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    n = world_size
    p, g, k = psi * param_bytes, psi * param_bytes, psi * optimizer_bytes
    shards = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (False, True, True)}
    sharded = shards.get(kind, (True, True, True))
    return tuple(-(-b // n) if s else b for b, s in zip((p, g, k), sharded))


def parse_memory(text: str) -> int:
    """``"1300m"``, ``"1.5g"``, ``"800MiB"``, ``"2GB"`` -> bytes (binary units, as Docker's and ``free``'s)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise PlanError(f"--memory {text!r}: expected a size such as 1300m, 1.5g or 800MiB")
    value = float(m[1]) * _UNITS[m[2]]
    if value <= 0:
        raise PlanError(f"--memory {text!r}: must be more than 0")
    return int(value)


def parse_worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise PlanError(f"--world {text!r}: expected a comma list of world sizes, e.g. 2,4") from None
    if not worlds or any(w < 1 for w in worlds):
        raise PlanError(f"--world {text!r}: expected world sizes of at least 1, e.g. 2,4")
    return worlds


@dataclass
class ModelFacts:
    """What the prediction needs from the model: Ψ, its largest FSDP unit, one micro-batch's activations (without
    and with activation checkpointing of its units)."""

    psi: int
    largest_unit: int  # parameters of the largest unit (each child of the root, ModuleList items apart)
    activation_bytes: int
    activation_bytes_checkpointed: int | None = None  # --activation-checkpointing units (None: not measured)


@dataclass
class Prediction:
    kind: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    largest_unit: int  # bytes of the largest unit gathered whole (zero3; 0 otherwise)
    in_flight: int
    activations: int
    base: int
    whole_model: int  # the model as built, before it is sharded

    @property
    def training(self) -> int:
        return self.params + self.grads + self.optimizer + self.largest_unit + self.in_flight + self.activations

    @property
    def construction(self) -> int:
        return self.base + self.whole_model

    resume_held: int = 0  # what a resuming rank holds beside the file it loads and the buffers it fills

    @property
    def peak(self) -> int:
        """A fresh start's peak: the larger of construction and training."""
        return max(self.base + self.training, self.construction)

    @property
    def resume_peak(self) -> int:
        """A resume's peak: the load, or training after it."""
        return max(self.peak, self.base + self.resume_held)

    @property
    def peak_phase(self) -> str:
        return "construction" if self.construction > self.base + self.training else "training"


def predict(
    kind: str,
    world_size: int,
    facts: ModelFacts,
    base: int,
    param_bytes: int = 4,
    optimizer_bytes: int = 8,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    activation_checkpointing: bool = False,
) -> Prediction:
    """One kind's per-rank peak at ``world_size`` (the module docstring's terms); ``activation_checkpointing``: with
    each unit's activations recomputed in backward (``--activation-checkpointing units``)."""
    p, g, k = split_state(kind, facts.psi, world_size, param_bytes, optimizer_bytes)
    whole = facts.psi * param_bytes
    unit = -(-facts.largest_unit // world_size) * world_size * param_bytes if kind == "zero3" else 0
    in_flight = {
        "ddp": min(int(bucket_cap_mb * MIB), whole),
        "zero1": min(2 * BROADCAST_BUCKET_BYTES, whole),
        "zero2": min(2 * int(bucket_cap_mb * MIB), whole),
        "zero3": 3 * unit,
    }[kind]
    shard = -(-(whole + facts.psi * optimizer_bytes) // world_size)  # a rank's file: its parameters' and state's share
    held = -(-facts.psi * optimizer_bytes // world_size) + min(SHARD_FILE_BYTES, shard)  # the state, one file
    resume_held = {"ddp": p + g + k, "zero1": p + g + held, "zero2": p + held, "zero3": p + held}[kind]
    activations = facts.activation_bytes
    if activation_checkpointing:
        if facts.activation_bytes_checkpointed is None:
            raise PlanError("activation checkpointing: the model facts hold no measurement with it (model_facts)")
        activations = facts.activation_bytes_checkpointed
    return Prediction(kind, world_size, p, g, k, unit, in_flight, activations, base, whole, resume_held)


def measured_base(results: Path = RESULTS) -> dict[tuple[str, int], int]:
    """``{(kind, world size): the idle worker's peak}`` from the memory bench's results ({} without the file)."""
    try:
        doc = json.loads(results.read_text())
    except (OSError, ValueError):
        return {}
    return {(kind, int(w)): r["base"]["peak_bytes"] for w, rows in doc["results"].items() for kind, r in rows.items()}


def base_for(kind: str, world_size: int, bases: dict[tuple[str, int], int]) -> int:
    """The measured base of (kind, world size); else the largest measured for that kind; else the default."""
    if (kind, world_size) in bases:
        return bases[(kind, world_size)]
    same_kind = [b for (k, _), b in bases.items() if k == kind]
    return max(same_kind or bases.values() or [DEFAULT_BASE_BYTES])


def model_facts(spec: str, model_kwargs: dict, data: str | None, data_kwargs: dict, micro_batch: int, loss):
    """Build the model (seeded, on the CPU), count it, and run one micro-batch forward and backward to measure the
    activations: the bytes of every tensor autograd saves for backward that is not a parameter, each storage once;
    then again with each unit checkpointed (the units ``--activation-checkpointing units`` takes): what is saved
    outside the units, their inputs, and the largest unit's own activations (rebuilt one unit at a time)."""
    import torch

    from app.check.inputs import InputError, build_data, build_loss, synthetic_data
    from app.parallel.activation_checkpointing import candidate_units, checkpoint_modules
    from app.parallel.zero.stage3 import assign_parameters, resolve_units
    from app.specs import DATA_SPECS, SpecError, build_model, expand

    try:
        torch.manual_seed(0)
        model = build_model(spec, model_kwargs)
        if data:
            x, y, _ = build_data(expand(data, DATA_SPECS), data_kwargs, micro_batch)
        else:
            x, y, _ = synthetic_data(model, micro_batch, seed=0)
        loss_fn = build_loss(loss, {})
    except (SpecError, InputError) as e:
        raise PlanError(first_line(e)) from None
    activations, per_unit = _activations(model, x, y, loss_fn)
    psi = sum(p.numel() for p in model.parameters())
    units = assign_parameters(model, resolve_units(model, None))  # zero3's default units: each child of the root
    largest = max(sum(p.numel() for p in ps) for ps in units.values())
    checkpointed = None
    try:
        ac_units = candidate_units(model, [])  # --activation-checkpointing units, as the worker chooses them
    except ValueError:
        ac_units = {}
    if ac_units:
        checkpoint_modules(ac_units.values())
        outside, _ = _activations(model, x, y, loss_fn, inputs_of=ac_units.values())
        # Backward recomputes one unit at a time: the largest unit's own activations exist again while it does.
        checkpointed = outside + max(per_unit.get(id(m), 0) for m in ac_units.values())
    return ModelFacts(psi, largest, activations, checkpointed)


def _activations(model, x, y, loss_fn, inputs_of=()) -> tuple[int, dict[int, int]]:
    """One forward and backward: the bytes of every tensor autograd saves that is not a parameter, each storage once,
    with the output and the inputs of the modules ``inputs_of`` (what a checkpointed unit keeps instead); and per
    module (by id) the bytes saved inside its forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside: dict[int, int] = {}
    current: list[int] = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in saved:
            saved[ptr] = t.untyped_storage().nbytes()
            for unit in current:
                inside[unit] = inside.get(unit, 0) + saved[ptr]
        return t

    def keep_input(_module, args):
        for t in args:
            if isinstance(t, torch.Tensor):
                saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    def enter(module, _args) -> None:
        current.append(id(module))

    def leave(_module, _args, _out) -> None:  # returns None: the output stays the module's
        current.pop()

    hooks = [m.register_forward_pre_hook(keep_input) for m in inputs_of]
    for m in model.modules():
        hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            loss_value = loss_fn(out, y)
        loss_value.backward()
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values()) + out.numel() * out.element_size(), inside


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m app.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="package.module:callable returning an nn.Module, or a built-in model name")
    p.add_argument("--model-kwargs", default="{}", help="keyword arguments for the model, JSON")
    p.add_argument("--data", help="data spec for the micro-batch (default: an input inferred from the model)")
    p.add_argument("--data-kwargs", default="{}", help="keyword arguments for --data, JSON")
    p.add_argument("--loss", help="loss spec (default: cross-entropy for integer targets, else MSE)")
    p.add_argument("--world", default="2,4", help="comma list of world sizes (default 2,4)")
    p.add_argument("--memory", help="memory per rank to check against, e.g. 1300m, 1.5g (default: no verdict)")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward (default 32)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_BYTES), default="adamw", help="default adamw")
    p.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB, help="zero2's buckets (default 25)")
    p.add_argument("--base", help="the idle worker's peak, e.g. 260m (default: measured, bench/results/memory.json)")
    p.add_argument(
        "--activation-checkpointing",
        choices=("off", "units"),
        default="off",
        help="predict with each unit's activations recomputed in backward, as the worker's flag (default off)",
    )
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    return p


def _json_arg(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise PlanError(f"{flag} {text!r}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise PlanError(f"{flag} {text!r}: expected a JSON object")
    return value


def render(predictions: list[Prediction], facts: ModelFacts, memory: int | None) -> list[str]:
    head = (
        f"Ψ = {facts.psi:,} parameters; activations of one micro-batch {facts.activation_bytes / MIB:.1f} MiB "
        "(measured); MiB per rank"
    )
    cols = "kind   N  params   grads  optim  unit  in flight  activ   base  predicted  peak in       resume"
    lines = [head, cols + (f"       fits {memory / MIB:.0f} MiB" if memory else "")]
    for r in predictions:
        line = (
            f"{r.kind:<6}{r.world_size:>2} {r.params / MIB:7.0f} {r.grads / MIB:7.0f} {r.optimizer / MIB:6.0f} "
            f"{r.largest_unit / MIB:5.0f} {r.in_flight / MIB:10.0f} {r.activations / MIB:6.0f} {r.base / MIB:6.0f} "
            f"{r.peak / MIB:10.0f}  {r.peak_phase:<12} {r.resume_peak / MIB:7.0f}"
        )
        if memory:  # judged on the resume: a job that cannot resume after a failure does not fit
            line += "  FITS" if r.resume_peak <= memory else "  DOES NOT FIT"
        lines.append(line)
    return lines + what_moves_the_line(predictions, facts)


def what_moves_the_line(predictions: list[Prediction], facts: ModelFacts) -> list[str]:
    """Issue 37's item 4: how far activation checkpointing (measured) and offloading the optimizer state to host
    files (its bytes leave the process's anonymous memory; not built) each lower a rank's peak, and which goes
    further for this model."""
    if facts.activation_bytes_checkpointed is None:
        ac = 0
        said = "activation checkpointing: no units to checkpoint (no nn.ModuleList/nn.Sequential)"
    else:
        ac = max(0, facts.activation_bytes - facts.activation_bytes_checkpointed)
        said = (
            f"activation checkpointing (units) lowers each peak by {ac / MIB:.1f} MiB (one micro-batch's "
            f"activations {facts.activation_bytes / MIB:.1f} -> {facts.activation_bytes_checkpointed / MIB:.1f} MiB)"
        )
    offload = [r.optimizer for r in predictions]
    further = "the optimizer state's offload" if min(offload) > ac else "activation checkpointing"
    return [
        said,
        f"offloading the optimizer state (not built) would lower them by the optim column, {min(offload) / MIB:.0f}"
        f"-{max(offload) / MIB:.0f} MiB: {further} moves the line further for this model and micro-batch",
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        worlds = parse_worlds(args.world)
        memory = parse_memory(args.memory) if args.memory else None
        base = parse_memory(args.base) if args.base else None
        if args.micro_batch < 1:
            raise PlanError(f"--micro-batch {args.micro_batch}: must be at least 1")
        model_kwargs = _json_arg("--model-kwargs", args.model_kwargs)
        data_kwargs = _json_arg("--data-kwargs", args.data_kwargs)
        facts = model_facts(args.model, model_kwargs, args.data, data_kwargs, args.micro_batch, args.loss)
    except PlanError as e:
        print(f"python -m app.plan: error: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    bases = measured_base()
    k = OPTIMIZER_BYTES[args.optimizer]
    try:
        predictions = [
            predict(
                kind,
                w,
                facts,
                base if base is not None else base_for(kind, w, bases),
                4,
                k,
                args.bucket_cap_mb,
                activation_checkpointing=args.activation_checkpointing == "units",
            )
            for w in worlds
            for kind in KINDS
        ]
    except PlanError as e:
        print(f"python -m app.plan: error: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    if args.json:
        rows = [
            {**vars(r), "peak": r.peak, "peak_phase": r.peak_phase, "resume_peak": r.resume_peak} for r in predictions
        ]
        print(json.dumps({"psi": facts.psi, "facts": vars(facts), "predictions": rows}, indent=1))
    else:
        print("\n".join(render(predictions, facts, memory)))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
