"""Run the refit benchmark (the same as ``asyncrefit bench``); ``--record`` saves it.

    python benchmarks/refit_bench.py --size-mib 1024 --repeats 3 --record

prints the table (or ``--json``) and, with ``--record``, appends a dated section with
the table and the JSON to ``benchmarks/RESULTS.md``. Record only runs made on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrefit.tools import bench
from asyncrefit.tools._table import append_to_section, recorded_command, results_section
from asyncrefit.tools._verify import VerificationError

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
SECTION = "## Refit on the CPU"


def record(result: dict[str, Any], command: str, path: Path = RESULTS) -> None:
    """Add a dated section with ``result``'s table and JSON to ``path``.

    It goes at the end of the CPU refit section (before the next ``## `` heading after
    ``SECTION``), or at the end of the file when there is no such section.
    """
    m = result["machine"]
    title = f"{result['date'][:10]}: {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
    section = results_section(title, command, bench.format_table(result), result, level=4)
    append_to_section(path, SECTION, section)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print it, and record it if asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="parameter set size (1024)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per variant (3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads of the trainer"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--record", action="store_true", help=f"append to {RESULTS.name}")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be positive")
    try:
        result = bench.run(
            args.size_mib, args.repeats, threads=args.threads, progress=bench.progress_line
        )
    except VerificationError as exc:
        print(f"refit_bench: VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else bench.format_table(result))
    if args.record:
        record(result, recorded_command("benchmarks/refit_bench.py", argv))
        print(f"recorded in {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
