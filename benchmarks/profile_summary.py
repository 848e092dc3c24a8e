"""Summarise a py-spy profile: where a client's samples went, by function.

Record the client while it runs a workload, in py-spy's collapsed ("raw") format, then
read it with this script::

    py-spy record --format raw --rate 500 -o streams.txt -- \\
        trio-enginecore bench --mode stream --concurrency 512 --duration-s 8
    python -m benchmarks.profile_summary streams.txt --under receive_outputs

It prints each function's share of the samples, its own (``self``: the samples whose
innermost frame it is) and with what it calls (``total``). ``--under NAME`` restricts
both to the samples whose stack passes through a function called NAME (the receive
task's ``receive_outputs``, say), with shares of those samples; ``--drop NAME``
leaves out the samples under NAME (``_find_and_load``: the imports at startup). A
flame graph of the same file shows the same numbers as widths; these tables are easier
to quote.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Samples", "frame_name", "read_samples", "summarise"]

Samples = list[tuple[list[str], int]]


def frame_name(frame: str) -> str:
    """``"push (trio_enginecore/client/_stream.py:95)"`` -> ``"push (_stream.py)"``."""
    function, _, where = frame.partition(" (")
    if not where:
        return function
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{function} ({path.rsplit('/', 1)[-1]})"


def read_samples(path: Path) -> Samples:
    """The stacks (outermost frame first) and their sample counts."""
    samples: Samples = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples.append(([frame_name(f) for f in stack.split(";")], int(count)))
    return samples


def _passes(stack: list[str], name: str) -> bool:
    return any(frame.partition(" (")[0] == name for frame in stack)


def summarise(
    samples: Samples, *, under: str | None = None, drop: tuple[str, ...] = ()
) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """(samples kept, self counts, total counts), after ``under`` and ``drop``."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    kept = 0
    for stack, count in samples:
        if under is not None and not _passes(stack, under):
            continue
        if any(_passes(stack, name) for name in drop):
            continue
        kept += count
        own[stack[-1]] += count
        for name in set(stack):
            total[name] += count
    return kept, own, total


def _lines(kept: int, counts: collections.Counter[str], top: int) -> Iterator[str]:
    for name, count in counts.most_common(top):
        yield f"{100 * count / kept:5.1f} %  {name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("profile", type=Path, help="a py-spy --format raw file")
    parser.add_argument("--under", default=None, metavar="NAME", help="only samples under NAME")
    parser.add_argument(
        "--drop", action="append", default=[], metavar="NAME", help="leave out samples under NAME"
    )
    parser.add_argument("--top", type=int, default=25, help="rows per table (25)")
    args = parser.parse_args(argv)
    kept, own, total = summarise(
        read_samples(args.profile), under=args.under, drop=tuple(args.drop)
    )
    if not kept:
        print("no samples left", file=sys.stderr)
        return 1
    scope = f" under {args.under}" if args.under else ""
    print(f"{kept} samples{scope}\n\nself:")
    print("\n".join(_lines(kept, own, args.top)))
    print("\ntotal (self and callees):")
    print("\n".join(_lines(kept, total, args.top)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # Piped into head: the reader has what it wanted. Point stdout at nothing so
        # that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
