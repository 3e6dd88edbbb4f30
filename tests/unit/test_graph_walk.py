"""``app.parallel.ddp.graph_walk``: the parameters a forward's output does not reach (``find_unused_parameters``),
whatever nesting the output comes in."""

from __future__ import annotations

import torch
from torch import nn

from app.parallel.ddp.graph_walk import tensors_in, unused_parameters


def test_the_parameters_no_output_reaches_are_the_unused_ones_in_parameter_order():
    a, b, c, d = (nn.Linear(2, 2) for _ in range(4))
    params = [*a.parameters(), *b.parameters(), *c.parameters(), *d.parameters()]
    x = torch.randn(1, 2)
    # a then b (one path), and d alone in a dict entry nested in a list: c is not reached.
    out = [b(a(x)), {"aux": (d(x), "not a tensor")}]
    assert unused_parameters(out, params) == [4, 5]
    # Only a's weight in the graph (its bias not): the bias and everything after it are unused.
    assert unused_parameters(x @ a.weight, params) == [1, 2, 3, 4, 5, 6, 7]
    # An output without a graph (no_grad, or a constant) reaches nothing.
    with torch.no_grad():
        assert unused_parameters(a(x), params) == list(range(8))
    # A parameter used twice (shared) is reached once; a diamond is walked without repeats.
    h = a(x)
    assert unused_parameters(b(h) + c(h), params) == [6, 7]


def test_every_tensor_of_a_nested_output_is_found_and_nothing_else():
    t1, t2, t3 = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    found = tensors_in({"a": t1, "b": [t2, (t3, 4, "x")], "c": None})
    assert [id(t) for t in found] == [id(t1), id(t2), id(t3)]
    assert tensors_in(t1) == [t1] and tensors_in(3.0) == [] and tensors_in(None) == []
