"""The preload thread imports a role's modules while the node waits, and is never running when
hivemind forks: it stops between two imports (node/preload.py)."""

from __future__ import annotations

import asyncio
import sys
import threading

from node.preload import ROLE_MODULES, Preload


def _modules(tmp_path, monkeypatch, names, slow_s=0.3):
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in names:
        sys.modules.pop(name, None)
        monkeypatch.delitem(sys.modules, name, raising=False)
        (tmp_path / f"{name}.py").write_text(f"import threading, time\ntime.sleep({slow_s})\n"
                                             "THREAD = threading.current_thread().name\n")


def _preload_threads():
    return [t for t in threading.enumerate() if t.name == "preload"]


def test_pause_waits_for_the_import_in_progress_and_late_modules_wait_for_the_fork(tmp_path, monkeypatch):
    names = ["preload_a", "preload_b", "preload_c"]
    _modules(tmp_path, monkeypatch, names)

    async def scenario():
        preload = Preload(early=names[:2], late=names[2:])
        preload.resume()
        await asyncio.sleep(0.1)  # inside preload_a's import
        await preload.pause()
        assert not _preload_threads(), "a paused preload left its thread running: a fork now is unsafe"
        imported = [n for n in names if n in sys.modules]
        preload.resume()
        await preload.pause()  # ends after preload_b: preload_c waits for the fork
        before_fork = [n for n in names if n in sys.modules]
        preload.forked()
        await preload.finish()
        return imported, before_fork, preload.done

    imported, before_fork, done = asyncio.run(scenario())
    assert imported == ["preload_a"]
    assert before_fork == ["preload_a", "preload_b"]
    assert done and all(sys.modules[n].THREAD == "preload" for n in names)
    assert not _preload_threads()


def test_a_module_that_fails_is_left_to_the_role_and_the_rest_still_load(tmp_path, monkeypatch):
    _modules(tmp_path, monkeypatch, ["preload_ok"], slow_s=0)
    (tmp_path / "preload_broken.py").write_text("raise ImportError('broken on purpose')\n")

    async def scenario():
        preload = Preload(early=["preload_broken", "preload_ok"])
        await preload.finish()
        return preload.done

    assert asyncio.run(scenario())
    assert "preload_ok" in sys.modules and "preload_broken" not in sys.modules


def test_every_role_module_named_exists():
    import importlib.util

    for early, late in ROLE_MODULES.values():
        for name in (*early, *late):
            assert importlib.util.find_spec(name) is not None, name
