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


def test_files_of_one_window_stream_it_and_one_byte_fewer_are_refused(tmp_path):
    from app.worker.data_stream import TokenStream

    (tmp_path / "a.txt").write_bytes(b"abcdefghi")  # seq_len 8 + 1: exactly one window
    one = token_stream(str(tmp_path / "a.txt"), seq_len=8)
    assert one.windows == 1 and [(bytes(x.tolist()), bytes(y.tolist())) for x, y in one] == [(b"abcdefgh", b"bcdefghi")]
    (tmp_path / "a.txt").write_bytes(b"abcdefgh")
    with pytest.raises(ValueError, match=r"^1 files hold 8 bytes, fewer than one window of seq_len \+ 1$"):
        token_stream(str(tmp_path / "a.txt"), seq_len=8)
    with pytest.raises(ValueError, match=r"^seq_len=0: must be >= 1$"):
        TokenStream([tmp_path / "a.txt"], seq_len=0)


def test_token_stream_reads_every_matching_file_once_in_sorted_order_and_names_a_pattern_that_matches_none(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"BBBB")
    (tmp_path / "a.txt").write_bytes(b"AAAA")
    (tmp_path / "sub" / "c.txt").write_bytes(b"CCC")
    stream = token_stream([str(tmp_path / "*.txt"), str(tmp_path / "a.txt"), str(tmp_path / "**" / "c.txt")], 2)
    assert [p.name for p in stream.paths] == ["a.txt", "b.txt", "c.txt"]
    assert stream.describe() == "3 files, 11 bytes, 5 windows of 2 + 1"
    assert b"".join(bytes(x.tolist()) for x, _ in stream) == b"AAAABBBBCC"
    with pytest.raises(ValueError) as e:
        token_stream(str(tmp_path / "*.bin"))
    assert str(e.value) == f"paths={[str(tmp_path / '*.bin')]}: no file matches; give existing files or glob patterns"


def test_a_token_streams_state_is_the_next_window_and_a_load_seeks_there_once(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(41)))
    stream = token_stream(str(tmp_path / "a.txt"), seq_len=4, chunk_bytes=1)  # chunks below a window: still whole
    whole = [x.tolist() for x, _ in stream]
    assert len(whole) == 10 and stream.state_dict() == {"window": 10}
    it = iter(stream)
    next(it), next(it), next(it)
    assert stream.state_dict() == {"window": 3}
    stream.load_state_dict({"window": 7})
    assert [x.tolist() for x, _ in stream] == whole[7:]  # the next pass continues there
    assert [x.tolist() for x, _ in stream] == whole  # and the one after starts over


def test_streams_and_map_style_sets_are_told_apart_and_dealt_by_their_own_dealer():
    from torch.utils.data import IterableDataset

    from app.worker.data import BatchShare, GlobalBatches, teacher_classification
    from app.worker.data_stream import build_batches, has_state, is_stream, resumable

    class SizedStream(IterableDataset):
        def __len__(self):
            return 100

        def __iter__(self):
            return iter(Numbers())

    data = teacher_classification(64, 0)
    assert is_stream(Numbers()) and is_stream(SizedStream()) and not is_stream(data) and not is_stream([1, 2])
    assert not has_state(Numbers())
    assert resumable(Numbers()) is None and resumable(iter(Numbers())).startswith("a generator is a one-shot")
    share = BatchShare(12, 2, 2, 5, CPU, torch.float32, equal_counts=True)
    stream = build_batches(Numbers(), 0, share)
    assert isinstance(stream, StreamBatches) and stream.sizes == [1, 1]  # 12 over 5 ranks: 3/3/2/2/2, 2 cuts each
    mapped = build_batches(data, 0, share)
    assert isinstance(mapped, GlobalBatches) and mapped.sizes == [1, 1]
    plain = build_batches(Numbers(), 0, BatchShare(12, 2, 2, 5, CPU, torch.float32))
    assert plain.sizes == [2]


def test_a_stream_shorter_than_a_global_batch_and_a_batch_below_the_world_are_refused():
    with pytest.raises(ValueError, match=r"^global batch 2 must be at least world_size=3$"):
        StreamBatches(Numbers(), 2, 1, 0, 3, CPU)
    assert StreamBatches(Numbers(), 3, 1, 0, 3, CPU).global_batch == 3
    short = StreamBatches(Numbers(), 101, 101, 0, 1, CPU)
    with pytest.raises(ValueError) as e:
        short.next_micro_batches()
    assert str(e.value) == (
        "the data stream yields 100 samples in a pass, fewer than one global batch of 101; give it more samples, or "
        "lower micro_batch or effective_batch"
    )
    whole = StreamBatches(Numbers(), 100, 50, 0, 1, CPU)  # exactly one pass per step
    assert [int(x[0, 0]) for x, _ in whole.next_micro_batches()] == [0, 50]
    assert [int(x[0, 0]) for x, _ in whole.next_micro_batches()] == [0, 50] and whole.epoch == 1


def test_a_resumed_stream_saved_again_before_a_read_names_the_place_it_was_given(tmp_path):
    pattern = corpus(tmp_path)
    batches = StreamBatches(token_stream(pattern, seq_len=SEQ), 10, 5, 0, 2, CPU)
    assert batches.stateful and not StreamBatches(Numbers(), 10, 5, 0, 2, CPU).stateful
    assert batches.state_dict() == {"epoch": 0, "consumed": 0, "stream": None}  # nothing read yet
    batches.next_micro_batches()
    assert batches.state_dict() == {"epoch": 0, "consumed": 10, "stream": {"window": 10}}
    other = StreamBatches(token_stream(pattern, seq_len=SEQ), 10, 5, 1, 2, CPU)
    other.load_state_dict({"epoch": 2, "consumed": 30, "stream": {"window": 30}})
    assert other.state_dict() == {"epoch": 2, "consumed": 30, "stream": {"window": 30}}
    x, _ = other.next_micro_batches()[0]
    assert torch.equal(x[0], text_files(pattern, seq_len=SEQ)[35][0])  # rank 1's share of step 4: windows 35..39
    assert other.state_dict() == {"epoch": 2, "consumed": 40, "stream": {"window": 40}}


def test_a_file_streams_through_in_chunks_of_1_mib_never_whole(tmp_path):
    # "Files larger than memory stream through": by default 1 MiB is read at a time, and at most the unread tail, the
    # new chunk and the two joined (about 3 chunks) are held at once, whatever the file's size.
    import tracemalloc

    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * (8 * 4096))  # 8 MiB
    stream = token_stream(str(tmp_path / "big.bin"), seq_len=4096)
    tracemalloc.start()
    try:
        windows = sum(1 for _ in stream)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert windows == (8 * 2**20 - 1) // 4096
    assert 2 * 2**20 < peak < 3.5 * 2**20, peak


def test_a_token_stream_resumed_in_a_later_file_seeks_past_the_files_before_it(tmp_path):
    pattern = corpus(tmp_path)  # files of 301, 97 and 450 bytes
    whole = [x.tolist() for x, _ in token_stream(pattern, seq_len=SEQ)]
    stream = token_stream(pattern, seq_len=SEQ)
    stream.load_state_dict({"window": 60})  # byte 480: past the first two files (398 bytes)
    assert [x.tolist() for x, _ in stream] == whole[60:]
