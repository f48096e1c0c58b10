"""The one table printer of the tools and benchmarks, and the sections that file them.

:func:`table` lines up rows under a header in fixed-width columns (plain text, as the
commands print); :func:`markdown_table` writes the same columns as a Markdown table.
:func:`results_section` wraps a printed table and its JSON in a dated section of
``benchmarks/RESULTS.md``, and :func:`append_to_section` files it under its heading.

Resource handling: :func:`append_to_section` reads and rewrites the file, closing it;
nothing else touches a file.

Error handling: a value that does not take its column's format spec raises
:class:`ValueError` (strings are never formatted with the spec: a ``"-"`` may stand
in a numeric column); :func:`append_to_section` lets :class:`OSError` through, but a
missing file is created.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its title, width (0: as wide as its text), the format spec of its
    values (``".2f"``, ``","``, ``".0%"``; not applied to strings), left or right
    aligned, and the spaces before it (``None``: the table's gap)."""

    title: str
    width: int = 0
    spec: str = ""
    left: bool = False
    gap: int | None = None


def _cell(value: object, column: Column, *, header: bool = False) -> str:
    text = value if isinstance(value, str) else format(value, "" if header else column.spec)
    if not column.width:
        return text
    return format(text, f"{'<' if column.left else '>'}{column.width}")


def _line(cells: Sequence[object], columns: Sequence[Column], gap: int, header: bool) -> str:
    if len(cells) != len(columns):
        raise ValueError(f"a row of {len(cells)} cells for {len(columns)} columns")
    parts = []
    for i, (value, column) in enumerate(zip(cells, columns, strict=True)):
        if i:
            parts.append(" " * (gap if column.gap is None else column.gap))
        parts.append(_cell(value, column, header=header))
    return "".join(parts)


def table(
    columns: Sequence[Column],
    rows: Iterable[Sequence[object] | str],
    *,
    gap: int = 0,
    rule: bool = False,
) -> list[str]:
    """The header line, with ``rule`` a line of ``-`` as long, then one line per row.

    Each row has one value per column; ``gap`` spaces stand between columns. A row
    that is a string is a line of its own, as it is (a failed run's note, say).
    """
    header = _line([c.title for c in columns], columns, gap, header=True)
    lines = [header, "-" * len(header)] if rule else [header]
    lines += [
        row if isinstance(row, str) else _line(row, columns, gap, header=False) for row in rows
    ]
    return lines


def markdown_table(columns: Sequence[Column], rows: Iterable[Sequence[object]]) -> list[str]:
    """The same columns as a Markdown table (widths ignored; left or right aligned)."""
    lines = [
        "| " + " | ".join(c.title for c in columns) + " |",
        "|" + "|".join(":---" if c.left else "---:" for c in columns) + "|",
    ]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells for {len(columns)} columns")
        cells = [
            v if isinstance(v, str) else format(v, c.spec)
            for v, c in zip(row, columns, strict=True)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def results_section(
    title: str, command: str, text: str, result: dict[str, Any], *, level: int = 3
) -> str:
    """A section of ``benchmarks/RESULTS.md``: a heading of ``level`` with ``title``, the
    command that ran, the printed ``text`` (a table) and ``result`` as folded JSON."""
    return (
        f"\n{'#' * level} {title}\n\n`{command}`\n\n```\n{text}\n```\n\n"
        f"<details><summary>JSON</summary>\n\n```json\n{json.dumps(result, indent=2)}\n```\n\n"
        "</details>\n"
    )


def recorded_command(script: str, argv: Sequence[str] | None) -> str:
    """``python <script> <arguments>``: the command line to record (``sys.argv``'s
    arguments when ``argv`` is ``None``)."""
    return f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv)


def append_to_section(path: str | os.PathLike[str], heading: str, text: str) -> None:
    """Add ``text`` at the end of the Markdown section whose heading line starts with
    ``heading`` (before the next ``## `` heading), or, without one, at the end of the
    file; a missing or empty file gets just ``text``."""
    try:
        with open(path) as f:
            whole = f.read()
    except FileNotFoundError:
        whole = ""
    start = whole.find(heading)
    end = whole.find("\n## ", start + 1) if start >= 0 else -1
    if not whole.strip():
        whole = text.lstrip("\n")
    elif end < 0:
        whole = whole.rstrip("\n") + "\n" + text
    else:
        whole = whole[:end].rstrip("\n") + "\n" + text + whole[end:]
    with open(path, "w") as f:
        f.write(whole)
