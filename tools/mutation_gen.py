"""The generated mutants of ``make mutants`` (``tools/mutation.py``): where they come from, which tests each runs,
how a run's sample is drawn, and the stable id a triage judgement is keyed by.

Python mutants are cosmic-ray's (its core operators: arithmetic, comparison, unary and boolean operators, numbers,
``break``/``continue``, ``except`` clauses, decorators, loops run zero times), enumerated over the files of ``AREAS``.
The alert rules are PromQL inside YAML, which no mutation library parses: ``alert_candidates`` mutates them with a
small operator set of its own (comparisons, set operators, numbers, range and ``for:`` durations).

A mutant's id is a hash of what it changes (operator, enclosing definition or alert, the line's text, and which of
the identical changes in that file it is), never of a line number or a file name, so that code moving inside a file
or to another file (the DDP split, the config package) keeps its triage judgements.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

# What is mutated, and the tests each file's mutants run. First matching rule wins; globs match across folders
# ("app/worker/config*" is config.py and a config/ package alike), and test globs are expanded in the copy at run
# time, so files split or renamed by a reorganisation still find their rule and their tests. Unit tests first:
# with -x the first failure ends the run, and a unit test fails in a second where a gloo test takes ten. A "-k"
# leaves out the slowest tests of a file (forced-stop and hang timeouts, GPU-only, a real Prometheus): a survivor
# runs its whole selection, and on 2 shared cores that has to stay within minutes.
SLOW = "not (stop_that_cannot_finish or hung_peer or tiny_transformer or two_plain_runs or torchrun_reaches)"
AREAS: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    (
        ("app/worker/checkpoint*",),
        (
            "tests/unit/test_checkpoint*.py",
            "tests/unit/test_weights*.py",  # weights.py: init_from and the export's reader
            "tests/integration/test_resume*.py",
            # the sharded resume (Checkpointer._resume_sharded): a ZeRO run resumed on another world size
            "tests/integration/test_train_sharded*.py::test_zero2_resumes_on_another_world_size_where_it_stopped",
            # ... and its damaged newest checkpoint set aside (Checkpointer._load_sharded's DamagedCheckpoint)
            "tests/integration/test_train_sharded*.py::"
            "test_a_damaged_newest_sharded_checkpoint_falls_back_to_the_one_before_and_ends_as_if_uninterrupted",
            # ... and a sharded save the disk refuses (Checkpointer._save_sharded's one line, exit 74)
            "tests/integration/test_train_sharded*.py::"
            "test_a_save_the_disk_refuses_ends_every_zero_rank_in_one_line_with_exit_74",
        ),
    ),
    (("app/checkpoint_dir*",), ("tests/unit/test_checkpoint_dir*.py", "tests/unit/test_launch*.py")),
    (
        ("app/worker/config*",),
        (
            "tests/unit/test_config*.py",
            "tests/unit/test_launch_config*.py",  # config/launch.py: the launchers' LAUNCH_* settings
            "tests/unit/test_docs*.py::test_config_table_is_generated_from_train_config",  # the documented defaults
            "tests/integration/test_train_pipeline*.py::test_bad_input_is_one_line_and_exit_2",  # the pipeline checks
        ),
    ),
    (("app/worker/data_files*",), ("tests/unit/test_data_files*.py", "tests/unit/test_workload*.py")),
    (("app/worker/data*",), ("tests/unit/test_data*.py",)),
    (
        ("app/worker/workload*",),
        (
            "tests/unit/test_workload*.py",
            "tests/unit/test_data_files*.py",
            "tests/unit/test_activation_checkpointing*.py",  # checkpointed_units: which modules a setting names
        ),
    ),
    (
        ("app/worker/models*",),
        (
            "tests/unit/test_specs*.py",
            "tests/unit/test_user_model*.py",
            "tests/unit/test_data.py",
            "tests/unit/test_workload*.py::test_the_benchmark_models_are_the_sizes_the_benchmark_docs_give",
        ),
    ),
    (
        ("app/worker/metrics*",),
        (
            "tests/unit/test_metrics*.py",
            "tests/integration/test_metrics*.py",
            "-k",
            "not real_prometheus",
        ),
    ),
    (("app/worker/steps/pipeline*",), ("tests/integration/test_train_pipeline*.py",)),
    (
        ("app/worker/steps/zero*",),
        ("tests/unit/test_steps*.py", "tests/unit/test_metrics*.py", "tests/integration/test_train_sharded*.py"),
    ),
    (
        ("app/worker/dist*", "app/worker/elastic*"),
        (
            "tests/unit/test_dist*.py",
            "tests/integration/test_world*.py",
            "tests/integration/test_train.py",
            "-k",
            SLOW,
        ),
    ),
    (
        ("app/worker/control*",),
        (
            "tests/unit/test_control*.py",
            "tests/unit/test_invariants*.py::test_a_stop_before_the_config_is_read_is_forced_after_the_documented_default",
            "tests/integration/test_train.py",
            "-k",
            SLOW,
        ),
    ),
    (("app/worker/startup*",), ("tests/unit/test_startup*.py", "tests/integration/test_train.py", "-k", SLOW)),
    (("app/worker/throughput_metrics*",), ("tests/integration/test_throughput_metrics*.py",)),
    (("app/worker/steps/data_parallel*",), ("tests/integration/test_data_parallel*.py",)),
    (("app/worker/recipe*",), ("tests/integration/test_recipe*.py",)),
    (
        ("app/worker/progress*",),
        ("tests/unit/test_progress*.py", "tests/integration/test_train.py", "-k", SLOW),
    ),
    (
        ("app/worker/evaluation*",),
        # the held-out split, and the validation loss of real ranks against one process's
        ("tests/unit/test_evaluation*.py", "tests/integration/test_validation*.py"),
    ),
    (
        ("app/worker/trainer*", "app/worker/heal*"),
        (
            "tests/unit/test_steps*.py",
            "tests/integration/test_train.py",
            "tests/integration/test_resume*.py",
            "tests/integration/test_metrics.py::test_a_resumed_world_counts_its_generation_and_the_steps_it_redoes",
            # the loop's heal: a rank killed and healed in place, then a new one let in mid-run
            "tests/integration/test_heal*.py::test_a_killed_rank_is_healed_in_place_and_a_new_one_joins",
            "-k",
            SLOW,
        ),
    ),
    (
        ("app/worker/*",),
        (
            "tests/unit/test_steps*.py",
            "tests/integration/test_train.py",
            "tests/integration/test_resume*.py",
            # the trainer's observations with metrics on (every other run here has them off)
            "tests/integration/test_metrics.py::test_a_resumed_world_counts_its_generation_and_the_steps_it_redoes",
            "-k",
            SLOW,
        ),
    ),
    (
        ("app/parallel/accum*",),
        (
            "tests/unit/test_data*.py",
            "tests/integration/test_accum*.py",
            "tests/integration/test_recipe*.py",  # StepRecipe: autocast, GradScaler, clipping
            "-k",
            "not make_accum_writes",
        ),
    ),
    (("app/parallel/model_parallel*",), ("tests/integration/test_model_parallel*.py",)),
    (
        ("app/parallel/tensor_parallel*",),
        ("tests/integration/test_tensor_parallel*.py",),
    ),
    (
        ("app/parallel/probes*", "app/parallel/ddp/comm_stats*"),
        (
            "tests/unit/test_metrics*.py::test_comm_stats_read_before_any_step_say_nothing_was_sent",
            "tests/integration/test_metrics*.py::test_bus_bandwidth_is_nccl_tests_busbw_over_the_wall_time_span",
            "tests/integration/test_metrics*.py::test_torch_ddp_bus_bandwidth_uses_first_launch_to_last_completion",
            "tests/integration/test_metrics*.py::test_our_ddp_bus_bandwidth_uses_the_wrappers_comm_span",
            "tests/integration/test_ddp_api*.py::test_a_known_delay_before_the_all_reduce_shows_in_the_reported_latency",
        ),
    ),
    (("app/parallel/pipeline*",), ("tests/integration/test_pipeline.py", "tests/integration/test_train_pipeline*.py")),
    # ZeRO and FSDP: their own tests against PyTorch's, not DDP's (which never imports them).
    (
        ("app/parallel/zero/stage3*",),
        (
            "tests/integration/test_fsdp*.py",
            "tests/integration/test_zero_overlap*.py::test_stage3_prefetch_gathers_at_most_its_limit_and_changes_nothing",
        ),
    ),
    (
        ("app/parallel/zero/stage1*", "app/parallel/zero/stage2*"),
        (
            "tests/integration/test_zero.py",
            # the checkpoint reads the shards' layout (FlatShard.pieces) that only a save and a load exercise
            "tests/integration/test_zero_checkpoint*.py",
            # stage 2's parameter all-gathers: how many in flight, and overlap_gather's waits
            "tests/integration/test_zero_overlap*.py::"
            "test_stage2_without_overlap_keeps_at_most_two_gathers_and_their_shard_copies_in_flight",
            "tests/integration/test_zero_overlap*.py::"
            "test_stage2_overlap_defers_each_gather_to_its_layer_and_every_read_waits_for_it",
            "tests/integration/test_zero_overlap*.py::"
            "test_stage2_overlap_waits_for_a_parameter_its_module_never_runs_before_the_parent_reads_it",
            "tests/integration/test_zero_overlap*.py::test_stage2_checkpoint_waits_for_the_gathers_in_flight",
        ),
    ),
    (
        ("app/parallel/zero/checkpoint*", "app/parallel/zero/__init__*"),
        (
            "tests/unit/test_invariants*.py::test_every_torch_load_loads_weights_only",  # a shard runs no pickled code
            "tests/integration/test_zero_checkpoint*.py",
            "tests/integration/test_train_sharded*.py",
        ),
    ),
    # The DDP wrapper's parts with a test file of their own: a mutant of join.py or sparse.py runs what exercises it.
    (("app/parallel/ddp/join*",), ("tests/integration/test_ddp_join*.py",)),
    (("app/parallel/ddp/sparse*",), ("tests/integration/test_ddp_sparse*.py",)),
    (
        ("app/parallel/ddp/comm_hooks*",),
        ("tests/integration/test_ddp_compression*.py", "tests/integration/test_ddp_api*.py", "-k", "not nccl"),
    ),
    (
        ("app/parallel/activation_checkpointing*",),
        ("tests/unit/test_activation_checkpointing*.py", "tests/integration/test_activation_checkpointing*.py"),
    ),
    (
        ("app/parallel/compile*",),
        ("tests/unit/test_compile*.py", "tests/integration/test_ddp_compile*.py"),  # which units, and compiled
    ),
    (
        ("app/parallel/ddp/module*",),
        (
            "tests/integration/test_ddp.py",
            "tests/integration/test_ddp_api*.py",
            "tests/integration/test_ddp_buffers*.py",
            # the Joinable protocol torch's Join reads (join_device, join_process_group, join_hook), and forward's
            # notices to the ranks that joined (uneven inputs: the first case, two ranks)
            "tests/integration/test_ddp_join*.py::test_a_second_join_context_divides_by_its_own_rule",
            "tests/integration/test_ddp_join*.py::test_uneven_inputs_train_as_with_pytorchs_join[world2]",
            "-k",
            "not (nccl or gpu_check or known_delay or powersgd)",
        ),
    ),
    (
        ("app/parallel/ddp/reducer*", "app/parallel/ddp/buckets*"),
        (
            "tests/integration/test_ddp.py",
            "tests/integration/test_ddp_api*.py",
            "tests/integration/test_ddp_buffers*.py",
            # where a gradient lives (a bucket slot lent as p.grad, _plan_lending): only these tests look
            "tests/integration/test_ddp_grad_slots*.py",
            # the divisor join() sets (Reducer.set_divisor) and the collectives a joined rank shadows
            "tests/integration/test_ddp_join*.py::test_a_second_join_context_divides_by_its_own_rule",
            "tests/integration/test_ddp_join*.py::test_uneven_inputs_train_as_with_pytorchs_join[world2]",
            # the hooks hold the reducer weakly and go with it (Reducer.__init__'s finalizer)
            "tests/integration/test_ddp_sparse*.py::test_a_dropped_wrapper_frees_its_reducer_and_leaves_the_module_alone",
            "-k",
            "not (nccl or gpu_check or known_delay or powersgd)",
        ),
    ),
    (
        ("app/parallel/*",),
        (
            "tests/integration/test_ddp.py",
            "tests/integration/test_ddp_api*.py",
            "tests/integration/test_ddp_buffers*.py",
            "-k",
            "not (nccl or gpu_check or known_delay or powersgd)",
        ),
    ),
    (("app/cluster/k8s_launch*",), ("tests/unit/test_k8s_launch*.py", "tests/integration/test_k8s_launch*.py")),
    (
        ("app/cluster/rendezvous_store*",),
        (
            "tests/unit/test_rendezvous_store*.py",
            "tests/integration/test_rendezvous_store*.py",
        ),
    ),
    (("app/cluster/memory*",), ("tests/unit/test_memory*.py", "tests/unit/test_launch*.py")),
    (("app/cluster/compose_env*",), ("tests/unit/test_compose_env*.py", "tests/unit/test_xdist_groups*.py")),
    (
        # the launcher's heal=in_place path: a container that comes to a live world runs its trainer as a newcomer
        # (newcomer.py) and launch() ends with that container's code, which only a launcher against real ranks shows
        ("app/cluster/launch*", "app/cluster/newcomer*"),
        (
            "tests/unit/test_first_world*.py",
            "tests/unit/test_launch*.py",
            "tests/unit/test_job_state*.py",
            "tests/integration/test_launch*.py",
            "tests/integration/test_heal*.py::test_a_launcher_that_comes_to_a_live_world_joins_it_as_a_newcomer",
        ),
    ),
    (
        ("app/cluster/*",),
        (
            "tests/unit/test_first_world*.py",  # app/cluster/elastic.py's hold for a full first world
            "tests/unit/test_launch*.py",
            "tests/unit/test_job_state*.py",
            "tests/integration/test_launch*.py",
        ),
    ),
    (
        ("docker/prometheus/alerts.yml",),
        ("promtool test rules docker/prometheus/alerts.test.yml", "tests/unit/test_alerts*.py"),
    ),
]
MUTATED = ("app/worker/**.py", "app/parallel/**.py", "app/cluster/**.py", "docker/prometheus/alerts.yml")
# VariableReplacer/VariableInserter need settings per project; without them cosmic-ray's own `init` skips them too.
SKIPPED_OPERATORS = {"core/VariableReplacer", "core/VariableInserter"}
# cosmic-ray's ExceptionReplacer names an exception class that only its own worker defines; a fresh class that
# nothing raises is the same mutant ("this except clause catches nothing") in code that runs without cosmic-ray.
CR_EXCEPTION = "CosmicRayTestingException"
NOTHING_RAISES = 'type("NeverRaised", (Exception,), {})'


@dataclass
class Candidate:
    id: str  # stable: see the module docstring
    path: str  # relative to the repository root
    line: int  # 1-based, where the change starts (for reading; not part of the id)
    operator: str  # cosmic-ray's operator name, or alerts/<name>
    where: str  # the enclosing function/class, or the alert's name
    before: str  # the line as it is (stripped)
    after: str = ""  # the line as mutated (stripped); Python mutants get it when applied
    occurrence: int = -1  # cosmic-ray's index of this operator's position in the file
    site: str = field(default="", repr=False)  # mutants at one site are variants of one change; one is drawn

    def tests(self) -> tuple[str, ...]:
        return selection_for(self.path)


def change_key(operator: str, where: str, before: str) -> str:
    """What a mutant's id is a hash of, besides its area: the change, the definition it sits in and the line."""
    return f"{operator}|{where}|{before}"


