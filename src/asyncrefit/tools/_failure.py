"""How a command tells that it failed: one JSON object on stdout, one line on stderr."""

from __future__ import annotations

import json
import sys
import traceback

from .._exceptions import AsyncRefitError


def report_failure(command: str, exc: Exception, *, as_json: bool) -> int:
    """Report that ``command`` failed with ``exc``; returns the exit status, 1.

    With ``as_json``, stdout gets exactly one JSON object, ``{"verified": false,
    "error": "<type>: <message>"}``, and nothing else, so a caller that parses stdout
    always gets an answer. stderr gets one line for the library's own errors
    (:class:`AsyncRefitError`) and the traceback, then that line, for anything else.
    A group of one exception (as task groups raise) is told as that exception.
    """
    cause: BaseException = exc
    while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
        cause = cause.exceptions[0]
    message = f"{type(cause).__name__}: {cause}"
    if as_json:
        print(json.dumps({"verified": False, "error": message}), flush=True)
    if not isinstance(cause, AsyncRefitError):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"asyncrefit {command} failed: {message}", file=sys.stderr)
    return 1
