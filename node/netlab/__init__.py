"""The internet lab's network layer: real agora-node processes in network namespaces behind
residential-style links (bandwidth and latency). Lab and HostSpec are in topology.py; the delay
model in plan.py; the switch and shaping in switch.py and shaping.py; leftovers in cleanup.py."""
