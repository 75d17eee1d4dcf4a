"""A Python that has already imported what a node imports, and forks `agora-node` processes from
there, for the integration tests.

A node's imports (torch, torch._dynamo, hivemind, scipy, the role's own modules) cost 4-5 s of
CPU, most of a worker's start; the suite starts some hundreds of nodes on two cores. Forked
from this process a node skips them and runs exactly what `python -m MODULE ARGS` runs from
there on (`runpy`, the same `__main__`, the same exit), in its own session, with its own
environment, working directory, stdout and stderr: it is still a real node process with its
own pid, signals and children. Only plain `PYTHON -m MODULE ...` commands are forked, optionally
behind `env VAR=VALUE ...` or `ip netns exec NAME` (the network lab's hosts: the child enters the
namespace with setns(2), as `ip netns exec` does, but without its private mount of /sys, which no
node reads); anything else runs as before.

    python -m tests.support.node_zygote SOCKET_NAME [MODULE ...]

imports the MODULEs (NodeZygote passes PRELOADED), then serves, on the abstract Unix socket
SOCKET_NAME, one SOCK_SEQPACKET request per connection: a JSON message {argv, env, cwd, netns}
with the node's stdout and stderr as SCM_RIGHTS file descriptors. It answers {"pid": N} at once and
{"returncode": N} when the node has exited (Popen's convention: -SIGNAL when killed), then
closes. It is single-threaded, so forking is safe, and leaves when its stdin closes (the test
process ended).
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import NamedTuple, Optional, Sequence

PRELOADED = ("node.cli", "node.daemon", "roles.worker.role", "roles.trainer.role", "roles.relay.service",
             "torch._dynamo", "authorizer.main", "authorizer.app")
"""What the nodes of the tests import (tests/unit/test_node_zygote.py checks that each exists)."""
MAX_REQUEST_BYTES = 1 << 20
NETNS_DIR = "/run/netns"
"""Where `ip netns add` keeps a named network namespace (bind-mounted /proc/PID/ns/net)."""
_CLONE_NEWNET = 0x40000000


class Forkable(NamedTuple):
    """A command the zygote can run: `python -m` argv, extra environment, network namespace."""

    argv: list[str]
    env: dict[str, str]
    netns: Optional[str] = None


class ZygoteChild:
    """The part of `subprocess.Popen` the launcher uses, for a node forked by the zygote."""

    def __init__(self, conn: socket.socket, pid: int, stdout):
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None
        self.args = None
        self._conn = conn
        self._exited = threading.Event()
        threading.Thread(target=self._await_exit, name=f"zygote-child-{pid}", daemon=True).start()

    def _await_exit(self) -> None:
        try:
            message = self._conn.recv(4096)
            code = json.loads(message)["returncode"] if message else -signal.SIGKILL
        except (OSError, ValueError, KeyError):
            code = -signal.SIGKILL  # the zygote died: its children died with it or are orphans
        finally:
            self._conn.close()
        self.returncode = int(code)
        self._exited.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class NodeZygote:
    """Starts the zygote server and forks nodes through it (`popen`, in place of subprocess.Popen)."""

    def __init__(self, env: Optional[dict[str, str]] = None, preload: Sequence[str] = PRELOADED):
        # An abstract socket (Linux): no file, so nothing a test could take for a node's leftover
        # (a child holds the listener for an instant after its fork).
        name = f"agora-zygote-{uuid.uuid4().hex}"
        self.path = "\0" + name
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.node_zygote", name, *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the node zygote did not start: {line!r}")

    @staticmethod
    def forkable(cmd: Sequence[str]) -> Optional[Forkable]:
        """What the zygote runs for `cmd`, or None when it cannot run it."""
        cmd, extra, netns = list(cmd), {}, None
        if cmd[:3] == ["ip", "netns", "exec"] and len(cmd) > 3 and "/" not in cmd[3]:
            netns, cmd = cmd[3], cmd[4:]
        if cmd and cmd[0] == "env":
            cmd = cmd[1:]
            while cmd and "=" in cmd[0] and not cmd[0].startswith("-"):
                name, _, value = cmd.pop(0).partition("=")
                extra[name] = value
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
            return None
        return Forkable([cmd[2], *cmd[3:]], extra, netns)

    def popen(self, cmd: Sequence[str], *, stdout=None, stderr=None, env: Optional[dict[str, str]] = None, **kwargs):
        """subprocess.Popen(cmd, stdout=PIPE, stderr=FILE, text=True, env=..., start_new_session=True),
        forked from the zygote where `cmd` allows, else started as before."""
        forkable = self.forkable(cmd) if self.proc.poll() is None else None
        if forkable is None or stdout != subprocess.PIPE or not hasattr(stderr, "fileno"):
            return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, **kwargs)
        read_end, write_end = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": forkable.argv,
                                  "env": {**(os.environ if env is None else env), **forkable.env},
                                  "cwd": os.fspath(kwargs.get("cwd") or os.getcwd()),
                                  "netns": forkable.netns}).encode()
            socket.send_fds(conn, [request], [write_end, stderr.fileno()])
            pid = json.loads(conn.recv(4096))["pid"]
        except (OSError, ValueError, KeyError):
            conn.close()
            os.close(read_end)
            return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, **kwargs)
        finally:
            os.close(write_end)
        return ZygoteChild(conn, pid, os.fdopen(read_end, "r", encoding="utf-8", errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _own_process_state() -> None:
    """Give the child what a fresh interpreter has of its own but a fork shares with the zygote and
    every other node forked from it: hivemind's process-wide locks, created when it is imported.
    Shared, one node SIGKILLed while holding one (the tests kill nodes) left every other node's
    DHT process waiting on it for good."""
    if "hivemind" not in sys.modules:
        return
    import multiprocessing as mp

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # MPFuture's two locks and SharedBytes' lock
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the named network namespace, as `ip netns exec` does."""
    import ctypes

    if name in ("", ".", "..") or "/" in name:  # a name, not a path out of NETNS_DIR
        raise OSError(errno.EINVAL, f"no network namespace name: {name!r}")
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"setns into network namespace {name!r}: {os.strerror(code)}")
    finally:
        os.close(fd)


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the node `python -m MODULE ARGS` would be, run it, exit."""
    import atexit
    import io
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        out, err = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True,
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True, write_through=True)
        _own_process_state()
        if request.get("netns"):
            try:
                _enter_netns(request["netns"])
            except OSError as exc:
                print(f"node zygote: {exc}", file=sys.stderr)
                raise
        module, *args = request["argv"]
        sys.argv = [module, *args]
        # As under `python -m`, the module runs as __main__ only; an import of it by name loads it apart.
        sys.modules.pop(module, None)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
            traceback.print_exc()
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def serve(name: str, preload: Sequence[str]) -> None:
    """Import `preload`, then fork a node for each request until stdin closes."""
    import importlib

    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the node's own import reports it where it belongs
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return
        if listener in readable:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 2)
            except OSError:
                conn.close()
                continue
            try:
                request = json.loads(message)
                if len(fds) != 2:
                    raise ValueError(f"{len(fds)} file descriptors, not stdout and stderr")
            except ValueError:
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                _run_child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
