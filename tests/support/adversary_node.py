"""A real `agora-node` whose worker cheats, for tests and benchmarks of how the swarm detects it.

    python -m tests.support.adversary_node --attack SPEC [--attack SPEC ...] -- PYTHON -m node.cli ARGS...

patches `StageRuntime` in this process (tests/support/adversary.py) and runs `node.cli.main(ARGS)`
here, so the process is the node: same pid, same signals, same exit codes, same readiness line.
The shipped code has no flag, option or hook for this. From a test, start a node through it with
the launcher's prefix:

    swarm.start("worker", stage=1, prefix=adversary_prefix("scale:3"))

`adversary_prefix` also puts the repository on PYTHONPATH (`tests` is not an installed package).

Attacks (SPEC), by the direction they alter; everything else the worker sends and its own
training state (weights, accumulated gradients, kept activations, step counts) stay honest:

  forward outputs: forward replies of a head or body (trainer-driven and chained alike) and, unless
  `eval:0`, its held-out evaluation coordinates; a tail sends none (a warning says so):
    scale:K        the output times K
    noise:SNR      plus Gaussian noise of std std(output)/SNR, per sample (seeded generator)
    bias:EPS       plus EPS * RMS(output) * sqrt(rank) * u at every position, u a fixed unit vector
                   of the coordinate space (seeded): the added tensor's RMS is EPS times the output's
    swap           another sample's output: the batch rolled by one; a batch of one gets the previous
                   batch's last output of the same shape (none yet: sent honestly)
    stale:N        the output on the stage's weights of N optimizer steps ago (a replay; the oldest
                   kept until N steps were taken, honest while those are the current weights)
  input gradients: backward replies of a body or tail (the head sends none) and, unless `eval:0`,
  the input gradients of evaluations that ask for one (spot checks re-executing a backward):
    zero_grad      the input gradient zeroed
    flip_grad      the input gradient sign-flipped
  losses: the tail's reported loss, in backward replies and, unless `eval:0`, held-out evaluations:
    loss:K         the loss times K (its gradients stay honest)
    loss_const:C   the loss reported as C
  SparseLoCo fragments (averaging.method sparseloco): what it sends its stage's other replicas:
    sloco_scale:K  its pseudo-gradient fragment times K before compression, signed as usual (its own
                   anchor, error buffer and applied update stay honest); `every:N` counts rounds
  AsyncSPARTA all-reduce parts (averaging.method asyncsparta): what it sends its stage's reducers:
    spart_scale:K  every part it sends another reducer times K, sealed as usual (the slice it
                   reduces and the average it applies stay honest); `every:N` counts rounds

Modifiers, after a comma:
    every:N        cheat on one sample in N only: the 1st, N+1th, ... of the attack's direction,
                   by a counter over the process's life (`noise:1,every:10`)
    eval:0         answer held-out evaluations honestly (default eval:1: they are altered too)

Several `--attack`s apply in the order given. Each logs (stderr, the node's log) its first altered
sample and then one line per 100, `adversary: altered N samples (SPEC)`, and its total when the
worker stops, `adversary: altered N samples (SPEC) in all`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from tests.support.adversary import install, parse_attack

REPO_ROOT = Path(__file__).resolve().parents[2]


def adversary_prefix(*specs: str) -> list[str]:
    """The launcher prefix (LocalSwarm.start(prefix=...)) that runs a node with `specs`: `env`
    execs the interpreter, so the pid the launcher holds is still the node's."""
    for spec in specs:
        parse_attack(spec)  # a typo fails in the test, not in a node's log
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    attacks = [arg for spec in specs for arg in ("--attack", spec)]
    return ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-m", "tests.support.adversary_node", *attacks, "--"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.support.adversary_node",
                                usage="%(prog)s --attack SPEC [--attack SPEC ...] -- PYTHON -m node.cli ARGS...",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attack", action="append", required=True, type=_attack_spec, metavar="SPEC",
                   help="an attack, e.g. scale:3, noise:10,every:4, flip_grad, stale:2, loss_const:0.5")
    return p


def _attack_spec(spec: str) -> str:
    try:
        parse_attack(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our options, the node's ARGS) from `OPTIONS -- PYTHON -m node.cli ARGS`; ValueError else."""
    argv = list(argv)
    if "--" not in argv:
        raise ValueError("no '--': give the node's command line after it (PYTHON -m node.cli ARGS)")
    at = argv.index("--")
    own, command = argv[:at], argv[at + 1:]
    if len(command) < 3 or command[1:3] != ["-m", "node.cli"] or not os.path.basename(command[0]).startswith("python"):
        raise ValueError(f"after '--' comes the node's command line, PYTHON -m node.cli ARGS; got {command[:3]}")
    return own, command[3:]


def run_node(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]],
             install_from: Callable[[argparse.Namespace], None]) -> int:
    """Parse our options before '--', install what they ask for in this process, then run the
    node's command line after it here (shared with tests/support/faults_node.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv and {"-h", "--help"} & set(argv):
        parser.parse_args(argv)  # prints the help and exits
    try:
        own, node_argv = split_argv(argv)
    except ValueError as exc:
        parser.error(str(exc))
    install_from(parser.parse_args(own))
    from node import cli

    return cli.main(node_argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_node(_parser(), argv, lambda options: install([parse_attack(spec) for spec in options.attack]))


if __name__ == "__main__":
    sys.exit(main())
