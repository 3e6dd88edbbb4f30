"""Data cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_data.py
"""

from __future__ import annotations


def test_the_transformers_targets_are_its_inputs_shifted_by_one_token():
    from app.worker.data import markov_sequences

    data = markov_sequences(size=16, seq_len=8, seed=0)
    inputs, targets = data.inputs, data.targets
    assert inputs.shape == targets.shape == (16, 8)
    assert (inputs[:, 1:] == targets[:, :-1]).all(), "next-token prediction: target t is input t + 1"


def test_the_built_in_loss_is_pytorchs_cross_entropy_for_class_and_next_token_logits():
    """``loss: cross_entropy``: a mean over every position, for ``[B, C]`` and ``[B, T, C]`` logits alike (B, T and
    C all different, so that no reshape along the wrong dimension can pass)."""
    import torch
    import torch.nn.functional as F

    from app.worker.data import cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 5, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    torch.testing.assert_close(cross_entropy(logits, labels), F.cross_entropy(logits, labels))
    tokens, targets = torch.randn(3, 4, 7, generator=gen), torch.randint(0, 7, (3, 4), generator=gen)
    expected = F.cross_entropy(tokens.permute(0, 2, 1), targets)  # PyTorch's own [B, C, T] form
    torch.testing.assert_close(cross_entropy(tokens, targets), expected)
