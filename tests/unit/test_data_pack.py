"""Sequence packing (app.worker.data_pack): documents laid end to end with a separator and cut into next-token
windows, exactly, from files or a list; a packed stream resumed mid-way (also on another world size) continues with
the very next window; bad lines and one-shot iterators are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from app.worker.data_pack import packed_documents, packed_files
from app.worker.data_stream import StreamBatches

CPU = torch.device("cpu")
DOCS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
SEP = 0


def windows(stream, n: int | None = None) -> list[tuple[list[int], list[int]]]:
    out = []
    for x, y in stream:
        out.append((x.tolist(), y.tolist()))
        if n is not None and len(out) == n:
            break
    return out


def doc_files(tmp_path) -> str:
    """DOCS as a .jsonl file of token ids with a blank line, and 20 text documents of 1..20 bytes in two files."""
    (tmp_path / "a.jsonl").write_text(json.dumps(DOCS[0]) + "\n\n" + "\n".join(json.dumps(d) for d in DOCS[1:]) + "\n")
    text = [bytes(range(65, 65 + n)).decode() for n in range(1, 21)]
    (tmp_path / "b.txt").write_text("\n".join(text[:7]) + "\n")
    (tmp_path / "c.txt").write_text("\r\n".join(text[7:]))  # CRLF, no final line break
    return str(tmp_path / "*")


def test_documents_are_packed_with_the_separator_into_overlapping_windows_without_padding():
    # 1 2 3 | 4 | 5 6 7 8 9 |, '|' the separator 0: 12 tokens, windows of 3 + 1 from tokens 0, 3, 6; the tail
    # from token 9 (8 9 0) is shorter than a window and left out.
    assert windows(packed_documents(DOCS, seq_len=3, sep=SEP)) == [
        ([1, 2, 3], [2, 3, 0]),
        ([0, 4, 0], [4, 0, 5]),
        ([5, 6, 7], [6, 7, 8]),
    ]
    assert windows(packed_documents(DOCS, seq_len=12, sep=SEP)) == []  # 12 tokens: no window of 12 + 1


def test_files_pack_jsonl_token_ids_and_text_lines_as_bytes(tmp_path):
    pattern = doc_files(tmp_path)
    texts = [list(range(65, 65 + n)) for n in range(1, 21)]
    from_list = windows(packed_documents(DOCS + texts, seq_len=5, sep=SEP))
    assert windows(packed_files(pattern, seq_len=5, sep=SEP)) == from_list
    tokens = sum(len(d) + 1 for d in DOCS + texts)
    assert len(from_list) == (tokens - 1) // 5  # every token but the first is a target once: nothing is padding


@pytest.mark.parametrize("source", ["files", "list"])
def test_a_packed_stream_resumed_after_any_window_continues_with_the_next(tmp_path, source):
    pattern = doc_files(tmp_path)
    texts = [list(range(65, 65 + n)) for n in range(1, 21)]

    def make():
        if source == "files":
            return packed_files([pattern], seq_len=7, sep=SEP)
        return packed_documents(DOCS + texts, seq_len=7, sep=SEP)

    straight = windows(make())
    assert len(straight) > 20
    for k in range(len(straight)):
        first = make()
        if k:
            assert windows(first, k) == straight[:k]
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as saved in a checkpoint
        assert windows(resumed) == straight[k:], k
        assert windows(resumed) == straight  # the pass after a resumed one starts over


def test_a_file_resume_seeks_to_the_line_of_the_next_window(tmp_path):
    doc_files(tmp_path)
    stream = packed_files(str(tmp_path / "a.jsonl"), seq_len=3, sep=SEP)
    windows(stream, 2)
    # The next window starts at token 6: the first token of [5, 6, 7, 8, 9], the line after "[4]".
    offset = len(json.dumps(DOCS[0]) + "\n\n" + json.dumps(DOCS[1]) + "\n")
    assert stream.state_dict() == {"window": 2, "place": [0, offset], "skip": 0}


@pytest.mark.parametrize("old, new", [(2, 3), (3, 1)])
def test_packed_batches_resumed_on_another_world_size_take_the_next_global_batch(tmp_path, old, new):
    pattern = doc_files(tmp_path)

    def world(size: int) -> list[StreamBatches]:
        return [StreamBatches(packed_files(pattern, 4, SEP), 6, 2, r, size, CPU) for r in range(size)]

    def steps(ranks: list[StreamBatches], n: int) -> list[list[list[int]]]:
        return [[x.tolist() for b in ranks for xs, _ in b.next_micro_batches() for x in xs] for _ in range(n)]

    straight = steps(world(1), 12)  # 60 windows a pass, 10 steps of 6: 12 cross into the second pass
    before = world(old)
    first = steps(before, 3)
    after = world(new)
    for b in after:
        b.load_state_dict(before[0].state_dict())
    assert first + steps(after, 9) == straight


def test_a_bad_jsonl_line_is_one_error_naming_the_file_and_the_line(tmp_path):
    (tmp_path / "docs.jsonl").write_text('[1, 2]\n{"text": "hi"}\n')
    with pytest.raises(ValueError) as e:
        windows(packed_files(str(tmp_path / "docs.jsonl"), seq_len=2, sep=SEP))
    assert str(e.value) == (
        f"{tmp_path / 'docs.jsonl'}: the line at byte 7 is not a JSON list of token ids (integers >= 0); write one "
        f"document per line as [id, id, ...]"
    )


def test_bad_settings_and_a_one_shot_iterator_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^sep=-1: must be a token id"):
        packed_documents(DOCS, seq_len=4, sep=-1)
    with pytest.raises(ValueError, match=r"^seq_len=0: must be an integer >= 1$"):
        packed_documents(DOCS, seq_len=0, sep=SEP)
    with pytest.raises(ValueError, match=r"^documents: a generator is a one-shot iterator"):
        packed_documents((d for d in DOCS), seq_len=4, sep=SEP)
    with pytest.raises(ValueError, match=r"no file matches"):
        packed_files(str(tmp_path / "none*.jsonl"), seq_len=4, sep=SEP)


def test_the_smallest_window_and_separator_are_taken_and_what_is_no_integer_refused():
    assert windows(packed_documents([[5]], seq_len=1, sep=0)) == [([5], [0])]  # seq_len 1, sep token 0
    for bad in (2.0, "2"):
        with pytest.raises(ValueError) as e:
            packed_documents(DOCS, seq_len=4, sep=bad)
        assert str(e.value) == f"sep={bad!r}: must be a token id, an integer >= 0 (your end-of-document token)"
    with pytest.raises(ValueError, match=r"^seq_len=4.0: must be an integer >= 1$"):
        packed_documents(DOCS, seq_len=4.0, sep=SEP)


@pytest.mark.parametrize("line", ["[1, -2]", "[1, true]", "[1.0]", "not json", '"12"'])
def test_a_jsonl_line_of_anything_but_token_ids_is_refused(tmp_path, line):
    (tmp_path / "docs.jsonl").write_text(f"[0]\n   \n{line}\n")  # a line of spaces is a blank line: no document
    with pytest.raises(ValueError, match=r"the line at byte 8 is not a JSON list of token ids"):
        windows(packed_files(str(tmp_path / "docs.jsonl"), seq_len=1, sep=SEP))


def test_a_packed_stream_describes_its_source_and_its_windows(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc\n")
    (tmp_path / "b.txt").write_bytes(b"de\n")
    files = packed_files(str(tmp_path / "*.txt"), seq_len=2, sep=10)
    assert files.describe() == "2 files of one document per line, 7 bytes, packed with sep=10 into windows of 2 + 1"
    assert windows(files) == [([97, 98], [98, 99]), ([99, 10], [10, 100]), ([100, 101], [101, 10])]  # abc, de
    assert packed_documents(DOCS, 3, 0).describe() == "the documents of a list, packed with sep=0 into windows of 3 + 1"
