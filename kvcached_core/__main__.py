"""``python -m kvcached_core``: run the demo fleet and print it through the reader API."""

from __future__ import annotations

import argparse
import sys
import time

from .demo import DemoFleet
from .reader import list_models
from .sizes import format_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcached_core", description=__doc__)
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args(argv)
    with DemoFleet(args.models) as fleet:
        fleet.wait_ready()
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            time.sleep(args.interval)
            for m in list_models():
                waste = "-" if m.waste_ratio is None else f"{m.waste_ratio:.2f}x"
                print(f"{m.name:24} {m.status:6} mapped {format_bytes(m.mapped_bytes):>10}  "
                      f"pages {m.pages_inuse:>4}/{m.pages_total}  cached {m.blocks_cached:>4}  waste {waste}")
            print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
