"""The one line every `agora-node` process prints on stdout when it serves, whatever its role:

    agora-node ready role=worker stage=0 peer=Qm... maddrs=/ip4/127.0.0.1/tcp/40123/p2p/Qm...
    agora-node ready role=authorizer stage=- peer=- url=http://127.0.0.1:8000

A node started with --metrics-port adds `metrics=http://HOST:PORT` (its /metrics, /healthz and
/readyz live there), so a test or script that asked for port 0 learns the port.

Scripts, the demo and the tests wait for it; it is written and read only here.
"""

from __future__ import annotations

from typing import Optional, Sequence

READY_PREFIX = "agora-node ready "


def ready_line(role: str, *, stage: Optional[int] = None, peer: str = "-", maddrs: Sequence[str] = (),
               url: Optional[str] = None, metrics: Optional[str] = None) -> str:
    fields = [f"role={role}", f"stage={'-' if stage is None else stage}", f"peer={peer or '-'}"]
    if maddrs:
        fields.append(f"maddrs={','.join(maddrs)}")
    if url:
        fields.append(f"url={url}")
    if metrics:
        fields.append(f"metrics={metrics}")
    return READY_PREFIX + " ".join(fields)


def parse_ready_line(line: str) -> Optional[dict[str, str]]:
    """The fields of a readiness line, or None if `line` is not one."""
    if not line.startswith(READY_PREFIX):
        return None
    return dict(part.split("=", 1) for part in line[len(READY_PREFIX):].split() if "=" in part)
