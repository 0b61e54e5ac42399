"""Closing a TensorFlow server's port to everyone but the cluster's own peers.

TensorFlow binds every task's port (and the coordinator's) on all network
interfaces, with no option to bind one, and its servers run any RPC they are
sent. This module attaches a classic BPF socket filter to the process's own
listening sockets on that port (Linux `SO_ATTACH_FILTER`, no privilege needed):
a packet is kept when it arrived on the loopback interface (this host, this
network namespace) or when its source address is one of the peers' addresses;
any other packet, a connection attempt included, is dropped. Connections
accepted later inherit the filter. Nothing is installed on the host: the
filter lives and dies with the socket.

The port listens before the filter can be attached (TF binds it inside
server start-up). So after attaching, the sockets of the port are checked:
a connection from anyone else that got in during that window is refused as an
error (`PortExposedError`) rather than left open.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable

from psclient._core.errors import PSClientError

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# Linux (asm-generic) socket options: attach a classic BPF program; lock it.
_SO_ATTACH_FILTER = 26
_SO_LOCK_FILTER = 44
# Classic BPF opcodes and the kernel's special load offsets (linux/filter.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JA = 0x05
_RET_K = 0x06
_SKF_AD_PROTOCOL = 0x100000000 - 0x1000 + 0  # ntohs(skb->protocol)
_SKF_AD_IFINDEX = 0x100000000 - 0x1000 + 8  # the interface the packet arrived on
_SKF_NET_OFF = 0x100000000 - 0x100000  # offsets from the network (IP) header
_ETH_P_IP = 0x0800
_ETH_P_IPV6 = 0x86DD
_KEEP = 0xFFFFFFFF
_DROP = 0
_TCP_LISTEN = "0A"
_TCP_OPEN = ("01", "03")  # ESTABLISHED, SYN_RECV (include/net/tcp_states.h)


class PortExposedError(PSClientError, RuntimeError):
    """A port could not be restricted, or someone else connected before it was."""


def supported() -> bool:
    """Whether this platform has socket filters (Linux)."""
    return sys.platform.startswith("linux")


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def _words(address: ipaddress.IPv6Address) -> list[int]:
    packed = address.packed
    return [int.from_bytes(packed[i:i + 4], "big") for i in range(0, 16, 4)]


def build_filter(loopback_index: int, peers: Iterable[_Address]) -> list[tuple[int, int, int, int]]:
    """The BPF program: keep loopback packets and packets from `peers`, drop the rest.

    Every match is followed by its own `ret keep`, so conditional jumps stay
    short (their offsets are 8-bit) however many peers there are.
    """
    v4 = sorted({int(p) for p in peers if p.version == 4})
    v6 = sorted({p for p in peers if p.version == 6}, key=int)
    v4_part: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _SKF_NET_OFF + 12)]  # IPv4 source
    for peer in v4:
        v4_part += [(_JEQ_K, 0, 1, peer), (_RET_K, 0, 0, _KEEP)]
    v4_part.append((_RET_K, 0, 0, _DROP))
    v6_part: list[tuple[int, int, int, int]] = []
    for peer in v6:  # IPv6 source: 4 words at offsets 8..20; a block of 9 per peer.
        block = []
        for i, word in enumerate(_words(peer)):
            block += [(_LD_W_ABS, 0, 0, _SKF_NET_OFF + 8 + 4 * i), (_JEQ_K, 0, 7 - 2 * i, word)]
        block[-1] = (_JEQ_K, 0, 1, _words(peer)[3])
        v6_part += block + [(_RET_K, 0, 0, _KEEP)]
    v6_part.append((_RET_K, 0, 0, _DROP))
    head = [
        (_LD_W_ABS, 0, 0, _SKF_AD_IFINDEX),
        (_JEQ_K, 0, 1, loopback_index),
        (_RET_K, 0, 0, _KEEP),
        (_LD_W_ABS, 0, 0, _SKF_AD_PROTOCOL),
        (_JEQ_K, 0, 1, _ETH_P_IP),
        (_JA, 0, 0, 3),  # to the IPv4 part
        (_JEQ_K, 0, 1, _ETH_P_IPV6),
        (_JA, 0, 0, 1 + len(v4_part)),  # to the IPv6 part
        (_RET_K, 0, 0, _DROP),  # neither: drop
    ]
    return head + v4_part + v6_part


def _loopback_index() -> int:
    try:
        return socket.if_nametoindex("lo")
    except OSError:
        return 1  # The loopback device is the first one of every network namespace.


def _proc_net_tcp() -> list[tuple[str, int, str, str]]:
    """(family, local, remote, state, inode) of every TCP socket in this network namespace, as /proc says them."""
    rows = []
    for name, family in (("tcp", 4), ("tcp6", 6)):
        try:
            with open(f"/proc/net/{name}", encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            rows.append((family, local, remote, state, inode))
    return rows


def _decode(hex_address: str, family: int) -> _Address:
    address, _, _ = hex_address.partition(":")
    raw = bytes.fromhex(address)
    # /proc prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    parsed = ipaddress.ip_address(raw)
    if family == 6 and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped
    return parsed


def _port_of(hex_address: str) -> int:
    return int(hex_address.rpartition(":")[2], 16)


def _is_local(address: _Address) -> bool:
    if address.is_loopback:
        return True
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def resolve_peers(hosts: Iterable[str]) -> set[_Address]:
    """Every address the hosts resolve to (IPv4-mapped IPv6 ones as IPv4).

    Raises:
        PortExposedError: a host does not resolve.
    """
    peers: set[_Address] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
        except socket.gaierror as e:
            raise PortExposedError(f"cannot resolve the cluster host {host!r} ({e.strerror})") from e
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            peers.add(address)
    return peers


def _listening_fds(port: int) -> list[int]:
    """This process's file descriptors of TCP sockets listening on `port`."""
    inodes = {inode for _, local, _, state, inode in _proc_net_tcp()
              if state == _TCP_LISTEN and _port_of(local) == port}
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # Closed meanwhile (the listing's own fd, too).
        if target.startswith("socket:[") and target[8:-1] in inodes:
            fds.append(int(name))
    return fds


