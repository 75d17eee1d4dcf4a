"""Process lifecycle: how a node stops, and what it leaves behind (nothing), however it ends.

What a node creates outside its own memory, and who removes it:

- child processes: hivemind's DHT process, p2pd (one per libp2p instance), the worker's averager
  process, torch's shared-memory manager;
- /dev/shm/torch_<pid>_* segments: hivemind switches torch to the `file_system` sharing strategy,
  whose segments outlive a process that dies hard;
- in the temp directory: p2pd's and its clients' unix sockets (`hivemind-*.sock`), a throwaway
  identity key when no --identity is given, the trust state `agora-trust-<pid>-*`, and
  multiprocessing's `pymp-*` directory with its listener sockets (one for the whole tree: it is
  created before the first fork, so every child uses the node's).

On an orderly exit the node reaps its children itself (`reap_children`) and removes its own
sockets and `pymp-*` directory (`exit_now`): it leaves with `os._exit`, so neither hivemind's
finalizers nor multiprocessing's run. The node learns its own sockets as it binds them (an audit
hook on `socket.bind`): hivemind binds its client socket when the first handler is added, at no
moment the watchdog would look, and closes it without removing the file. For every other end
(SIGKILL, the OOM killer, a crash) a tiny watchdog process, started before anything else, holds the
read end of a pipe whose write end only the node holds. It notes the node's descendants, their
unix sockets and the paths the node registers; at end-of-file (the node is gone, by any means) it
kills the descendants still alive, removes their segments, sockets and registered paths, and exits.
Children the node forks from its main thread also get PR_SET_PDEATHSIG(SIGKILL), and the node is a
child subreaper, so grandchildren orphaned by a dead child (p2pd of a killed DHT process) stay in
its tree where both cleanups find them.

Signals: the first SIGINT/SIGTERM sets `stop` (every phase waits on it); a second one kills every
child at once and exits with ExitCode.INTERRUPTED.
"""

from __future__ import annotations

import ctypes
import faulthandler
import glob
import logging
import multiprocessing.util
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable, Optional

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
INTERRUPTED = 130
"""ExitCode.INTERRUPTED; the watchdog must not import the protocol package."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_WATCH_PERIOD_S = 0.1
"""How often the watchdog lists the node's descendants while the family is changing..."""
_QUIET_PERIOD_S = 1.0
"""...and while it is not. Listing them reads every process's /proc entry: 12 ms with 360
processes on the machine, a tenth of a core per node at 0.1 s on a busy test machine."""
_FRESH_TURNS = 30
"""A new process's unix sockets are listed on each of its first this many turns, and the family
is listed every _WATCH_PERIOD_S while one is this new or the node forked as many turns ago..."""
_SOCKETS_EVERY_S = 5.0
"""...and everyone's sockets every this many seconds after that."""


