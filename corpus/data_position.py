"""How far a trainer has read its share of a prepared corpus, kept on disk across restarts.

Samples end out of order (lanes run side by side), so the position is a watermark, `next`:
every ordinal below it has ended; plus the ordinals above it that ended already. A sample that
completed, or was dropped and counted, has ended; one cut off by a stop or a crash has not, and
a restarted trainer trains it. The file is rewritten atomically at every end (a few hundred
bytes), so a killed trainer loses at most the samples in flight, which it then trains again.
The key (corpus hash, shard, shard count, seq_len, seed) must match, or the file describes
another walk through the data and is set aside.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["DataPosition"]

log = logging.getLogger(__name__)


class DataPosition:
    def __init__(self, path: Path, key: dict[str, Any]):
        self.path = path
        self.key = key
        self.next = 0
        self._above: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, key: dict[str, Any]) -> "DataPosition":
        position = cls(path, key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return position
        except (OSError, ValueError) as exc:
            log.warning("the data position %s is unreadable (%s); this trainer starts its shard from the beginning",
                        path, exc)
            return position
        if data.get("key") != key:
            aside = path.with_name(path.name + ".other")
            os.replace(path, aside)
            log.warning("the data position %s was recorded for other data or sharding (%s); it is kept as %s and "
                        "this trainer starts its shard from the beginning", path, data.get("key"), aside.name)
            return position
        position.next = int(data["next"])
        position._above = {int(o) for o in data.get("ended_above", []) if int(o) > position.next}
        return position

    def has_ended(self, ordinal: int) -> bool:
        return ordinal < self.next or ordinal in self._above

    def end(self, ordinal: int) -> None:
        with self._lock:
            if self.has_ended(ordinal):
                return
            self._above.add(ordinal)
            while self.next in self._above:
                self._above.discard(self.next)
                self.next += 1
            self._write()

    def save(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"key": self.key, "next": self.next, "ended_above": sorted(self._above)}))
        os.replace(tmp, self.path)
