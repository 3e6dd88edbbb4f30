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

Modules: ``cli`` (flags, table, verdict), ``inputs`` (data, synthetic input, loss), ``runs`` (the ranks and the
reference), ``diagnose`` (comparison, probes, causes).
"""

DEFAULT_TOLERANCE = {"float32": 2e-4, "float64": 1e-9}  # see above: measured, with the margin to the broken models
