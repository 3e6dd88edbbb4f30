"""An example user package: a model, a data set and a loss, named by specs such as ``user_model.model:build_model``.

Nothing here imports the cluster's code: ``model``, ``data`` and ``loss`` are plain PyTorch, so the same package
works with ``python -m app.check``, the worker's ``DDP_MODEL``/``DDP_DATA``/``DDP_LOSS`` settings and the user's own
script (``examples/user_model/train.py``). How it reaches the cluster: docs/your-model.md, "On the cluster".
"""
