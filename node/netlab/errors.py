"""Errors of the network lab.

    AgoraError
    └── LabError              the lab could not be built or driven; the message says what to do
        ├── LabUnavailable    this machine cannot run a lab (not root, no /dev/net/tun, no `ip`)
        └── SubnetInUse       the lab's subnet is already routed in the root namespace
"""

from __future__ import annotations

from protocol.errors import AgoraError


class LabError(AgoraError):
    """The lab could not be built or driven; the message is one line that says what to do."""


class LabUnavailable(LabError):
    """This machine cannot run a lab: not root, no /dev/net/tun, or no iproute2."""


class SubnetInUse(LabError):
    """The lab's subnet is already routed in the root namespace (another lab, or a real network)."""
