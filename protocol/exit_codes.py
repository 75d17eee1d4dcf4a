"""The exit codes of every `agora-node` role, in one table: operators script against them, so a
code never changes meaning. `--help` and docs/cli.md show `EXIT_CODES` as it is here."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    LEFT_STAGE = 3
    ADMISSION_REJECTED = 4
    REVOKED = 5
    CREDENTIAL_EXPIRED = 6
    WAIT_TIMED_OUT = 7
    DEVICE_FAULT = 8
    NON_FINITE_GRADIENTS = 9
    LOST_CONNECTIVITY = 10
    PROGRESS_UNREADABLE = 11
    HOST_MEMORY = 12
    DEVICE_MEMORY = 13
    INTERRUPTED = 130


EXIT_CODES: dict[ExitCode, str] = {
    ExitCode.OK: "clean exit (including a first Ctrl-C or SIGTERM, after draining)",
    ExitCode.FAILURE: "unexpected failure (a bug: the log has the traceback)",
    ExitCode.USAGE: "bad input or environment: flags, config, data, memory plan, port or identity in use, "
                    "authorizer or initial peers unreachable; the message names the fix",
    ExitCode.LEFT_STAGE: "a worker left its stage: rule averaging, it failed 2 of its last 3 averaging rounds",
    ExitCode.ADMISSION_REJECTED: "the authorizer turned the node away; the message says what to change",
    ExitCode.REVOKED: "the node was banned or its credential revoked, or renewal was refused",
    ExitCode.CREDENTIAL_EXPIRED: "the credential expired while every authorizer was unreachable",
    ExitCode.WAIT_TIMED_OUT: "a command's --wait-s ran out before what it waited for happened (agora-node preempt)",
    # 8-13: a worker's self-termination rules (roles/worker/health/termination.py, docs/operations.md)
    ExitCode.DEVICE_FAULT: "a worker left its stage: rule device_fault, its device failed (CUDA error)",
    ExitCode.NON_FINITE_GRADIENTS: "a worker left its stage: rule non_finite, its gradients stayed non-finite",
    ExitCode.LOST_CONNECTIVITY: "a worker left its stage: rule connectivity, no peer answered it",
    ExitCode.PROGRESS_UNREADABLE: "a worker left its stage: rule progress, it could not read its stage's progress",
    ExitCode.HOST_MEMORY: "a worker left its stage: rule host_memory, its RAM use passed the run's limit",
    ExitCode.DEVICE_MEMORY: "a worker left its stage: rule device_memory, its device memory passed the run's limit",
    ExitCode.INTERRUPTED: "a second Ctrl-C: stopped at once, without draining",
}


def exit_code_table() -> str:
    """The table as plain text, one code a line (for --help and docs/cli.md)."""
    import textwrap

    return "\n".join(textwrap.fill(text, width=96, initial_indent=f"  {int(code):>3}  ", subsequent_indent=" " * 7)
                     for code, text in EXIT_CODES.items())
