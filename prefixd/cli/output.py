"""What a command prints: JSON for scripts (`--json`), rich tables for people, and progress on
stderr only when it is a terminal (and not `--quiet`), so a script's output is its result alone.
Piped, a table keeps its full width instead of rich's 80 columns.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

PIPED_WIDTH = 1 << 12  # columns a table may use when stdout is no terminal: nothing is cut

Advance = Callable[[int], None]


class Output:
    """Where a command's result and progress go, as its flags ask."""

    def __init__(
        self,
        *,
        as_json: bool = False,
        quiet: bool = False,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        self.as_json = as_json
        self.stdout = stdout or sys.stdout
        stderr = stderr or sys.stderr
        width = None if self.stdout.isatty() else PIPED_WIDTH
        self.console = Console(file=self.stdout, width=width, soft_wrap=width is not None)
        self.progress_console = Console(file=stderr)
        self.show_progress = not quiet and stderr.isatty()

    def result(self, report: Mapping[str, Any], title: str) -> None:
        """A command's result: JSON under --json, else a table of its fields."""
        if self.as_json:
            self.json(report)
        else:
            self.console.print(report_table(report, title))

    def json(self, value: Any) -> None:
        self.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        self.stdout.flush()

    def show(self, renderable: RenderableType) -> None:
        self.console.print(renderable)

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None = None) -> Iterator[Advance]:
        """A bar (or, without a total, a spinner) while the block runs; yields `advance(n)`."""
        if not self.show_progress:
            yield lambda n: None
            return
        columns = (
            (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
            if total is None
            else (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
        )
        with Progress(*columns, console=self.progress_console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def report_table(report: Mapping[str, Any], title: str) -> Table:
    """A report's fields, one row each; nested maps as dotted names, lists one item a line."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for name, value in _flat(report):
        table.add_row(name, value)
    return table


def _flat(report: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for name, value in report.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            yield from _flat(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            yield key, "\n".join(map(str, value)) if value else "none"
        elif isinstance(value, Mapping):
            yield key, "none"
        else:
            yield key, str(value)
