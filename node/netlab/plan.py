"""What a lab is made of, as pure data: its hosts, their names in the kernel (namespaces, devices),
their addresses and the nominal link figures that measurements are compared with. No side effects;
topology.py turns a plan into namespaces and devices.

Delay model: every host has a one-way access delay d = rtt_ms / 2 on its own link, in each
direction, so a packet from a to b is delayed d_a + d_b and RTT(a, b) = 2 (d_a + d_b) =
rtt_ms(a) + rtt_ms(b). A host with rtt_ms=X therefore has RTT X to an unshaped, zero-delay host
(the controller, for instance).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import string
from dataclasses import dataclass
from typing import Optional

CONTROLLER = "controller"
"""The root namespace's own lab host: no shaping, no delay; the runner reaches every node from it."""

PREFIX = "agl"
"""Every namespace and device a lab creates starts with this, then '-' and the lab id."""

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
_LAB_ID = re.compile(r"^[a-z0-9]{1,8}$")
_PREFIX = re.compile(r"^[a-z]{1,4}$")


@dataclass(frozen=True)
class HostSpec:
    """One lab host: a network namespace behind a residential-style access link."""

    name: str
    """e.g. "auth", "w0-0", "t0"; letters, digits, '.', '_' and '-'."""
    up_mbit: Optional[float] = None
    """Upload rate in Mbit/s; None = unshaped."""
    down_mbit: Optional[float] = None
    """Download rate in Mbit/s; None = unshaped."""
    rtt_ms: float = 0.0
    """RTT to an unshaped zero-delay host; the host's one-way access delay is rtt_ms / 2."""
    behind: Optional[str] = None
    """The lab host this one sits behind as a home router does: its namespace is not on the switch
    but on the router's LAN (a bridge, unshaped), and the router masquerades its traffic with
    nftables, so it can connect out and nothing outside can connect in. A router may sit behind
    another (two levels: a stand-in for carrier-grade NAT). The router's own link is the shaped one;
    link figures of a host behind a router are refused."""

    def __post_init__(self) -> None:
        if not _HOST_NAME.match(self.name) or self.name == CONTROLLER:
            raise ValueError(f"host name {self.name!r} is not allowed: use up to 40 letters, digits, '.', '_' "
                             f"or '-' (and not {CONTROLLER!r}, the root namespace's name)")
        check_link(up_mbit=self.up_mbit, down_mbit=self.down_mbit, rtt_ms=self.rtt_ms)
        if self.behind is not None and (self.up_mbit or self.down_mbit or self.rtt_ms):
            raise ValueError(f"host {self.name!r} sits behind {self.behind!r}: shape the router's link, not its own")


def check_link(*, up_mbit: Optional[float], down_mbit: Optional[float], rtt_ms: float) -> None:
    """Refuse link figures the lab cannot apply, with the reason."""
    for label, value in (("up_mbit", up_mbit), ("down_mbit", down_mbit)):
        if value is not None and not (0.01 <= value <= 100_000):
            raise ValueError(f"{label}={value} is out of range: give 0.01..100000 Mbit/s, or None for unshaped")
    if not (0.0 <= rtt_ms <= 10_000):
        raise ValueError(f"rtt_ms={rtt_ms} is out of range: give 0..10000 ms")


def new_lab_id() -> str:
    """A short random id that tells this lab's namespaces and devices from other labs'."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))


def check_names(prefix: str, lab_id: str) -> None:
    if not _PREFIX.match(prefix):
        raise ValueError(f"prefix {prefix!r} must be 1-4 lowercase letters")
    if not _LAB_ID.match(lab_id):
        raise ValueError(f"lab_id {lab_id!r} must be 1-8 lowercase letters or digits")


def netns_name(prefix: str, lab_id: str, host: str) -> str:
    return f"{prefix}-{lab_id}-{host}"


def device_name(prefix: str, lab_id: str) -> str:
    """The TUN device's name, the same in every namespace of the lab (at most 13 characters, under
    the kernel's 15)."""
    return f"{prefix}-{lab_id}"


def lab_id_of(prefix: str, name: str) -> Optional[str]:
    """The lab id in a namespace or device name this module made, or None if it is not one."""
    if not name.startswith(prefix + "-"):
        return None
    lab_id = name[len(prefix) + 1:].split("-", 1)[0]
    return lab_id if _LAB_ID.match(lab_id) else None


def allocate_addresses(subnet: str, hosts: list[str]) -> dict[str, str]:
    """The controller gets the subnet's first address, the hosts the next ones in order."""
    net = ipaddress.IPv4Network(subnet, strict=True)
    if len(set(hosts)) != len(hosts) or CONTROLLER in hosts:
        raise ValueError(f"host names must be unique and not {CONTROLLER!r}: {hosts}")
    if net.num_addresses - 2 < len(hosts) + 1:
        raise ValueError(f"subnet {subnet} has room for {max(net.num_addresses - 2, 0)} addresses; "
                         f"the lab needs {len(hosts) + 1}")
    first = int(net.network_address) + 1
    names = [CONTROLLER, *hosts]
    return {name: str(ipaddress.IPv4Address(first + i)) for i, name in enumerate(names)}


def one_way_delay_s(rtt_ms: float) -> float:
    return rtt_ms / 2000.0


def nominal_rtt_ms(a: HostSpec | None, b: HostSpec | None) -> float:
    """RTT(a, b) = rtt_ms(a) + rtt_ms(b); None stands for the controller."""
    return (a.rtt_ms if a else 0.0) + (b.rtt_ms if b else 0.0)


def nominal_mbit(a: HostSpec | None, b: HostSpec | None) -> Optional[float]:
    """Bulk a->b is bounded by a's upload and b's download; None when neither is shaped."""
    limits = [x for x in ((a.up_mbit if a else None), (b.down_mbit if b else None)) if x is not None]
    return min(limits) if limits else None
