"""Delivery-time math of the lab's switch and the upload qdisc (node/netlab/shaping.py)."""

from __future__ import annotations

import pytest

from node.netlab.shaping import MIN_BURST_BYTES, Downlink, PairClock, upload_qdisc


def test_downlink_serialises_back_to_back_packets_at_the_rate():
    link = Downlink()
    rate = 100e6
    # 10 packets of 12,500 bytes (1 ms each at 100 Mbit/s) arriving together leave 1 ms apart
    departures = [link.admit(1.0, 12_500, rate, queue_s=0.1) for _ in range(10)]
    assert departures == pytest.approx([1.0 + 0.001 * (i + 1) for i in range(10)])


def test_downlink_idles_between_sparse_packets():
    link = Downlink()
    assert link.admit(1.0, 12_500, 100e6, 0.1) == pytest.approx(1.001)
    assert link.admit(2.0, 12_500, 100e6, 0.1) == pytest.approx(2.001)  # no credit saved, no debt


def test_downlink_drops_when_the_queue_ahead_exceeds_its_length():
    link = Downlink()
    accepted = [link.admit(0.0, 125_000, 10e6, queue_s=0.25) for _ in range(5)]  # 100 ms each
    # waits before starting: 0, 100, 200, 300 ms... -> the 4th (300 ms > 250 ms) and later drop
    assert [a is not None for a in accepted] == [True, True, True, False, False]
    assert link.admit(0.35, 125_000, 10e6, queue_s=0.25) == pytest.approx(0.45)  # the link is idle again at 0.3 s


def test_pair_clock_keeps_a_pair_in_order_when_its_delay_drops():
    clock = PairClock()
    assert clock.schedule(0, 1, now=1.0, delay_s=0.1) == pytest.approx(1.1)
    assert clock.schedule(0, 1, now=1.01, delay_s=0.0) == pytest.approx(1.1)  # not before the first
    assert clock.schedule(1, 0, now=1.01, delay_s=0.0) == pytest.approx(1.01)  # other pair unaffected


def test_upload_qdisc_is_tbf_with_a_bucket_that_holds_an_offload_packet():
    [argv] = upload_qdisc("agl-x", 200.0, queue_ms=100)
    assert argv[:7] == ["tc", "qdisc", "replace", "dev", "agl-x", "root", "tbf"]
    assert argv[argv.index("rate") + 1] == "200000000bit"
    assert int(argv[argv.index("burst") + 1]) == 100_000  # 4 ms at 200 Mbit/s
    [slow] = upload_qdisc("agl-x", 1.0)
    assert int(slow[slow.index("burst") + 1]) == MIN_BURST_BYTES
    assert upload_qdisc("agl-x", None) == [["tc", "qdisc", "del", "dev", "agl-x", "root"]]


def test_an_offload_packet_counts_one_ip_and_tcp_header_per_segment():
    import struct

    from node.netlab.switch import wire_size

    vnet = bytes([1, 1]) + struct.pack("=HHHH", 52, 1448, 0, 0)  # flags, gso_type TCPv4, hdr_len, gso_size, ...
    ip = bytes([0x45]) + bytes(19)  # IPv4, 20-byte header
    tcp = bytes(12) + bytes([0x80]) + bytes(19)  # data offset 8 words = 32 bytes
    payload = bytes(1448 * 10)
    packet = vnet + ip + tcp + payload
    assert wire_size(packet, 10, len(packet) - 10) == 10 * (1448 + 52)
