"""Is the root cause right every time? A table of real failure kinds on rank 1
(SIGKILL, a segfault, ``sys.exit(1)``, ``os._exit(0)``, a raise, a raise
whose ``__str__`` raises) while rank 0 waits in ``all_reduce`` and sees only
its transport error, under every start method, each repeated; counts wrong
blames and times failure -> exception in the caller (the failing rank
writes the time just before it fails).

    python bench/failures.py              # 30 of each (about 10 minutes on 2 CPUs)
    python bench/failures.py --repeats 3  # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from failure_cases import EXPECTED, verdict  # noqa: E402

METHODS = ("fork", "forkserver", "spawn")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    opts = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "failed-at")
        for case in EXPECTED:
            for method in METHODS:
                wrong, latencies, examples = 0, [], []
                for _ in range(opts.repeats):
                    if os.path.exists(stamp):
                        os.remove(stamp)
                    rank, ok, summary = verdict(case, method, stamp)
                    raised = time.time()
                    if os.path.exists(stamp):
                        latencies.append(raised - float(Path(stamp).read_text()))
                    if not ok:
                        wrong += 1
                        examples.append(summary)
                rows.append({"case": case, "method": method, "runs": opts.repeats, "wrong": wrong,
                             "median_s": statistics.median(latencies), "max_s": max(latencies),
                             "wrong_examples": examples[:3]})
                print(f"{case:24s} {method:10s} wrong {wrong}/{opts.repeats}  failure -> raise: "
                      f"median {rows[-1]['median_s']:.3f} s, max {rows[-1]['max_s']:.3f} s", flush=True)
    if opts.repeats >= 30:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "failures.json").write_text(json.dumps(rows, indent=2))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
