"""``python -m app.check SPEC``: the command line, the table and the verdict (see ``app/check/__init__.py``)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from app import exit_codes
from app.check import DEFAULT_TOLERANCE  # by dtype
from app.specs import MODEL_SPECS, SpecError

WRAPPER_NAMES = {"ours": "ours (app.parallel.ddp)", "torch": "PyTorch's (torch.nn.parallel)"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: the message names the flag and what to do
        self.exit(exit_codes.BAD_CONFIG, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from app.check import __doc__ as doc

    p = _Parser(
        prog="python -m app.check",
        description=doc.split("\n\n")[0],
        epilog=(
            "Without --data the input is inferred from the model's first Linear (N(0,1) of its in_features), "
            "Embedding (token ids of its num_embeddings, 16 per sample) or Conv1d/2d/3d (N(0,1) of its in_channels, "
            "64 / 16x16 / 8x8x8); targets are class ids for token inputs (cross-entropy), else N(0,1) shaped like the "
            "output (MSE). Exit codes: 0 PASS, 1 FAIL, 2 bad input."
        ),
    )
    p.add_argument("model", help=f"package.module:callable returning an nn.Module, or one of {', '.join(MODEL_SPECS)}")
    p.add_argument("--model-kwargs", default="{}", help="keyword arguments for the model, JSON ('{\"hidden\": 32}')")
    p.add_argument("--data", help="package.module:callable returning (inputs, targets) tensors or a map-style data set")
    p.add_argument("--data-kwargs", default="{}", help="keyword arguments for --data, JSON")
    p.add_argument(
        "--loss",
        help="package.module:callable, loss(output, target); default: cross-entropy for integer "
        "targets, else MSE (a class is instantiated with --loss-kwargs, a function gets them bound)",
    )
    p.add_argument("--loss-kwargs", default="{}", help="keyword arguments for --loss, JSON")
    p.add_argument("--ranks", type=int, default=2, help="ranks, gloo on CPU (default 2); the pipeline's stages")
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per rank per step, no_sync() on all but the last; --parallel pipeline: ranks x accum "
        "micro-batches through the stages",
    )
    p.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch (default 8)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="default adamw")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--wrapper", choices=["ours", "torch", "both"], help="which DDP (default both)")
    p.add_argument(
        "--tolerance",
        type=float,
        help="max |parameter - reference| and |loss gap| that still count as equal (default: "
        + ", ".join(f"{v:.0e} in {k}" for k, v in DEFAULT_TOLERANCE.items())
        + ", measured on the built-in models, see docs/check.md)",
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="train with the model in eval mode (no dropout, BatchNorm "
        "uses running stats): to compare a model whose train-mode forward is random",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="of parameters and float data (default float32); float64 shrinks rounding to ~1e-16: to tell a real "
        "difference from float32 rounding that AdamW amplified",
    )
    p.add_argument("--find-unused-parameters", action="store_true", help="pass find_unused_parameters=True to DDP")
    _add_kind_and_recipe(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the model's start and the synthetic data")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks count as hung (default 600)")
    return p


def _add_kind_and_recipe(p: argparse.ArgumentParser) -> None:
    """``--parallel`` and the worker's recipe: how the ranks share the state, and what each step runs."""
    p.add_argument(
        "--parallel",
        choices=["ddp", "zero1", "zero2", "zero3", "pipeline"],
        default="ddp",
        help="how the ranks share the state, as the worker's parallel setting (default ddp); zero2/zero3 are our "
        "wrappers only, zero1 is our ZeRO-1 optimizer under --wrapper's DDP; pipeline: one stage per rank, the "
        "step's ranks x accum micro-batches streamed through them",
    )
    p.add_argument(
        "--pipeline-split",
        help="--parallel pipeline: comma list of the modules where stages 2.. begin (net.2, or blocks.4,blocks.8); "
        "default: balanced by parameter count",
    )
    p.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b"], help="--parallel pipeline: default gpipe")
    p.add_argument(
        "--autocast",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="the recipe's autocast (fp16: a GradScaler)",
    )
    p.add_argument("--grad-clip-norm", type=float, default=0.0, help="clip the global gradient norm to this (0: off)")
    p.add_argument(
        "--lr-schedule", choices=["constant", "cosine", "linear"], default="constant", help="default constant"
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps of the schedule (default 0)")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="where cosine/linear decay ends, x lr (default 0)")


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked: a bad one exits 2 with one line naming it (``_Parser.error``)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name, low in (("ranks", 1), ("accum", 1), ("micro_batch", 1), ("steps", 1), ("warmup_steps", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.tolerance is None:
        args.tolerance = DEFAULT_TOLERANCE[args.dtype if args.autocast == "none" else args.autocast]
    if not (args.lr > 0 and args.tolerance >= 0 and args.timeout > 0):
        p.error("--lr and --timeout must be > 0, --tolerance >= 0")
    if args.grad_clip_norm < 0 or not 0 <= args.min_lr_ratio <= 1:
        p.error("--grad-clip-norm must be >= 0 and --min-lr-ratio within [0, 1]")
    if args.autocast != "none" and args.dtype != "float32":
        p.error(f"--autocast {args.autocast} runs on float32 parameters: drop --dtype {args.dtype}")
    if args.find_unused_parameters and args.parallel in ("zero2", "zero3", "pipeline"):
        p.error(f"--find-unused-parameters is for a DDP wrapper (ddp, zero1); --parallel {args.parallel} has none")
    _check_pipeline_flags(p, args)
    if args.parallel == "zero3" and args.dtype != "float32":
        p.error("--parallel zero3 keeps float32 master shards: drop --dtype float64, or use --parallel zero2")
    for flag in ("model_kwargs", "data_kwargs", "loss_kwargs"):
        try:
            value = json.loads(getattr(args, flag))
        except json.JSONDecodeError as e:
            p.error(f"--{flag.replace('_', '-')}: not JSON ({e})")
        if not isinstance(value, dict):
            p.error(f"--{flag.replace('_', '-')}: expected a JSON object like '{{\"hidden\": 32}}'")
        setattr(args, flag, value)
    return args


def _check_pipeline_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What means nothing to one side: a DDP wrapper for the pipeline's stages, a split for a kind without stages."""
    if args.parallel != "pipeline":
        for flag in ("pipeline_split", "pipeline_schedule"):
            if getattr(args, flag) is not None:
                name = flag.replace("_", "-")
                p.error(f"--{name} is for --parallel pipeline; --parallel {args.parallel} has no stages")
        args.wrapper = args.wrapper or "both"
        return
    if args.wrapper is not None:
        p.error(f"--wrapper {args.wrapper} chooses a DDP; --parallel pipeline has none (each rank runs one stage)")
    if args.ranks < 2:
        p.error(f"--parallel pipeline needs --ranks >= 2 (one stage per rank), got {args.ranks}")
    cuts = args.pipeline_split
    args.pipeline_split = [name.strip() for name in cuts.split(",")] if cuts and cuts.strip() else None
    if args.pipeline_split is not None and not all(args.pipeline_split):
        p.error(f"--pipeline-split {cuts!r}: a comma list of module names, without empty names")
    args.pipeline_schedule = args.pipeline_schedule or "gpipe"
    args.wrapper = "pipeline"  # the one side the ranks run: the verdict's name for it


def main(argv=None) -> int:
    args = parse_args(argv)
    from app.check.inputs import InputError

    try:
        setup, model, data_note = prepare(args)
    except (SpecError, InputError) as e:
        print(f"python -m app.check: error: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    return run(args, setup, model, data_note)


def prepare(args: argparse.Namespace):
    """Resolve the specs, build the model, data and loss once and try them: every input error happens here."""
    import torch

    from app.check.inputs import build_data, build_loss, check_loss, check_pipeline_split, synthetic_data
    from app.check.runs import Recipe, Setup
    from app.specs import build_model, expand

    torch.set_num_threads(1)  # as every rank: the same kernels, and several processes share the cores
    model_spec = expand(args.model, MODEL_SPECS)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = build_model(model_spec, args.model_kwargs).to(dtype)
    model.train(not args.eval)
    needed = args.steps * args.ranks * args.accum * args.micro_batch
    if args.data:
        inputs, targets, note = build_data(args.data, args.data_kwargs, needed)
    else:
        inputs, targets, note = synthetic_data(model, needed, args.seed)
    inputs, targets = (t.to(dtype) if t.is_floating_point() else t for t in (inputs, targets))
    loss_fn = build_loss(args.loss, args.loss_kwargs)
    check_loss(loss_fn, model, inputs[: args.micro_batch], targets[: args.micro_batch], "the first micro-batch")
    kwargs = {"find_unused_parameters": True} if args.find_unused_parameters else {}
    split = []
    if args.parallel == "pipeline":
        split = check_pipeline_split(model, args.ranks, args.pipeline_split, inputs[: args.micro_batch])
    setup = Setup(
        model_spec=model_spec, model_kwargs=args.model_kwargs, loss_spec=args.loss, loss_kwargs=args.loss_kwargs,
        inputs=inputs, targets=targets, initial_state=model.state_dict(), world_size=args.ranks, accum=args.accum,
        micro_batch=args.micro_batch, steps=args.steps, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
        eval_mode=args.eval, dtype=args.dtype, wrapper_kwargs=kwargs, parallel=args.parallel,
        recipe=Recipe(args.autocast, args.grad_clip_norm, args.lr_schedule, args.warmup_steps, args.min_lr_ratio),
        pipeline_split=split, pipeline_schedule=args.pipeline_schedule or Setup.pipeline_schedule,
    )  # fmt: skip
    return setup, model, note


def run(args: argparse.Namespace, setup, model, data_note: str) -> int:
    from app.check.diagnose import compare, observe
    from app.check.runs import rank_main, run_reference
    from app.world import spawn_world

    wrappers = ["ours", "torch"] if args.wrapper == "both" else [args.wrapper]
    if args.parallel in ("zero2", "zero3"):
        wrappers = ["ours"]  # our ZeRO-2/ZeRO-3 wrappers: there is no DDP wrapper to choose
    g = setup.global_batch
    print(f"model {setup.model_spec} {json.dumps(setup.model_kwargs)}; data {data_note}")
    print(
        f"{args.ranks} ranks x {args.accum} micro-batch(es) of {args.micro_batch} = global batch {g}; reference: one "
        f"process, the whole batch; {args.optimizer} lr {args.lr:g}, {args.steps} steps, "
        f"{'eval' if args.eval else 'train'} mode, {args.dtype}, tolerance {args.tolerance:.0e}",
        flush=True,
    )
    print(f"parallel {_describe_kind(setup)}; recipe: {_describe_recipe(setup.recipe)}", flush=True)
    reference = run_reference(setup)
    obs = observe(setup, model, reference)
    verdicts = {}
    for wrapper in wrappers:
        print(
            f"\n{_side_name(args.parallel, wrapper)}{' (find_unused_parameters=True)' if setup.wrapper_kwargs else ''}"
        )
        try:
            results = spawn_world(rank_main, args.ranks, setup, [wrapper], timeout=args.timeout)
        except Exception as e:  # a rank raised or hung: the verdict is FAIL, the probes may say why
            verdicts[wrapper] = _report_crash(wrapper, e, obs, model, args)
            continue
        comp = compare(reference, [r[wrapper] for r in results], args.tolerance)
        _print_table(comp)
        verdicts[wrapper] = _report(wrapper, comp, obs, model, args)
    ok = all(v == "equal" for v in verdicts.values())
    summary = "; ".join(f"{w}: {v}" for w, v in verdicts.items())
    print(
        f"\n{'PASS' if ok else 'FAIL'}: {args.ranks} ranks ({args.parallel}) vs one process, {args.steps} steps "
        f"({summary})"
    )
    return exit_codes.OK if ok else exit_codes.FAILED


def _describe_kind(setup) -> str:
    if not setup.pipeline:
        return setup.parallel
    return (
        f"pipeline ({setup.world_size} stages, stages 2.. begin at {','.join(setup.pipeline_split)}; "
        f"{setup.pipeline_schedule}, {setup.world_size * setup.accum} micro-batches of {setup.micro_batch} a step)"
    )


def _side_name(parallel: str, wrapper: str) -> str:
    if parallel == "pipeline":
        return "our pipeline (app.parallel.pipeline on PyTorch's schedules)"
    if parallel in ("zero2", "zero3"):
        return f"ours ZeRO-{parallel[-1]} (app.parallel.zero)"
    ddp = f"{WRAPPER_NAMES[wrapper]} DDP"
    return ddp if parallel == "ddp" else f"our ZeRO-1 optimizer under {ddp}"


def _describe_recipe(recipe) -> str:
    parts = [f"autocast {recipe.autocast}" + (" + GradScaler" if recipe.autocast == "fp16" else "")]
    parts.append(f"clip {recipe.grad_clip_norm:g}" if recipe.grad_clip_norm else "no clipping")
    schedule = (
        recipe.lr_schedule if not recipe.warmup_steps else f"{recipe.warmup_steps} warm-up + {recipe.lr_schedule}"
    )
    return ", ".join([*parts, f"lr schedule {schedule}"])


def _print_table(comp) -> None:
    print(f"{'step':>4}  {'ref loss':>10}  {'rank0 loss':>10}  {'worst gap':>9}  {'max |dp|':>9}  {'same':>4}  digest")
    for step, ref_loss, loss, gap, dp, same, digest in comp.rows:
        print(
            f"{step:>4}  {ref_loss:>10.6f}  {loss:>10.6f}  {gap:>9.2e}  {dp:>9.2e}  {'yes' if same else 'NO':>4}  "
            f"{digest}"
        )


def _report(wrapper: str, comp, obs, model, args) -> str:
    from app.check.diagnose import likely_causes

    if comp.ok:
        same = "the stages merged every step" if args.parallel == "pipeline" else "identical on all ranks every step"
        print(f"PASS ({wrapper}): max |dp| {comp.worst_dp:.2e}, worst loss gap {comp.worst_gap:.2e} <= "
              f"{args.tolerance:.0e}, parameters {same}")  # fmt: skip
        return "equal"
    print(
        f"FAIL ({wrapper}): max |dp| {comp.worst_dp:.2e}, worst loss gap {comp.worst_gap:.2e} "
        f"(tolerance {args.tolerance:.0e})"
    )
    if comp.diverged:
        firsts = ", ".join(f"{n} (step {s})" for n, s in list(comp.diverged.items())[:6])
        print(f"  diverge from one process: {firsts}{' ...' if len(comp.diverged) > 6 else ''}")
    if comp.buffers_diverged:
        firsts = ", ".join(f"{n} (step {s})" for n, s in list(comp.buffers_diverged.items())[:6])
        print(f"  buffers diverge from one process: {firsts}")
    if comp.ranks_differ:
        firsts = ", ".join(f"{n} (step {s})" for n, s in list(comp.ranks_differ.items())[:6])
        print(f"  differ across ranks: {firsts}")
    _print_causes(likely_causes(obs, comp, model, args.optimizer, args.parallel))
    return "differs"


def _report_crash(wrapper: str, error: Exception, obs, model, args) -> str:
    from app.check.diagnose import likely_causes

    print(f"FAIL ({wrapper}): the ranks stopped: {_exception_line(error)}")
    _print_causes(likely_causes(obs, None, model, args.optimizer, args.parallel))
    return "stopped"


def _exception_line(error: Exception) -> str:
    """The raising rank's ``SomeError: message`` line out of the traceback spawn_world passes on, shortened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    line = (raised or lines or [type(error).__name__])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def _print_causes(causes: list[str]) -> None:
    if not causes:
        print("  likely cause: none this check can observe (docs/check.md: what it cannot see)")
    for cause in causes:
        print(f"  likely cause: {cause}")
