"""Issue 11, finding 6: etcd with authentication and TLS, against a real etcd on loopback.

One etcd for the module, started with ``--client-cert-auth`` on an https
listener (certificates made with ``openssl`` for the test), a plain http
listener beside it, ``--auth-token-ttl=2``, and auth enabled with a ``root``
user and an ``elasticd`` user whose role may only touch ``elasticd/``. The
store contract (``test_conformance.py``) runs unchanged against it, through
TLS with a client certificate, as that user, under that prefix; the other
tests attack it without credentials and let tokens expire or be revoked.
The daemon's refusal of an insecure store beyond loopback is checked where
no traffic can leave: in a network namespace of its own, and at the config
level.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elasticd.config import Config, check_store, load_config, read_store_password
from elasticd.errors import ConfigError, StoreAuthError, StoreUnavailable
from elasticd.store import EtcdOptions, Store, open_store
from elasticd.store.etcd import EtcdStore, prefix_end

from .conftest import LIST_LIMIT, Backend
from .etcd_server import etcd_binary, free_port

# The store contract, collected again here: this module's ``backend`` fixture runs
# every conformance test against the authenticated, TLS, prefixed etcd.
from .test_conformance import *  # noqa: F403

pytestmark = pytest.mark.timeout(90)

ROOT_PASSWORD = "root-secret"
USER = "elasticd"
PASSWORD = "elasticd-secret"
PREFIX = "elasticd/"
TOKEN_TTL = 2  # seconds an unused auth token lives (etcd's --auth-token-ttl)


# -- certificates and etcd ---------------------------------------------------


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        message = "openssl is not installed (apt-get install openssl)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class Pki:
    """A throwaway CA, etcd's server certificate, elasticd's client certificate, and a rogue CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path
    named_cert: Path
    named_key: Path


def _make_pki(folder: Path) -> Pki:
    openssl = _openssl()

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=folder, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def ca(name: str) -> None:
        run("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
            "-subj", f"/CN={name}")  # fmt: skip

    def cert(name: str, ca_name: str, usage: str, san: bool, subject: str = "") -> None:
        # No Common Name: etcd's gateway refuses client certificates with one once
        # auth is enabled (it cannot use the CN as the user, as gRPC clients do).
        run("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", subject or f"/O={name}")  # fmt: skip
        ext = folder / f"{name}.ext"
        ext.write_text(f"extendedKeyUsage={usage}\n" + ("subjectAltName=IP:127.0.0.1\n" * san))
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca_name}.crt", "-CAkey",
            f"{ca_name}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", ext.name)  # fmt: skip
        (folder / f"{name}.key").chmod(0o600)

    ca("ca")
    ca("rogue-ca")
    # etcd's gateway also uses the server certificate as a client of etcd itself.
    cert("server", "ca", "serverAuth,clientAuth", san=True)
    cert("client", "ca", "clientAuth", san=False)
    cert("rogue", "rogue-ca", "clientAuth", san=False)
    cert("named", "ca", "clientAuth", san=False, subject="/CN=elasticd")
    return Pki(
        ca=folder / "ca.crt",
        server_cert=folder / "server.crt",
        server_key=folder / "server.key",
        client_cert=folder / "client.crt",
        client_key=folder / "client.key",
        rogue_ca=folder / "rogue-ca.crt",
        rogue_cert=folder / "rogue.crt",
        rogue_key=folder / "rogue.key",
        named_cert=folder / "named.crt",
        named_key=folder / "named.key",
    )


