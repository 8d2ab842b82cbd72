"""Seqlock stress: writers hammer segments, readers snapshot them; no torn copy may be accepted.

The writers, readers and invariants are ``tests/seqlock_stress.py`` (the harness that
``tests/test_hardening_concurrency.py`` runs); this times it. ``run(quick)`` reports the writer's
publish time (p50, p99, p99.9) alone and with readers running: readers never lock, so the
difference is CPU sharing, not waiting. Also reported: how many raw copies taken *without* the
seqlock break the invariants, which shows that the invariants do catch tearing.
``python benchmarks/stress.py [--quick]`` prints the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.seqlock_stress import PAGES_PER_UPDATE, stress  # noqa: E402


def run(quick: bool) -> list[dict]:
    updates = 100_000 if quick else 1_000_000
    readers = 3
    alone = stress(1, 0, updates, timed=True)
    shared = stress(1, readers, updates, timed=True)
    w0, w1 = alone.writers[0], shared.writers[0]
    cpus = os.cpu_count() or 1
    note = f"{updates} updates of {PAGES_PER_UPDATE} page entries + counters, one writer; {cpus} CPUs"
    rows = []
    for q in ("p50", "p99", "p99.9"):
        rows.append({"name": f"seqlock publish {q}, no readers", "value": round(w0[q], 2), "unit": "µs",
                     "note": note})
        rows.append({"name": f"seqlock publish {q}, {readers} reader processes", "value": round(w1[q], 2),
                     "unit": "µs", "note": note + ("; readers share the CPUs" if readers >= cpus else "")})
    rows.append({"name": "seqlock publish rate, no readers", "value": round(updates / w0["seconds"]), "unit": "1/s",
                 "note": "timed loop, including the timer calls"})
    rows.append({"name": f"snapshots accepted by {readers} readers", "value": shared.accepted, "unit": "snapshots",
                 "note": f"torn snapshots accepted: {shared.violation_count}; busy retries exhausted: "
                         f"{sum(r['busy'] for r in shared.readers)}"})
    raw_copies = sum(r["raw_copies"] for r in shared.readers)
    raw_torn = sum(r["raw_torn"] for r in shared.readers)
    rows.append({"name": "raw copies (no seqlock) breaking an invariant", "value": raw_torn, "unit": "copies",
                 "note": f"of {raw_copies} plain copies taken during the run: what the seqlock and checksums reject"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(args.quick):
        print(json.dumps(row, ensure_ascii=False))


if __name__ == "__main__":
    main()
