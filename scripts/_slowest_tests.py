"""Print the slowest tests of scripts/test's finished logs (the DURATION lines tests/conftest.py
writes: setup, call and teardown together), slowest first: where the suite's time goes.

Usage: _slowest_tests.py [--count N] FINISHED_LOG...
"""

from __future__ import annotations

import argparse
import sys


def slowest(paths: list[str], count: int) -> list[tuple[float, str]]:
    """The `count` longest (seconds, test) over the logs; a test run twice (a rerun) counts its longest."""
    longest: dict[str, float] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as log:
                for line in log:
                    if not line.startswith("DURATION "):
                        continue
                    seconds, _, nodeid = line[len("DURATION "):].strip().partition(" ")
                    try:
                        longest[nodeid] = max(longest.get(nodeid, 0.0), float(seconds))
                    except ValueError:
                        continue
        except OSError:
            continue
    return sorted(((s, n) for n, s in longest.items()), reverse=True)[:count]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=10)
    p.add_argument("logs", nargs="+")
    args = p.parse_args(argv)
    found = slowest(args.logs, args.count)
    if found:
        print(f"scripts/test: the {len(found)} slowest tests (setup, call and teardown):")
        for seconds, nodeid in found:
            print(f"  {seconds:7.1f} s  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
