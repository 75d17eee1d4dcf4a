"""scripts/test's helpers: the flaky record holds a test to account, and the slowest tests are
listed from the finished logs."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import _rerun_failed  # noqa: E402
import _slowest_tests  # noqa: E402

TEST = "tests/integration/test_x.py::test_y"


def test_a_test_recorded_twice_without_a_reason_is_not_forgiven_and_a_reason_marks_it(tmp_path):
    record = str(tmp_path / "flaky.tsv")
    with open(record, "w") as f:
        f.write("# header\n")
        f.write("2026-01-01T00:00Z\tabc1234\ttests/integration/test_x.py::test_other\tknown: a slow disk\n")
    assert _rerun_failed.record_flaky(TEST, record) == (1, False)
    assert _rerun_failed.record_flaky(TEST, record) == (2, False)  # scripts/test fails the run now
    with open(record, "a") as f:
        f.write(f"2026-01-02T00:00Z\tabc1234\t{TEST}\tthe rerun races a port: being fixed\n")
    assert _rerun_failed.record_flaky(TEST, record) == (4, True)
    assert _rerun_failed.record_flaky("tests/integration/test_x.py::test_other", record) == (2, True)
    lines = open(record).read().splitlines()
    assert lines[2].split("\t")[2] == TEST and lines[2].endswith("\t") and len(lines) == 7


def test_the_repository_record_parses_and_every_line_is_a_test():
    with open(_rerun_failed.FLAKY_RECORD) as f:
        entries = [line.rstrip("\n").split("\t") for line in f if not line.startswith("#") and line.strip()]
    assert all(len(e) == 4 and "::" in e[2] for e in entries), entries


def test_the_slowest_tests_come_from_the_duration_lines(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("DURATION 12.5 t::a\nt::a\nFAILED t::b\nDURATION 3.0 t::b\nt::b\nDURATION x t::c\n")
    second.write_text("DURATION 40.0 t::solo\nDURATION 7.0 t::b\n")
    assert _slowest_tests.slowest([str(first), str(second), str(tmp_path / "missing")], 2) == [
        (40.0, "t::solo"), (12.5, "t::a")]
    assert _slowest_tests.slowest([str(first), str(second)], 10)[-1] == (7.0, "t::b")
