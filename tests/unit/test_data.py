"""The global batch: the same samples in step t at every world size, split unevenly when it must, resumable anywhere.

What a user notices: changing the number of workers (or resuming on another number) does not change which samples
a step trains on, so the training itself does not change.
"""

from __future__ import annotations

import pytest
import torch

from app.parallel.accum import grad_accum_steps_for, micro_batch_sizes, split_global_batch
from app.worker.data import GlobalBatches, teacher_classification
from app.worker.models import TinyTransformer

DATA = teacher_classification(1000, seed=0)
CPU = torch.device("cpu")


def world(global_batch: int, world_size: int, micro_batch: int = 8) -> list[GlobalBatches]:
    return [GlobalBatches(DATA, global_batch, micro_batch, r, world_size, 0, CPU) for r in range(world_size)]


def global_steps(ranks: list[GlobalBatches], steps: int) -> list[list[int]]:
    """Per step, the sample indices of all ranks together, in rank order."""
    return [torch.cat([b.next_indices() for b in ranks]).tolist() for _ in range(steps)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7])
def test_step_t_has_the_same_samples_at_every_world_size(world_size):
    # 30 steps of 50 samples cross an epoch boundary (1000 samples = 20 steps).
    assert global_steps(world(50, world_size), 30) == global_steps(world(50, 1), 30)


def test_ranks_split_the_batch_without_overlap_and_unevenly_when_it_must():
    ranks = world(50, 4)
    shares = [b.next_indices().tolist() for b in ranks]
    assert [len(s) for s in shares] == [13, 13, 12, 12]
    assert len(set().union(*shares)) == 50
    # The wrapper averages scale × (local mean) over the 4 ranks: every sample must end up weighing 1/50, as in
    # the mean over the whole batch, whichever share it fell into.
    assert [b.grad_scale / 4 / b.local_samples for b in ranks] == pytest.approx([1 / 50] * 4)


