"""The ``asyncrefit`` command: ``demo``, ``bench`` and ``plan``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import __version__
from .tools._failure import report_failure


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrefit", description="Push trained weights into inference workers."
    )
    parser.add_argument("--version", action="version", version=f"asyncrefit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="train a small transformer and push it to local workers, verified"
    )
    demo.add_argument("--workers", type=int, default=2, help="local worker processes (2)")
    demo.add_argument("--steps", type=int, default=3, help="optimizer steps, one push each (3)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT while the demo runs (0: any free "
        "port, told on stderr; needs the metrics extra)",
    )

    bench = sub.add_parser(
        "bench", help="measure refit throughput against memcpy and two baselines"
    )
    bench.add_argument("--size-mib", type=int, default=1024, help="parameter set size (1024)")
    bench.add_argument("--repeats", type=int, default=3, help="timed pushes per variant (3)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--trace", metavar="PATH", help="write one push as a Chrome trace (JSON)")
    bench.add_argument(
        "--timeline", metavar="PATH", help="draw one push as a PNG (needs matplotlib)"
    )

    plan = sub.add_parser("plan", help="show how a parameter set is cut into buckets")
    plan.add_argument("--bucket-mib", type=float, default=256.0, help="bucket size (256)")
    plan.add_argument("--size-mib", type=int, default=1024, help="synthetic set size (1024)")
    return parser


@contextmanager
def _numpy_optional() -> Iterator[None]:
    """Import torch without its warning that numpy is missing (numpy is optional).

    The worker processes the commands start are silenced likewise (see
    ``asyncrefit.local``); nothing else of the warnings filters changes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        try:
            with _numpy_optional():
                from .tools.demo import main as demo_main
        except Exception as exc:  # e.g. a broken torch: --json still answers in JSON
            return report_failure("demo", exc, as_json=args.json)
        return demo_main(args)
    if args.command == "bench":
        with _numpy_optional():
            from .tools.bench import main as bench_main

        return bench_main(args)
    with _numpy_optional():
        from .tools.bench import plan_main

    return plan_main(args)


if __name__ == "__main__":
    sys.exit(main())
