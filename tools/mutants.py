"""Do the tests catch the bugs a user would notice? One-line mutants of the load-bearing lines, each run against
the tests that should catch it.

    make mutants-curated                                  # every mutant; tens of minutes on 2 cores
    .venv/bin/python -m tools.mutants --only ckpt-no-fsync,loss-not-divided-by-k   # a few, by name
    .venv/bin/python -m tools.mutants --list              # the mutants and whether each snippet is still found

Each mutant names a file, a snippet of code that occurs in it exactly once, its replacement, and the tests that
should fail with it. The snippet, not a line number, locates it, so the list survives code moving around; a snippet
no longer found (or found twice) is reported as "stale" and counts as not caught, so a rename shows up in the
score instead of silently shrinking the list (``tests/unit/test_mutants.py`` checks every snippet on each commit).

The repository is never mutated in place: the tracked and untracked-but-not-ignored files are copied to a temporary
folder once, each mutant is applied there, its tests run with that folder as the working directory and first on
``PYTHONPATH`` (the virtualenv of this checkout is reused; the script checks that the mutated module is imported from
the copy), and the file is restored before the next mutant. First the selected tests run once unmutated: a test that
already fails would "catch" its mutants, which are then reported as such instead of run.

Outcomes: ``caught`` (a selected test failed), ``caught (timeout)`` (the tests hung past ``--timeout``: a user
would notice that too), ``survived`` (every selected test passed: a gap in the tests), ``stale`` (snippet not found
exactly once), ``error`` (pytest could not run the selection: a bad test id), ``baseline fails`` (a selected test
fails with no mutant planted, so it proves nothing; the baseline run lists them). The score is caught / total. Writes
``bench/results/mutants.json`` (with ``tools/provenance.py``'s record) for the full list, ``runs/mutants.json`` for a
subset, or ``--out``. Exit status: 0 when every mutant was caught, 1 otherwise, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.provenance import describe_output, git_commit, load_average, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Mutant:
    name: str  # short id, for --only
    what: str  # the bug, as a user would notice it
    path: str  # file, relative to the repository root
    find: str  # code that occurs exactly once in that file
    replace: str  # what it becomes
    tests: tuple[str, ...]  # pytest arguments: node ids, files, or "-k", "expr"


def T(*tests: str) -> tuple[str, ...]:
    return tests


# The curated list. Keep each `find` as short as stays unique, and the tests as few as catch it (speed).
MUTANTS: list[Mutant] = [
    # -- the DDP wrapper (app/parallel/ddp/module.py, reducer.py) --------------------------------------------------
    Mutant(
        "ddp-no-divide-by-world-size",
        "gradients summed over ranks, not averaged: every step is world_size times too big",
        "app/parallel/ddp/reducer.py",
        "torch.tensor(1.0 / self._divisor, dtype=b.params[0].dtype)",
        "torch.tensor(1.0, dtype=b.params[0].dtype)",
        T("tests/integration/test_ddp.py::test_matches_single_process_training_step_by_step"),
    ),
    Mutant(
        "ddp-bucket-order-differs-by-rank",
        "odd ranks bucket parameters in another order: all-reduces pair up different gradients",
        "app/parallel/ddp/reducer.py",
        "self._build_buckets(list(reversed(range(len(self._params)))))",
        "self._build_buckets(list(range(len(self._params))) if dist.get_rank() % 2 "
        "else list(reversed(range(len(self._params)))))",
        T("tests/integration/test_ddp.py::test_matches_single_process_training_step_by_step"),
    ),
    Mutant(
        "ddp-no-initial-broadcast",
        "ranks keep their own initial weights instead of rank 0's: they drift apart forever",
        "app/parallel/ddp/module.py",
        "[p.data for p in module.parameters()] + buffers, src=self._src_rank",
        "[], src=self._src_rank",
        T("tests/integration/test_ddp.py::test_matches_single_process_training_step_by_step"),
    ),
    Mutant(
        "ddp-no-sync-ignored",
        "no_sync() still all-reduces every backward: accumulation costs K syncs per step",
        "app/parallel/ddp/module.py",
        "self.require_backward_grad_sync = False",
        "self.require_backward_grad_sync = True",
        T("tests/integration/test_accum.py::test_gradients_sync_once_per_effective_step"),
    ),
    Mutant(
        "ddp-first-bucket-not-capped",
        "the first bucket is as big as the others (25 MiB), so its all-reduce starts late in backward",
        "app/parallel/ddp/module.py",
        "FIRST_BUCKET_BYTES = 1024 * 1024",
        "FIRST_BUCKET_BYTES = 1024 * 1024 * 1024",
        T("tests/integration/test_ddp_api.py::test_buckets_are_cut_like_pytorchs"),
    ),
    Mutant(
        "ddp-bucket-closes-past-its-cap",
        "a bucket closes only once it exceeds its cap, not when it reaches it: buckets differ from PyTorch's",
        "app/parallel/ddp/buckets.py",
        "if current_bytes >= cap:",
        "if current_bytes > cap:",
        T("tests/integration/test_ddp_api.py::test_buckets_are_cut_like_pytorchs"),
    ),
    # -- gradient accumulation (app/parallel/accum.py) ------------------------------------------------------------
    Mutant(
        "accum-loss-not-divided-by-k",
        "each micro-batch's loss counts in full: the accumulated step is K times too big",
        "app/parallel/accum.py",
        "weight = sizes[i] / total * grad_scale if scale_loss else 1.0",
        "weight = grad_scale if scale_loss else 1.0",
        T("tests/integration/test_accum.py::test_one_batch_of_16_equals_4_micro_batches_of_4"),
    ),
    # -- checkpoints (app/worker/checkpoint/checkpointer.py) --------------------------------------------------
    Mutant(
        "ckpt-written-in-place",
        "the checkpoint is written straight to its final name: a crash mid-write leaves a torn newest file",
        "app/files.py",
        'tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")',
        "tmp = path",
        T("tests/unit/test_files.py", "tests/unit/test_checkpoint.py"),
    ),
    Mutant(
        "ckpt-no-fsync",
        "the bytes are not forced to disk before the rename: a power loss can leave an empty newest file",
        "app/files.py",
        "os.fsync(f.fileno())",
        "f.flush()",
        T("tests/unit/test_checkpoint.py::test_the_bytes_are_durable_before_the_name_and_the_name_before_returning"),
    ),
    Mutant(
        "ckpt-no-directory-fsync",
        "the rename is not made durable: after a power loss the newest checkpoint may be missing",
        "app/files.py",
        "        fsync_directory(path.parent)\n",
        "        pass\n",
        T("tests/unit/test_checkpoint.py::test_the_bytes_are_durable_before_the_name_and_the_name_before_returning"),
    ),
    Mutant(
        "ckpt-digest-not-checked",
        "a checkpoint with flipped bits is loaded as if it were good",
        "app/worker/checkpoint/files.py",
        'if digest(state, after=release if mapped else None) != state["digest"]:',
        "if False:",
        T("tests/unit/test_checkpoint.py::test_flipped_bits_are_detected"),
    ),
    Mutant(
        "ckpt-rng-not-restored",
        "a resumed run draws other random numbers than the straight run would have",
        "app/worker/checkpoint/checkpointer.py",
        'torch.set_rng_state(rng["cpu"][ctx.rank].cpu())',
        "pass",
        T("tests/integration/test_resume.py::test_resume_restores_every_ranks_own_rng_stream"),
    ),
    # -- data position on resume (app/worker/data.py) ------------------------------------------------------------------
    Mutant(
        "data-resume-position-assumes-2-ranks",
        "the saved sampler position assumes 2 ranks: a resume onto another world size skips or repeats samples",
        "app/worker/data.py",
        'return {"epoch": self.epoch, "consumed": self.consumed}',
        'return {"epoch": self.epoch, "consumed": self.consumed // self.global_batch * self.local_samples * 2}',
        T("tests/unit/test_data.py::test_a_resume_on_another_world_size_continues_with_the_next_global_batch"),
    ),
    # -- a user's data and settings (app/worker/data_files.py, data.py, workload.py, config/load.py) ------------------
    Mutant(
        "data-files-target-is-the-input",
        "a file window's targets are its inputs, not the next tokens: the model learns to copy",
        "app/worker/data_files.py",
        "return window[:-1], window[1:]",
        "return window[:-1], window[:-1]",
        T("tests/unit/test_data_files.py::test_a_window_is_seq_len_tokens_and_the_next_token_at_each"),
    ),
    Mutant(
        "map-style-batch-repeats-a-sample",
        "a map-style data set's micro-batch is one sample repeated: the run memorises it",
        "app/worker/data.py",
        "pairs = [self.samples[i] for i in indices]",
        "pairs = [self.samples[indices[0]] for i in indices]",
        T("tests/unit/test_data_files.py::test_every_window_once_per_epoch_and_the_same_steps_at_any_world_size"),
    ),
    Mutant(
        "kwargs-json-ignored",
        "DDP_MODEL_KWARGS / --model-kwargs JSON is dropped: the model trains at its defaults",
        "app/worker/config/load.py",
        "            value = json.loads(raw)\n",
        "            value = {}\n",
        T("tests/unit/test_workload.py::test_specs_and_keywords_from_yaml_env_and_flags"),
    ),
    Mutant(
        "loss-not-checked-scalar",
        "a loss that is not reduced to a scalar passes the start-up check",
        "app/worker/workload.py",
        "if not isinstance(loss, torch.Tensor) or loss.numel() != 1:",
        "if not isinstance(loss, torch.Tensor):",
        T("tests/unit/test_workload.py::test_check_workload_names_the_spec_and_the_cause"),
    ),
    # -- metrics (app/worker/metrics.py) -------------------------------------------------------------------------------
    Mutant(
        "metrics-samples-count-steps",
        "ddp_samples_total counts 1 per step instead of the samples",
        "app/worker/metrics.py",
        "self.samples.inc(samples)",
        "self.samples.inc(1)",
        T("tests/integration/test_metrics.py::test_metric_values_after_known_steps"),
    ),
    Mutant(
        "metrics-loss-is-the-lr",
        "ddp_loss shows the learning rate",
        "app/worker/metrics.py",
        "self.loss.set(loss)",
        "self.loss.set(lr)",
        T("tests/integration/test_metrics.py::test_metric_values_after_known_steps"),
    ),
    # -- process group (app/worker/dist.py) ----------------------------------------------------------------------------
    Mutant(
        "dist-rendezvous-deadline-tripled",
        "forming the group may take 3× rendezvous_timeout_seconds",
        "app/worker/dist.py",
        "remaining = max(deadline - time.monotonic(), 0.5)",
        "remaining = 3 * max(deadline - time.monotonic(), 0.5)",
        T("tests/integration/test_train.py::test_rank_0_waits_for_its_peers_no_longer_than_the_rendezvous_timeout"),
    ),
    Mutant(
        "dist-endpoint-wait-tripled",
        "an unreachable rendezvous endpoint is given up on after 3× rendezvous_timeout_seconds",
        "app/worker/dist.py",
        "wait_for_endpoint(host, port, timeout_s)",
        "wait_for_endpoint(host, port, 3 * timeout_s)",
        T("tests/integration/test_train.py::test_unreachable_rendezvous_fails_within_the_timeout_naming_the_endpoint"),
    ),
    # -- the worker's main (app/train.py) ---------------------------------------------------------------------------
    Mutant(
        "train-stop-never-forced",
        "a graceful stop that hangs is never forced after stop_timeout_seconds",
        "app/worker/control.py",
        'threading.Thread(target=self._force_exit, name="stop-timeout", daemon=True).start()',
        "pass",
        T("tests/integration/test_train.py::test_a_stop_that_cannot_finish_is_forced_after_stop_timeout_seconds"),
    ),
    Mutant(
        "train-sigint-not-handled",
        "Ctrl-C kills the worker without a checkpoint instead of stopping it like SIGTERM",
        "app/worker/control.py",
        "SIGNALS = {signal.SIGTERM, signal.SIGINT}",
        "SIGNALS = {signal.SIGTERM}",
        T("tests/integration/test_train.py::test_sigint_is_handled_as_sigterm"),
    ),
    Mutant(
        "train-metrics-port-taken-exits-1",
        "a metrics port already taken exits 1 (a crash to restart) instead of 2 (a configuration error)",
        "app/train.py",
        "if metrics is None:\n        return BAD_CONFIG",
        "if metrics is None:\n        return FAILED",
        T("tests/integration/test_train.py::test_a_metrics_port_already_taken_is_a_config_error_exit_2"),
    ),
    Mutant(
        "train-config-error-exits-1",
        "a bad flag exits 1 instead of the documented 2",
        "app/train.py",
        "        return BAD_CONFIG\n    cfg = resolved.config",
        "        return FAILED\n    cfg = resolved.config",
        T("tests/unit/test_config.py::test_bad_input_exits_2_with_one_line"),
    ),
    # -- configuration (app/worker/config/schema.py) ---------------------------------------------------------------
    Mutant(
        "config-no-positive-check",
        "a zero or negative setting (steps, batch, lr, ...) is accepted instead of a one-line error",
        "app/worker/config/schema.py",
        'raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")',
        "pass",
        T("tests/unit/test_config.py::test_validation_names_the_field"),
    ),
    Mutant(
        "dtype-ignored",
        "dtype=float64 accepted but the model trains in float32 (the chaos proof would compare float32 runs)",
        "app/worker/steps/ddp.py",
        "self.model = inputs.model.to(ctx.device, dtype)",
        "self.model = inputs.model.to(ctx.device)",
        T("tests/integration/test_invariance.py::test_in_float64_the_world_size_changes_nothing_but_the_last_bits"),
    ),
    # -- failures seen from outside ----------------------------------------------------------------------------------
    Mutant(
        "lost-peer-as-traceback",
        "a peer that went away is reported as a 60-line traceback instead of one line naming it",
        "app/train.py",
        "cause = lost_peer(e)",
        "cause = None",
        T("tests/integration/test_train.py::test_a_killed_peer_is_named_in_one_line_and_exit_1"),
    ),
    Mutant(
        "grafana-password-remade",
        "Grafana's admin password file is made anew (world-readable) at every start",
        "compose.yaml",
        'if [ ! -s "$$f" ]; then (umask 077 && tr',
        "if true; then (tr",
        T("tests/e2e/test_cluster_files.py::test_grafana_admin_password_is_random_per_cluster_and_kept"),
    ),
    # -- issue 38: promises of the docs and docstrings a held-out audit found unguarded ------------------------------
    # Silent wrong training
    Mutant(
        "zero1-scheduler-lr-ignored",
        "ZeRO-1 steps every partition at the lr it was built with: an LR scheduler or a hand-set group lr is ignored",
        "app/parallel/zero/stage1.py",
        '            local.update({k: v for k, v in group.items() if k != "params"})\n'
        "        self.optim.step(**kwargs)",
        "            pass\n        self.optim.step(**kwargs)",
        T(
            "tests/integration/test_zero.py::"
            "test_zero1_follows_an_lr_scheduler_a_hand_set_lr_and_two_groups_into_its_state_dict"
        ),
    ),
    Mutant(
        "zero1-state-dict-groups-overlap",
        "ZeRO-1's consolidated state dict numbers every group's parameters from 0: with two groups, state lands on "
        "the wrong parameters",
        "app/parallel/zero/stage1.py",
        "            start += n\n",
        "            start += 0\n",
        T(
            "tests/integration/test_zero.py::"
            "test_zero1_follows_an_lr_scheduler_a_hand_set_lr_and_two_groups_into_its_state_dict"
        ),
    ),
    Mutant(
        "zero2-second-backward-replaces-the-first",
        "ZeRO-2: of two synchronised backwards before one step, only the last one's gradient is kept",
        "app/parallel/zero/stage2.py",
        "b.shard.grad = chunk if b.shard.grad is None else b.shard.grad.add_(chunk)",
        "b.shard.grad = chunk",
        T("tests/integration/test_zero.py::test_zero2_adds_up_two_synchronised_backwards_before_one_step"),
    ),
    Mutant(
        "join-final-model-from-the-highest-rank",
        "join() ends with every rank holding the highest rank's model, even when that rank stopped training early",
        "app/parallel/ddp/join.py",
        "common_rank(ddp, candidate=is_last_joiner)",
        "common_rank(ddp, candidate=True)",
        T(
            "tests/integration/test_ddp_join.py::test_uneven_inputs_train_as_with_pytorchs_join[world3-rank0-joins-last]"
        ),
    ),
    Mutant(
        "sparse-table-none-on-a-rank-that-looked-up-nothing",
        "a sparse table this rank looked up no rows of keeps p.grad None: the others' rows never reach it, the ranks "
        "drift apart",
        "app/parallel/ddp/sparse.py",
        "if p.grad is not None or grad._nnz():",
        "if p.grad is not None:",
        T(
            "tests/integration/test_ddp_sparse.py::test_sparse_gradients_train_as_with_pytorchs_ddp[table-one-rank-looks-up]"
        ),
    ),
    # A check that lies
    Mutant(
        "check-passes-when-one-wrapper-differs",
        "python -m app.check prints PASS and exits 0 when one of the two wrappers differs from one process",
        "app/check/cli.py",
        'ok = all(v == "equal" for v in verdicts.values())',
        'ok = any(v == "equal" for v in verdicts.values())',
        T("tests/integration/test_check.py::test_one_wrapper_differing_is_a_fail_and_exit_1"),
    ),
    # Settings silently ignored
    Mutant(
        "loss-function-keywords-dropped",
        "loss_kwargs of a loss given as a function are checked, then dropped: it runs at its defaults",
        "app/specs.py",
        "return functools.partial(fn, **kwargs) if kwargs else fn",
        "return fn",
        T("tests/unit/test_specs.py::test_a_loss_gets_its_keywords_as_a_function_and_as_a_class"),
    ),
    Mutant(
        "env-settings-in-seconds-ignored",
        "every DDP_*_SECONDS variable is skipped: the timeouts run at their defaults, whatever the environment says",
        "app/worker/config/load.py",
        "if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:",
        'if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV or key.endswith("_SECONDS"):',
        T("tests/unit/test_config.py::test_every_setting_arrives_by_each_documented_route"),
    ),
    # Bad input as a late traceback
    Mutant(
        "pipeline-data-check-counts-one-replica",
        "a data set too small for a pipeline with several replicas passes the start-up check (it holds one batch)",
        "app/worker/workload.py",
        'shares = cfg.pipeline_layout(world_size)[1] if cfg.parallel == "pipeline" else world_size',
        'shares = 1 if cfg.parallel == "pipeline" else world_size',
        T("tests/unit/test_workload.py::test_a_pipelines_data_must_hold_one_batch_per_replica"),
    ),
    # Security
    Mutant(
        "token-file-runs-pickled-code",
        "a token file is unpickled in full: a file of unknown origin runs the code it carries on load",
        "app/worker/data_files.py",
        'tokens = torch.load(path, map_location="cpu", weights_only=True)',
        'tokens = torch.load(path, map_location="cpu", weights_only=False)',
        T("tests/unit/test_data_files.py::test_a_token_file_that_would_run_code_on_load_is_refused_without_running_it"),
    ),
    Mutant(
        "checkpoint-runs-pickled-code",
        "a checkpoint is unpickled in full: one holding more than tensors loads (and could run code)",
        "app/worker/checkpoint/files.py",
        'state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)',
        'state = torch.load(path, map_location="cpu", weights_only=False, mmap=mapped)',
        T("tests/unit/test_invariants.py::test_every_torch_load_loads_weights_only"),
    ),
    # Misleading signals
    Mutant(
        "zero1-optimizer-state-gauge-reads-zero",
        "ddp_zero_optimizer_state_bytes reads 0 under zero1 (the wrapper's own, empty, state is counted)",
        "app/worker/steps/zero.py",
        "tensor_bytes(p.grad for p in params), optimizer_state_bytes(self.optimizer.optim)",
        "tensor_bytes(p.grad for p in params), optimizer_state_bytes(self.optimizer)",
        T("tests/integration/test_train_sharded.py::test_zero1_and_zero3_memory_gauges_read_what_each_rank_holds"),
    ),
    Mutant(
        "zero3-parameter-gauge-counts-the-model",
        "ddp_zero_parameter_bytes under zero3 counts the bare model, not the 1/N shards the rank keeps",
        "app/worker/steps/zero.py",
        "return tensor_bytes(shards), tensor_bytes(s.grad for s in shards), optimizer_state_bytes(self.optimizer)",
        "return tensor_bytes(self.model.parameters()), tensor_bytes(s.grad for s in shards), "
        "optimizer_state_bytes(self.optimizer)",
        T("tests/integration/test_train_sharded.py::test_zero1_and_zero3_memory_gauges_read_what_each_rank_holds"),
    ),
    Mutant(
        "world-below-minimum-pages-at-the-minimum",
        "DDPWorldBelowMinimum pages for a job running exactly its minimum number of workers",
        "docker/prometheus/alerts.yml",
        "            < on() max(last_over_time(ddp_min_world_size[10m]))",
        "            <= on() max(last_over_time(ddp_min_world_size[10m]))",
        T("tests/unit/test_alerts.py"),
    ),
    Mutant(
        "max-workers-make-and-compose-differ",
        "make up accepts WORKERS up to another maximum than compose.yaml's world (--nnodes=1:MAX_WORKERS)",
        "Makefile",
        "MAX_WORKERS ?= 8 ",
        "MAX_WORKERS ?= 6 ",
        T("tests/unit/test_alerts.py"),
    ),
    # Jobs ending wrongly
    Mutant(
        "job-state-full-volume-crashes-the-launcher",
        "a read-only or full LAUNCH_STATE_DIR volume ends the launcher with a traceback instead of a warning",
        "app/cluster/job_state.py",
        "except OSError as e:  # a read-only or full volume",
        "except PermissionError as e:  # a read-only or full volume",
        T("tests/unit/test_job_state.py"),
    ),
    Mutant(
        "k8s-grace-shorter-than-the-stop",
        "the pod's grace period is shorter than the trainer's stop: an evicted pod is killed before it checkpoints",
        "k8s/base/job.yaml",
        "terminationGracePeriodSeconds: 60",
        "terminationGracePeriodSeconds: 15",
        T("tests/unit/test_invariants.py::test_kubernetes_waits_longer_than_the_trainers_stop"),
    ),
    Mutant(
        "compose-grace-shorter-than-the-stop",
        "Docker's stop_grace_period is shorter than the trainer's stop: a stopped container is killed mid-checkpoint",
        "compose.yaml",
        "stop_grace_period: 30s",
        "stop_grace_period: 20s",
        T("tests/unit/test_invariants.py::test_docker_waits_longer_than_the_trainers_stop"),
    ),
    # -- issue 38, the modules' docstrings walked: promises no issue had named --------------------------------------
    Mutant(
        "join-accepts-skip-all-reduce-unused-params",
        "join() takes a DDP with skip_all_reduce_unused_params, whose skipped buckets a joined rank cannot tell: a "
        "hang instead of the documented one-line refusal",
        "app/parallel/ddp/join.py",
        '"skip_all_reduce_unused_params": ddp.skip_all_reduce_unused_params,',
        '"skip_all_reduce_unused_params": False,',
        T(
            "tests/integration/test_ddp_join.py::"
            "test_join_refuses_what_it_cannot_shadow_in_one_line[skip_all_reduce_unused_params]"
        ),
    ),
    Mutant(
        "join-disabled-still-refuses",
        "join(enable=False) refuses a comm hook or static_graph although it shadows nothing",
        "app/parallel/ddp/join.py",
        "if enable and refused:",
        "if refused:",
        T("tests/integration/test_ddp_join.py::test_join_refuses_what_it_cannot_shadow_in_one_line[hook]"),
    ),
    Mutant(
        "ddp-skip-unused-flags-still-all-reduced",
        "skip_all_reduce_unused_params=True still all-reduces the used flags every step",
        "app/parallel/ddp/reducer.py",
        "if not self.skip_all_reduce_unused_params:",
        "if True:",
        T(
            "tests/integration/test_ddp_api.py::"
            "test_skip_all_reduce_unused_params_skips_what_it_says_and_trains_as_pytorchs[skipped]"
        ),
    ),
    Mutant(
        "ddp-skip-unused-buckets-still-reduced",
        "skip_all_reduce_unused_params=True still all-reduces buckets that hold only unused parameters",
        "app/parallel/ddp/reducer.py",
        "if self.skip_all_reduce_unused_params and unused and set(bucket.param_indices) <= set(unused):",
        "if False:",
        T(
            "tests/integration/test_ddp_api.py::"
            "test_skip_all_reduce_unused_params_skips_what_it_says_and_trains_as_pytorchs[skipped]"
        ),
    ),
    Mutant(
        "zero1-closure-loss-dropped",
        "ZeroRedundancyOptimizer.step(closure) runs the closure but returns None, not its loss",
        "app/parallel/zero/stage1.py",
        "loss = closure()",
        "closure()",
        T("tests/integration/test_zero.py::test_zero1_steps_with_a_closure_and_with_more_ranks_than_parameters"),
    ),
    Mutant(
        "progress-no-line-at-the-last-step",
        "rank 0 logs no progress line for the last step when it is not a multiple of log_every",
        "app/worker/progress.py",
        "if not (i == self.first_step or i % self.log_every == 0 or i == self.steps):",
        "if not (i == self.first_step or i % self.log_every == 0):",
        T("tests/unit/test_progress.py"),
    ),
    Mutant(
        "progress-no-line-at-the-first-step",
        "rank 0 logs no progress line for the first step of a run (or of a resume)",
        "app/worker/progress.py",
        "if not (i == self.first_step or i % self.log_every == 0 or i == self.steps):",
        "if not (i % self.log_every == 0 or i == self.steps):",
        T("tests/unit/test_progress.py"),
    ),
    Mutant(
        "data-every-epoch-the-same-order",
        "every epoch deals the samples out in the first epoch's order (and drops the same tail every time)",
        "app/worker/data.py",
        "gen = torch.Generator().manual_seed(self.seed + epoch)",
        "gen = torch.Generator().manual_seed(self.seed)",
        T("tests/unit/test_data.py::test_an_epochs_short_tail_is_skipped_and_each_epoch_is_its_own_permutation"),
    ),
    Mutant(
        "data-short-tail-trained",
        "an epoch's tail shorter than one global batch is trained as a short step instead of skipped (drop_last)",
        "app/worker/data.py",
        "if self.consumed + self.global_batch > len(self._order):",
        "if self.consumed >= len(self._order):",
        T("tests/unit/test_data.py::test_an_epochs_short_tail_is_skipped_and_each_epoch_is_its_own_permutation"),
    ),
    Mutant(
        "net-wait-tripled",
        "wait_for_tcp (the launchers' wait for a store or a peer) waits three times the timeout it was given",
        "app/net.py",
        "deadline = time.monotonic() + timeout_s",
        "deadline = time.monotonic() + 3 * timeout_s",
        T("tests/unit/test_net.py"),
    ),
    Mutant(
        "net-unresolved-name-is-a-crash",
        "a name that does not resolve yet (a container still starting) ends the wait with a socket.gaierror",
        "app/net.py",
        "    except OSError as e:\n        return e.strerror or type(e).__name__",
        "    except ConnectionRefusedError as e:\n        return e.strerror or type(e).__name__",
        T("tests/unit/test_net.py"),
    ),
    Mutant(
        "net-wait-returns-at-once",
        "wait_for_tcp returns before anything listens: the launcher dials a store that is not there yet",
        "app/net.py",
        "        if why is None:\n            return",
        "        if True:\n            return",
        T("tests/unit/test_net.py"),
    ),
    Mutant(
        "cli-quiet-ignored",
        "every rank logs INFO, not only rank 0: N copies of every progress line in a cluster's logs",
        "app/cli.py",
        "level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO",
        "level = logging.DEBUG if debug else logging.INFO",
        T("tests/unit/test_cli.py"),
    ),
    Mutant(
        "cli-debug-still-filtered",
        "LOGLEVEL=DEBUG still cuts torch's reports to one line: the debugging run hides what it was asked to show",
        "app/cli.py",
        "if line_filter is not None and not debug:",
        "if line_filter is not None:",
        T("tests/unit/test_cli.py"),
    ),
    Mutant(
        "cli-routed-logger-printed-twice",
        "torch's own loggers print through their handler and ours: every such line twice, in two formats",
        "app/cli.py",
        "routed.handlers, routed.propagate = [handler], False",
        "routed.propagate = True",
        T("tests/unit/test_cli.py"),
    ),
    Mutant(
        "zero1-loaded-state-left-unplaced",
        "ZeRO-1 keeps a loaded state's tensors as they came: another dtype stays, and steps write into the caller's "
        "dict (the generated sample's survivor 23115c16eb)",
        "app/parallel/zero/stage1.py",
        "    if not isinstance(value, torch.Tensor):",
        "    if not not isinstance(value, torch.Tensor):",
        T("tests/integration/test_zero.py::test_zero1_loads_a_float64_state_into_float32_parameters_as_its_own_copy"),
    ),
    Mutant(
        "reformation-gauge-set-every-step",
        "after a resume, ddp_reformation_seconds is set at every step but the first: it ends as checkpoint-to-last-"
        "step, not the re-formation's cost (the generated sample's survivor 940176538b)",
        "app/worker/trainer.py",
        "if self.resumed and self.resumed.wall_time and not self.progress.all:",
        "if self.resumed and self.resumed.wall_time and self.progress.all:",
        T("tests/integration/test_metrics.py::test_a_resumed_world_counts_its_generation_and_the_steps_it_redoes"),
    ),
]


def count(m: Mutant, root: Path = REPO) -> int:
    """How often the mutant's snippet occurs in its file (1 = applicable)."""
    path = root / m.path
    return path.read_text().count(m.find) if path.is_file() else 0