def stable_id(path: str, key: str, seen: dict[str, int]) -> str:
    """A short hash of ``key``; the n-th identical key of one area gets its own id (a ``#n`` suffix, hashed)."""
    # The area (app/parallel, app/worker, ...), not the file: an id survives a file split in two.
    key = "/".join(path.split("/")[:2]) + "|" + key
    n = seen.get(key, 0)
    seen[key] = n + 1
    return hashlib.sha1(f"{key}|#{n}".encode()).hexdigest()[:10]


REPO = Path(__file__).resolve().parents[1]


def selection_for(path: str, root: Path = REPO) -> tuple[str, ...]:
    """The test selection (pytest arguments, globs; or one promtool command) for a mutated file: its area's rule
    (the first that matches) with the file's own tests added, unit ones first (``own_tests``)."""
    rule = next((tests for files, tests in AREAS if any(fnmatch.fnmatch(path, f) for f in files)), None)
    if rule is None:
        raise KeyError(f"{path}: no rule in tools/mutation_gen.py AREAS names its tests")
    tests: tuple[str, ...] = rule
    if not path.endswith(".py"):
        return tests
    k = tests.index("-k") if "-k" in tests else len(tests)
    unit, integration = own_tests(path, root)
    return tuple(dict.fromkeys((*unit, *tests[:k], *integration))) + tests[k:]


