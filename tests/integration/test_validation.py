"""The validation loop on real ranks: the validation loss a 2-rank run logs equals one process's, and falls.

mini_mlp's teacher task in float64, 25% of the data set held out (``eval_fraction``), a validation every 4 steps
(``eval_every``). One process and 2 ranks train the same global batches, so their models and held-out losses agree
to ~1e-15; the log prints 6 decimals, so the logged values must match to 1e-6 (a rank evaluating only its own
share, or the mean over ranks instead of samples, would be off by far more: the held-out shares' losses differ).
"""

from __future__ import annotations

import re

import pytest

from tests.integration.test_metrics import scrape_at_the_end
from tests.trainer_run import describe, free_port, run_process

pytestmark = pytest.mark.timeout(600)
SETTINGS = {
    "dataset_size": 512,
    "eval_fraction": 0.25,
    "eval_every": 4,
    "steps": 12,
    "effective_batch": 32,
    "micro_batch": 16,
    "dtype": "float64",
    "metrics_port": 0,
    "log_every": 4,
}
LINE = re.compile(r"step (\d+): validation loss ([0-9.]+) over 128 held-out samples")


def flags(**settings) -> list[str]:
    return [part for k, v in {**SETTINGS, **settings}.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def validation_losses(log: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LINE.findall(log)}


def test_the_validation_loss_of_2_ranks_equals_one_process_and_falls():
    """...and every rank's /metrics, scraped after the run, shows the last one as ddp_validation_loss."""
    one = run_process(*flags(wrapper="none"))
    assert one.returncode == 0, describe(one)
    scraped, err = scrape_at_the_end(free_port(2), **{k: v for k, v in SETTINGS.items() if k != "metrics_port"})
    a, b = validation_losses(one.stderr), validation_losses(err)
    assert sorted(a) == sorted(b) == [4, 8, 12], err
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a, b)
    assert b[12] < b[4], b
    assert len(LINE.findall(err)) == 3  # rank 0 logs it, once per validation
    for rank, values in enumerate(scraped):
        assert abs(values[f'ddp_validation_loss{{rank="{rank}"}}'] - b[12]) <= 1e-6, values
