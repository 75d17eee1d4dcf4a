"""Writing small state files so that a crash never leaves half of one behind."""

from __future__ import annotations

import os
import tempfile


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it over `path`:
    readers see the old file or the new one, never a torn one. `mode` applies before any byte is
    written, so secrets are never briefly world-readable."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
