"""A real `agora-node` with faults injected, for tests of how a worker and its swarm handle them.

    python -m tests.support.faults_node --fault NAME=VALUE [--fault ...] -- PYTHON -m node.cli ARGS...

wraps the product in this process (tests/support/faults.py lists the faults) and runs
`node.cli.main(ARGS)` here, so the process is the node: same pid, same signals, same exit codes,
same readiness line. The shipped code has no flag, option or hook for any fault. From a test,
start a node through it with the launcher's prefix:

    swarm.start("worker", stage=0, prefix=faults_prefix(fail_forwards=3))
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from tests.support.adversary_node import REPO_ROOT, run_node
from tests.support.faults import install, parse_fault


def faults_prefix(**faults: object) -> list[str]:
    """The launcher prefix (LocalSwarm.start(prefix=...)) that runs a node with `faults`
    (NAME=VALUE; see tests/support/faults.py): `env` execs the interpreter, so the pid the
    launcher holds is still the node's. It also puts the repository on PYTHONPATH."""
    specs = [f"{name}={value}" for name, value in faults.items()]
    for spec in specs:
        parse_fault(spec)  # a typo fails in the test, not in a node's log
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    args = [arg for spec in specs for arg in ("--fault", spec)]
    return ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-m", "tests.support.faults_node", *args, "--"]


def _fault_spec(spec: str) -> str:
    try:
        parse_fault(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.faults_node",
                                     usage="%(prog)s --fault NAME=VALUE [--fault ...] -- PYTHON -m node.cli ARGS...",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", action="append", required=True, type=_fault_spec, metavar="NAME=VALUE")
    return run_node(parser, argv, lambda options: install(options.fault))


if __name__ == "__main__":
    sys.exit(main())
