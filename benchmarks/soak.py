"""Soak benchmark: 1000 pushes into 2 local workers; prints first/last/max per quantity.

Run: .venv/bin/python benchmarks/soak.py [--pushes 1000] [--json]
"""

from __future__ import annotations

import argparse
import json

import anyio

from asyncrefit._loop import backend_options
from asyncrefit.tools.soak import run_soak

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
    print(f"{'quantity':<18}{'first':>12}{'last':>12}{'max':>12}{'growth':>12}")
    for key in (
        "coordinator_rss",
        "worker_rss_max",
        "coordinator_fds",
        "worker_fds_max",
        "shm_segments",
        "child_processes",
    ):
        s = result[key]
        scale, unit = (MIB, " MiB") if key.endswith("rss") or key == "worker_rss_max" else (1, "")
        row = [s["first"] / scale, s["last"] / scale, s["max"] / scale, s["growth"] / scale]
        fmt = "{:>12.1f}" if scale > 1 else "{:>12.0f}"
        print(f"{key + unit:<18}" + "".join(fmt.format(v) for v in row))


if __name__ == "__main__":
    main()
