"""Streaming data: step t takes the same samples at every world size, and a resume on another world size continues
with the very next global batch, for a stateful stream (TokenStream) and a re-iterable one alike; a one-shot
generator is refused in one line."""

from __future__ import annotations

import pytest
import torch

from app.worker.config import ConfigError
from app.worker.data_files import text_files
from app.worker.data_stream import StreamBatches, token_stream
from app.worker.workload import _as_data_set  # noqa: PLC2701 - the refusal is this function's job

CPU = torch.device("cpu")
SEQ = 8


class Numbers:
    """A re-iterable stream with no state: sample i is (i, i) as 1-element tensors; 100 per pass."""

    def __iter__(self):
        return ((torch.tensor([float(i)]), torch.tensor([i])) for i in range(100))


def corpus(tmp_path) -> str:
    # Three files of uneven sizes: windows straddle the file boundaries.
    for i, size in enumerate((301, 97, 450)):
        (tmp_path / f"part{i}.txt").write_bytes(bytes((7 * i + 3 * j) % 251 for j in range(size)))
    return str(tmp_path / "part*.txt")


def world(make, global_batch: int, world_size: int) -> list[StreamBatches]:
    return [StreamBatches(make(), global_batch, 4, r, world_size, CPU) for r in range(world_size)]


def global_steps(ranks: list[StreamBatches], steps: int) -> list[list[int]]:
    """Per step, every rank's samples together in rank order, each named by its first input value."""
    out = []
    for _ in range(steps):
        out.append([int(x[i, 0]) for b in ranks for x, _ in b.next_micro_batches() for i in range(x.shape[0])])
    return out


def test_token_stream_yields_the_windows_of_the_files_read_whole(tmp_path):
    pattern = corpus(tmp_path)
    whole = text_files(pattern, seq_len=SEQ)
    streamed = list(token_stream(pattern, seq_len=SEQ, chunk_bytes=16))  # chunks much smaller than a file
    assert len(streamed) == len(whole) == (301 + 97 + 450 - 1) // SEQ
    for i, (x, y) in enumerate(streamed):
        assert torch.equal(x, whole[i][0]) and torch.equal(y, whole[i][1]), i


@pytest.mark.parametrize("world_size", [2, 3])
def test_step_t_has_the_same_samples_at_every_world_size(world_size):
    # 100 samples, 30 per step: 3 steps a pass (the tail of 10 skipped), so 7 steps cross two passes.
    straight = global_steps(world(Numbers, 30, 1), 7)
    assert global_steps(world(Numbers, 30, world_size), 7) == straight
    assert straight[3] == list(range(30)) and straight[2] == list(range(60, 90))


@pytest.mark.parametrize("old, new", [(2, 3), (3, 1)])
@pytest.mark.parametrize("stateful", [True, False])
def test_a_resume_on_another_world_size_continues_with_the_next_global_batch(tmp_path, old, new, stateful):
    pattern = corpus(tmp_path)
    make = (lambda: token_stream(pattern, seq_len=SEQ, chunk_bytes=16)) if stateful else Numbers
    straight = global_steps(world(make, 20, 1), 9)  # a pass of 105 windows or 100 numbers: 5 steps
    before = world(make, 20, old)
    first = global_steps(before, 6)  # past the first pass's end
    state = before[0].state_dict()
    assert all(b.state_dict() == state for b in before)  # every rank would save the same position
    assert (state["stream"] is not None) == stateful
    after = world(make, 20, new)
    for b in after:
        b.load_state_dict(state)
    assert [b.state_dict() for b in after] == [state] * new  # saved again before a read: the same place
    assert first + global_steps(after, 3) == straight


def test_a_one_shot_generator_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        _as_data_set((pair for pair in Numbers()), "tests.models_user:one_shot_stream")
    assert str(e.value) == (
        "data='tests.models_user:one_shot_stream': a generator is a one-shot iterator with no "
        "state_dict()/load_state_dict(), so a resume could not find its place; return a re-iterable data set (a "
        "class whose __iter__ starts the stream over) or give it state_dict()/load_state_dict()"
    )
    assert _as_data_set(Numbers(), "numbers") is not None  # re-iterable: resumed by skipping