def own_tests(path: str, root: Path = REPO) -> tuple[list[str], list[str]]:
    """A file's own tests, whatever its area's rule says: a held-out sample's survivors were mostly mutants of a
    file that fell under a folder's catch-all, whose selection left out the test file named after the module or the
    unit test that imports it. Unit: tests/unit/test_<name>.py and test_<name>_*.py, and every unit test file that
    imports the module; integration: tests/integration/test_<name>.py only (test_ddp_*.py is a dozen gloo files a
    survivor would run whole). <name> is the package's for an __init__.py."""
    p = Path(path)
    name = p.parent.name if p.stem == "__init__" else p.stem
    module = ".".join(p.with_suffix("").parts[:-1] if p.stem == "__init__" else p.with_suffix("").parts)
    imports = re.compile(rf"\b{re.escape(module)}\b|from {re.escape(module.rpartition('.')[0])} import .*\b{p.stem}\b")
    unit = [f"tests/unit/test_{name}.py", f"tests/unit/test_{name}_*.py"]
    if p.stem != "__init__":
        unit += [test for test, text in _unit_test_texts(root) if imports.search(text)]
    return list(dict.fromkeys(unit)), [f"tests/integration/test_{name}.py"]


@functools.lru_cache(maxsize=4)
def _unit_test_texts(root: Path) -> tuple[tuple[str, str], ...]:
    """Every unit test file under ``root`` and its text, read once a run (``own_tests`` asks for every mutant)."""
    return tuple((str(t.relative_to(root)), t.read_text()) for t in sorted((root / "tests/unit").glob("test_*.py")))


