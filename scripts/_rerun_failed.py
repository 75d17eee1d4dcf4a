"""Run once more, alone, the integration tests that failed in a phase of scripts/test, and exit 0
only if each of them passes that time. Integration tests time real processes on a shared two-core
machine, so a rare miss of a deadline is not always a fault of the code; one that passes alone is
named on the output as FLAKY, so it stays visible and can be fixed. Nothing else is forgiven: a
failed unit test, or more than MAX_RERUNS failures in one phase, fails the run as it is.

Usage: _rerun_failed.py FINISHED_LOG [pytest arguments of the phase...]
"""

from __future__ import annotations

import subprocess
import sys

MAX_RERUNS = 3
"""More failures than this in one phase is not chance: the run fails without a rerun."""


def failed_tests(finished_log: str) -> list[str]:
    """The node ids that tests/conftest.py logged as failed (in setup, call or teardown), in order."""
    with open(finished_log, encoding="utf-8") as log:
        failed = [line[len("FAILED "):].strip() for line in log if line.startswith("FAILED ")]
    return list(dict.fromkeys(failed))


def integration_tests(nodeids: list[str]) -> set[str]:
    """Which of `nodeids` carry the `integration` marker (pytest's own collection decides)."""
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                              "-m", "integration", *nodeids], capture_output=True, text=True, check=False)
    return {line.strip() for line in listing.stdout.splitlines() if "::" in line and not line.startswith(" ")}


def main() -> int:
    failed = failed_tests(sys.argv[1])
    if not failed:
        print("scripts/test: the phase failed but no test did (a collection or session error, above); no rerun")
        return 1
    if len(failed) > MAX_RERUNS:
        print(f"scripts/test: {len(failed)} tests failed (more than {MAX_RERUNS}); no rerun")
        return 1
    others = [nodeid for nodeid in failed if nodeid not in integration_tests(failed)]
    if others:
        print("scripts/test: not integration tests, so not run again: " + ", ".join(others))
        return 1
    print(f"scripts/test: running the {len(failed)} failed integration test(s) once more, alone")
    status = 0
    for nodeid in failed:
        rerun = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", nodeid],
                               check=False)
        if rerun.returncode == 0:
            print(f"scripts/test: FLAKY (failed beside other tests, passed alone): {nodeid}")
        else:
            print(f"scripts/test: FAILED again alone: {nodeid}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
