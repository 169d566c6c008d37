"""A real Slurm cluster on this machine for end-to-end tests (issue 38).

Debian's ``slurm-wlm`` (22.05) and ``munge``, nothing faked:

* ``munged`` with a key made in the test's folder and its own socket, pid,
  seed and log paths there (``AuthInfo=socket=...`` points Slurm at it);
* ``slurmctld`` in this machine's namespaces, on the bridge's address;
* one ``slurmd -N nK`` per node, each in network, UTS and mount namespaces of
  its own (held by an ``unshare ... sleep`` process, entered with
  ``nsenter``: ``ip netns exec`` remounts ``/sys``, which hides
  ``/sys/fs/cgroup`` from slurmd), its hostname ``nK``, ``/etc/hosts`` bound
  over in its mount namespace so the cluster's names resolve there;
* the nodes joined by a bridge on a ``10.213.X.0/24`` subnet that no
  interface of this machine uses, with names unique to the run.

Every path (``slurm.conf``, spool, state, logs, pid files) is in the test's
folder, ports are free ones, and :meth:`SlurmCluster.close` tears it all down
and checks that nothing is left (no daemon, no process in a node's
namespaces, no bridge or veth). Needs root, ``ip``, ``unshare``/``nsenter``.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: What the harness needs on PATH (Debian: slurm-wlm, munge, iproute2, util-linux).
TOOLS = ("slurmctld", "slurmd", "srun", "sinfo", "scontrol", "munged", "ip", "unshare", "nsenter")
#: ``KillWait``: the seconds between Slurm's SIGTERM and its SIGKILL on a cancel or time limit.
KILL_WAIT = 10


def require_slurm() -> None:
    """Skip the test when Slurm, munge or root are missing, unless CI is set (then fail)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    why = f"needs {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None
    if why is None and os.geteuid() != 0:
        why = "needs root (network namespaces, a bridge, slurmd)"
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"a real Slurm cluster {why}")
    pytest.skip(f"a real Slurm cluster {why}")


def _sh(*args: str, timeout: float = 30) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_subnet() -> str:
    """``10.213.X`` for an X that no address or route of this machine uses."""
    taken = _sh("ip", "-4", "addr") + _sh("ip", "-4", "route")
    candidates = [x for x in range(1, 255) if f"10.213.{x}." not in taken]
    if not candidates:
        raise RuntimeError("every 10.213.X.0/24 is in use on this machine")
    return f"10.213.{random.choice(candidates)}"


@dataclass
class SlurmNode:
    """One node: its namespaces' holder process, its address, its slurmd."""

    name: str
    addr: str
    holder: subprocess.Popen[bytes]
    veth: str
    slurmd: subprocess.Popen[bytes] | None = None

    def nsenter(self, *args: str) -> list[str]:
        """``args`` run inside this node's network, UTS and mount namespaces."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", "--", *args]

    def pids(self) -> list[int]:
        """Every process in this node's network namespace but its holder."""
        mine = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.holder.pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == mine:
                    found.append(int(entry))
        return found


