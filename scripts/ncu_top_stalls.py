"""Where a kernel's warps wait: the SASS instructions with the most warp-stall samples in an Nsight Compute report
(collected with ``--set full``, which samples program counters), each with its largest stall reasons, and the
kernel's totals per reason.

    ncu --import forwards.ncu-rep --page source --print-source sass --csv -k regex:_ws_int8 > sass.csv
    python scripts/ncu_top_stalls.py sass.csv --top 40
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

_SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints banner lines before the table
    # the table's header is the first line naming the samples column (a "Kernel Name" line comes before it)
    start = next((i for i, line in enumerate(lines) if _SAMPLES in line), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows or _SAMPLES not in rows[0]:
        print(f"no '{_SAMPLES}' column; columns: {list(rows[0]) if rows else None}", file=sys.stderr)
        return 2
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    totals = collections.Counter()
    for row in rows:
        for c in reasons:
            totals[c] += _number(row[c])
    all_samples = sum(_number(r[_SAMPLES]) for r in rows)
    print(f"{all_samples:.0f} samples; by reason:")
    for c, n in totals.most_common(12):
        print(f"  {c}: {n:.0f} ({n / max(all_samples, 1):.1%})")
    print()
    for row in sorted(rows, key=lambda r: -_number(r[_SAMPLES]))[:args.top]:
        top = sorted(((_number(row[c]), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c} {n:.0f}" for n, c in top if n)
        print(f"{row.get('Address', '?'):>8} {_number(row[_SAMPLES]):7.0f}  {row.get('Source', '')[:60]:60}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