def copy_tree(dst: Path) -> None:
    """Copy tracked and untracked-but-not-ignored files (what a clone plus the work in progress would have)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():  # deleted in the work tree but still in the index
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel, follow_symlinks=False)  # k8s/*.yaml are links (tests/unit/test_k8s.py)
    # A repository of its own, files indexed, no commit: tests that ask git what is tracked (the README's layout
    # table, tests/unit/test_docs.py) see the same files here as in the checkout, not a failure before any mutant.
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        subprocess.run(cmd, cwd=dst, capture_output=True, check=True)


def env_for(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}
    env.update(PYTHONPATH=str(copy), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)  # a missing tool should skip here, not fail the selection for an unrelated reason
    return env


def module_of(path: str) -> str | None:
    return path[:-3].replace("/", ".") if path.endswith(".py") and path.startswith("app/") else None


def check_imports_from_copy(copy: Path, path: str, timeout: float = 600) -> None:
    """The package is installed editable from the checkout: make sure the copy's module is the one imported. The
    import takes seconds, but minutes on a shared machine at load 30 (a 120 s limit once ended a whole run)."""
    module = module_of(path)
    if module is None:
        return
    code = f"import {module} as m; print(m.__file__)"
    out = subprocess.run(
        [PYTHON, "-c", code], cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=timeout
    )
    where = out.stdout.strip()
    if out.returncode != 0 or not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutants: {module} is imported from {where or out.stderr.strip()[-300:]}, not from {copy}")


def run_tests(
    copy: Path, tests: tuple[str, ...], timeout: float, extra: tuple[str, ...] = ("-x",)
) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout' | 'error', seconds, the output's tail)."""
    cmd = [PYTHON, "-m", "pytest", *extra, "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", time.monotonic() - started, out[-1500:]
    took = time.monotonic() - started
    outcome = {0: "passed", 1: "failed"}.get(r.returncode, "error")
    return outcome, took, (r.stdout + r.stderr)[-1500:]


def baseline_failures(copy: Path, selection: tuple[str, ...], timeout: float) -> tuple[set[str], float]:
    """The tests of ``selection`` that fail with no mutant planted ("file::name"), and the seconds it took."""
    report = copy / ".mutants-baseline.xml"
    _, took, tail = run_tests(copy, selection, timeout, extra=(f"--junitxml={report}",))
    if not report.exists():
        raise SystemExit(f"mutants: the unmutated tests did not run:\n{tail}")
    failed = set()
    for case in ET.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            file = case.get("classname", "").replace(".", "/") + ".py"
            failed.add(f"{file}::{case.get('name', '').split('[')[0]}")
    return failed, took


def selects(test: str, failed: str) -> bool:
    """Whether pytest argument ``test`` (a file or a node id) selects the failed test ``failed``."""
    return failed == test.split("[")[0] or failed.startswith(test.rstrip("/") + "::")


def run_mutant(copy: Path, m: Mutant, timeout: float) -> dict:
    target = copy / m.path
    found = count(m, copy)
    row = {**asdict(m), "tests": list(m.tests)}
    if found != 1:
        return {**row, "outcome": "stale", "detail": f"snippet found {found}× in {m.path} (must be exactly once)"}
    original = target.read_text()
    target.write_text(original.replace(m.find, m.replace))
    try:
        check_imports_from_copy(copy, m.path, timeout)
        result, took, tail = run_tests(copy, m.tests, timeout)
    finally:
        target.write_text(original)
    outcome = {"failed": "caught", "timeout": "caught (timeout)", "passed": "survived"}.get(result, "error")
    return {**row, "outcome": outcome, "seconds": round(took, 1), "detail": tail if outcome != "caught" else ""}


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the selected tests unmutated first")
    p.add_argument("--list", action="store_true", help="list the mutants and whether each applies, run nothing")
    p.add_argument("--out", type=Path, default=None, help="JSON to write (default: bench/results/ for all mutants)")
    args = p.parse_args(argv)
    names = {m.name for m in MUTANTS}
    unknown = [n for n in args.only.split(",") if n and n not in names]
    if unknown:
        p.error(f"--only: no mutant named {', '.join(unknown)} (see --list)")
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            found = count(m)
            state = "ok" if found == 1 else f"STALE (found {found}×)"
            print(f"{m.name:<52} {state:<18} {m.path}: {m.what}")
        return 0
    out_path = output_path(parser, args, "mutants")
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copied_at = git_commit()  # the commit (and uncommitted work) the mutants ran on, not HEAD at the end
        copy_tree(copy)
        broken: set[str] = set()
        if not args.skip_baseline:
            selection = tuple(dict.fromkeys(t for m in chosen if count(m, copy) == 1 for t in m.tests))
            broken, took = baseline_failures(copy, selection, args.timeout * 3)
            print(
                f"baseline (unmutated, {len(selection)} selections): {len(broken)} failing in {took:.0f}s", flush=True
            )
            for name in sorted(broken):
                print(f"  fails unmutated: {name}", flush=True)
        rows = []
        for i, m in enumerate(chosen, 1):
            spoilt = sorted(f for f in broken for t in m.tests if selects(t, f))
            if spoilt:  # a test that fails anyway would "catch" the mutant: no verdict
                row = {**asdict(m), "tests": list(m.tests), "outcome": "baseline fails", "detail": ", ".join(spoilt)}
            else:
                row = run_mutant(copy, m, args.timeout)
            rows.append(row)
            print(
                f"[{i:>2}/{len(chosen)}] {row['outcome']:<17} {m.name:<52} {row.get('seconds', 0):>5.0f}s", flush=True
            )
    caught = sum(r["outcome"].startswith("caught") for r in rows)
    doc = {
        "schema": "mutants.v1",
        **provenance(args, load_before),
        **copied_at,
        "score": f"{caught}/{len(rows)}",
        "caught": caught,
        "total": len(rows),
        "mutants": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        if not r["outcome"].startswith("caught"):
            print(f"\n{r['outcome'].upper()}: {r['name']} ({r['path']}): {r['what']}\n{r['detail']}")
    print(f"\nscore: {caught}/{len(rows)} mutants caught")
    print(describe_output(out_path))
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
