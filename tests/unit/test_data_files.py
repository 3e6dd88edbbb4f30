"""The file-backed data sets (app.worker.data_files): windows of seq_len + 1 tokens with their next tokens, every
window dealt out exactly once per epoch by GlobalBatches at any world size, files read in a fixed order, a real
corpus (the stdlib) the same on every call, and a data set the model cannot take refused in one line."""

from __future__ import annotations

import pytest
import torch

from app.worker.config import ConfigError, load_config
from app.worker.data import GlobalBatches
from app.worker.data_files import TokenWindows, stdlib_corpus, stdlib_files, text_files, token_file
from app.worker.workload import check_workload
from tests.trainer_run import REPO

CPU = torch.device("cpu")


def test_a_window_is_seq_len_tokens_and_the_next_token_at_each():
    tokens = torch.arange(100, 100 + 4 * 5 + 3)  # 23 tokens: 5 windows of 4 + 1, two left over
    data = TokenWindows(tokens, seq_len=4)
    assert len(data) == 5
    x, y = data[2]
    assert x.tolist() == [108, 109, 110, 111] and y.tolist() == [109, 110, 111, 112]
    assert x.dtype == torch.int64
    targets = torch.cat([data[i][1] for i in range(len(data))])
    assert targets.tolist() == tokens[1:21].tolist()  # every token but the first is a target exactly once
    with pytest.raises(IndexError):
        data[5]


def test_seq_len_plus_one_tokens_make_one_window_and_fewer_are_refused_in_one_line():
    assert len(TokenWindows(torch.arange(9), seq_len=8)) == 1  # 8 inputs and the token after the last
    with pytest.raises(ValueError, match=r"^tokens: 8 tokens, fewer than one window of seq_len \+ 1 = 9$"):
        TokenWindows(torch.arange(8), seq_len=8)


