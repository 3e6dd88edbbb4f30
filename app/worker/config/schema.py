"""The trainer's settings: ``TrainConfig``, one documented dataclass validated on construction (``ConfigError``:
app.worker.config.checks, with the checks where settings depend on each other).

Each field has a one-line doc with its unit (it becomes the flag's ``--help`` and the docs' table); ``__post_init__``
checks what a value alone can break, ``check_world`` what needs the world size or this machine (it imports torch,
only then). A bad value raises ``ConfigError``, one line naming the field and the fix; ``app.train`` prints it and
exits 2. Where the values come from (file, environment, flags) is ``app.worker.config.load``'s job.

    >>> TrainConfig(steps=0)
    Traceback (most recent call last):
    ...
    app.worker.config.checks.ConfigError: steps=0: must be an integer >= 1
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

from app.parallel import WRAPPERS
from app.worker.config.checks import (
    PIPELINE_MAX_STAGES,
    ConfigError,
    at_least,
    check_activation_checkpointing,
    check_compile,
    check_heal,
    check_kind_settings,
    check_pipeline,
    check_pipeline_cuts,
    check_recipe,
    check_validation,
    check_workload,
    choice,
)
from app.worker.config.timeouts import check_trainer_timeouts

DEVICE_CHOICES = ("auto", "cpu", "cuda")
PARALLEL_CHOICES = ("ddp", "pipeline", "dp", "zero1", "zero2", "zero3")
ZERO_KINDS = ("zero1", "zero2", "zero3")  # the sharded step kinds (app.worker.steps.zero)
SCHEDULE_CHOICES = ("gpipe", "1f1b")
DTYPE_CHOICES = ("float32", "float64")
# The recipe's settings (app.worker.recipe) and their defaults: what a kind other than ddp must leave alone.


def _doc(text: str, default: Any = MISSING) -> Any:
    # The text becomes the flag's --help line and the README's table: one line, with the unit.
    if isinstance(default, dict):  # a mapping (keyword arguments): each config gets its own copy
        return field(default_factory=lambda: dict(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class TrainConfig:
    """Everything a training run can be told. Validated on construction (``__post_init__``)."""

    # -- workload -------------------------------------------------------------------------------------------------
    model: str = _doc(
        "model to train: mini_mlp | tiny_transformer | deep_mlp, or an import spec 'package.module:callable' "
        "returning an nn.Module (docs/check.md#your-model-in-the-worker)",
        "mini_mlp",
    )
    model_kwargs: dict[str, Any] = _doc(
        "keyword arguments for the model's callable (YAML mapping, or JSON in env/flag)", {}
    )
    data: str = _doc(
        "data set: an import spec (or built-in name, app.specs.DATA_SPECS) returning a map-style data set of "
        "(input, target) tensors or a resumable iterable of them (app.worker.data_stream); "
        '"" = the built-in model\'s own data set (required for any other model)',
        "",
    )
    data_kwargs: dict[str, Any] = _doc("keyword arguments for the data set's callable (mapping; JSON in env/flag)", {})
    loss: str = _doc(
        "loss(output, target) -> scalar: cross_entropy | mse or an import spec (a class is instantiated); "
        '"" = the built-in model\'s own loss (required for any other model)',
        "",
    )
    loss_kwargs: dict[str, Any] = _doc("keyword arguments for the loss (mapping; JSON in env/flag)", {})
    init_from: str = _doc(
        "start from these weights: a state_dict .pt or .safetensors file, or a checkpoint_dir of any kind "
        '(ignored when checkpoint_dir holds a checkpoint to resume; "" = the model\'s own initialisation)',
        "",
    )
    steps: int = _doc("optimizer steps in the whole run (a resumed run continues up to this step)", 200)
    micro_batch: int = _doc("samples per forward/backward on one rank", 32)
    grad_accum_steps: int | None = _doc(
        "micro-batches per optimizer step, per rank (default 1; or set effective_batch instead)", None
    )
    effective_batch: int | None = _doc(
        "samples per optimizer step over all ranks, held fixed at any world size: the ranks split it (unevenly "
        "when it does not divide) and each accumulates micro-batches of at most micro_batch",
        None,
    )
    lr: float = _doc("AdamW learning rate (the peak of lr_schedule; scaled when lr_reference_batch is set)", 0.003)
    lr_schedule: str = _doc(
        "after warm-up: constant | cosine | linear decay to min_lr_ratio × lr at the last step (a function of the "
        "optimizer step, stepped once per step)",
        "constant",
    )
    warmup_steps: int = _doc("optimizer steps of linear warm-up from lr / warmup_steps to lr (0 = none)", 0)
    min_lr_ratio: float = _doc("lr_schedule=cosine|linear: the last step's lr as a fraction of lr (0..1)", 0.0)
    lr_reference_batch: int = _doc("linear scaling rule: lr × global batch / this many samples (0 = lr as given)", 0)
    autocast: str = _doc("mixed precision of forward and loss: none | bf16 | fp16 (fp16 adds a GradScaler)", "none")
    grad_clip_norm: float = _doc(
        "clip the gradient's global L2 norm to this, over every rank's shards under ZeRO, every stage in a pipeline "
        "(0 = off)",
        0.0,
    )
    dtype: str = _doc(
        "precision of parameters, gradients and inputs: float32 | float64 (parallel=ddp, zero1, zero2; float64 keeps "
        "runs on different world sizes equal to ~1e-15, where float32 rounding can tip a ReLU: docs/cluster.md)",
        "float32",
    )
    seed: int = _doc(
        "seed of the parameters and the data (same on every rank); per-rank randomness uses seed + rank", 0
    )
    dataset_size: int = _doc(
        "samples in the built-in data set (generated deterministically from seed; data unset only)", 16384
    )
    seq_len: int = _doc("tokens per sequence of the built-in data set (tiny_transformer, data unset only)", 32)
    eval_fraction: float = _doc(
        "share of a map-style data set held out of training (its last samples) as the validation split (0 = none)",
        0.0,
    )
    eval_every: int = _doc(
        "optimizer steps between validation losses over the held-out split (needs eval_fraction; 0 = off)", 0
    )
    # -- distribution ---------------------------------------------------------------------------------------------
    wrapper: str = _doc(
        "data-parallel wrapper: ours (app.parallel.ddp) | torch (PyTorch's DDP) | none (world size 1 only)",
        "ours",
    )
    bucket_cap_mb: float = _doc("DDP bucket size in MiB", 25.0)
    parallel: str = _doc(
        "how the ranks share the work: ddp (data parallel) | pipeline (one model stage per rank, "
        "app.worker.steps.pipeline) | dp (nn.DataParallel: one process, >= 2 GPUs) | zero1 (optimizer state "
        "sharded) | zero2 (+ gradients) | zero3 (+ parameters: FSDP, CPU only); zero*: app.worker.steps.zero",
        "ddp",
    )
    fsdp_units: str = _doc(
        'parallel=zero3: comma list of module class names to shard as units ("" = each child of the root)', ""
    )
    activation_checkpointing: str = _doc(
        "recompute activations in backward instead of keeping them: off | units (each unit) | every:N (every N-th "
        "unit); a unit keeps only its input (non-reentrant torch.utils.checkpoint; docs/training.md)",
        "off",
    )
    activation_checkpointing_units: str = _doc(
        'activation_checkpointing: comma list of module class names whose instances are the units ("" = the '
        "items of the nn.ModuleList/nn.Sequential holding the most parameters: tiny_transformer's blocks, an MLP's "
        "layers)",
        "",
    )
    compile: str = _doc(
        "torch.compile: none | aot_eager | inductor (the backend; inductor is torch.compile's default), so the "
        "wrappers' gradient hooks still fire during backward: parallel=ddp|zero1 compile the model whole, its graph "
        "cut at the DDP buckets (dynamo's DDPOptimizer, for wrapper=torch and ours), the other kinds each unit on "
        "its own (docs/ddp.md#torchcompile)",
        "none",
    )
    compile_units: str = _doc(
        'compile: comma list of module class names compiled one by one ("" = the items of the '
        "nn.ModuleList/nn.Sequential holding the most parameters, as activation_checkpointing_units); units "
        "without parameters run eager; named, they replace the bucket cuts of wrapper=ours parallel=ddp|zero1",
        "",
    )
    overlap_gather: int = _doc(
        "parallel=zero2: 1 = the parameters' all-gather after each step runs on into the next forward, each "
        "bucket waited for before its first use (0 = waited for within the step)",
        0,
    )
    prefetch: int = _doc(
        "parallel=zero3: units whose all-gather is launched ahead of the unit computing, in forward and backward "
        "(0 = each gathered when needed)",
        0,
    )
    reshard_after_forward: int = _doc(
        "parallel=zero3: 1 = free each unit's gathered parameters after its forward (gathered again in backward); "
        "0 = keep them until its gradients are reduce-scattered (more memory, fewer all-gathers)",
        1,
    )
    pipeline_stages: int = _doc(
        "parallel=pipeline: stages per pipeline (0 = world size); the world holds world_size / stages replicas", 0
    )
    pipeline_microbatches: int = _doc(
        "parallel=pipeline: micro-batches each replica's batch per step (micro_batch, or its share of "
        "effective_batch) is cut into; must divide it",
        4,
    )
    pipeline_schedule: str = _doc("parallel=pipeline: gpipe | 1f1b (1f1b needs microbatches >= stages)", "gpipe")
    pipeline_split: str = _doc(
        "parallel=pipeline: comma list of the modules where stages 2.. begin, named in the model's sequence (its "
        'children in forward order, an nn.Sequential/ModuleList child expanded: net.2 | blocks.4,blocks.8); "" = '
        "balanced by parameter count (docs/parallelism.md#your-model-in-the-pipeline)",
        "",
    )
    device: str = _doc("auto (CUDA + NCCL when a GPU is visible, else CPU + gloo) | cpu | cuda", "auto")
    rendezvous_timeout_seconds: float = _doc(
        "seconds to reach MASTER_ADDR:MASTER_PORT and form the group (one deadline for both)", 60.0
    )
    collective_timeout_seconds: float = _doc(
        "the formed group's timeout for every collective, in seconds: a hung peer is detected after this long; "
        "must outlast the slowest checkpoint write (the other ranks wait in a collective meanwhile)",
        300.0,
    )
    heal: str = _doc(
        "what a lost or new rank costs: restart (torchrun restarts every rank from the newest checkpoint) | in_place "
        "(parallel=ddp: the survivors rebuild their group in-process and redo only the failed step; a new rank is "
        "given the state by a live peer: app.worker.heal, docs/cluster.md)",
        "restart",
    )
    heal_store: str = _doc(
        "heal=in_place: HOST:PORT of a TCPStore that outlives every rank, where the ranks agree on each new world "
        '(the compose rendezvous store; "" = none)',
        "",
    )
    # -- checkpoints ----------------------------------------------------------------------------------------------
    checkpoint_dir: str = _doc('directory for checkpoints, shared by all ranks ("" = no checkpoints)', "")
    checkpoint_every: int = _doc("write a checkpoint every this many optimizer steps (and at the end)", 50)
    keep_checkpoints: int = _doc("checkpoints to keep (older ones are deleted)", 3)
    checkpoint_timeout_seconds: float = _doc(
        "the longest one checkpoint write may take, in seconds: shorter than stop_timeout_seconds and "
        "collective_timeout_seconds (checked at start); a slower write is logged",
        2.0,
    )
    # -- observability --------------------------------------------------------------------------------------------
    metrics_port: int = _doc(
        "base port of the Prometheus /metrics endpoint; each process listens on "
        "metrics_port + LOCAL_RANK (0 = no metrics)",
        9400,
    )
    metrics_linger_seconds: float = _doc(
        "keep /metrics up this long after training, so Prometheus scrapes the final values", 0.0
    )
    log_every: int = _doc("rank 0 logs a progress line every this many steps", 10)
    flight_recorder_entries: int = _doc(
        "collectives each rank's flight recorder keeps, dumped to <checkpoint_dir>/flight on a timeout, a failure or "
        "SIGUSR1 for python -m app.doctor (docs/diagnostics.md; 0 = off)",
        4096,
    )
    desync_check: int = _doc(
        "debug: 1 = before each collective the ranks compare what they are about to run, and stop at the first "
        "mismatch naming both ops (one more small collective each; 0 = off)",
        0,
    )
    min_step_seconds: float = _doc(
        "each optimizer step lasts at least this long (the loop sleeps the rest), so that a run on a fast machine "
        "still spans Prometheus scrapes: for demos, drills and tests (0 = as fast as it goes)",
        0.0,
    )
    # -- stopping -------------------------------------------------------------------------------------------------
    stop_timeout_seconds: float = _doc(
        "after SIGTERM/SIGINT, force-exit (code 1) if the graceful stop has not finished within this many seconds", 10.0
    )
    inject_nan_at_step: int = _doc("failure drill: the last rank's loss becomes NaN at this step (0 = off)", 0)

    def __post_init__(self) -> None:
        check_workload(self)
        choice("wrapper", self.wrapper, WRAPPERS)
        choice("device", self.device, DEVICE_CHOICES)
        choice("parallel", self.parallel, PARALLEL_CHOICES)
        choice("pipeline_schedule", self.pipeline_schedule, SCHEDULE_CHOICES)
        choice("dtype", self.dtype, DTYPE_CHOICES)
        check_recipe(self)
        if self.dtype != "float32" and self.parallel not in ("ddp", "zero1", "zero2"):
            # zero3 keeps fp32 master shards whatever the model's dtype: float64 would be rounded at every step.
            raise ConfigError(
                f"dtype={self.dtype} works with parallel=ddp, zero1 or zero2 only: "
                f"set dtype=float32 for {self.parallel}"
            )
        check_kind_settings(self)
        check_heal(self)
        check_activation_checkpointing(self)
        check_compile(self)
        check_validation(self)
        at_least("pipeline_stages", self.pipeline_stages, 0)
        at_least("pipeline_microbatches", self.pipeline_microbatches, 1)
        if self.parallel == "pipeline":
            check_pipeline(self)
        for name in (
            "steps",
            "micro_batch",
            "dataset_size",
            "seq_len",
            "checkpoint_every",
            "keep_checkpoints",
            "log_every",
        ):
            at_least(name, getattr(self, name), 1)
        for name in ("grad_accum_steps", "effective_batch"):
            if getattr(self, name) is not None:
                at_least(name, getattr(self, name), 1)
        for name in (
            "lr",
            "bucket_cap_mb",
            "rendezvous_timeout_seconds",
            "collective_timeout_seconds",
            "stop_timeout_seconds",
            "checkpoint_timeout_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")
        check_trainer_timeouts(self)  # (app.worker.config.timeouts: the order that lets the right layer see a fault)
        for name in ("metrics_linger_seconds", "min_step_seconds"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port}: must be a TCP port 1..65535, or 0 for no metrics")
        at_least("flight_recorder_entries", self.flight_recorder_entries, 0)
        if self.desync_check not in (0, 1):
            raise ConfigError(f"desync_check={self.desync_check}: must be 0 (off) or 1 (on)")
        if self.inject_nan_at_step < 0:
            raise ConfigError(f"inject_nan_at_step={self.inject_nan_at_step}: must be >= 0 (0 = off)")
        if self.model == "tiny_transformer" and not self.data and self.seq_len > 64:
            raise ConfigError(f"seq_len={self.seq_len}: tiny_transformer has 64 positions; choose seq_len <= 64")

    def pipeline_layout(self, world_size: int) -> tuple[int, int]:
        """``(stages, replicas)`` of ``parallel=pipeline`` in a world of ``world_size`` ranks; ConfigError if none.

        Example::

            >>> TrainConfig(parallel="pipeline").pipeline_layout(4)
            (4, 1)
        """
        stages = self.pipeline_stages or world_size
        if stages < 2:
            raise ConfigError(
                f"parallel=pipeline with world_size={world_size}: a pipeline needs >= 2 stages, one per rank; "
                f"run >= 2 ranks (torchrun --nproc-per-node=2), or parallel=ddp"
            )
        if stages > PIPELINE_MAX_STAGES.get(self.model, stages):
            raise ConfigError(
                f"parallel=pipeline: {stages} stages (pipeline_stages=0: the world size) but {self.model} has "
                f"{PIPELINE_MAX_STAGES[self.model]} layers with parameters; set pipeline_stages to a divisor of "
                f"{world_size} up to {PIPELINE_MAX_STAGES[self.model]}"
            )
        check_pipeline_cuts(self.pipeline_split, stages)
        if world_size % stages:
            raise ConfigError(
                f"pipeline_stages={stages} does not divide world_size={world_size}: run a multiple of {stages} ranks"
            )
        if self.pipeline_schedule == "1f1b" and self.pipeline_microbatches < stages:
            raise ConfigError(
                f"pipeline_schedule=1f1b needs pipeline_microbatches >= {stages} stages, got "
                f"{self.pipeline_microbatches}; raise it or use pipeline_schedule=gpipe"
            )
        replicas = world_size // stages
        if self.effective_batch is not None and self.effective_batch % (replicas * self.pipeline_microbatches):
            raise ConfigError(
                f"effective_batch={self.effective_batch} does not split into {replicas} replicas x "
                f"pipeline_microbatches={self.pipeline_microbatches} equal micro-batches; choose a multiple of "
                f"{replicas * self.pipeline_microbatches}"
            )
        return stages, replicas

    def pipeline_batch(self, world_size: int) -> int:
        """Samples one pipeline replica trains on per step: ``micro_batch``, or its share of ``effective_batch``."""
        _, replicas = self.pipeline_layout(world_size)
        return self.micro_batch if self.effective_batch is None else self.effective_batch // replicas

    def check_world(self, world_size: int, local_world_size: int = 1) -> int:
        """Checks that need the world size or this machine; returns ``grad_accum_steps`` per rank.

        ``local_world_size``: processes on this machine (torchrun's LOCAL_WORLD_SIZE), each with its own metrics port.
        """
        if self.parallel == "pipeline":
            _, replicas = self.pipeline_layout(world_size)
            world_size = replicas  # the data is dealt to the replicas; every stage of one sees the same batch
        if self.parallel == "dp" and world_size > 1:
            raise ConfigError(
                f"parallel=dp with world_size={world_size}: nn.DataParallel is one process driving every GPU; "
                f"run it without torchrun (python -m app.train --parallel dp), or use parallel=ddp"
            )
        if self.wrapper == "none" and world_size > 1 and self.parallel == "ddp":
            raise ConfigError(
                f"wrapper=none with world_size={world_size}: unsynchronised ranks would train "
                f"{world_size} different models; use wrapper=ours or wrapper=torch, or run one process"
            )
        # A data spec's size is known once it is built: app.worker.workload checks it then.
        if not self.data and self.dataset_size // world_size < self.micro_batch:
            # DistributedSampler(drop_last=True) gives each rank dataset_size // world_size samples.
            raise ConfigError(
                f"dataset_size={self.dataset_size} gives each of world_size={world_size} ranks "
                f"{self.dataset_size // world_size} samples, fewer than micro_batch={self.micro_batch}; "
                f"raise dataset_size to >= {self.micro_batch * world_size} or lower micro_batch"
            )
        top = self.metrics_port + local_world_size - 1
        if self.metrics_port and top > 65535:
            raise ConfigError(
                f"metrics_port={self.metrics_port}: the {local_world_size} processes on this machine "
                f"would listen on ports up to {top} > 65535; choose metrics_port <= "
                f"{65536 - local_world_size}, or 0 for no metrics"
            )

        import torch  # only once the flags are known good: a bad flag fails before this seconds-long import

        from app.parallel.accum import grad_accum_steps_for, resolve_grad_accum_steps

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "device=cuda: no CUDA device is visible here (torch.cuda.is_available() is False); "
                "use device=auto or device=cpu, or run on a machine with a GPU"
            )
        if self.parallel == "dp" and (self.device == "cpu" or torch.cuda.device_count() < 2):
            raise ConfigError(
                f"parallel=dp needs CUDA with >= 2 GPUs; {torch.cuda.device_count()} visible"
                f"{' and device=cpu' if self.device == 'cpu' else ''}: use parallel=ddp (any device), "
                f"or run on a machine with >= 2 GPUs"
            )

        if self.effective_batch is not None and self.grad_accum_steps is None:
            return self._check_global_batch(world_size, grad_accum_steps_for)
        try:
            return resolve_grad_accum_steps(self.micro_batch, world_size, self.grad_accum_steps, self.effective_batch)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_global_batch(self, world_size: int, grad_accum_steps_for) -> int:
        if self.effective_batch < world_size:
            raise ConfigError(
                f"effective_batch={self.effective_batch} is smaller than world_size={world_size}: every rank needs "
                f"at least one sample per step; raise effective_batch to >= {world_size} or run fewer ranks"
            )
        if not self.data and self.effective_batch > self.dataset_size:
            raise ConfigError(
                f"effective_batch={self.effective_batch} is larger than dataset_size={self.dataset_size}: one step "
                f"would need more samples than an epoch holds; raise dataset_size or lower effective_batch"
            )
        if self.parallel == "zero3":
            self._check_zero3_micro_batches(world_size)
        return grad_accum_steps_for(self.effective_batch, world_size, self.micro_batch)

    def _check_zero3_micro_batches(self, world_size: int) -> None:
        # Stage 3 reduce-scatters after every micro-batch (app.worker.steps.zero: it has no no_sync), so every rank
        # cuts its share into as many micro-batches as the largest share needs; a share with fewer samples than
        # that count cannot (micro_batch=1 and uneven shares), and its rank would leave the others waiting.
        from app.worker.data import equal_micro_batch_count  # torch: check_world's part, as its docstring says

        count = equal_micro_batch_count(self.effective_batch, world_size, self.micro_batch)
        smallest = self.effective_batch // world_size
        if smallest < count:
            fits = -(-self.effective_batch // world_size) * world_size
            raise ConfigError(
                f"parallel=zero3: effective_batch={self.effective_batch} over world_size={world_size} leaves some "
                f"ranks {smallest} samples for the {count} micro-batches of micro_batch <= {self.micro_batch} every "
                f"rank runs (zero3 reduce-scatters after each one); set effective_batch to a multiple of "
                f"{world_size} (e.g. {fits}) or raise micro_batch"
            )

    def global_batch(self, world_size: int, grad_accum_steps: int) -> int:
        """Samples per optimizer step over all ranks: ``effective_batch`` when set (the same at every world size),
        else ``micro_batch × grad_accum_steps × world_size``."""
        if self.effective_batch is not None:
            return self.effective_batch
        return self.micro_batch * grad_accum_steps * world_size

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