def expand(tests: tuple[str, ...], root: Path) -> list[str]:
    """Test globs as files that exist under ``root`` (a glob that matches nothing is dropped, not an error); a
    ``-k EXPR`` pair is passed on as it is."""
    files: list[str] = []
    for t in tests:
        if t.startswith("-") or (files and files[-1] == "-k"):
            files.append(t)
        elif "*" in t:  # a glob of files, or of one test in them ("tests/x/test_y*.py::test_z")
            pattern, sep, name = t.partition("::")
            files += sorted(str(p.relative_to(root)) + sep + name for p in root.glob(pattern))
        elif (root / t.partition("::")[0]).exists():  # a file, or a test in it
            files.append(t)
    return list(dict.fromkeys(files))


def mutated_files(root: Path) -> list[str]:
    files = {str(p.relative_to(root)) for g in MUTATED for p in root.glob(g.replace("**.py", "**/*.py"))}
    return sorted(f for f in files if not f.endswith("__init__.py") or (root / f).stat().st_size > 400)


def _family(operator: str) -> str:
    """ReplaceBinaryOperator_Add_Sub -> ReplaceBinaryOperator_Add: the variants of one change at one site."""
    return operator.rsplit("_", 1)[0] if operator.count("_") >= 2 else operator


def _in_annotation(node) -> bool:
    """Whether a parso node sits in a type annotation (never evaluated under ``from __future__ import annotations``:
    mutating it is equivalent by construction)."""
    while node.parent is not None:
        parent, prev = node.parent, node.get_previous_sibling()
        value = getattr(prev, "value", None)
        if (parent.type in ("annassign", "param", "tfpdef") and value == ":") or value == "->":
            return True
        node = parent
    return False


