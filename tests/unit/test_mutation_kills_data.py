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
