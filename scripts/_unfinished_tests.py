"""Print, one per line, the tests pytest collects for the given arguments that the log of finished
tests (AGORA_TEST_FINISHED_LOG, written by tests/conftest.py) does not name: what scripts/test
runs again when a pytest worker ended the session early."""

from __future__ import annotations

import subprocess
import sys


def main() -> int:
    finished_log, *pytest_args = sys.argv[1:]
    with open(finished_log, encoding="utf-8") as log:
        finished = {line.strip() for line in log if line.strip() and not line.startswith(("FAILED ", "DURATION "))}
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", *pytest_args],
                             capture_output=True, text=True, check=False)
    collected = [line for line in listing.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    for nodeid in collected:
        if nodeid not in finished:
            print(nodeid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
