"""What is generated from ``TrainConfig``'s fields: docs/training.md's configuration table and compose.yaml's list of
the workers' ``DDP_*`` variables, and their writer.

    python -m tools.config_table            # rewrite both, between their markers
    make docs-config                        # the same

``tests/unit/test_docs.py`` fails when the docs hold another table, and ``tests/unit/test_cluster_settings.py`` when
compose.yaml names other variables, so a field added to ``app/worker/config/schema.py`` cannot be missing from the
docs, nor be dropped by a plain ``docker compose up``.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

from app.worker.config import TrainConfig, env_name, flag_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training.md"
BEGIN, END = "<!-- config-table:begin -->", "<!-- config-table:end -->"
COMPOSE = ROOT / "compose.yaml"
COMPOSE_BEGIN = "      # -- settings:begin (make docs-config writes this list from TrainConfig) --\n"
COMPOSE_END = "      # -- settings:end --\n"


def config_table_markdown() -> str:
    """The configuration table of docs/training.md, one row per ``TrainConfig`` field, from the fields themselves.

    ``make docs-config`` writes it into the docs (``write_table``); the test of the docs compares it with theirs,
    so a field added to TrainConfig cannot be missing there.

    Example::

        >>> print(config_table_markdown().splitlines()[2])
        | `model` | `DDP_MODEL` | `--model` | `mini_mlp` | model to train: mini_mlp \\| tiny_transformer |
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a bare | would end the Markdown cell

    rows = ["| field | env | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in fields(TrainConfig):
        value = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        default = "unset" if value is None else f"`{value!r}`" if value == "" else f"`{value}`"
        rows.append(
            f"| `{f.name}` | `{env_name(f.name)}` | `{flag_name(f.name)}` | {default} | {cell(f.metadata['doc'])} |"
        )
    return "\n".join(rows) + "\n"


def compose_settings_yaml() -> str:
    """compose.yaml's worker ``environment:`` entries, one ``DDP_<FIELD>:`` per ``TrainConfig`` field, in field order.

    An entry with no value passes the caller's variable through when it is set and leaves it out when it is not,
    so a plain ``DDP_STEPS=400 docker compose up`` reaches the workers and an unset one means "not given". Compose
    hands a container only the variables its file names: a field missing here would be dropped without a word.

    Example::

        >>> compose_settings_yaml().splitlines()[0]
        '      DDP_MODEL:'
    """
    return "".join(f"      {env_name(f.name)}:\n" for f in fields(TrainConfig))


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + body + text[stop:]


def write_table(doc: Path = DOC) -> None:
    """Replace what lies between the config-table markers of ``doc`` with the table."""
    doc.write_text(replace_between(doc.read_text(), BEGIN, END, "\n" + config_table_markdown()))


def write_compose_settings(compose: Path = COMPOSE) -> None:
    """Replace compose.yaml's generated list of ``DDP_*`` variables with the fields' own."""
    compose.write_text(replace_between(compose.read_text(), COMPOSE_BEGIN, COMPOSE_END, compose_settings_yaml()))


if __name__ == "__main__":
    write_table(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
    write_compose_settings()