def test_micro_batches_respect_the_limit_and_cover_the_share():
    rank0 = world(50, 3, micro_batch=8)[0]  # 17 samples: 3 micro-batches of 6, 6, 5
    micro = rank0.next_micro_batches()
    assert [x.shape[0] for x, _ in micro] == [6, 6, 5]
    assert micro_batch_sizes(64, 32) == [32, 32] and micro_batch_sizes(1, 32) == [1]
    assert grad_accum_steps_for(128, 3, 32) == 2 and grad_accum_steps_for(128, 2, 32) == 2
    assert [split_global_batch(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]


@pytest.mark.parametrize("old, new", [(2, 3), (4, 2), (3, 1)])
def test_a_resume_on_another_world_size_continues_with_the_next_global_batch(old, new):
    straight = global_steps(world(50, 1), 26)
    before = world(50, old)
    first = global_steps(before, 13)  # mid-way through the second epoch's first half
    state = before[0].state_dict()
    assert all(b.state_dict() == state for b in before)  # every rank would save the same position
    after = world(50, new)
    for b in after:
        b.load_state_dict(state)
    assert first + global_steps(after, 13) == straight


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_epoch_covers_every_sample_exactly_once_when_the_batch_divides_the_data_set(world_size):
    # 1000 samples, 50 a step: 20 steps are one epoch, its last global batch included, and step 21 starts the next.
    ranks = world(50, world_size)
    epoch = global_steps(ranks, 20)
    assert sorted(i for step in epoch for i in step) == list(range(1000))
    assert [b.epoch for b in ranks] == [0] * world_size
    assert global_steps(ranks, 1) and [b.epoch for b in ranks] == [1] * world_size


def test_an_epochs_short_tail_is_skipped_and_each_epoch_is_its_own_permutation():
    # 1000 samples, 300 a step: each epoch trains on 900 of them (3 steps) and drops a tail of 100, as drop_last=True
    # would; the next epoch draws a new order (seed + epoch), so over epochs every sample is seen.
    ranks = world(300, 2)
    steps = global_steps(ranks, 6)
    first, second = steps[:3], steps[3:]
    assert [b.epoch for b in ranks] == [1, 1]
    for epoch in (first, second):
        seen = [i for step in epoch for i in step]
        assert len(seen) == len(set(seen)) == 900  # no sample twice in one epoch, the tail of 100 not trained on
    assert first != second  # another order ...
    assert set(range(1000)) - {i for s in first for i in s} != set(range(1000)) - {i for s in second for i in s}  # tail


def test_the_synthetic_labels_use_every_class_of_the_model():
    from app.worker.models import MiniMLP

    assert sorted(DATA.targets.unique().tolist()) == list(range(MiniMLP().net[-1].out_features))


class PairsFromDisk:
    """A map-style data set as a user brings one: ``len`` and ``[i] -> (input, target)``, read sample by sample."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i), i + 0.5, -float(i)]), torch.tensor(i % 3)


def test_a_map_style_data_set_is_stacked_input_with_input_and_target_with_target_in_the_model_dtype():
    data = PairsFromDisk(24)
    for rank in range(2):
        twin = GlobalBatches(data, 8, 3, rank, 2, 0, CPU)  # the same draw: which samples this rank's step takes
        indices = twin.next_indices().tolist()
        micro = GlobalBatches(data, 8, 3, rank, 2, 0, CPU, dtype=torch.float64).next_micro_batches()
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        assert [len(m[0]) for m in micro] == [2, 2] and x.dtype == torch.float64 and y.dtype == torch.int64
        assert torch.equal(x, torch.stack([data[i][0] for i in indices]).double())
        assert torch.equal(y, torch.stack([data[i][1] for i in indices]))


def test_markov_sequences_are_next_token_pairs_that_follow_each_tokens_few_successors():
    # The transformer's data (model=tiny_transformer): learnable because each token has only a few successors.
    from app.worker.data import SUCCESSOR_PROBS, VOCAB, markov_sequences
    from app.worker.models import TinyTransformer

    data = markov_sequences(200, 16, seed=0)
    x, y = data.inputs, data.targets
    assert x.shape == y.shape == (200, 16) and int(x.min()) >= 0
    assert int(max(x.max(), y.max())) < TinyTransformer().tok.num_embeddings  # the model's own vocabulary holds them
    assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the next token
    successors: dict[int, set[int]] = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert len(successors) > VOCAB // 2 and all(len(s) <= len(SUCCESSOR_PROBS) for s in successors.values())
    assert torch.equal(markov_sequences(200, 16, seed=0).inputs, x)  # the same seed, the same data


def test_the_transformer_takes_the_longest_sequence_its_config_allows():
    # TrainConfig refuses seq_len > 64 for tiny_transformer because the model has 64 positions; a config that
    # passes must then train: a 64-token batch goes through and each position gets its own logits.
    model = TinyTransformer()
    tokens = torch.randint(0, 64, (2, 64))
    assert model(tokens).shape == (2, 64, 64)
    with pytest.raises(IndexError):
        model(torch.randint(0, 64, (2, 65)))  # one more than its positions: the bound the config enforces


def test_the_built_in_loss_is_pytorchs_cross_entropy_for_class_and_next_token_logits():
    """``loss: cross_entropy``: a mean over every position, for ``[B, C]`` and ``[B, T, C]`` logits alike (B, T and
    C all different, so that no reshape along the wrong dimension can pass)."""
    import torch.nn.functional as F

    from app.worker.data import cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 5, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    torch.testing.assert_close(cross_entropy(logits, labels), F.cross_entropy(logits, labels))
    tokens, targets = torch.randn(3, 4, 7, generator=gen), torch.randint(0, 7, (3, 4), generator=gen)
    expected = F.cross_entropy(tokens.permute(0, 2, 1), targets)  # PyTorch's own [B, C, T] form
    torch.testing.assert_close(cross_entropy(tokens, targets), expected)


@pytest.mark.parametrize(
    ("global_batch", "world", "micro", "counts"),
    [(50, 3, 8, 3), (12, 5, 2, 2), (11, 3, 4, 1), (64, 4, 16, 1), (65, 4, 16, 2)],
)
def test_equal_counts_give_every_rank_the_largest_shares_micro_batch_count(global_batch, world, micro, counts):
    # zero3 reduce-scatters after every micro-batch: a rank with fewer would leave the others waiting in one.
    shares = [
        GlobalBatches(teacher_classification(256, 0), global_batch, micro, r, world, 0, torch.device("cpu"))
        for r in range(world)
    ]
    for share in shares:
        share.cut_equal_counts()
    assert [len(s.sizes) for s in shares] == [counts] * world
    assert all(sum(s.sizes) == s.local_samples and max(s.sizes) <= micro for s in shares)
    with pytest.raises(ValueError, match="rank 1's 1 samples cannot fill the 2 micro-batches every rank runs"):
        GlobalBatches(teacher_classification(8, 0), 4, 1, 1, 3, 0, torch.device("cpu")).cut_equal_counts()


def test_a_share_recut_for_another_world_is_the_share_that_world_deals():
    """A heal in place (app.worker.heal) re-deals the same global batch over the new ranks: a recut share must be
    exactly the share a fresh dealer of that world gives (samples, micro-batches, gradient weight)."""
    import torch

    from app.worker.data import BatchShare

    cpu = torch.device("cpu")
    for equal in (False, True):
        share = BatchShare(50, 8, 2, 3, cpu, torch.float64, equal_counts=equal)
        share.recut(0, 2)
        fresh = BatchShare(50, 8, 0, 2, cpu, torch.float64, equal_counts=equal)
        got = (share.rank, share.world_size, share.start, share.local_samples, share.sizes, share.grad_scale)
        assert got == (0, 2, fresh.start, fresh.local_samples, fresh.sizes, fresh.grad_scale)
        assert share.equal_counts is equal


def test_each_tokens_successors_come_with_the_documented_odds_so_the_loss_floor_is_1_11_nats():
    """The module docstring's chain: 4 successors per token at 0.55 / 0.25 / 0.15 / 0.05, whose entropy, 1.11
    nats, is the floor no model can beat (what docs and benchmarks compare the transformer's loss with)."""
    import math
    from collections import Counter

    from app.worker.data import SUCCESSOR_PROBS, markov_sequences

    assert SUCCESSOR_PROBS == (0.55, 0.25, 0.15, 0.05)
    assert round(-sum(p * math.log(p) for p in SUCCESSOR_PROBS), 2) == 1.11
    data = markov_sequences(2000, 32, seed=0)
    pairs = Counter(zip(data.inputs.flatten().tolist(), data.targets.flatten().tolist()))
    ranked = [0, 0, 0, 0]  # each token's successors, most frequent first, counted over every token
    for token in {a for a, _ in pairs}:
        for i, n in enumerate(sorted((n for (a, _), n in pairs.items() if a == token), reverse=True)):
            ranked[i] += n
    assert [round(n / sum(ranked), 2) for n in ranked] == pytest.approx([0.55, 0.25, 0.15, 0.05], abs=0.01)


@pytest.mark.parametrize(("global_batch", "world_size"), [(3, 4), (1001, 1)])
def test_a_global_batch_below_the_world_or_above_the_data_set_is_refused_naming_both(global_batch, world_size):
    with pytest.raises(ValueError) as e:
        GlobalBatches(DATA, global_batch, 8, 0, world_size, 0, CPU)
    assert str(e.value) == (
        f"global batch {global_batch} must lie between world_size={world_size} and dataset_size=1000: raise "
        "dataset_size or change the batch"
    )
    assert len(GlobalBatches(DATA, 1000, 8, 0, 1, 0, CPU).next_indices()) == 1000  # the whole set is one batch


def test_the_built_in_loss_passes_its_keywords_to_pytorchs_cross_entropy():
    # loss: cross_entropy with loss_kwargs {label_smoothing: 0.1} (app.worker.workload binds them)
    import torch.nn.functional as F

    from app.worker.config import TrainConfig
    from app.worker.data import cross_entropy
    from app.worker.workload import build_loss

    gen = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(4, 3, 5, generator=gen), torch.randint(0, 5, (4, 3), generator=gen)
    smoothed = F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(cross_entropy(logits, labels, label_smoothing=0.1), smoothed)
    loss = build_loss(TrainConfig(loss="cross_entropy", loss_kwargs={"label_smoothing": 0.1}))
    torch.testing.assert_close(loss(logits, labels), smoothed)
    assert not torch.allclose(cross_entropy(logits, labels), smoothed)
