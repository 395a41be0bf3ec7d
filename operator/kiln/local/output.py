"""How the `kiln` command prints data: a rich table for people, JSON or YAML for scripts (`-o`).

Plain output (no box drawing, no colour, no wrapping) when stdout is not a terminal or NO_COLOR
is set, so pipes, logs and `grep` see one line per row. Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

FORMATS = ("table", "json", "yaml")

# Wide enough that no table or message line is ever wrapped in plain output.
PLAIN_WIDTH = 10_000

Data = Sequence[Mapping[str, Any]] | Mapping[str, Any]
"""What a command prints: a list of plain dicts (one per row), or one dict (`zoo show`).
Values are JSON values (str, int, float, bool, None, lists and dicts of them)."""


def add_option(parser: argparse.ArgumentParser) -> None:
    """Give a command that prints data the `-o/--output table|json|yaml` option."""
    parser.add_argument("-o", "--output", choices=FORMATS, default="table",
                        help="table (default; plain columns when piped), or json/yaml for "
                        "scripts: the same data, machine-readable, and nothing else on stdout")


def wants_plain(console: Console) -> bool:
    """True when `console` is not a terminal or NO_COLOR (any value but empty) is set."""
    return not console.is_terminal or bool(os.environ.get("NO_COLOR"))


def stdout_console() -> Console:
    """The console for data and progress: rich on a terminal, plain otherwise."""
    console = Console()
    if wants_plain(console):  # no colour system: no escape codes at all, not even bold
        return Console(color_system=None, width=PLAIN_WIDTH, soft_wrap=True)
    return console


def stderr_console() -> Console:
    """The console for errors and warnings: a message is never wrapped mid-line."""
    if os.environ.get("NO_COLOR"):
        return Console(stderr=True, soft_wrap=True, color_system=None)
    return Console(stderr=True, soft_wrap=True)


def show(console: Console, fmt: str, data: Data, table: Table | None = None) -> None:
    """Print `data` as `fmt` ("table", "json" or "yaml") on `console`.

    Args:
        console: stdout's console (`stdout_console`).
        fmt: the command's `-o` value.
        data: what the command reports; json and yaml print exactly this, and it parses back.
        table: the people's view of `data` (formatted cells, a title); default: one column per
            key of the rows, in first-seen order.
    """
    if fmt == "json":  # straight to the file: no markup, no wrapping, fast for a big zoo
        console.file.write(json.dumps(data, indent=2) + "\n")
    elif fmt == "yaml":
        console.file.write(yaml.safe_dump(_plain_types(data), sort_keys=False,
                                          allow_unicode=True))
    else:
        print_table(console, table if table is not None else rows_table(data))


def print_table(console: Console, table: Table) -> None:
    """Print a rich table; without box drawing and with a left-aligned title when plain."""
    if not wants_plain(console):
        console.print(table)
        return
    table.box, table.pad_edge, table.show_edge, table.title_justify = None, False, False, "left"
    with console.capture() as captured:
        console.print(table)
    lines = (line.rstrip() for line in captured.get().splitlines())  # cells pad to the column
    console.out("\n".join(lines), highlight=False)


def rows_table(data: Data, title: str | None = None) -> Table:
    """A table of plain-dict rows: one column per key in first-seen order, values as text."""
    rows = [data] if isinstance(data, Mapping) else list(data)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(Text(cell_text(row.get(column))) for column in columns))
    return table


def cell_text(value: Any) -> str:
    """One value as a table cell: "-" for None, floats to 4 significant digits, JSON for lists."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _plain_types(data: Any) -> Any:
    """`data` with tuples as lists and mappings as dicts, which `yaml.safe_dump` accepts."""
    if isinstance(data, Mapping):
        return {key: _plain_types(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain_types(value) for value in data]
    return data
