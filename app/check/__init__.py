"""Does YOUR model train the same on N ranks as on one process? Run this before a long job.

    python -m app.check app.worker.models:MiniMLP                     # 2 CPU ranks, ours and PyTorch's DDP, 5 steps
    python -m app.check mini_mlp --ranks 4 --accum 2                  # a built-in name; 2 micro-batches per step
    python -m app.check mypkg.models:build --model-kwargs '{"width": 64}' --data mypkg.data:tiny --loss torch.nn:MSELoss
    make check MODEL_SPEC=tiny_transformer CHECK_ARGS="--accum 2"

N ranks (gloo on CPU, ``app.world.spawn_world``) train the model with DDP (``app.parallel.wrap_model``, ours
and PyTorch's), with gradient accumulation (``no_sync()`` on all but the last micro-batch, the loss divided by K), on
the same global batch that one process trains on whole; ``make demo``'s table compares them after every optimizer
step. On a mismatch the check names the parameters that diverge and the first step they do, and the likely cause
from what its probes observed (``app/check/diagnose.py``): a parameter without a gradient, parameters created in
forward, non-deterministic ops, randomness in forward, buffers that differ across ranks.

Exit codes: 0 PASS, 1 FAIL (or a rank crashed), 2 bad input (a spec, a flag, data that does not fit the model),
one line, before any rank starts. ``docs/check.md`` explains the table, each diagnosis and what the check cannot see.

Tolerance (``--tolerance``, on both max |parameter - reference| and the loss gap): 2e-4 in float32, 1e-9 in float64.
Measured in float32 (AdamW lr 1e-3, 5 steps, micro-batch 8, both wrappers, ``--ranks 2/4 --accum 1/2``, but not
``tiny_transformer`` at 4 ranks with accum 2): ``mini_mlp`` max |dp| <= 2.2e-8; ``tiny_transformer`` <= 4.1e-5. In
the 2-layer run inspected, what exceeded 1e-5 was attention's projections, where the exact gradient is zero and
AdamW turns rounding noise into an update; in float64 that run differs by 1.4e-14. BatchNorm, dropout and the
non-deterministic model of ``tests/models_broken.py`` differ by 2e-3 after one step. Another ``--lr`` or many more
``--steps``: measure again, or use ``--dtype float64``. Table and caveats: docs/check.md.

Every kind and the recipe: ``--parallel ddp|zero1|zero2|zero3`` (zero2/zero3: our wrappers; zero3 gathers the model
on rank 0 after each step to compare it; ``pipeline`` below), ``--autocast bf16|fp16`` (fp16 with a GradScaler,
sharded for zero2/zero3), ``--grad-clip-norm``, ``--lr-schedule`` with ``--warmup-steps``/``--min-lr-ratio``: both
sides run the worker's step (``accumulation_step`` with its ``StepRecipe``) and schedule. Under autocast the
tolerance is 1e-2: the whole-batch forward rounds to bf16/fp16 differently from the ranks' micro-batches, and AdamW
turns that into parameter differences, measured up to 3.8e-3 (bf16) and 2.9e-3 (fp16) on ``tiny_transformer`` in 5
steps (mini_mlp 2e-4 and 5e-5), so prove equality in float32 first. Buffers that differ across ranks fail the check
at any tolerance (a BatchNorm without SyncBatchNorm), and so do buffers that differ from the one process's.

``--parallel pipeline`` (``--pipeline-split``, ``--pipeline-schedule``): the N ranks are the N stages of one pipeline,
stepped as the worker's ``parallel=pipeline`` steps them (``build_pipeline_stage``, ``forward_backward``,
``optimizer_step``, the schedule), with the recipe (autocast in every stage, fp16 with a ShardedGradScaler);
the same global batch streamed as ranks x accum micro-batches of --micro-batch; the merged stages are compared.
Measured (5 steps, AdamW lr 1e-3; mini_mlp, deep_mlp, tests.models_user:StackNet; ranks 2 and 4, accum 1 and 2;
the recipe: clip 1.0, 2 warm-up + cosine): max |dp| <= 1.5e-6 in float32, <= 3.0e-3 in bf16 and <= 8.3e-4 in fp16
(deep_mlp, where AdamW turns a near-zero gradient into lr-sized steps), within the same default tolerances.

    python -m app.check mypkg.models:Net --parallel pipeline --ranks 2 --autocast bf16 --grad-clip-norm 1.0 \
        --lr-schedule cosine --warmup-steps 2 --accum 2

A model the pipeline cannot cut (not the sequence of its children, fewer modules with parameters than ranks, a
stage without parameters) and a DDP flag (--wrapper, --find-unused-parameters) are one line, exit 2. BatchNorm FAILs
and is named (each micro-batch normalised with its own statistics); a parameter without a gradient PASSes (no
gradient is reduced across ranks; each stage's optimizer skips it as one process's does). docs/check.md has more.

Modules: ``cli`` (flags, table, verdict), ``inputs`` (data, synthetic input, loss), ``runs`` (the ranks and the
reference), ``diagnose`` (comparison, probes, causes).
"""

# See above: measured, with the margin to the broken models. Under autocast the key is the autocast dtype.
DEFAULT_TOLERANCE = {"float32": 2e-4, "float64": 1e-9, "bf16": 1e-2, "fp16": 1e-2}