def _gateway(url: str, path: str, body: dict[str, Any], token: str | None = None) -> Any:
    """One call to etcd's JSON gateway over plain http (set-up and probes only)."""
    request = urllib.request.Request(
        url + "/v3" + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": token} if token else {},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@dataclass
class SecureEtcd:
    """The module's etcd: https (client certificates required) and http, auth enabled."""

    https_url: str
    http_url: str
    pki: Pki
    password_file: Path
    process: subprocess.Popen[bytes]
    log: Path

    def root_token(self) -> str:
        answer = _gateway(
            self.http_url, "/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD}
        )
        return str(answer["token"])

    def options(self, **changes: Any) -> EtcdOptions:
        """Everything a daemon would use: user, password, CA, client certificate, prefix."""
        settings: dict[str, Any] = {
            "username": USER,
            "password": PASSWORD,
            "ca_file": self.pki.ca,
            "cert_file": self.pki.client_cert,
            "key_file": self.pki.client_key,
            "prefix": PREFIX,
        }
        settings.update(changes)
        return EtcdOptions(**settings)


def _start_etcd(folder: Path, pki: Pki) -> SecureEtcd:
    https_port, http_port, peer_port = free_port(), free_port(), free_port()
    https_url = f"https://127.0.0.1:{https_port}"
    http_url = f"http://127.0.0.1:{http_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log = folder / "etcd.log"
    args = [
        etcd_binary(),
        "--name=secure",
        f"--data-dir={folder / 'data'}",
        f"--listen-client-urls={https_url},{http_url}",
        f"--advertise-client-urls={https_url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=secure={peer}",
        "--heartbeat-interval=10",
        "--election-timeout=50",
        "--max-request-bytes=8388608",
        "--client-cert-auth",
        f"--trusted-ca-file={pki.ca}",
        f"--cert-file={pki.server_cert}",
        f"--key-file={pki.server_key}",
        f"--auth-token-ttl={TOKEN_TTL}",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=error",
    ]
    with log.open("ab") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + 20
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"etcd exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(http_url + "/health", timeout=1) as response:
                if b'"true"' in response.read():
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"etcd not healthy within 20 s: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    # What docs/store.md tells operators to do, through the gateway instead of etcdctl.
    end = base64.b64encode(prefix_end(PREFIX.encode())).decode()  # --prefix=true's range end
    for path, body in [
        ("/auth/user/add", {"name": "root", "password": ROOT_PASSWORD}),
        ("/auth/role/add", {"name": "root"}),
        ("/auth/user/grant", {"user": "root", "role": "root"}),
        ("/auth/user/add", {"name": USER, "password": PASSWORD}),
        ("/auth/role/add", {"name": USER}),
        (
            "/auth/role/grant",
            {
                "name": USER,
                "perm": {"permType": "READWRITE", "key": _b64(PREFIX), "range_end": end},
            },
        ),
        ("/auth/user/grant", {"user": USER, "role": USER}),
        ("/auth/enable", {}),
    ]:
        answer = _gateway(http_url, path, body)
        assert "error" not in answer, (path, answer)
    password_file = folder / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    return SecureEtcd(https_url, http_url, pki, password_file, process, log)


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """The module's etcd, killed at the end."""
    folder = tmp_path_factory.mktemp("secure-etcd")
    etcd_binary()  # skip (or fail under CI) before making certificates
    server = _start_etcd(folder, _make_pki(folder))
    try:
        yield server
    finally:
        server.process.kill()
        server.process.wait(timeout=10)


@pytest.fixture
async def backend(secure_etcd: SecureEtcd) -> AsyncIterator[Backend]:
    """The conformance suite's store: https + client certificate + user + prefix."""
    admin = EtcdStore(
        [secure_etcd.http_url], options=EtcdOptions(username="root", password=ROOT_PASSWORD)
    )

    async def make() -> Store:
        return EtcdStore(
            [secure_etcd.https_url], options=secure_etcd.options(), max_list_bytes=LIST_LIMIT
        )

    async def compact(revision: int) -> None:
        await admin.compact(revision)  # compaction is for etcd's root only

    backend = Backend("etcd-secure", make, compact, lease_ttl=1.0)
    try:
        yield backend
    finally:
        await backend.aclose()
        await admin.close()


class CountingStore(EtcdStore):
    """An EtcdStore that counts how often it authenticates."""

    authentications = 0

    async def _authenticate(self) -> str | None:
        self.authentications += 1
        return await super()._authenticate()


# -- authentication ------------------------------------------------------------


async def test_without_credentials_etcd_refuses_clearly(secure_etcd: SecureEtcd) -> None:
    """No user: the first request fails with StoreAuthError naming the settings to set."""
    async with EtcdStore([secure_etcd.http_url]) as store:
        with pytest.raises(StoreAuthError, match="requires authentication.*store_username"):
            await store.put("elasticd/jobs/x", b"{}")
        with pytest.raises(StoreAuthError, match="requires authentication"):
            await store.watch("elasticd/jobs/x", 0, 1.0)
    assert _gateway(secure_etcd.http_url, "/kv/range", {"key": _b64("elasticd/jobs/x")})["error"]


async def test_wrong_password_is_refused_clearly(secure_etcd: SecureEtcd) -> None:
    """A wrong password fails with a message about the user and the password file, not the password."""
    options = EtcdOptions(username=USER, password="not-it", prefix=PREFIX)
    async with EtcdStore([secure_etcd.http_url], options=options) as store:
        with pytest.raises(StoreAuthError, match="wrong user name or password") as caught:
            await store.get("k")
    assert "not-it" not in str(caught.value)
    assert "not-it" not in repr(options) and "not-it" not in repr(store)


async def test_the_role_confines_elasticd_to_its_prefix(secure_etcd: SecureEtcd) -> None:
    """Without the prefix the same user is denied, with a message saying what to grant."""
    options = EtcdOptions(username=USER, password=PASSWORD)
    async with EtcdStore([secure_etcd.http_url], options=options) as store:
        with pytest.raises(StoreAuthError, match="grant its role readwrite"):
            await store.put("nodes/evil", b"{}")


async def test_keys_live_under_the_prefix(secure_etcd: SecureEtcd) -> None:
    """With store_prefix every key is written under it and read back without it."""
    options = EtcdOptions(username=USER, password=PASSWORD, prefix=PREFIX)
    async with EtcdStore([secure_etcd.http_url], options=options) as store:
        entry = await store.put("nodes/prefixed", b"v")
        assert entry.key == "nodes/prefixed"
        assert [e.key for e in (await store.list("nodes/")).entries] == ["nodes/prefixed"]
    raw = _gateway(
        secure_etcd.http_url,
        "/kv/range",
        {"key": _b64(PREFIX + "nodes/prefixed")},
        secure_etcd.root_token(),
    )
    assert base64.b64decode(raw["kvs"][0]["value"]) == b"v"


IDLE = TOKEN_TTL + 2.5  # long enough for etcd to drop an unused token


async def test_an_expired_token_is_renewed_transparently(secure_etcd: SecureEtcd) -> None:
    """After the token expires, a burst of concurrent requests succeeds with one shared renewal."""
    async with CountingStore([secure_etcd.http_url], options=secure_etcd.options()) as store:
        written = await store.put("renew", b"1")
        assert store.authentications == 1
        deadline = time.monotonic() + 60
        while store.authentications == 1:  # until a burst met an expired token
            assert time.monotonic() < deadline, "the token never expired"
            await asyncio.sleep(IDLE)  # idle on purpose: that is what expires a token
            got = await asyncio.gather(*(store.get("renew") for _ in range(20)))
            assert all(g is not None and g.version == written.version for g in got)
        assert store.authentications == 2  # the burst shared one renewal


async def test_a_revoked_token_is_renewed_transparently(secure_etcd: SecureEtcd) -> None:
    """Setting the user's password (to the same one) revokes its tokens; the next write renews once."""
    async with CountingStore([secure_etcd.http_url], options=secure_etcd.options()) as store:
        first = await store.put("revoke", b"1")
        stale = store._token
        answer = _gateway(
            secure_etcd.http_url,
            "/auth/user/changepw",
            {"name": USER, "password": PASSWORD},
            secure_etcd.root_token(),
        )
        assert "error" not in answer
        probe = {"key": _b64(PREFIX + "revoke")}
        refused = _gateway(secure_etcd.http_url, "/kv/range", probe, stale)
        assert "invalid auth token" in refused["error"]  # the old token is no good any more
        second = await store.compare_and_set("revoke", b"2", first.version)
        assert second.ok
        assert store.authentications == 2 and store._token != stale


async def test_a_watch_survives_token_expiry(secure_etcd: SecureEtcd) -> None:
    """A watch waits past its token's expiry and still gets the change; a new watch re-authenticates."""
    options = secure_etcd.options()
    async with (
        CountingStore([secure_etcd.https_url], options=options) as watcher,
        EtcdStore([secure_etcd.https_url], options=options) as writer,
    ):
        start = await writer.put("watched", b"0")
        await watcher.get("watched")
        watch = asyncio.create_task(watcher.watch("watched", start.version, 30.0))
        await asyncio.sleep(IDLE)  # the watcher is idle: its token expires
        written = await writer.put("watched", b"1")
        events = await asyncio.wait_for(watch, 20)
        assert [(e.value, e.revision) for e in events] == [(b"1", written.version)]
        assert watcher.authentications == 1
        # Its token has expired by now (unused for longer than the TTL): the next watch
        # is refused for it, authenticates again, and sees the next change.
        await asyncio.sleep(IDLE)
        watch = asyncio.create_task(watcher.watch("watched", written.version, 30.0))
        later = await writer.put("watched", b"2")
        events = await asyncio.wait_for(watch, 20)
        assert [e.revision for e in events] == [later.version]
        assert watcher.authentications == 2


# -- TLS ---------------------------------------------------------------------


async def test_tls_with_a_client_certificate_works(secure_etcd: SecureEtcd) -> None:
    """etcds with the CA, a client certificate and the user: reads and writes work."""
    async with EtcdStore([secure_etcd.https_url], options=secure_etcd.options()) as store:
        entry = await store.put("tls", b"ok")
        got = await store.get("tls")
        assert got is not None and (got.value, got.version) == (b"ok", entry.version)


@pytest.mark.parametrize("client", ["none", "rogue"])
async def test_tls_without_a_trusted_client_certificate_is_refused(
    secure_etcd: SecureEtcd, client: str
) -> None:
    """No client certificate, or one from another CA: the TLS handshake is refused, nothing is written."""
    pki = secure_etcd.pki
    cert = {"none": (None, None), "rogue": (pki.rogue_cert, pki.rogue_key)}[client]
    options = secure_etcd.options(cert_file=cert[0], key_file=cert[1])
    async with EtcdStore([secure_etcd.https_url], options=options) as store:
        with pytest.raises(StoreUnavailable) as caught:
            await store.put("tls-refused", b"x")
        # etcd's alert, read as StoreAuthError saying what to set; or, when etcd closes
        # the connection before the alert is read, a reset during the handshake.
        message = str(caught.value)
        if isinstance(caught.value, StoreAuthError):
            assert "refused this client's TLS certificate" in message
            assert "store_cert_file" in message
        else:
            assert "reset" in message or "closed" in message
    raw = _gateway(
        secure_etcd.http_url,
        "/kv/range",
        {"key": _b64(PREFIX + "tls-refused")},
        secure_etcd.root_token(),
    )
    assert "kvs" not in raw


async def test_a_client_certificate_with_a_common_name_is_explained(
    secure_etcd: SecureEtcd,
) -> None:
    """etcd's gateway refuses a client certificate with a CN once auth is on: the error says so."""
    pki = secure_etcd.pki
    options = secure_etcd.options(cert_file=pki.named_cert, key_file=pki.named_key)
    async with EtcdStore([secure_etcd.https_url], options=options) as store:
        with pytest.raises(StoreAuthError, match="without a CN"):
            await store.get("k")


async def test_etcds_url_opens_verified_tls_with_the_options(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """open_store("etcds://...", etcd=options) reaches the secure etcd through verified TLS."""
    url = secure_etcd.https_url.replace("https://", "etcds://")
    store = open_store(url, token=None, state_dir=tmp_path, etcd=secure_etcd.options())
    async with store:
        assert isinstance(store, EtcdStore) and store.endpoints == [secure_etcd.https_url]
        wire = store._wires[0]
        assert wire is not None and wire[0].tls is not None and wire[0].tls.check_hostname
        assert (await store.put("via-open-store", b"x")).key == "via-open-store"


async def test_tls_refuses_a_server_the_ca_did_not_sign(secure_etcd: SecureEtcd) -> None:
    """The server's certificate is verified: trusting another CA fails, never silently connects."""
    options = secure_etcd.options(ca_file=secure_etcd.pki.rogue_ca)
    async with EtcdStore([secure_etcd.https_url], options=options) as store:
        with pytest.raises(StoreUnavailable, match="certificate is not trusted"):
            await store.get("k")


# -- the daemon's refusal of an insecure store -----------------------------------


def _config(tmp_path: Path, **settings: object) -> Config:
    return load_config({"state_dir": str(tmp_path / "state"), **settings}, environ={})


@pytest.mark.parametrize(
    # (A daemon's HTTP store always gets a token: every daemon has one.)
    "url",
    ["etcd://10.1.2.3:2379", "etcds://10.1.2.3"],
)
def test_serve_refuses_an_unauthenticated_remote_store_before_connecting(
    tmp_path: Path, url: str
) -> None:
    """`elasticd serve` exits 2 at once, saying what to set; it runs where no packet can leave."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    command = [
        "unshare", "--net", sys.executable, "-m", "elasticd", "serve", "--port", "0",
        "--state-dir", str(tmp_path / "state"), "--store-url", url,
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 30
    assert "allow_insecure_store = true" in done.stderr
    assert "10.1.2.3 is not a loopback address" in done.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was opened


def test_allow_insecure_store_lets_it_through(tmp_path: Path) -> None:
    """allow_insecure_store = true accepts the same settings (checked without any traffic)."""
    config = _config(tmp_path, store_url="etcd://10.1.2.3:2379")
    with pytest.raises(ConfigError, match="allow_insecure_store"):
        check_store(config, token=None)
    toml = tmp_path / "elasticd.toml"
    toml.write_text('store_url = "etcd://10.1.2.3:2379"\nallow_insecure_store = true\n')
    check_store(_config(tmp_path, config=str(toml)), token=None)


def test_what_counts_as_authenticated(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    """An etcd user or a client certificate (or, for a daemon's store, a token) passes; loopback always."""
    pki = secure_etcd.pki
    remote = "etcds://10.1.2.3:2379"
    check_store(_config(tmp_path, store_url="etcd://127.0.0.1:2379"), token=None)
    check_store(_config(tmp_path, store_url="etcd://localhost,[::1]:2379"), token=None)
    check_store(
        _config(
            tmp_path,
            store_url="etcd://10.1.2.3",
            store_username=USER,
            store_password_file=str(secure_etcd.password_file),
        ),
        token=None,
    )
    check_store(
        _config(tmp_path, store_url=remote, store_ca_file=str(pki.ca), store_cert_file=str(pki.client_cert),
                store_key_file=str(pki.client_key)),
        token=None,
    )  # fmt: skip
    check_store(_config(tmp_path, store_url="http://10.1.2.3:7070"), token="t")
    with pytest.raises(ConfigError, match="not authenticated"):  # TLS alone: anyone may write
        check_store(_config(tmp_path, store_url=remote, store_ca_file=str(pki.ca)), token=None)
    with pytest.raises(ConfigError, match="not authenticated"):  # the token is not etcd's
        check_store(_config(tmp_path, store_url="etcd://10.1.2.3"), token="t")


def test_store_settings_are_checked(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    """Half-set pairs, TLS files on a plaintext URL, a prefix that is not a folder: each a clear error."""
    pki = secure_etcd.pki
    cases = [
        ({"store_username": USER}, "go together"),
        ({"store_cert_file": str(pki.client_cert)}, "go together"),
        ({"store_ca_file": str(pki.ca)}, "need TLS.*etcds://"),
        ({"store_prefix": "elasticd"}, "must end with '/'"),
    ]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_store(_config(tmp_path, store_url="etcd://127.0.0.1", **settings), token=None)
    with pytest.raises(ConfigError, match="only apply to an etcd"):
        check_store(_config(tmp_path, store_username=USER), token=None)


def test_credentials_in_the_url_are_refused_and_never_shown(tmp_path: Path) -> None:
    """etcd://user:password@host is refused with the password redacted from the message."""
    for url in [
        "etcd://elasticd:hunter2@10.1.2.3:2379",
        "etcds://hunter2@127.0.0.1",
        "etcd://u:hun/ter2@10.1.2.3",
        "http://u:hunter2@h:1",
    ]:
        with pytest.raises(ConfigError, match="credentials") as caught:
            check_store(_config(tmp_path, store_url=url), token=None)
        shown = str(caught.value)
        assert "hunter2" not in shown and "hun/ter2" not in shown and "***@" in shown
    with pytest.raises(ConfigError) as caught:
        EtcdStore(["https://elasticd:hunter2@127.0.0.1:2379"])
    assert "hunter2" not in str(caught.value)


def test_the_password_file_must_be_private_to_the_daemon(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """store_password_file readable by others, or owned by another user (a job's), is refused."""
    secret = tmp_path / "password"
    secret.write_text(PASSWORD)
    config = _config(
        tmp_path, store_url="etcd://127.0.0.1", store_username=USER, store_password_file=str(secret)
    )
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_store_password(config)
    secret.chmod(0o600)
    assert read_store_password(config) == PASSWORD
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # would block a plain open() forever
    with pytest.raises(ConfigError, match="not a regular file"):
        read_store_password(config.model_copy(update={"store_password_file": fifo}))
    if os.geteuid() == 0:
        os.chown(secret, 65534, 65534)  # nobody: a job running as nobody could rewrite it
        with pytest.raises(ConfigError, match="belongs to nobody"):
            read_store_password(config)


@pytest.mark.slow
def test_daemon_runs_on_the_secure_etcd(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    """A real daemon: refused clearly (exit 2) without credentials; registers under the prefix with them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["ELASTICD_ALLOW_ROOT"] = "true"
    base = [sys.executable, "-m", "elasticd", "serve", "--port", "0", "--node-name", "secure-node"]
    plain = subprocess.run(
        [*base, "--state-dir", str(tmp_path / "a"), "--store-url", secure_etcd.http_url.replace("http", "etcd")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 2, plain.stderr
    # Refused before connecting (a root daemon: no store without credentials); told that
    # every local user is trusted, it connects and etcd itself refuses it, as clearly.
    assert "store is not authenticated" in plain.stderr and "store_username" in plain.stderr
    trusting = subprocess.run(
        [*base, "--state-dir", str(tmp_path / "a2"), "--store-url", secure_etcd.http_url.replace("http", "etcd")],
        env={**env, "ELASTICD_ALLOW_INSECURE_STORE": "true"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert trusting.returncode == 2, trusting.stderr
    assert "requires authentication" in trusting.stderr and "store_username" in trusting.stderr
    pki = secure_etcd.pki
    toml = tmp_path / "elasticd.toml"
    toml.write_text(
        "\n".join(
            [
                f'store_url = "{secure_etcd.https_url.replace("https", "etcds")}"',
                f'store_username = "{USER}"',
                f'store_password_file = "{secure_etcd.password_file}"',
                f'store_ca_file = "{pki.ca}"',
                f'store_cert_file = "{pki.client_cert}"',
                f'store_key_file = "{pki.client_key}"',
                f'store_prefix = "{PREFIX}"',
            ]
        )
    )
    daemon = subprocess.Popen(
        [*base, "--state-dir", str(tmp_path / "b"), "--config", str(toml)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        token = secure_etcd.root_token()
        deadline = time.monotonic() + 60
        while True:
            assert daemon.poll() is None, daemon.stdout.read().decode() if daemon.stdout else ""
            raw = _gateway(
                secure_etcd.http_url,
                "/kv/range",
                {"key": _b64(PREFIX + "nodes/secure-node")},
                token,
            )
            if raw.get("kvs"):
                break
            assert time.monotonic() < deadline, "the daemon never registered"
            time.sleep(0.2)  # polling under the deadline
        output = b""
    finally:
        daemon.terminate()
        try:
            output, _ = daemon.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            output, _ = daemon.communicate()
    assert PASSWORD.encode() not in output