def python_candidates(root: Path, rel: str, seen: dict[str, int]) -> list[Candidate]:
    """Every cosmic-ray mutant of one file, less the ones that cannot change behaviour (annotations, lines marked
    ``# pragma: no mutate``)."""
    from cosmic_ray.ast import ast_nodes, get_ast
    from cosmic_ray.ast.ast_query import ASTQuery
    from cosmic_ray.plugins import get_operator, operator_names

    source = (root / rel).read_text()
    lines = source.splitlines()
    nodes = list(ast_nodes(get_ast(source)))
    future = "from __future__ import annotations" in source
    out = []
    for name in operator_names():
        if name in SKIPPED_OPERATORS:
            continue
        op = get_operator(name)()
        occurrence = -1
        for node in nodes:
            for start, end in op.mutation_positions(node):
                occurrence += 1  # counted over every position, as cosmic-ray's MutationVisitor counts them
                text = lines[start[0] - 1].strip()
                if "pragma: no mutate" in text or (future and _in_annotation(node)):
                    continue
                where = ASTQuery(node).get_definition_name() or "<module>"
                key = change_key(name, where, text)
                site = f"{rel}|{start}|{end}|{_family(name)}"
                out.append(Candidate(stable_id(rel, key, seen), rel, start[0], name, where, text, "", occurrence, site))
    return out