def trust_dirs(pid: int) -> list[str]:
    """The trust state directories of node `pid` (node/trust.py names them `agora-trust-<pid>-*`)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"agora-trust-{pid}-*"))


class StopRequested(Exception):
    """A stop signal arrived during a phase that was then abandoned; the node exits cleanly."""


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ProcessLifecycle:
    """The node process's signal handling and its watchdog; one per process (`lifecycle()`)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.signal_at: Optional[float] = None
        """time.monotonic() of the first stop signal."""
        self.signal_name = ""
        self.watchdog: Optional[subprocess.Popen] = None
        self._write_fd: Optional[int] = None
        self._node_only_fds: list[int] = []
        self._callbacks: list[Callable[[], None]] = []
        self._previous: dict[int, object] = {}
        self._installed_pid: Optional[int] = None
        self._forking_from_main = False
        self._temp_prefix = ""
        self.own_sockets: set[str] = set()
        """Unix sockets this process bound in the temp directory (removed by `exit_now`)."""

    @property
    def installed(self) -> bool:
        return self._installed_pid == os.getpid()

    def install(self, *, signals: bool = True) -> "ProcessLifecycle":
        """Take SIGINT/SIGTERM (unless `signals` is False: the process handles them itself), become
        a subreaper, start the watchdog. Idempotent; call it first, before anything slow and before
        any child exists."""
        if self.installed:
            return self
        self._installed_pid = os.getpid()
        for sig in (signal.SIGINT, signal.SIGTERM) if signals else ():
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        # `kill -USR1 PID` writes every thread's stack to the log (forked children inherit it):
        # how a node that hangs can be looked into without stopping it.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self._start_watchdog()
        self.remove_on_exit(multiprocessing.util.get_temp_dir())
        self._temp_prefix = os.path.join(tempfile.gettempdir(), "")
        sys.addaudithook(self._on_audit)
        os.register_at_fork(before=self._before_fork, after_in_parent=self.note_resources,
                            after_in_child=self._after_fork_in_child)
        return self

    # ---- signals ----

    def _on_signal(self, signum: int, frame) -> None:
        if self.stop.is_set():
            self.abort(f"second {signal.Signals(signum).name}")
        self.signal_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        self.stop.set()
        logger.warning("%s: stopping; send it again to stop at once", self.signal_name)
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:  # a closed loop: its phase is over, the flag is what counts now
                pass

    def on_stop(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (from the main thread, in a signal handler) when a stop signal arrives;
        at once if one already did. Returns the function that unregisters it."""
        self._callbacks.append(callback)
        if self.stop.is_set():
            callback()
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def abort(self, why: str) -> None:
        """Kill every child now and exit with INTERRUPTED; the watchdog removes what they left."""
        logger.warning("%s: stopping at once", why)
        kill_descendants(exclude=self.watchdog_pids())
        os._exit(INTERRUPTED)

    # ---- watchdog ----

    def watchdog_pids(self) -> set[int]:
        return {self.watchdog.pid} if self.watchdog is not None else set()

    def _start_watchdog(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-m", "node.lifecycle", str(os.getpid())], stdin=read_fd,
                stdout=subprocess.DEVNULL, close_fds=True, start_new_session=False)
        except OSError as exc:
            os.close(write_fd)
            logger.warning("no watchdog (%s): children may outlive this node if it is killed", exc)
            return
        finally:
            os.close(read_fd)
        self._write_fd = write_fd

    def remove_on_exit(self, path: str) -> None:
        """Have the watchdog remove `path` (a file or directory) once this process is gone."""
        if self._write_fd is None or not self.installed:
            return
        try:
            os.write(self._write_fd, os.fsencode(path) + b"\n")
        except OSError:
            pass

    def keep_from_children(self, fd: int) -> None:
        """Close `fd` in every child this process forks (a lock only the node may hold)."""
        self._node_only_fds.append(fd)

    def _on_audit(self, event: str, args: tuple) -> None:
        """Note each unix socket this process binds in the temp directory, for the watchdog and
        for `exit_now`. Runs on every audited event of the process: the first test is all most pay."""
        if event != "socket.bind" or not self.installed:
            return
        try:
            address = args[1]
            if isinstance(address, (str, bytes)) and address and address[:1] not in ("\0", b"\0"):
                path = os.fsdecode(address)
                if path.startswith(self._temp_prefix) and path not in self.own_sockets:
                    self.own_sockets.add(path)
                    self.remove_on_exit(path)
        except Exception:  # an exception here would fail the bind itself
            pass

    # ---- fork ----

    def note_resources(self) -> None:
        """Have the watchdog note our children and their sockets now, not at its next period:
        called after each fork and after each phase that starts or binds something."""
        if self._write_fd is not None and self.installed:
            try:
                os.write(self._write_fd, b"\n")
            except OSError:
                pass

    def _before_fork(self) -> None:
        self._forking_from_main = threading.current_thread() is threading.main_thread()

    def _after_fork_in_child(self) -> None:
        if self._installed_pid is None:
            return
        parent = self._installed_pid
        self._installed_pid = None
        if self._write_fd is not None:  # only the node holds the write end, or the watchdog never sees EOF
            try:
                os.close(self._write_fd)
            except OSError:
                pass
            self._write_fd = None
        for fd in self._node_only_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._node_only_fds = []
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (TypeError, ValueError):
                pass
        self._callbacks = []
        # PDEATHSIG fires when the forking *thread* exits, so only forks from the main thread get it.
        if self._forking_from_main and _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent:
            os._exit(1)


_LIFECYCLE = ProcessLifecycle()


def lifecycle() -> ProcessLifecycle:
    return _LIFECYCLE


def begin_process() -> ProcessLifecycle:
    """The first call of a node process: signals, subreaper, watchdog."""
    return _LIFECYCLE.install()


def guard_children() -> ProcessLifecycle:
    """For a process that handles its signals itself but starts children (the authorizer's health
    monitor forks hivemind's DHT, which starts p2pd): subreaper, watchdog and PDEATHSIG, so its
    children and their sockets go with it however it dies."""
    return _LIFECYCLE.install(signals=False)


def exit_now(code: int) -> None:
    """End the process once the node has closed everything: skip the interpreter's teardown
    (torch's takes about a second on two busy cores, and a stop must take under two). The
    watchdog then removes our own shared-memory segments, which that teardown would have freed.
    torch's shared-memory manager, spared by `reap_children` for that teardown, goes now too."""
    for pid in descendant_pids():
        if pid not in _LIFECYCLE.watchdog_pids():
            kill_tree(pid)
    remove_own_files()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(code))


def remove_own_files() -> None:
    """Remove this process's unix sockets in the temp directory (hivemind's P2P client socket, bound
    when the first handler is added, is closed only by a finalizer) and multiprocessing's `pymp-*`
    directory: both outlive a process that leaves with `os._exit`. The watchdog would remove them
    too, but only those it noticed, and only after the node is gone."""
    try:
        sockets = _unix_sockets(psutil.Process())
    except psutil.Error:
        sockets = set()
    for path in sockets | _LIFECYCLE.own_sockets:
        _remove_path(path)
    if _LIFECYCLE.installed:  # its pymp directory was created at install (a child has its parent's)
        _remove_path(multiprocessing.util.get_temp_dir())
    for cache in glob.glob(os.path.join(tempfile.gettempdir(), "torchinductor_*")):
        try:
            os.rmdir(cache)  # the empty cache directory importing torch creates; never one in use
        except OSError:
            pass


# ---- reaping ----


def descendant_pids(pid: int | None = None) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def kill_descendants(exclude: Iterable[int] = ()) -> list[int]:
    """SIGKILL every descendant of this process (but `exclude`); returns their pids."""
    excluded = set(exclude)
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in excluded]
    except psutil.Error:
        return []
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    return [c.pid for c in children]


def kill_tree(pid: int, timeout_s: float = 3.0) -> None:
    """Kill process `pid` and its descendants at once (a half-started child has nothing worth
    saving) and remove the unix sockets and segments they leave."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    sockets: set[str] = set()
    for process in tree:
        sockets |= _unix_sockets(process)
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass
    _wait_gone(tree, timeout_s)
    remove_shared_memory(p.pid for p in tree)
    for path in sockets:
        _remove_path(path)


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> None:
    """Wait until each process is gone or a zombie: an orphan's zombie lasts until whoever
    inherited it reaps it, which is not ours to wait for."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        while time.monotonic() < deadline:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    break
                process.wait(0.02)
                break
            except psutil.TimeoutExpired:
                continue
            except psutil.Error:
                break


def reap_children(timeout_s: float = 5.0) -> None:
    """Terminate, then kill, every descendant process still alive (but the watchdog), wait for
    them, and remove the shared-memory segments they created. Our own segments are freed by torch
    when we exit; unlinking them under it would make it abort."""
    watchdog = _LIFECYCLE.watchdog_pids() if _LIFECYCLE.installed else set()
    try:
        children = [c for c in psutil.Process().children(recursive=True)
                    if c.pid not in watchdog and not _is_shm_manager(c)]
    except psutil.Error:
        children = []
    pids = [c.pid for c in children]
    sockets: set[str] = set()
    for child in children:
        sockets |= _unix_sockets(child)
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    if alive:
        logger.warning("killed %d child process(es) that ignored SIGTERM", len(alive))
    remove_shared_memory(pids)
    for path in sockets:  # a child terminated mid-way does not remove its own
        _remove_path(path)


def _is_shm_manager(process: psutil.Process) -> bool:
    """torch's shared-memory manager must outlive our last shared tensor: killing it makes torch
    abort at exit ("Broken pipe"). It leaves by itself once its clients are gone."""
    try:
        return process.name() == "torch_shm_manager"
    except psutil.Error:
        return False


def shared_memory_files(pids: Iterable[int], born_after: Optional[float] = None) -> list[str]:
    """torch's /dev/shm segments named after `pids`; with `born_after` (a time.time()), only those
    created since: pids are reused (32,768 of them on most hosts), and a segment some earlier
    process of the same pid leaked is not ours."""
    files: list[str] = []
    for pid in set(pids):
        for path in glob.glob(os.path.join(SHM_DIR, f"torch_{pid}_*")):
            if born_after is not None:
                try:
                    if os.stat(path).st_ctime < born_after - 1.0:
                        continue
                except OSError:
                    continue
            files.append(path)
    return files


def remove_shared_memory(pids: Iterable[int], born_after: Optional[float] = None) -> None:
    """Unlink the torch segments of `pids`; memory still mapped stays valid until unmapped."""
    for path in shared_memory_files(pids, born_after):
        try:
            os.unlink(path)
        except OSError:
            pass


# ---- the watchdog process ----


def _unix_sockets(process: psutil.Process) -> set[str]:
    temp = tempfile.gettempdir()
    try:
        connections = process.net_connections(kind="unix")
    except (psutil.Error, AttributeError, OSError):
        return set()
    return {c.laddr for c in connections if isinstance(c.laddr, str) and c.laddr.startswith(temp)}


def _remove_path(path: str) -> None:
    import shutil

    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
    parent = os.path.dirname(path)
    # torch_shm_manager's private socket directory; multiprocessing's, of a listener socket
    if os.path.basename(parent).startswith(("torch-shm-dir-", "pymp-")):
        try:
            os.rmdir(parent)
        except OSError:
            pass


def watch(node_pid: int, fd: int = 0) -> None:
    """The watchdog's loop: note the node's descendants until the pipe closes, then clean up.
    A process's sockets are bound and its own children started soon after it starts, so the family
    is listed every _WATCH_PERIOD_S while a process in it is new (and after the node wakes the loop,
    which it does whenever it forks) and every _QUIET_PERIOD_S otherwise; a child started in between
    is still found at the end, under its parent (`_clean_up`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the whole group
    me = os.getpid()
    try:
        node = psutil.Process(node_pid)
    except psutil.Error:
        node = None
    known: dict[int, float] = {}
    processes: dict[int, psutil.Process] = {}
    fresh: dict[int, int] = {}
    sockets: set[str] = set()
    paths: list[str] = []
    pending = b""
    busy_turns = _FRESH_TURNS
    sockets_listed = time.monotonic()
    while node is not None:
        period = _WATCH_PERIOD_S if fresh or busy_turns > 0 else _QUIET_PERIOD_S
        ready, _, _ = select.select([fd], [], [], period)
        busy_turns -= 1
        rescan = False
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            paths.extend(os.fsdecode(line) for line in lines if line)
            rescan = any(not line for line in lines)  # an empty line: the node forked or bound something
            if rescan:
                busy_turns = _FRESH_TURNS
        try:
            family = [node, *node.children(recursive=True)]
        except psutil.Error:
            break
        for process in family:
            if process.pid == me or process.pid in known:
                continue
            try:
                known[process.pid] = process.create_time()
            except psutil.Error:
                continue
            processes[process.pid] = process
            fresh[process.pid] = _FRESH_TURNS
        for pid in list(fresh):
            sockets |= _unix_sockets(processes[pid])
            fresh[pid] -= 1
            if fresh[pid] <= 0:
                del fresh[pid]
        if rescan or time.monotonic() - sockets_listed >= _SOCKETS_EVERY_S:
            sockets_listed = time.monotonic()
            for process in processes.values():
                sockets |= _unix_sockets(process)
    _clean_up(node_pid, known, sockets, paths)


def _clean_up(node_pid: int, known: dict[int, float], sockets: set[str], paths: list[str]) -> None:
    victims = []
    for pid, created in known.items():
        if pid == node_pid:
            continue
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) > 0.01:
                continue  # the pid was reused by someone else
            # stop it before listing its children, so it starts none after the list; but not
            # torch's shared-memory manager, which starts none: if this watchdog dies before the
            # kill below (a SIGKILL to the node's whole group), it would stay stopped forever,
            # while left running it leaves by itself once its clients are gone
            if not _is_shm_manager(process):
                process.suspend()
            victims.append(process)
        except psutil.Error:
            continue
    # a process started since the last listing is still under its parent, a known descendant (the
    # node announces its own forks, and its children die with it by PDEATHSIG)
    for parent in list(victims):
        try:
            grandchildren = parent.children(recursive=True)
        except psutil.Error:
            continue
        for process in grandchildren:
            if process.pid not in known and process.pid != os.getpid():
                try:
                    known[process.pid] = process.create_time()
                    victims.append(process)
                except psutil.Error:
                    continue
    for process in victims:
        sockets |= _unix_sockets(process)  # one found only now bound its sockets unseen
        try:
            process.kill()
        except psutil.Error:
            continue
    _wait_gone(victims, 3.0)
    remove_shared_memory([node_pid, *known], born_after=min(known.values(), default=None))
    for path in [*sockets, *paths, *trust_dirs(node_pid)]:
        _remove_path(path)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
