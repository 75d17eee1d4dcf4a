"""A NAT lab that looks like the internet: network namespaces joined by veth pairs, public-class
addresses on the internet side, and home routers that masquerade with nftables.

The TUN lab (topology.py) shapes links and puts every host, the controller included, on one
private-class subnet. This one shapes nothing and is made to look like what a contributor's node
meets on its way in:

  - an "internet": a bridge in its own namespace; every public host (authorizer, relays, public
    workers, trainers) is a namespace with one veth onto it, on an address of
    INTERNET_SUBNET (198.18.0.0/24 by default, of the range reserved for benchmarks: routed
    nowhere, and not one of the private classes 10/8, 172.16/12, 192.168/16 or 100.64/10 that
    libp2p treats as a LAN, so a relay there is treated as a real one on the internet is);
  - home routers: a namespace with a WAN veth on the internet (or on a carrier router's LAN, for
    two levels of NAT) and a LAN bridge on 192.168.N.0/24; nftables masquerades whatever leaves by
    the WAN and forwards nothing in but replies (established, related); a port forward (DNAT) is
    added on request, as a user would on their router;
  - carrier NAT: a router whose LAN is on 100.64.N.0/24 (the shared address space RFC 6598 gives
    carriers), with home routers behind it.

The root namespace is on none of it: no route leads out of the lab, so nothing a node sends can
leave the machine, and the runner reaches the nodes only through the processes it starts in them.
What a lab leaves behind while it runs and how it is removed: cleanup.py (prefix "agn").
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass
from typing import Optional

from node.netlab import cleanup
from node.netlab.errors import LabError, LabUnavailable
from node.netlab.plan import check_names, netns_name, new_lab_id

PREFIX = "agn"
"""Every namespace of a NAT lab starts with this, '-' and the lab id."""

INTERNET_SUBNET = "198.18.0.0/24"
"""The lab internet's addresses: public-class (not a private range), and routed nowhere."""

CARRIER_SUBNETS = "100.64.0.0/16"
"""Carrier routers' LANs, one /24 each (RFC 6598 shared address space)."""

HOME_SUBNETS = "192.168.0.0/16"
"""Home routers' LANs, one /24 each."""

BACKBONE = "ix"
"""The internet's namespace (a bridge and nothing else)."""

_SYSCTLS = ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")


@dataclass(frozen=True)
class Site:
    """A host or router of the lab. `behind`: the router it sits behind (None: on the internet)."""

    name: str
    behind: Optional[str] = None
    router: bool = False
    carrier: bool = False
    """A router whose LAN is carrier-grade NAT's shared address space rather than a home's."""


