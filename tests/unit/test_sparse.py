"""``app.parallel.ddp.sparse`` without ranks: which parameters PyTorch's rule calls sparse (kept out of the buckets),
and the empty gradient a rank that looked up no rows contributes (the reduction on ranks: test_ddp_sparse.py)."""

from __future__ import annotations

import torch
from torch import nn

from app.parallel.ddp.sparse import SparseGradients, sparse_gradient_params


def test_the_sparse_parameters_are_the_trainable_weights_of_sparse_embeddings_and_bags():
    model = nn.ModuleDict(
        {
            "table": nn.Embedding(10, 3, sparse=True),
            "bag": nn.EmbeddingBag(10, 3, sparse=True),
            "dense_table": nn.Embedding(10, 3),
            "frozen": nn.Embedding(10, 3, sparse=True),
            "linear": nn.Linear(3, 3),
        }
    )
    model["frozen"].weight.requires_grad_(False)
    assert sparse_gradient_params(model) == {id(model["table"].weight), id(model["bag"].weight)}
    assert sparse_gradient_params(nn.Linear(2, 2)) == set()


def test_a_rank_that_looked_up_no_rows_contributes_an_empty_sparse_gradient_of_the_tables_shape():
    table = nn.Parameter(torch.zeros(10, 3, dtype=torch.float64))
    empty = SparseGradients.empty_gradient(table)
    assert empty.is_sparse and empty.shape == (10, 3) and empty._nnz() == 0 and empty.dtype == torch.float64
    assert torch.equal(empty.to_dense(), torch.zeros(10, 3, dtype=torch.float64))