@dataclass
class SlurmCluster:
    """A controller and ``size`` nodes ``n1..nN``; :meth:`start`, then :meth:`close`."""

    root: Path
    size: int = 3
    #: More slurm.conf lines (``Prolog=...``, say).
    extra_conf: tuple[str, ...] = ()
    nodes: dict[str, SlurmNode] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = secrets.token_hex(3)
        self.bridge = f"esb{tag}"
        self.subnet = _free_subnet()
        self.controller_addr = f"{self.subnet}.1"
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.cluster_name = f"t{tag}"
        self._tag = tag
        self._bridge_made = False
        self._closed = False

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands (``srun``, ``sinfo``, ...) against this cluster."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTICD_"))}
        environ["SLURM_CONF"] = str(self.conf)
        return environ

    # -- start -----------------------------------------------------------------

    def start(self, timeout: float = 30) -> None:
        try:
            self._network()
            self._munge()
            self._write_conf()
            self._spawn(["slurmctld", "-D", "-f", str(self.conf)], self.root / "slurmctld.out")
            for node in self.nodes.values():
                node.slurmd = self._spawn(
                    node.nsenter("slurmd", "-D", "-N", node.name, "-f", str(self.conf)),
                    self.root / f"slurmd-{node.name}.out",
                )
            self.wait_idle(timeout)
        except BaseException:
            self.close(check=False)
            raise

    def _network(self) -> None:
        hosts = self.root / "hosts"
        lines = ["127.0.0.1 localhost", f"{self.controller_addr} ctl"]
        names = [f"n{i}" for i in range(1, self.size + 1)]
        lines += [f"{self.subnet}.{10 + i} {name}" for i, name in enumerate(names, 1)]
        hosts.write_text("\n".join(lines) + "\n")
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _sh("ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(names, 1):
            holder = subprocess.Popen(
                ["unshare", "--net", "--uts", "--mount", "--propagation", "private",
                 "sleep", "infinity"],
                start_new_session=True,
            )  # fmt: skip
            veth = f"esv{self._tag}{i}"
            node = SlurmNode(name, f"{self.subnet}.{10 + i}", holder, veth)
            self.nodes[name] = node
            self._wait_unshared(holder)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                "netns", str(holder.pid))  # fmt: skip
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            for cmd in (
                ["ip", "link", "set", "lo", "up"],
                ["ip", "addr", "add", f"{node.addr}/24", "dev", "eth0"],
                ["ip", "link", "set", "eth0", "up"],
                ["hostname", name],
                ["mount", "--bind", str(hosts), "/etc/hosts"],
            ):
                _sh(*node.nsenter(*cmd))

    @staticmethod
    def _wait_unshared(holder: subprocess.Popen[bytes]) -> None:
        """Until ``unshare`` has made the namespaces and exec'd ``sleep`` (bounded)."""
        deadline = time.monotonic() + 10
        host_net = os.readlink("/proc/self/ns/net")
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                exe = os.readlink(f"/proc/{holder.pid}/exe")
                if exe.endswith("sleep") and os.readlink(f"/proc/{holder.pid}/ns/net") != host_net:
                    return
            if holder.poll() is not None:
                raise RuntimeError(f"unshare exited {holder.returncode}")
            time.sleep(0.01)
        raise RuntimeError("unshare did not make the node's namespaces within 10 s")

    def _munge(self) -> None:
        folder = self.munge_socket.parent
        folder.mkdir(mode=0o700)
        key = folder / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            os.write(fd, secrets.token_bytes(1024))
        finally:
            os.close(fd)
        self._spawn(
            [
                "munged", "--foreground", "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--log-file={folder / 'munged.log'}",
                f"--seed-file={folder / 'munged.seed'}",
            ],
            folder / "munged.out",
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(folder / 'munged.out')}")
            time.sleep(0.02)

    def _write_conf(self) -> None:
        state = self.root / "state"
        spool = self.root / "spool"
        logs = self.root / "logs"
        for folder in (state, spool, logs):
            folder.mkdir()
        for name in self.nodes:
            (spool / name).mkdir()
        cpus = 2
        lines = [
            f"ClusterName={self.cluster_name}",
            # The controller is this machine (slurmctld checks its own hostname), on the bridge.
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({self.controller_addr})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={logs}/slurmctld.log",
            f"SlurmdLogFile={logs}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmdTimeout=10",
            f"KillWait={KILL_WAIT}",
            "ReturnToService=2",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        lines += self.extra_conf
        for node in self.nodes.values():
            lines.append(
                f"NodeName={node.name} NodeAddr={node.addr} NodeHostname={node.name} "
                f"CPUs={cpus} State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, args: list[str], out: Path) -> subprocess.Popen[bytes]:
        with out.open("ab") as sink:
            proc = subprocess.Popen(
                args,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    # -- use -------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm command (``sinfo``, ``scontrol``, ...) against this cluster."""
        return subprocess.run(
            args, capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` shows it (``idle``, ``alloc``, ``down*``, ...)."""
        done = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        if done.returncode != 0:
            return {}
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 30) -> None:
        """Until ``sinfo`` shows every node idle."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states()
            if len(states) == self.size and all(s == "idle" for s in states.values()):
                return
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout} s: {states}\n{self.logs()}")
            time.sleep(0.1)

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL a node's slurmd (the controller marks it down after SlurmdTimeout)."""
        slurmd = self.nodes[name].slurmd
        assert slurmd is not None
        slurmd.kill()
        slurmd.wait(10)

    @staticmethod
    def _tail(path: Path, n: int = 3000) -> str:
        try:
            return path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def logs(self) -> str:
        """The tails of every daemon's log, for a failure's message."""
        files = sorted((self.root / "logs").glob("*.log")) if (self.root / "logs").exists() else []
        files += sorted(self.root.glob("*.out")) + [self.root / "munge" / "munged.log"]
        return "\n".join(f"== {p.name}\n{self._tail(p)}" for p in files if p.exists())

    # -- stop ------------------------------------------------------------------

    def close(self, *, check: bool = True) -> None:
        """Stop every daemon, kill what is left in each node, remove the network; then
        (``check``) assert that nothing of the cluster is left. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self._procs):  # slurmds, then slurmctld, munged last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        leftovers = {name: node.pids() for name, node in self.nodes.items()}
        for node in self.nodes.values():
            for pid in node.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Its veth pair goes with either end; deleted here rather than left to the
            # kernel's deferred clean-up of the namespace.
            subprocess.run(["ip", "link", "del", node.veth], capture_output=True, check=False)
            node.holder.kill()
            node.holder.wait(10)
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        if not check:
            return
        assert not any(leftovers.values()), f"processes left in the nodes: {leftovers}"
        links = _sh("ip", "-o", "link")
        assert self.bridge not in links and f"esv{self._tag}" not in links, links
        for proc in self._procs:
            assert proc.poll() is not None, proc.args
