"""Run once more, alone, the integration tests that failed in a phase of scripts/test, and exit 0
only if each of them passes that time. Integration tests time real processes on a shared two-core
machine, so a rare miss of a deadline is not always a fault of the code; one that passes alone is
named on the output as FLAKY, so it stays visible and can be fixed. Nothing else is forgiven: a
failed unit test, or more than MAX_RERUNS failures in one phase, fails the run as it is.

Every FLAKY result is appended to the record, tests/flaky.tsv (tab-separated: UTC date, commit,
test, reason), and printed with how often the record holds that test. A test the record holds
twice or more fails the run, until it is fixed (remove its lines) or a line of it gives a reason
in its fourth column: several tests once forgiven as flaky were races in the product. CI runs on a
clean clone, so its appended lines are printed for a developer to commit; the record in the
repository is the history.

Usage: _rerun_failed.py FINISHED_LOG [pytest arguments of the phase...]
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

MAX_RERUNS = 3
"""More failures than this in one phase is not chance: the run fails without a rerun."""
FLAKY_RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "flaky.tsv")
FLAKES_FORGIVEN = 1
"""Times the record may hold a test without a reason before its next flake fails the run."""


def record_flaky(nodeid: str, record: str = FLAKY_RECORD) -> tuple[int, bool]:
    """Append one FLAKY result of `nodeid` to the record; how many times the record now holds it,
    and whether a line of it gives a reason (the fourth column)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False, cwd=os.path.dirname(record) or ".").stdout.strip() or "-"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    line = f"{when}\t{commit}\t{nodeid}\t\n"
    with open(record, "a", encoding="utf-8") as f:
        f.write(line)
    print(f"scripts/test: recorded in tests/flaky.tsv: {line.rstrip()}")
    times, reason = 0, False
    with open(record, encoding="utf-8") as f:
        for entry in f:
            fields = entry.rstrip("\n").split("\t")
            if entry.startswith("#") or len(fields) < 3 or fields[2] != nodeid:
                continue
            times += 1
            reason = reason or (len(fields) > 3 and bool(fields[3].strip()))
    return times, reason


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
            times, reason = record_flaky(nodeid)
            print(f"scripts/test: FLAKY (failed beside other tests, passed alone; {times} time(s) in "
                  f"tests/flaky.tsv): {nodeid}")
            if times > FLAKES_FORGIVEN and not reason:
                print(f"scripts/test: FAILED: {nodeid} flaked {times} times in the record; fix it, or give a "
                      "reason in the fourth column of one of its lines in tests/flaky.tsv")
                status = 1
        else:
            print(f"scripts/test: FAILED again alone: {nodeid}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
