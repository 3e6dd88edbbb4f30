"""Real training scripts run unchanged on our wrapper: swap the class, keep every line.

Each script below is written once, in our own words, after the idioms of widely used training code, and takes the
wrapper class as its only variable: ``torch.nn.parallel.DistributedDataParallel`` or ours. Both runs see the same
data on the same real gloo ranks and must end with the same parameters, to float tolerance.

- ``nanogpt_style``: gradient accumulation by ``model.require_backward_grad_sync = (micro == K - 1)``, ``loss / K``,
  ``clip_grad_norm_``, AdamW with decay / no-decay parameter groups, embedding tied to the output head, the wrapper
  built as ``DDP(model, device_ids=[local_rank])`` on a GPU and ``DDP(model)`` on CPU, ``model.module`` for the raw
  model.
- ``examples_style``: a ``Trainer`` class with ``DistributedSampler`` + ``set_epoch``, a snapshot of
  ``model.module.state_dict()`` written by rank 0, and a second ``Trainer`` that resumes from it.
- ``torch.compile(model)`` wrapped by the DDP class.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from app.parallel.ddp import DistributedDataParallel as OurDDP
from app.world import run_world

WRAPPERS = {"torch": TorchDDP, "ours": OurDDP}
TOL = 1e-5


class TinyGPT(nn.Module):
    """Token + position embeddings, two MLP blocks with LayerNorm, a head tied to the token embedding."""

    def __init__(self, vocab=48, dim=32, block=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(2)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = x + block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def configure_optimizers(model: nn.Module, weight_decay: float, lr: float) -> torch.optim.Optimizer:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]  # matrices and embeddings decay; biases and norms don't
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def nanogpt_style(rank, world, wrapper, steps=4, compile_model=False):
    DDP = WRAPPERS[wrapper]
    local_rank = rank
    device = f"cuda:{local_rank}" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    torch.manual_seed(1337)  # the same initial model on every rank
    model = TinyGPT().to(device)
    optimizer = configure_optimizers(model, weight_decay=0.1, lr=1e-2)
    if compile_model:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank]) if device.startswith("cuda") else DDP(model)
    raw_model = model.module
    grad_accum = 3
    data = torch.Generator().manual_seed(1000 + rank)  # each rank reads its own data

    def get_batch():
        x = torch.randint(0, 48, (4, 16), generator=data)
        return x.to(device), ((3 * x + 1) % 48).to(device)  # a rule per token: learnable in a few steps

    losses = []
    X, Y = get_batch()
    for _ in range(steps):
        for micro in range(grad_accum):
            # Sync gradients only on the last micro-step: the official no_sync() does the same through this flag.
            model.require_backward_grad_sync = micro == grad_accum - 1
            _, loss = model(X, Y)
            loss = loss / grad_accum
            X, Y = get_batch()  # fetch the next batch while backward would run on a GPU
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * grad_accum)
    return [p.detach().cpu().clone() for p in raw_model.parameters()], losses


class Trainer:
    """The shape of pytorch/examples' DDP tutorial trainer: snapshot every ``save_every`` epochs, resume from it."""

    def __init__(self, ddp_class, model, train_data, optimizer, save_every, snapshot_path):
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = ddp_class(self.model)  # device_ids=[local_rank] on GPUs; a CPU module takes none

    def _load_snapshot(self, path):
        snapshot = torch.load(path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if dist.get_rank() == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
            dist.barrier()  # the snapshot is complete before anyone may read it


def examples_style(rank, world, wrapper, snapshot_dir):
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 10, generator=g), torch.randint(0, 4, (64,), generator=g))

    def load_train_objs():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loader():
        return DataLoader(dataset, batch_size=8, shuffle=False, sampler=DistributedSampler(dataset, seed=3))

    path = os.path.join(snapshot_dir, f"snapshot-{wrapper}.pt")
    model, opt = load_train_objs()
    Trainer(WRAPPERS[wrapper], model, loader(), opt, save_every=2, snapshot_path=path).train(max_epochs=2)
    first_run = [p.detach().clone() for p in model.parameters()]
    model, opt = load_train_objs()  # a new process would start here: fresh objects, resume from the snapshot
    resumed = Trainer(WRAPPERS[wrapper], model, loader(), opt, save_every=2, snapshot_path=path)
    epochs_at_resume = resumed.epochs_run
    resumed.train(max_epochs=4)
    return first_run, [p.detach().clone() for p in model.parameters()], epochs_at_resume


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def test_nanogpt_style_loop_runs_unchanged_and_equals_pytorchs_ddp():
    theirs = run_world(nanogpt_style, 2, "torch")
    ours = run_world(nanogpt_style, 2, "ours")
    for (p_t, loss_t), (p_o, loss_o) in zip(theirs, ours):
        assert max_diff(p_t, p_o) <= TOL
        assert max(abs(a - b) for a, b in zip(loss_t, loss_o)) <= TOL
        assert loss_o[-1] < loss_o[0]  # it trains
    assert max_diff(ours[0][0], ours[1][0]) == 0  # the ranks stay identical


def test_examples_style_trainer_snapshot_and_resume_equal_pytorchs_ddp():
    with tempfile.TemporaryDirectory() as snapshot_dir:
        theirs = run_world(examples_style, 2, "torch", snapshot_dir)
        ours = run_world(examples_style, 2, "ours", snapshot_dir)
    for (first_t, final_t, epochs_t), (first_o, final_o, epochs_o) in zip(theirs, ours):
        assert epochs_t == epochs_o == 2  # the second trainer resumed at epoch 2, from model.module's state_dict
        assert max_diff(first_t, first_o) <= TOL
        assert max_diff(final_t, final_o) <= TOL
        assert max_diff(first_o, final_o) > 1e-3  # the resumed run trained on


def compiled(rank, world):
    import torch._inductor.config

    # Two ranks already share the machine's cores: a pool of compile workers per rank would only add start-up.
    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    out = {w: nanogpt_style(rank, world, w, steps=3, compile_model=True) for w in ("torch", "ours")}
    eager = nanogpt_style(rank, world, "ours", steps=3)
    return out, eager


@pytest.mark.timeout(900)
def test_compiled_model_wrapped_by_ours_trains_and_equals_pytorchs_ddp():
    # CPU inductor generates and compiles C++ for the model: tens of seconds per rank on a loaded machine.
    for out, eager in run_world(compiled, 2, timeout=600):
        (p_t, _), (p_o, loss_o) = out["torch"], out["ours"]
        assert max_diff(p_t, p_o) <= 1e-4
        assert loss_o[-1] < loss_o[0]
        assert max_diff(p_o, eager[0]) <= 1e-4  # and compiled equals eager