def test_every_window_once_per_epoch_and_the_same_steps_at_any_world_size():
    data = TokenWindows(torch.arange(40 * 8 + 1), seq_len=8)  # 40 windows; window i starts at token 8 i
    steps_per_epoch = 40 // 10
    seen: dict[int, list[list[int]]] = {}
    for world in (1, 2, 3):
        ranks = [GlobalBatches(data, 10, 4, rank, world, seed=1, device=CPU) for rank in range(world)]
        steps = []
        for _ in range(steps_per_epoch):
            shares = [torch.cat([x[:, 0] // 8 for x, _ in r.next_micro_batches()]) for r in ranks]
            steps.append(torch.cat(shares).tolist())  # the step's global batch, rank by rank
        seen[world] = steps
        assert sorted(i for step in steps for i in step) == list(range(40)), world
    assert seen[1] == seen[2] == seen[3]


def test_text_files_are_read_in_sorted_order_and_capped(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world!")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    data = text_files(str(tmp_path / "*.txt"), seq_len=3)
    stream = bytes(data.tokens.tolist())
    assert stream == b"hello world!" and len(data) == 3
    assert bytes(data[1][0].tolist()) == b"lo " and bytes(data[1][1].tolist()) == b"o w"
    assert bytes(text_files([str(tmp_path / "*.txt")], seq_len=3, max_bytes=8).tokens.tolist()) == b"hello wo"
    with pytest.raises(ValueError, match="no file matches"):
        text_files(str(tmp_path / "*.md"))


def test_a_token_file_loads_with_weights_only(tmp_path):
    torch.save(torch.arange(0, 17, dtype=torch.int32), tmp_path / "tokens.pt")
    data = token_file(str(tmp_path / "tokens.pt"), seq_len=4)
    assert len(data) == 4 and data[3][1].tolist() == [13, 14, 15, 16]
    torch.save(torch.rand(17), tmp_path / "floats.pt")
    with pytest.raises(ValueError, match="must be a 1-D integer tensor"):
        token_file(str(tmp_path / "floats.pt"))


class _Planted:
    """What a hostile token file holds: unpickling it calls ``open(marker, "w")``, code the file chose to run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_token_file_that_would_run_code_on_load_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"tokens": torch.arange(17), "payload": _Planted(str(marker))}, tmp_path / "hostile.pt")
    with pytest.raises(Exception, match="Unsupported global"):  # torch's weights-only loader, naming builtins.open
        token_file(str(tmp_path / "hostile.pt"), seq_len=4)
    assert not marker.exists(), "loading the token file ran the code pickled in it"


def test_the_stdlib_corpus_is_the_same_bytes_every_time():
    a, b = stdlib_corpus(seq_len=64, max_bytes=50_000), stdlib_corpus(seq_len=64, max_bytes=50_000)
    assert len(a.tokens) == 50_000 and a.describe() == b.describe() and "sha256" in a.describe()
    assert torch.equal(a.tokens, b.tokens)
    after = stdlib_corpus(seq_len=64, max_bytes=1000, skip_bytes=49_000)
    assert torch.equal(after.tokens, a.tokens[49_000:])  # held-out bytes follow the training bytes
    assert "after byte" not in a.describe() and " after byte 49000, sha256 " in after.describe()


def test_the_corpus_config_fits_and_a_byte_set_too_wide_for_the_model_is_named():
    cfg = load_config(["--config", str(REPO / "configs" / "corpus.yaml")], {}).config
    check_workload(cfg, world_size=2, grad_accum_steps=1)  # the documented example passes the start-up check
    narrow = load_config(["--config", str(REPO / "configs" / "corpus.yaml"), "--model-kwargs", '{"vocab": 64}'], {})
    with pytest.raises(ConfigError) as e:
        check_workload(narrow.config, world_size=2, grad_accum_steps=1)
    message = str(e.value)
    assert message.startswith(
        "model='tiny_transformer': its forward failed on the first samples of data='stdlib_corpus'"
    )
    assert "IndexError: index out of range" in message and "\n" not in message


def test_the_stdlib_corpus_leaves_out_tests_and_installed_packages(tmp_path):
    # The corpus is the standard library's own sources: its test suites and whatever pip installed beside it
    # (site-packages, which differs between machines) would make the bytes differ from one machine to the next.
    for rel in ["a.py", "json/b.py", "test/c.py", "site-packages/d.py", "idlelib/idle_test/e.py", "f.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    found = [p.relative_to(tmp_path).as_posix() for p in stdlib_files(str(tmp_path))]
    assert found == ["a.py", "json/b.py"]


def test_by_default_each_reader_makes_windows_as_long_as_the_transformers_positions(tmp_path):
    # A data spec given only its path (`data_kwargs: {path: ...}`) trains model=tiny_transformer as it comes: one
    # position more and its first forward fails, one fewer and every sequence is silently shorter.
    from app.worker.models import TinyTransformer

    positions = TinyTransformer().pos.num_embeddings
    torch.save(torch.arange(1000), tmp_path / "tokens.pt")
    (tmp_path / "a.txt").write_bytes(b"x" * 1000)
    readers = [
        token_file(str(tmp_path / "tokens.pt")),
        text_files(str(tmp_path / "a.txt")),
        stdlib_corpus(max_bytes=10_000),
    ]
    assert [r.seq_len for r in readers] == [positions] * 3


def test_a_double_star_pattern_reads_files_in_every_folder_below(tmp_path):
    for rel in ["a.txt", "sub/b.txt", "sub/deeper/c.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel[-5])
    data = text_files(str(tmp_path / "**" / "*.txt"), seq_len=1)
    assert bytes(data.tokens.tolist()) == b"abc" and "3 files" in data.describe()


def test_windows_are_indexed_from_either_end_and_tokens_that_are_no_id_sequence_are_refused():
    data = TokenWindows(torch.arange(13, dtype=torch.uint8), seq_len=4, source="bytes")  # 3 windows
    assert data[-1][0].tolist() == data[2][0].tolist() == [8, 9, 10, 11] and data[-3][0].tolist() == [0, 1, 2, 3]
    assert data[0][0].dtype == torch.int64  # bytes become the ids an Embedding takes
    for i in (3, -4):
        with pytest.raises(IndexError, match=rf"^window {i} of 3$"):
            data[i]
    assert data.describe() == "bytes: 13 tokens, 3 windows of 4 + 1"
    with pytest.raises(ValueError, match=r"^bytes: tokens must be a 1-D integer tensor, got torch.int64 \[2, 7\]$"):
        TokenWindows(torch.zeros(2, 7, dtype=torch.long), seq_len=4, source="bytes")
    with pytest.raises(ValueError, match=r"^seq_len=0: must be >= 1$"):
        TokenWindows(torch.arange(13), seq_len=0)


def test_a_token_file_holding_no_tensor_is_one_line_naming_it(tmp_path):
    torch.save({"tokens": torch.arange(17)}, tmp_path / "dict.pt")
    path = str(tmp_path / "dict.pt")
    with pytest.raises(ValueError) as e:
        token_file(path)
    assert str(e.value) == f"path={path!r}: holds a dict, not a tensor of token ids"
    torch.save(torch.arange(65), tmp_path / "t.pt")
    assert len(token_file(str(tmp_path / "t.pt"))) == 1  # the default: windows of 64 + 1
    assert (
        token_file(str(tmp_path / "t.pt")).describe()
        == f"token file {tmp_path / 't.pt'}: 65 tokens, 1 windows of 64 + 1"
    )


def test_a_byte_data_set_names_its_files_and_the_first_12_hex_digits_of_their_sha256(tmp_path):
    import hashlib

    (tmp_path / "a.txt").write_bytes(b"hello world!")
    data = text_files(str(tmp_path / "*.txt"), seq_len=3)
    digest = hashlib.sha256(b"hello world!").hexdigest()[:12]
    assert data.describe() == (
        f"1 files matching {[str(tmp_path / '*.txt')]}, sha256 {digest}: 12 tokens, 3 windows of 3 + 1"
    )
