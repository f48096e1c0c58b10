"""Soak benchmark: 1000 pushes into 2 local workers; prints first/last/max per quantity.

Run: .venv/bin/python benchmarks/soak.py [--pushes 1000] [--json]
"""

from __future__ import annotations

import argparse
import json

import anyio

from asyncrefit._loop import backend_options
from asyncrefit.tools._table import Column, table
from asyncrefit.tools.soak import QUANTITIES, run_soak

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pushes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = anyio.run(run_soak, args.pushes, args.workers, backend_options=backend_options())
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"soak: {result['pushes']} pushes into {result['workers']} workers in "
        f"{result['seconds']:.1f} s, last version verified: {result['verified']}"
    )
    columns = [Column("quantity", 18, left=True)]
    columns += [Column(title, 12) for title in ("first", "last", "max", "growth")]
    rows = []
    for key in QUANTITIES:
        s = result[key]
        memory = "rss" in key
        scale, unit, spec = (MIB, " MiB", ".1f") if memory else (1, "", ".0f")
        values = (s["first"], s["last"], s["max"], s["growth"])
        rows.append([key + unit, *(format(v / scale, spec) for v in values)])
    print("\n".join(table(columns, rows)))


if __name__ == "__main__":
    main()
