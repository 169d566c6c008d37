"""The one token-file reader (elasticd.tokens), used by the daemon, the client, the store
server and workers: every way a token file can be unusable gives a clear error, and none
of them blocks."""

from __future__ import annotations

import os

import pytest

from elasticd.tokens import MAX_TOKEN_FILE, TokenFileError, read_token_file

pytestmark = pytest.mark.timeout(10)


def test_a_token_is_the_stripped_text(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret \n")
    assert read_token_file(path) == "s3cret"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text(" \n"), "is empty"),
        (lambda p: p.write_bytes(b"\xff\xfe"), "is not utf-8 text"),
        (lambda p: p.mkdir(), "is not a regular file"),
        (lambda p: os.mkfifo(p), "is not a regular file"),  # a FIFO must not hang the reader
        (lambda p: None, "cannot read the token file"),
    ],
)
def test_an_unusable_token_file_is_a_clear_error(tmp_path, make, message):
    path = tmp_path / "token"
    make(path)
    with pytest.raises(TokenFileError, match=message) as info:
        read_token_file(path)
    assert str(path) in str(info.value)


def test_the_check_sees_the_descriptor_that_is_read_and_only_a_bounded_prefix_is_read(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"a" * (MAX_TOKEN_FILE + 10))
    seen: list[int] = []
    token = read_token_file(path, check=lambda st: seen.append(st.st_size))
    assert seen == [MAX_TOKEN_FILE + 10] and len(token) == MAX_TOKEN_FILE

    def refuse(st: os.stat_result) -> None:
        raise TokenFileError("refused by the check")

    with pytest.raises(TokenFileError, match="refused by the check"):
        read_token_file(path, what="store_password_file", check=refuse)
    with pytest.raises(TokenFileError, match="the store_password_file"):
        read_token_file(tmp_path / "missing", what="store_password_file")
