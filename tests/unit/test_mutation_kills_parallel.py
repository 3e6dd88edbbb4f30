"""app/parallel cases that generated mutants showed missing (`make mutants`, tools/mutation_triage.yaml).

.venv/bin/python -m pytest tests/unit/test_mutation_kills_parallel.py
"""

from __future__ import annotations


def test_a_tensor_parallel_pair_all_reduces_its_output_and_its_input_gradient():
    from app.parallel.tensor_parallel import all_reduce_bytes_per_step

    # forward: the [8, 4] output; backward: the [8, 16] input gradient; float32.
    assert all_reduce_bytes_per_step(batch=8, in_features=16, out_features=4) == (8 * 4 + 8 * 16) * 4
    assert all_reduce_bytes_per_step(batch=8, in_features=16, out_features=4, element_size=2) == (8 * 4 + 8 * 16) * 2
