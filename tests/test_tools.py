"""The tools' shared helpers: the workers' check, the machine's description, tables."""

from __future__ import annotations

import pytest
import torch

from asyncrefit.tools._machine import machine_info, machine_line, rss_bytes
from asyncrefit.tools._table import Column, markdown_table, table
from asyncrefit.tools._verify import (
    VerificationError,
    mismatches,
    module_digests,
    verify_workers,
)

pytestmark = pytest.mark.timeout(30)


class DigestsOf:
    """A worker that answers the digests it was given."""

    def __init__(self, name: str, digests: dict[str, str]) -> None:
        self._name = name
        self._digests = digests

    @property
    def name(self) -> str:
        return self._name

    async def parameter_digests(self) -> dict[str, str]:
        return dict(self._digests)


async def test_verify_names_every_parameter_that_differs() -> None:
    model = torch.nn.Linear(3, 2)
    want = module_digests(model)
    assert set(want) == {"weight", "bias"}
    with torch.no_grad():
        model.bias.add_(1.0)
    other = module_digests(model)
    good = DigestsOf("good", want)
    stale = DigestsOf("stale", other)
    short = DigestsOf("short", {"weight": want["weight"], "extra": "x"})

    got = await mismatches([good, stale, short], want)
    assert got == {"good": [], "stale": ["bias"], "short": ["bias", "extra"]}
    await verify_workers([good], want, what="run")
    with pytest.raises(VerificationError, match=r"run: worker stale .* 1 of 2 parameters"):
        await verify_workers([good, stale], want, what="run")


def test_machine_info_describes_this_machine() -> None:
    m = machine_info()
    assert m["cores"] >= 1 and m["torch"] == torch.__version__ and "gpu" not in m
    assert machine_line(m).startswith(f"machine: {m['cpu']}, {m['cores']} cores")
    rss, peak = rss_bytes()
    assert 0 < rss <= peak


def test_table_lines_up_columns_and_passes_strings_through() -> None:
    columns = (Column("name", 6, left=True), Column("GB/s", 7, ".2f"), Column("B", 8, ","))
    lines = table(columns, [("a", 1.5, 1234), ("b", "-", "-"), "b failed"], gap=1, rule=True)
    assert lines == [
        "name      GB/s        B",
        "-----------------------",
        "a         1.50    1,234",
        "b            -        -",
        "b failed",
    ]
    assert markdown_table(columns, [("a", 1.5, 1234)]) == [
        "| name | GB/s | B |",
        "|:---|---:|---:|",
        "| a | 1.50 | 1,234 |",
    ]
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table(columns, [("a", 1.0)])
