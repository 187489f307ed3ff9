"""The fake kubelet's pod IPs: round-robin, as CNI's host-local IPAM, so that a freed IP is not handed to
the next pod while what spoke on it may still be stopping."""

import pytest

from rljob.testing.kubelet import IpAllocator


def test_a_freed_ip_comes_back_only_after_the_range() -> None:
    ips = IpAllocator("127.9.0.2", "127.9.0.5")
    a, b = ips.acquire(), ips.acquire()
    assert (a, b) == ("127.9.0.2", "127.9.0.3")
    ips.release(a)
    assert ips.acquire() == "127.9.0.4"  # not the one just freed
    assert ips.acquire() == "127.9.0.5"
    assert ips.acquire() == "127.9.0.2"  # wrapped around: now it is free and next
    with pytest.raises(RuntimeError, match="exhausted"):
        ips.acquire()


def test_the_ip_a_pod_already_has_is_kept_and_octets_0_and_255_are_skipped() -> None:
    ips = IpAllocator("127.9.0.254", "127.9.1.3")
    assert ips.acquire("127.9.1.2") == "127.9.1.2"  # a restarted kubelet keeps the pod's status.podIP
    assert ips.acquire("127.9.1.2") == "127.9.0.254"  # taken: a fresh one
    assert ips.acquire() == "127.9.1.1"  # .255 and .0 are skipped
    assert ips.acquire() == "127.9.1.3"
