"""Streaming data on real ranks: a run over ``token_stream`` (files read in chunks) stopped at step 4 on 2 ranks and
resumed on 3 ends with the parameters of a straight 2-rank run; a one-shot generator, and a packed file with a line
that is no document (app.worker.data_pack), are refused at start-up in one line.

float64, so the sum over 3 ranks' shares in another order than 2's stays far below the tolerance of 1e-12 (as
tests/integration/test_train_sharded.py's); a resume that lost or repeated one global batch moves every parameter
by about lr per step.
"""

from __future__ import annotations

import pytest
import torch

from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
from tests.trainer_run import describe, finished, run_process, run_ranks

pytestmark = pytest.mark.timeout(600)
FLOAT64_TOLERANCE = 1e-12
SETTINGS = {
    "model": "tiny_transformer",
    "model_kwargs": '{"vocab": 256, "dim": 16, "heads": 2, "layers": 1, "max_len": 16}',
    "data": "token_stream",
    "dtype": "float64",
    "effective_batch": 12,
    "micro_batch": 4,
    "checkpoint_every": 4,
    "keep_checkpoints": 5,
    "metrics_port": 0,
    "log_every": 4,
}


def flags(**settings) -> list[str]:
    return [part for k, v in {**SETTINGS, **settings}.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def corpus(tmp_path) -> str:
    """Two files, 62 windows of 16 + 1 bytes: 5 steps of 12 a pass, so a run of 8 steps crosses into the second."""
    (tmp_path / "data").mkdir()
    text = bytes(range(32, 127)) * 11
    (tmp_path / "data" / "a.txt").write_bytes(text[:600])
    (tmp_path / "data" / "b.txt").write_bytes(text[600:1000])
    return f'{{"paths": ["{tmp_path / "data"}/*.txt"], "seq_len": 16, "chunk_bytes": 64}}'


def train(tmp_path, name: str, steps: int, world_size: int, kwargs: str) -> dict:
    result = run_ranks(*flags(data_kwargs=kwargs, steps=steps, checkpoint_dir=tmp_path / name), world_size=world_size)
    assert result.returncode == 0, describe(result)
    assert set(finished(result.stdout)) == set(range(world_size)), describe(result)
    return {"log": result.stderr, "state": load_checkpoint(checkpoint_path(tmp_path / name, steps))}


def test_a_stream_stopped_on_2_ranks_and_resumed_on_3_ends_as_a_straight_run(tmp_path):
    kwargs = corpus(tmp_path)
    straight = train(tmp_path, "straight", 8, 2, kwargs)
    train(tmp_path, "resumed", 4, 2, kwargs)
    resumed = train(tmp_path, "resumed", 8, 3, kwargs)
    assert "resumed from" in resumed["log"] and "step-00000004.pt" in resumed["log"], resumed["log"]
    a, b = straight["state"], resumed["state"]
    assert a["data"] == b["data"] == {"epoch": 1, "consumed": 36, "stream": {"window": 36}}
    diff = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert diff < FLOAT64_TOLERANCE, f"max |Δparam| resumed on 3 ranks vs straight on 2: {diff:.3g}"
    assert a["model"]["tok.weight"].dtype == torch.float64


def test_a_one_shot_generator_is_refused_before_training(tmp_path):
    result = run_process(
        "--data", "tests.models_user:one_shot_stream", "--wrapper", "none", "--metrics-port", "0",
        "--checkpoint-dir", str(tmp_path / "ckpt"),
    )  # fmt: skip
    assert result.returncode == 2, describe(result)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "config error: data='tests.models_user:one_shot_stream': a generator is a one-shot iterator with no "
        "state_dict()/load_state_dict(), so a resume could not find its place; return a re-iterable data set (a "
        "class whose __iter__ starts the stream over) or give it state_dict()/load_state_dict()"
    ], describe(result)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_packed_file_with_a_line_that_is_no_document_is_refused_in_one_line(tmp_path):
    (tmp_path / "docs.jsonl").write_text('[1, 2, 3]\n[4, "x"]\n')
    kwargs = f'{{"paths": ["{tmp_path / "docs.jsonl"}"], "seq_len": 2, "sep": 0}}'
    result = run_process(
        "--model", "tiny_transformer", "--data", "packed_files", "--data-kwargs", kwargs, "--micro-batch", "2",
        "--wrapper", "none", "--metrics-port", "0",
    )  # fmt: skip
    assert result.returncode == 2, describe(result)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"config error: data='packed_files': reading the stream raised ValueError: {tmp_path / 'docs.jsonl'}: the "
        f"line at byte 10 is not a JSON list of token ids (integers >= 0); write one document per line as [id, id, "
        f"...]"
    ], describe(result)
    assert "Traceback" not in result.stderr
