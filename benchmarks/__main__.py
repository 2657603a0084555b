"""The benchmarks' one entry point.

    python -m benchmarks --list                      # every benchmark, what it measures, its options
    python -m benchmarks NAME [OPTIONS]              # run one; its result goes to benchmarks/results/NAME/
    python -m benchmarks NAME --help                 # the options of NAME's module
    python -m benchmarks --results DIR NAME ...      # write the result under DIR/NAME/ instead
    torchrun --nproc-per-node 2 -m benchmarks context_parallel

The benchmark's module runs as if called as ``python -m <module> <registered options> OPTIONS --out
<results>/NAME``, and writes ``<gpu>.json``, ``.md`` and ``.png`` there (:mod:`benchmarks.report`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .registry import BENCHMARKS, RESULTS


def listing() -> str:
    """One block per benchmark: name and description, then its module and registered options."""
    lines = []
    for name, bench in BENCHMARKS.items():
        lines += [f"{name:18s} {bench.description}", f"{'':18s}   python -m {bench.module} {' '.join(bench.args)}"]
    return "\n".join(lines)


def run(name: str, options: list[str], results: Path) -> int:
    """Run benchmark ``name`` with ``options`` added to its registered ones, writing under ``results/name``;
    the module's exit status."""
    bench = BENCHMARKS[name]
    sys.argv = [f"python -m benchmarks {name}", *bench.args, *options, "--out", str(results / name)]
    return importlib.import_module(bench.module).main() or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Run one registered benchmark.",
                                     epilog="Options after NAME go to the benchmark (NAME --help lists them).")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of the current results, one subfolder per benchmark (default: %(default)s)")
    parser.add_argument("name", nargs="?", choices=list(BENCHMARKS), metavar="NAME")
    parser.add_argument("options", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.name is None:
        parser.error("name a benchmark (--list lists them)")
    if any(option == "--out" or option.startswith("--out=") for option in args.options):
        parser.error("the result's folder is --results DIR (before NAME), not --out")
    return run(args.name, args.options, args.results)


if __name__ == "__main__":
    sys.exit(main())
