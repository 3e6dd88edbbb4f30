"""Training data: generated deterministically from the seed (nothing downloaded), sharded by ``DistributedSampler``.

Two tasks, one per model, each with structure the model can learn in well under a minute on 2 CPU cores:

- ``mini_mlp``: teacher classification. A fixed random "teacher" network (seeded, never trained) labels Gaussian
  inputs with one of 8 classes; the student learns to imitate it. Loss starts near ln 8 = 2.08 and falls.
- ``tiny_transformer``: a Markov chain over 64 tokens in which each token has 4 possible successors with fixed
  probabilities (0.55 / 0.25 / 0.15 / 0.05). Next-token loss starts high (the head tied to N(0, 1) embeddings
  makes the first logits large: ~35 nats, not ln 64 = 4.16), is below 4 within ~40 steps and falls towards the
  chain's entropy, 1.11 nats: the floor no model can beat.

Every rank generates the same data set from ``seed``; ``DistributedSampler`` gives each rank its shard, and
``set_epoch`` reshuffles per epoch identically on all ranks. ``ShardedBatches`` remembers its position (epoch and
samples consumed in the epoch, counted over all ranks) so a resumed run continues the same data order, also after
the world size changed: the sampler deals indices round-robin (rank r gets positions r, r+n, r+2n, ...), so after
``c`` samples consumed by everyone, each of ``n`` ranks resumes at position ``c / n`` of its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

MLP_IN, MLP_CLASSES = 32, 8  # MiniMLP's default in/out features
VOCAB = 64  # TinyTransformer's default vocabulary
SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)


@dataclass
class Dataset:
    """Inputs and targets as two tensors (the whole set fits in memory many times over)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]


def teacher_classification(size: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, MLP_IN, generator=gen)
    w1 = torch.randn(MLP_IN, 64, generator=gen) / MLP_IN**0.5
    w2 = torch.randn(64, MLP_CLASSES, generator=gen) / 8.0
    # Centre the teacher's logits per class so no class dominates: a balanced task starts at ln 8.
    logits = torch.tanh(x @ w1) @ w2
    logits = logits - logits.mean(dim=0)
    return Dataset(x, logits.argmax(dim=1))


def markov_sequences(size: int, seq_len: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(VOCAB, generator=gen)[: len(SUCCESSOR_PROBS)] for _ in range(VOCAB)])
    probs = torch.tensor(SUCCESSOR_PROBS)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (size,), generator=gen)
    for t in range(seq_len):
        choice = torch.multinomial(probs, size, replacement=True, generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return Dataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def build_dataset(model: str, size: int, seed: int, seq_len: int = 32) -> Dataset:
    if model == "mini_mlp":
        return teacher_classification(size, seed)
    if model == "tiny_transformer":
        return markov_sequences(size, seq_len, seed)
    raise ValueError(f"no data set for model {model!r}")


def loss_function(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if model == "tiny_transformer":
        return lambda logits, targets: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return F.cross_entropy


class ShardedBatches:
    """This rank's endless stream of micro-batches: ``DistributedSampler`` order, epoch after epoch.

    A micro-batch never straddles two epochs: a shard's remainder shorter than ``micro_batch`` is skipped (as a
    DataLoader with ``drop_last=True`` would), so every micro-batch has the same size on every rank.
    """

    def __init__(self, dataset: Dataset, micro_batch: int, rank: int, world_size: int, seed: int, device: torch.device):
        if len(dataset) // world_size < micro_batch:
            raise ValueError(
                f"dataset_size={len(dataset)} gives each of {world_size} ranks fewer than "
                f"micro_batch={micro_batch} samples; raise dataset_size or lower micro_batch"
            )
        self.inputs = dataset.inputs.to(device)
        self.targets = dataset.targets.to(device)
        self.micro_batch = micro_batch
        self.world_size = world_size
        # drop_last: equal shards, so every rank runs the same number of steps per epoch (no collective mismatch).
        self.sampler = DistributedSampler(
            range(len(dataset)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.epoch = 0
        self.index = 0  # position within this rank's shard of the current epoch
        self._order = self._shard(self.epoch)

    def _shard(self, epoch: int) -> torch.Tensor:
        self.sampler.set_epoch(epoch)  # same permutation on every rank for this epoch, a new one each epoch
        return torch.tensor(list(iter(self.sampler)), dtype=torch.long, device=self.inputs.device)

    def next_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.micro_batch > len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shard(self.epoch)
        idx = self._order[self.index : self.index + self.micro_batch]
        self.index += self.micro_batch
        return self.inputs[idx], self.targets[idx]

    def next_micro_batches(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.next_micro_batch() for _ in range(k)]

    def state_dict(self) -> dict[str, int]:
        # Counted over all ranks, so a run resumed with a different world size starts at the same global position.
        return {"epoch": self.epoch, "consumed": self.index * self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._order = self._shard(self.epoch)
        self.index = min(int(state["consumed"]) // self.world_size, len(self._order))
