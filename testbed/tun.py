"""TUN devices that hand the emulator virtio-net framed, offloaded packets."""

import fcntl
import os
import struct

from fusionllm.testbed.errors import TestbedError

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN, _IFF_NO_PI, _IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6, _TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
_TUN_F_USO4, _TUN_F_USO6 = 0x20, 0x40
_TSO = _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6 | _TUN_F_TSO_ECN
MAX_IFNAME = 15


def open_tun(name: str) -> int:
    """A non-blocking fd for a new TUN device ``name`` (IFF_TUN|IFF_NO_PI|IFF_VNET_HDR) with
    checksum, TSO and (where the kernel has it) USO offloads. The device lives as long as an
    fd to it is open, whichever namespace it is moved into."""
    if not name or len(name) > MAX_IFNAME:
        raise TestbedError(f"interface name {name!r}: 1-{MAX_IFNAME} characters")
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TestbedError(f"/dev/net/tun: {exc.strerror}") from exc
    try:
        ifreq = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifreq)
        try:
            fcntl.ioctl(fd, _TUNSETOFFLOAD, _TSO | _TUN_F_USO4 | _TUN_F_USO6)
        except OSError:  # kernels before 6.2 have no USO
            fcntl.ioctl(fd, _TUNSETOFFLOAD, _TSO)
    except OSError as exc:
        os.close(fd)
        raise TestbedError(f"TUN device {name}: {exc.strerror}") from exc
    return fd