def apply_python(c: Candidate, source: str) -> str | None:
    """The source with mutant ``c`` applied (``c.after`` filled in), or None when cosmic-ray finds no such position
    or cannot make the change there."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    try:
        mutated = mutate_code(source, get_operator(c.operator)(), c.occurrence)
    except AttributeError:  # ExceptionReplacer on a dotted class (`except (dist.DistError, ...)`): it cannot rename it
        return None
    if mutated is None:
        return None
    mutated = mutated.replace(CR_EXCEPTION, NOTHING_RAISES)
    old, new = source.splitlines(), mutated.splitlines()
    i = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    c.after = new[i].strip() if i < len(new) and len(new) == len(old) else "(line removed)"
    return mutated


# -- the alert rules: a small operator set of our own --------------------------------------------------------------
_CMP = {"==": ("!=",), "!=": ("==",), "<": ("<=", ">"), "<=": ("<",), ">": (">=", "<"), ">=": (">", "<")}
_SETOP = {"and": ("or", "unless"), "or": ("and",), "unless": ("and",)}
_TOKENS = re.compile(r"(==|!=|<=|>=|<|>)|\b(and|or|unless)\b|\[(\d+)([smhd])\]|(?<![\w.\[])(\d+)(?![\w.\]])")


def _alert_variants(text: str):
    """(operator, mutated line) for each mutation of one PromQL line."""
    for m in _TOKENS.finditer(text):
        head, tail = text[: m.start()], text[m.end() :]
        if m[1]:
            for r in _CMP[m[1]]:
                yield f"alerts/cmp {m[1]}->{r}", head + r + tail
        elif m[2]:
            for r in _SETOP[m[2]]:
                yield f"alerts/setop {m[2]}->{r}", head + r + tail
        elif m[3]:
            n = int(m[3])
            for r in sorted({n * 2, max(1, n // 2)} - {n}):
                yield f"alerts/range [{n}{m[4]}]->[{r}{m[4]}]", head + f"[{r}{m[4]}]" + tail
        else:
            n = int(m[5])
            for r in (n + 1, n - 1):
                yield f"alerts/number {n}->{r}", head + str(r) + tail


def alert_candidates(root: Path, rel: str, seen: dict[str, int]) -> list[Candidate]:
    """Mutants of the rules' ``expr:`` (one line or a ``|`` block) and ``for:`` lines."""
    lines = (root / rel).read_text().splitlines()
    out, alert, in_expr = [], "", False
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("- alert:"):
            alert, in_expr = s.split(":", 1)[1].strip(), False
            continue
        if in_expr and (s.startswith("#") or not s or re.match(r"^[a-z_]+:", s)):
            in_expr = False
        variants: list[tuple[str, str]] = []
        if s.startswith("expr:"):
            in_expr = s.endswith("|")
            variants = [(op, line.replace(s, "expr: " + v.strip(), 1)) for op, v in _alert_variants(s[5:])]
        elif in_expr:
            variants = list(_alert_variants(line))
        elif alert and (m := re.match(r"^(\s*)for: (\d+)([smh])$", line)):
            n = int(m[2])
            variants = [(f"alerts/for {n}{m[3]}->{r}{m[3]}", f"{m[1]}for: {r}{m[3]}") for r in (n * 2, max(1, n // 2))]
            variants.append((f"alerts/for {n}{m[3]}->none", f"{m[1]}for: 0s"))
        for op, new in variants:
            if new == line:
                continue
            key = change_key(op, alert, s)
            out.append(Candidate(stable_id(rel, key, seen), rel, i, op, alert, s, new.strip(), site=f"{rel}|{i}|{op}"))
    return out


def apply_alert(c: Candidate, source: str) -> str | None:
    lines = source.splitlines(keepends=True)
    line = lines[c.line - 1]
    if line.strip() != c.before:
        return None
    indent = line[: len(line) - len(line.lstrip())]
    lines[c.line - 1] = indent + c.after + "\n"
    return "".join(lines)


def all_candidates(root: Path) -> list[Candidate]:
    out: list[Candidate] = []
    seen: dict[str, int] = {}  # over all files: two files of one area never share an id
    for rel in mutated_files(root):
        out += (alert_candidates if rel.endswith(".yml") else python_candidates)(root, rel, seen)
    return out


def draw(candidates: list[Candidate], n: int, seed: int) -> list[Candidate]:
    """A seeded sample of ``n`` mutants: sites first (one place, one kind of change), then one variant per site,
    so that an ``a + b`` with ten operator replacements weighs as much as one ``if a < b`` or one number."""
    rng = random.Random(seed)
    sites: dict[str, list[Candidate]] = {}
    for c in sorted(candidates, key=lambda c: (c.site, c.id)):  # the order of the input must not matter
        sites.setdefault(c.site, []).append(c)
    chosen = rng.sample(sorted(sites), min(n, len(sites)))
    # In the order drawn: a run cut short by --budget has run a smaller random sample, not the first files only.
    return [rng.choice(sites[s]) for s in chosen]
