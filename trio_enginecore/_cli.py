"""The ``trio-enginecore`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__

_NOT_BUILT = {
    "demo": "the demo runs on the built-in reference engine, which is not built yet",
    "serve": "the reference engine process is not built yet",
    "bench": "the benchmark harness is not built yet",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-enginecore",
        description="A Trio-native engine-core client for vLLM-compatible LLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("demo", help="stream a generation from the built-in engine")
    commands.add_parser("serve", help="run a reference EngineCore process")
    commands.add_parser("bench", help="measure the client against baselines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trio-enginecore`` console script."""
    args = _parser().parse_args(argv)
    reason = _NOT_BUILT[args.command]
    print(f"trio-enginecore {args.command}: not built yet ({reason}).", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