def connections_to(port: int) -> int:
    """Open TCP connections (established, or being accepted) to `port` on this host."""
    return sum(1 for _, local, _, state, _ in _proc_net_tcp()
               if state in _TCP_OPEN and _port_of(local) == port)


def foreign_connections(port: int, peers: Iterable[_Address]) -> list[str]:
    """"address:port" of each connection to `port` from neither this host nor a peer."""
    allowed = set(peers)
    found = []
    for family, local, remote, state, _ in _proc_net_tcp():
        if state == _TCP_LISTEN or _port_of(local) != port:
            continue
        address = _decode(remote, family)
        if address not in allowed and not _is_local(address):
            found.append(f"{address}:{_port_of(remote)}")
    return found


def restrict_port(port: int, peers: Iterable[_Address], *, what: str, lock: bool = True,
                  established_ok: Iterable[_Address] = ()) -> int:
    """Drops packets to this process's listening sockets on `port` unless they come
    over loopback or from `peers`; returns how many sockets were filtered.

    `what` names the server in error messages ("worker:0", "the coordinator").
    `lock`: nothing can detach or replace the filter afterwards (SO_LOCK_FILTER);
    without it, a later call replaces it (a wider set of peers).
    `established_ok`: addresses whose connections made before this call are
    not intruders (the peers of the filter this call replaces).

    Raises:
        PortExposedError: not Linux, no socket listens on `port` in this process,
            the kernel refused the filter, or someone else connected first.
    """
    if not supported():
        raise PortExposedError(f"cannot restrict {what}'s port {port}: socket filters need Linux "
                               f"(this is {sys.platform})")
    peers = set(peers)
    program = build_filter(_loopback_index(), peers)
    insns = (_Insn * len(program))(*(_Insn(*insn) for insn in program))
    fprog = bytes(_Program(len(program), ctypes.cast(insns, ctypes.POINTER(_Insn))))
    fds = _listening_fds(port)
    if not fds:
        raise PortExposedError(f"cannot restrict {what}'s port {port}: no socket of this process listens on it")
    for fd in fds:
        sock = socket.socket(fileno=os.dup(fd))  # The same socket; closing the copy leaves it open.
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            if lock:
                sock.setsockopt(socket.SOL_SOCKET, _SO_LOCK_FILTER, 1)
        except OSError as e:
            raise PortExposedError(f"cannot restrict {what}'s port {port}: the kernel refused the "
                                   f"socket filter ({e.strerror})") from e
        finally:
            sock.close()
    intruders = foreign_connections(port, peers | set(established_ok))
    if intruders:
        raise PortExposedError(
            f"{what}'s port {port} was reached from {', '.join(intruders)} (neither this host nor "
            "a cluster peer) before it could be restricted; refusing to go on")
    return len(fds)
