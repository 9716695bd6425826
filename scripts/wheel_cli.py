"""The ``extract`` command shared by the scripts that take third-party kernels out of their wheels into
``.gpu/`` for the benchmarks (``upstream_replayssm.py``, ``fla_kernels.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def extract_main(argv, description: str, command_help: str, source_flag: str, source_help: str, folder: bool,
                 default_out: Path, extract) -> int:
    """``extract [SOURCE_FLAG PATH] [--out DIR]``: ``extract(path or None, out)`` and print its result; a
    missing ``PATH`` (a folder when ``folder``, else a file) is a usage error naming it."""
    p = argparse.ArgumentParser(description=description)
    sub = p.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("extract", help=command_help)
    cmd.add_argument(source_flag, dest="source", type=Path, help=source_help)
    cmd.add_argument("--out", type=Path, default=default_out)
    args = p.parse_args(argv)
    if args.source is not None and not (args.source.is_dir() if folder else args.source.is_file()):
        p.error(f"{source_flag} {args.source}: no such {'folder' if folder else 'file'}")
    print(extract(args.source, args.out))
    return 0
