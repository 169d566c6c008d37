"""Who is on the other end of a loopback TCP connection: the uid that owns the client socket.

torchft's Managers speak plaintext gRPC with no credential, so a job's Lighthouse checks
the peer itself: the connecting socket's row in ``/proc/net/tcp`` (or ``tcp6``) is the one
whose local address is the peer's and whose remote address is the server's, and its
``uid`` column names the user that opened it. Only the job's user and root may talk to the
job's Lighthouse (:func:`allowed`). A row whose inode is 0 belongs to no process (a socket
closing), and two live rows for one address pair that disagree on the uid prove nothing:
both deny.

The decisions are pure functions over parsed rows (:func:`parse_table`,
:func:`peer_uid`, :func:`allowed`); :func:`read_tables` is the IO. Where the tables do
not exist (not Linux) the caller cannot check and says so. Standard library only.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TcpRow", "allowed", "parse_grpc_peer", "parse_table", "peer_uid", "read_tables"]

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

Address = tuple[str, int]


@dataclass(frozen=True)
class TcpRow:
    local: Address
    remote: Address
    uid: int
    inode: int


def _address(text: str) -> Address:
    host, _, port = text.partition(":")
    if len(host) not in (8, 32):
        raise ValueError(f"an address of {len(host)} hex digits")
    # The kernel prints each 32-bit word of the address as a number in host byte order.
    packed = b"".join(struct.pack("=I", int(host[i : i + 8], 16)) for i in range(0, len(host), 8))
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return _normal(socket.inet_ntop(family, packed)), int(port, 16)


def _normal(ip: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 form; every address in one spelling."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def parse_table(text: str) -> list[TcpRow]:
    """The rows of a ``/proc/net/tcp`` or ``tcp6`` table; a line that does not parse is skipped."""
    rows = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        try:
            rows.append(TcpRow(_address(cols[1]), _address(cols[2]), int(cols[7]), int(cols[9])))
        except ValueError:
            continue
    return rows


def parse_grpc_peer(peer: str) -> Address | None:
    """``ipv4:127.0.0.1:5000`` or ``ipv6:[::1]:5000`` (brackets maybe %-encoded) as an address."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    try:
        return _normal(host.strip("[]")), int(port)
    except ValueError:
        return None


def peer_uid(rows: Iterable[TcpRow], peer: Address, server: Address) -> int | None:
    """The uid owning the client socket ``peer`` connected to ``server``; None: unknown."""
    peer = (_normal(peer[0]), peer[1])
    server = (_normal(server[0]), server[1])
    uids = {row.uid for row in rows if row.local == peer and row.remote == server and row.inode}
    return uids.pop() if len(uids) == 1 else None


def allowed(uid: int | None, job_uid: int) -> bool:
    """Only the job's own user and root may reach the job's Lighthouse."""
    return uid is not None and uid in (job_uid, 0)


def read_tables(paths: Iterable[Path] = TABLES) -> list[TcpRow] | None:
    """Every row of the kernel's TCP tables; None where there are none (not Linux)."""
    rows: list[TcpRow] = []
    found = False
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = True
        rows += parse_table(text)
    return rows if found else None
