"""The training worker: what ``python -m app.train`` runs on every rank, one job per module.

Reading order: ``config`` (the settings, validated) → ``dist`` (the process group) → ``data`` and ``models`` (what
is trained on what) → ``steps`` (what one training step is: ddp, pipeline, dp) → ``trainer`` (the loop: step,
checkpoint, log; with ``control``, ``progress``) → ``checkpoint`` and ``metrics``. It uses
``app.parallel`` (what is taught); nothing in ``app.parallel`` imports it.
"""