class NatLab:
    """Namespaces, veth pairs, addresses, routes and NAT rules; a context manager whose exit always
    removes everything (processes started in the lab's namespaces included)."""

    def __init__(self, sites: list[Site], *, lab_id: Optional[str] = None,
                 internet_subnet: str = INTERNET_SUBNET) -> None:
        self.lab_id = lab_id or new_lab_id()
        check_names(PREFIX, self.lab_id)
        self.sites = {s.name: s for s in sites}
        if len(self.sites) != len(sites) or BACKBONE in self.sites:
            raise ValueError(f"site names must be unique and not {BACKBONE!r}")
        for site in sites:
            if site.behind is not None and not self.sites.get(site.behind, Site("")).router:
                raise ValueError(f"{site.name} sits behind {site.behind!r}, which is not a router of this lab")
        self.internet = ipaddress.IPv4Network(internet_subnet)
        self.addresses: dict[str, str] = {}
        """Each site's own address: public for sites on the internet, a LAN address for the others."""
        self.lans: dict[str, ipaddress.IPv4Network] = {}
        self._plan_addresses()
        self._started = False

    def _plan_addresses(self) -> None:
        public = iter(self.internet.hosts())
        carriers = ipaddress.IPv4Network(CARRIER_SUBNETS).subnets(new_prefix=24)
        homes = ipaddress.IPv4Network(HOME_SUBNETS).subnets(new_prefix=24)
        next(homes)  # 192.168.0.0/24 is left alone: many machines use it already
        for site in self.sites.values():
            if site.router:
                self.lans[site.name] = next(carriers) if site.carrier else next(homes)
        on_lan = {name: iter(list(lan.hosts())[1:]) for name, lan in self.lans.items()}  # .1 is the router
        for site in self.sites.values():
            self.addresses[site.name] = str(next(public) if site.behind is None else next(on_lan[site.behind]))

    # -- names -----------------------------------------------------------------------------------

    def netns(self, name: str) -> str:
        if name != BACKBONE and name not in self.sites:
            raise LabError(f"no site {name!r} in this lab; sites: {', '.join(self.sites)}")
        return netns_name(PREFIX, self.lab_id, name)

    def public_address(self, name: str) -> str:
        """The address the internet sees `name` at: its own, or that of the outermost router it is behind."""
        site = self.sites[name]
        while site.behind is not None:
            site = self.sites[site.behind]
        return self.addresses[site.name]

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside site `name`'s namespace."""
        return ["ip", "netns", "exec", self.netns(name), *argv]

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "NatLab":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self._started:
            raise LabError("this NatLab was already started; make a new one")
        self._started = True
        for tool in ("ip", "nft"):
            if subprocess.run(["which", tool], capture_output=True).returncode != 0:
                raise LabUnavailable(f"the NAT lab needs `{tool}` (scripts/setup installs iproute2 and nftables)")
        cleanup.write_state(self.lab_id, {"prefix": PREFIX, "subnet": str(self.internet), "device": None,
                                          "namespaces": [self.netns(BACKBONE), *map(self.netns, self.sites)]})
        try:
            _run(["ip", "netns", "add", self.netns(BACKBONE)])
            self._sh(BACKBONE, ["ip link set lo up", "ip link add ix type bridge", "ip link set ix up"])
            for name in self.sites:
                _run(["ip", "netns", "add", self.netns(name)])
                self._sh(name, [*(f"sysctl -q -w {s}" for s in _SYSCTLS), "ip link set lo up"])
            # parents before children: a router behind another needs its parent's LAN bridge
            for site in sorted(self.sites.values(), key=self._depth):
                if site.router:
                    self._sh(site.name, ["sysctl -q -w net.ipv4.ip_forward=1", "ip link add lan type bridge",
                                         "ip link set lan up",
                                         f"ip addr add {self._gateway(site.name)}/24 dev lan"])
                self._wire(site)
                if site.router:
                    self._masquerade(site.name)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every process in the lab's namespaces and remove the namespaces (their veths go with them)."""
        cleanup.remove_lab(self.lab_id, PREFIX, grace_s=2.0)

    def _depth(self, site: Site) -> int:
        depth = 0
        while site.behind is not None:
            site, depth = self.sites[site.behind], depth + 1
        return depth

    def _gateway(self, router: str) -> str:
        return str(next(self.lans[router].hosts()))

    def _wire(self, site: Site) -> None:
        """One veth from `site` to the bridge it hangs off: the internet's, or its router's LAN."""
        parent = BACKBONE if site.behind is None else site.behind
        bridge = "ix" if site.behind is None else "lan"
        outside = f"to{list(self.sites).index(site.name)}"  # the parent's end: unique there
        _run(["ip", "link", "add", "name", outside, "netns", self.netns(parent), "type", "veth", "peer", "name",
              "wan", "netns", self.netns(site.name)])
        self._sh(parent, [f"ip link set {outside} master {bridge}", f"ip link set {outside} up"])
        prefixlen = self.internet.prefixlen if site.behind is None else 24
        script = ["ip link set wan up", f"ip addr add {self.addresses[site.name]}/{prefixlen} dev wan"]
        if site.behind is not None:
            script.append(f"ip route add default via {self._gateway(site.behind)}")
        self._sh(site.name, script)

    def _masquerade(self, router: str) -> None:
        rules = ("table ip agora_nat {\n"
                 " chain prerouting { type nat hook prerouting priority -100; }\n"
                 " chain postrouting { type nat hook postrouting priority 100; oifname \"wan\" masquerade; }\n"
                 " chain forward { type filter hook forward priority 0; policy drop;\n"
                 "  ct state established,related accept\n  iifname \"lan\" oifname \"wan\" accept\n"
                 "  ct status dnat accept\n }\n}\n")
        self._nft(router, rules)

    def forward_port(self, router: str, port: int, to: str, to_port: Optional[int] = None) -> None:
        """A port forward on `router`, as a user sets one up: TCP `port` on its WAN address goes to
        site `to` on its LAN (at `to_port`, by default the same)."""
        if self.sites[to].behind != router:
            raise LabError(f"{to} is not on {router}'s LAN")
        self._nft(router, f"add rule ip agora_nat prerouting iifname \"wan\" tcp dport {port} "
                          f"dnat to {self.addresses[to]}:{to_port or port}\n")

    def block_port(self, router: str, port: int) -> None:
        """`router` drops whatever its LAN sends to TCP `port` anywhere (an outbound firewall rule)."""
        self._nft(router, f"insert rule ip agora_nat forward iifname \"lan\" tcp dport {port} drop\n")

    def _nft(self, name: str, rules: str) -> None:
        result = subprocess.run(self.command(name, ["nft", "-f", "-"]), input=rules, text=True, capture_output=True)
        if result.returncode != 0:
            raise LabError(f"nftables on {name}: {result.stderr.strip()}")

    def _sh(self, name: str, script: list[str]) -> None:
        _run(self.command(name, ["sh", "-ec", "; ".join(script)]))


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
