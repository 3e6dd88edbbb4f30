"""Which parameters a forward's output reaches: the autograd-graph walk behind ``find_unused_parameters``.

The reducer (``reducer.py``) walks the graph after a forward to learn which parameters will get no gradient in the
coming backward, so that their buckets still complete; ZeRO stage 3 finds the tensors of a forward's output the same
way, to hook its backward.
"""

from __future__ import annotations

import torch
from torch import nn


def unused_parameters(outputs, params: list[nn.Parameter]) -> list[int]:
    """Indices of ``params`` that the autograd graph behind ``outputs`` does not reach (their hooks never fire)."""
    reached: set[int] = set()
    seen: set = set()
    stack = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if (variable := getattr(fn, "variable", None)) is not None:  # AccumulateGrad nodes hold their parameter
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [i for i, p in enumerate(params) if id(p) not in reached]


def tensors_in(output) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) forward output."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_in(item)]
    return []
