"""The peer check: the client socket's uid from the kernel's TCP tables, as pure functions."""

from __future__ import annotations

import socket

import pytest

from elasticd.lighthouse import peer
from elasticd.lighthouse.peer import TcpRow

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
# The server listens on 127.0.0.1:8080 (1F90); a client of uid 1000 connects from port 50000
# (C350); the server's accepted socket (root's) is the mirror row; one TIME_WAIT row (inode 0).
TCP = HEADER + (
    "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0\n"
    "   1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 101 1 0\n"
    "   2: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 102 1 0\n"
    "   3: 0100007F:C351 0100007F:1F90 06 00000000:00000000 00:00000000 00000000  1001        0 0 1 0\n"
    "   4: garbage\n"
)
# tcp6: a dual-stack client whose address is IPv4-mapped (::ffff:127.0.0.1), port 50002.
TCP6 = HEADER + (
    "   0: 0000000000000000FFFF00000100007F:C352 0000000000000000FFFF00000100007F:1F90 01 "
    "00000000:00000000 00:00000000 00000000  2000        0 200 1 0\n"
    "   1: 00000000000000000000000001000000:C353 00000000000000000000000001000000:1F91 01 "
    "00000000:00000000 00:00000000 00000000  3000        0 201 1 0\n"
)
ROWS = peer.parse_table(TCP) + peer.parse_table(TCP6)


def test_the_tables_parse_into_addresses_uids_and_inodes() -> None:
    assert ROWS[1] == TcpRow(("127.0.0.1", 50000), ("127.0.0.1", 8080), 1000, 101)
    assert ROWS[4].local == ("127.0.0.1", 50002)  # IPv4-mapped, spelt as IPv4
    assert ROWS[5].local == ("::1", 50003)
    assert len(ROWS) == 6  # the garbage line is skipped


@pytest.mark.parametrize(
    ("client", "server", "uid"),
    [
        (("127.0.0.1", 50000), ("127.0.0.1", 8080), 1000),  # the client's row, not the server's
        (("127.0.0.1", 50002), ("127.0.0.1", 8080), 2000),  # found in tcp6
        (("::ffff:127.0.0.1", 50002), ("127.0.0.1", 8080), 2000),
        (("::1", 50003), ("::1", 8081), 3000),
        (("127.0.0.1", 50001), ("127.0.0.1", 8080), None),  # inode 0: no owner
        (("127.0.0.1", 40000), ("127.0.0.1", 8080), None),  # no such connection
        (("127.0.0.1", 50000), ("127.0.0.1", 9999), None),  # to another server
    ],
)
def test_peer_uid(client: peer.Address, server: peer.Address, uid: int | None) -> None:
    assert peer.peer_uid(ROWS, client, server) == uid


def test_two_rows_that_disagree_prove_nothing() -> None:
    twin = TcpRow(("127.0.0.1", 50000), ("127.0.0.1", 8080), 0, 999)
    assert peer.peer_uid([*ROWS, twin], ("127.0.0.1", 50000), ("127.0.0.1", 8080)) is None


@pytest.mark.parametrize(
    ("uid", "job_uid", "ok"),
    [
        (1000, 1000, True),
        (0, 1000, True),
        (1001, 1000, False),
        (None, 1000, False),
        (None, 0, False),
    ],
)
def test_only_the_jobs_user_and_root_are_allowed(uid: int | None, job_uid: int, ok: bool) -> None:
    assert peer.allowed(uid, job_uid) is ok


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("ipv4:127.0.0.1:5000", ("127.0.0.1", 5000)),
        ("ipv6:[::1]:5000", ("::1", 5000)),
        ("ipv6:%5B::ffff:127.0.0.1%5D:5000", ("127.0.0.1", 5000)),
        ("unix:/tmp/x", None),
        ("ipv4:nonsense:1", None),
        ("ipv4:127.0.0.1:x", None),
    ],
)
def test_grpc_peer_strings(text: str, address: peer.Address | None) -> None:
    assert peer.parse_grpc_peer(text) == address


def test_this_machines_tables_name_a_live_connection() -> None:
    """On the real kernel: a loopback connection of this process is found, with our uid."""
    if peer.read_tables() is None:
        pytest.skip("no /proc/net/tcp here")
    import os

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            with conn:
                found = peer.peer_uid(
                    peer.read_tables() or [], client.getsockname(), ("127.0.0.1", port)
                )
    assert found == os.getuid()
