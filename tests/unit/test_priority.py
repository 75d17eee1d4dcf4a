"""A serving node lowers its own CPU priority, for every process of its group, and never raises it."""

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from node.priority import lower_priority
    os.nice(int(sys.argv[2]))  # as `nice -n K agora-node ...` would start it
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # a child, like p2pd
    said = lower_priority(int(sys.argv[1]))
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # forked after
    try:
        group = open("/proc/self/autogroup").read().split()[-1]
    except OSError:
        group = None
    print(json.dumps({"said": said, "own": os.getpriority(os.PRIO_PROCESS, 0),
                      "helper": os.getpriority(os.PRIO_PROCESS, helper.pid),
                      "late": os.getpriority(os.PRIO_PROCESS, late.pid), "autogroup": group}))
    helper.kill(); late.kill()
""")


def _run(nice: int, started_at: int = 0) -> dict:
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", CHILD, str(nice), str(started_at)], capture_output=True, text=True,
                         timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root},
                         start_new_session=True)  # its own session, as a supervisor starts a node
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_whole_process_group_serves_at_the_lower_priority():
    seen = _run(10)
    assert seen["own"] == 10 and seen["helper"] == 10 and seen["late"] == 10
    assert "nice 0 -> 10" in seen["said"]
    if seen["autogroup"] is not None:  # a kernel with autogroup: the session's share goes down too
        assert seen["autogroup"] == "10"
        assert "session nice 0 -> 10" in seen["said"]


def test_a_node_started_at_a_lower_priority_keeps_it():
    seen = _run(5, started_at=15)
    assert seen["own"] == 15 and seen["helper"] == 15
    assert not (seen["said"] or "").startswith("nice ")  # the session's nice may still go from 0 to 5


def test_zero_leaves_the_priority_alone():
    seen = _run(0)
    assert seen["said"] is None and seen["own"] == 0
