"""The lab's pure plan: names, addresses, the delay model's nominal figures (node/netlab/plan.py)."""

from __future__ import annotations

import pytest

from node.netlab.plan import (CONTROLLER, HostSpec, allocate_addresses, device_name, lab_id_of, netns_name,
                              new_lab_id, nominal_mbit, nominal_rtt_ms, one_way_delay_s)


def test_controller_gets_the_first_address_and_hosts_follow_in_order():
    assert allocate_addresses("10.77.0.0/16", ["auth", "w0-0", "t0"]) == {
        CONTROLLER: "10.77.0.1", "auth": "10.77.0.2", "w0-0": "10.77.0.3", "t0": "10.77.0.4"}


def test_addresses_cross_octet_boundaries_and_refuse_a_full_subnet():
    addresses = allocate_addresses("10.77.0.0/23", [f"h{i}" for i in range(300)])
    assert addresses["h253"] == "10.77.0.255" and addresses["h254"] == "10.77.1.0"
    with pytest.raises(ValueError, match="room for 2"):
        allocate_addresses("10.77.0.0/30", ["a", "b"])


def test_duplicate_or_reserved_host_names_are_refused():
    with pytest.raises(ValueError):
        allocate_addresses("10.77.0.0/16", ["a", "a"])
    with pytest.raises(ValueError):
        HostSpec(CONTROLLER)
    with pytest.raises(ValueError):
        HostSpec("bad name")
    with pytest.raises(ValueError, match="up_mbit"):
        HostSpec("a", up_mbit=0)
    with pytest.raises(ValueError, match="rtt_ms"):
        HostSpec("a", rtt_ms=-1)


def test_names_fit_the_kernel_and_carry_the_lab_id():
    lab_id = new_lab_id()
    assert len(device_name("agl", "abcdefgh")) <= 15
    assert lab_id_of("agl", netns_name("agl", lab_id, "w0-0")) == lab_id
    assert lab_id_of("agl", device_name("agl", lab_id)) == lab_id
    assert lab_id_of("agl", "probe1") is None and lab_id_of("agl", "aglx-1") is None


def test_delay_model_rtt_is_the_sum_of_both_hosts_rtt_ms():
    a, b = HostSpec("a", rtt_ms=40), HostSpec("b", rtt_ms=100)
    assert one_way_delay_s(40) == pytest.approx(0.020)
    # a -> b is delayed d_a + d_b each way: RTT = 2 (20 + 50) ms
    assert nominal_rtt_ms(a, b) == pytest.approx(140)
    assert nominal_rtt_ms(a, None) == pytest.approx(40)  # None = the controller, zero delay


def test_nominal_rate_is_the_sender_upload_or_the_receiver_download():
    a = HostSpec("a", up_mbit=50, down_mbit=200)
    b = HostSpec("b", up_mbit=10, down_mbit=30)
    assert nominal_mbit(a, b) == 30
    assert nominal_mbit(b, a) == 10
    assert nominal_mbit(HostSpec("c"), None) is None
