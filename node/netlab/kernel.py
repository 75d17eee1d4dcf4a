"""The few Linux calls the lab needs that Python's standard library does not wrap: entering a
network namespace (setns), opening a TUN device inside one, and parent-death signals (prctl).

Everything here is a thin ctypes/ioctl wrapper; the callers decide what to do with the results.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import struct
from typing import Iterator

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1

# linux/if_tun.h
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04

# struct virtio_net_hdr (the default 10-byte form): flags, gso_type, hdr_len, gso_size, csum_start,
# csum_offset. Every packet read from or written to a TUN opened with vnet_hdr=True starts with it.
VNET_HDR_LEN = 10

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace that `fd` refers to."""
    _check(_libc.setns(fd, CLONE_NEWNET), "setns")


@contextlib.contextmanager
def in_netns(path: str | None) -> Iterator[None]:
    """Run the body with the calling thread in the network namespace at `path` (e.g.
    /run/netns/NAME), then return it to the namespace it was in; None = stay where we are.
    Only the calling thread moves: call this from a single-threaded process or a dedicated thread."""
    if path is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(target)
        try:
            yield
        finally:
            setns(home)
    finally:
        os.close(target)
        os.close(home)


def open_tun(name: str, *, netns_path: str | None = None, vnet_hdr: bool = True) -> int:
    """Create the layer-3 TUN device `name` in the namespace at `netns_path` and return its
    nonblocking fd. The device is not persistent: it disappears when the fd's last holder exits,
    which is what makes a dead switch leave no devices behind.

    With `vnet_hdr` the kernel hands us TCP segmentation-offload packets (up to 64 KiB carrying
    MSS-sized segments) instead of one packet per MTU, so a user-space switch moves a lot of
    traffic in few reads while the hosts keep a realistic 1500-byte MTU."""
    flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if vnet_hdr else 0)
    with in_netns(netns_path):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
            if vnet_hdr:
                fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
        except BaseException:
            os.close(fd)
            raise
    return fd


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits (see
    prctl(2): it is the parent *thread*, so callers that may fork from short-lived threads use a
    catchable signal and check os.getppid())."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
