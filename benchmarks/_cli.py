"""Argument types for the benchmark scripts' command lines.

A count of 0, a negative size or a width list with a typo is a usage error that names the option
(``error: argument --repeat: 0 is not an integer >= 1``), not a traceback from inside a run
(``statistics.median`` of no timings, a division by zero layers) nor a silently replaced default.
"""
from __future__ import annotations

import argparse
import math


def _checked(text: str, convert, ok, what: str):
    try:
        value = convert(text)
    except (TypeError, ValueError):
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """A count or a size: an integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """A seed, a number of cycles, or 0 for "all": an integer >= 0."""
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A time, a tolerance, a learning rate or a ratio: a finite number > 0."""
    return _checked(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def nonnegative_float(text: str) -> float:
    """A ratio that may be 0 or inf (SwitchRule's ``ratio=inf`` only monitors): a number >= 0, not NaN."""
    return _checked(text, float, lambda v: v >= 0, "a number >= 0 (inf allowed)")


def positive_ints(text: str) -> str:
    """A comma-separated list of integers >= 1 (``"16,64"``), returned as the normalised list text so that
    the scripts go on splitting it at the commas."""
    parts = text.split(",")
    values = [_checked(p.strip(), int, lambda v: v >= 1, "an integer >= 1") if p.strip() else None for p in parts]
    if not parts or None in values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers >= 1")
    return ",".join(str(v) for v in values)


def end_worker(code: int = 0) -> None:
    """End a gloo worker process now that its results are printed, without the interpreter's shutdown.

    The library's failure-notice listener keeps a gloo receive posted on each process group (gloo
    cannot cancel it, and ``destroy_process_group`` does not end it); it returns when a peer process
    exits, and if that happens while this interpreter is finalising, the returning thread aborts the
    process (``terminate called without an active exception``, exit code -6 after a successful run:
    seen once in a fresh-clone test run of ``vs_model_parallel.py --quick``; README, Limitations).
    A worker whose output is complete has nothing left to clean up, so it leaves at once.
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
