"""TinyTransformer on a real corpus, offline: Python's standard library, byte by byte; its loss curve on 1 and 2 ranks.

    python -m bench.corpus_curve                   # configs/corpus.yaml, 1 process then 2 ranks (~3 min on 2 cores)
    python -m bench.corpus_curve --steps 60 --every 20   # a quick trial (written to runs/, not bench/results/)

Each run is the real worker (``python -m app.train --config configs/corpus.yaml``; 2 ranks under ``torchrun
--standalone``) with the data set ``stdlib_corpus`` (app.worker.data_files): the first ``max_bytes`` of the
stdlib's ``.py`` files in sorted order, one byte a token, windows of 64 + 1. It checkpoints every ``--every``
steps; this bench then loads every checkpoint and measures the loss on held-out bytes, the ``--eval-windows``
windows that follow the training bytes in the same file order (code the model never trained on).

Two baselines say what the numbers mean: ln 256 (a uniform guess over bytes) and the unigram loss (the training
bytes' frequencies, what a model learns first). The two world sizes train on the same 32 windows a step
(``effective_batch``), so their held-out curves agree up to float32 drift; the training column is rank 0's mean
over its share of the batch, which differs between them by sampling.

Writes ``bench/results/corpus-curve.json`` (with provenance, bench/provenance.py) and ``corpus-curve.png``;
``tools/report.py`` renders the table into docs/check.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "corpus.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.corpus_curve", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each run")
    p.add_argument("--every", type=int, default=25, help="checkpoint (and measure the held-out loss) every this many")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes, run one after the other")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows (64 + 1 bytes each)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/corpus-curve.json)")
    return p


def train(directory: Path, world: int, args) -> dict:
    """One run of the worker; its rank-0 progress losses, FINISHED checksum and wall time."""
    launcher = [sys.executable, "-m", "app.train", "--wrapper", "none"]
    if world > 1:
        launcher = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={world}"]
        launcher += ["-m", "app.train"]
    cmd = [*launcher, "--config", str(CONFIG), "--steps", str(args.steps), "--checkpoint-dir", str(directory)]
    cmd += ["--checkpoint-every", str(args.every), "--keep-checkpoints", str(args.steps // args.every + 1)]
    cmd += ["--log-every", str(args.every)]  # a training loss beside every held-out one
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")} | {"OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"world {world} exited {result.returncode}:\n{result.stderr[-3000:]}")
    losses = {int(s): float(x) for s, x in re.findall(r"step (\d+)/\d+ \| loss ([0-9.]+)", result.stderr)}
    checksum = re.search(r"FINISHED rank=0 .* checksum=([0-9a-f]+)", result.stdout)
    return {"train_loss": losses, "checksum": checksum and checksum[1], "wall_s": round(time.monotonic() - started, 1)}


def held_out(cfg, windows: int):
    """The ``windows`` windows after the training bytes: (inputs, targets), and what they are."""
    import torch

    from app.worker.data_files import stdlib_corpus

    seq_len, skip = cfg.data_kwargs["seq_len"], cfg.data_kwargs["max_bytes"]
    data = stdlib_corpus(seq_len=seq_len, max_bytes=windows * seq_len + 1, skip_bytes=skip)
    pairs = [data[i] for i in range(len(data))]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]), data.describe()


def unigram_loss(train_tokens, targets) -> float:
    """Cross-entropy of the held-out targets under the training bytes' frequencies (add-one smoothed)."""
    import torch

    counts = torch.bincount(train_tokens.long(), minlength=256).double() + 1
    return -(counts / counts.sum()).log()[targets.reshape(-1)].mean().item()


def evaluate(cfg, directory: Path, steps: list[int], x, y) -> dict[int, float]:
    """Held-out loss of each checkpoint (step 0: the seeded initial model, as every run starts)."""
    import torch

    from app.worker.checkpoint.files import checkpoint_path, load_checkpoint
    from app.worker.workload import build_loss, build_model

    loss_fn, out = build_loss(cfg), {}
    for step in [0, *steps]:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg)
        if step:
            model.load_state_dict(load_checkpoint(checkpoint_path(directory, step))["model"])
        with torch.no_grad():
            out[step] = round(loss_fn(model.eval()(x), y).item(), 4)
    return out


def measure(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from app.worker.config import load_config
    from app.worker.workload import build_dataset

    cfg = load_config(["--config", str(CONFIG)], {}).config
    train_set = build_dataset(cfg)
    x, y, eval_note = held_out(cfg, args.eval_windows)
    steps = list(range(args.every, args.steps + 1, args.every))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="corpus-curve-") as top:
        for world in args.worlds:
            run = train(Path(top) / f"w{world}", world, args)
            run["held_out_loss"] = evaluate(cfg, Path(top) / f"w{world}", steps, x, y)
            runs[str(world)] = run
            print(f"world {world}: {run['wall_s']} s, held-out loss {run['held_out_loss']}", file=sys.stderr)
    return {
        "corpus": {"train": train_set.describe(), "held_out": eval_note},
        "config": {k: v for k, v in cfg.as_dict().items() if k in ("model", "model_kwargs", "data", "data_kwargs")}
        | {"effective_batch": cfg.effective_batch, "micro_batch": cfg.micro_batch, "lr": cfg.lr},
        "baselines": {"uniform": round(math.log(256), 4), "unigram": round(unigram_loss(train_set.tokens, y), 4)},
        "runs": runs,
        "torch_threads": torch.get_num_threads(),
    }


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (w, run) in enumerate(doc["runs"].items()):
        held, style = run["held_out_loss"], ("-", "--", ":")[i % 3]  # dashed over solid: equal curves stay visible
        ax.plot([int(s) for s in held], list(held.values()), style, marker="o", label=f"held-out, world {w}")
        ax.plot([int(s) for s in run["train_loss"]], list(run["train_loss"].values()), alpha=0.5, label=f"train, {w}")
    for name, value in doc["baselines"].items():
        ax.axhline(value, linestyle=":", color="grey")
        ax.annotate(name, (0, value), textcoords="offset points", xytext=(4, 3), fontsize=8, color="grey")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title="TinyTransformer on the stdlib")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.provenance import describe_output, load_average, write_result

    parser = build_parser()
    args = parser.parse_args(argv)
    before = load_average()
    path, doc = write_result(parser, args, "corpus-curve", measure(args), before)
    plot(doc, path.with_suffix(".png"))
    from tools.renderers.corpus import render_corpus_curve

    print("\n".join(render_corpus_curve(doc)))
    print(describe_output(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
