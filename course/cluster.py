"""An emulated cluster on one Linux machine: nodes made of namespaces, links shaped by `tc`, MPI
launched across them. Lessons 12, 13 and 16 measure collectives and parallel training on it.

    with EmulatedCluster(nodes=2, ppn=2, link="2gbit") as cluster:
        run(fn, 4, engine="mpi", nodes=2)      # minitorch.comm: the ranks on the cluster's 2 nodes
        cluster.link_bytes()                    # per rank: bytes its NIC sent and received so far

    make cluster NODES=2 PPN=2 LINK=2gbit      # the same, kept up until Ctrl-C, for notebooks
    python -m course.cluster status | down     # what is running; remove every emulated cluster

What a cluster of N nodes x P ranks is made of (all named mtc<k>..., k its index, so that several
clusters can run at once):
- **A NIC per rank.** Rank (n, i) (node n, local rank i) gets a network namespace `mtc<k>n<n>r<i>`
  holding one end of a veth pair, `eth0`, addressed 10.213.k.(n*P + i + 1); the other end sits in
  this machine's namespace, on a bridge `mtc<k>br` (10.213.k.254) that joins every NIC: one switch
  with full bisection bandwidth. A NIC per rank is how GPU servers are built (a DGX H100 has one
  400 Gb/s NIC per GPU), and it keeps the simulator's model of the same cluster exact: every rank
  has a link of its own (minitorch.comm's two-level topology).
- **Shaped links.** Each NIC sends at most `link` (a token bucket, `tc qdisc ... tbf`, on both ends
  of the veth: what a rank sends and what it receives), MTU 9000. No latency is added (the kernels
  these run on often lack `netem`): the inter-node alpha is the software's, measured.
- **Nodes.** hydra's `mpiexec` (the mpich wheel's) starts one proxy per node through its ssh
  launcher, pointed (`-launcher-exec`) at a small script that starts the proxy in the node's own
  mount, UTS and IPC namespaces (a hostname and a /dev/shm of its own, so that MPI finds the ranks of
  a node, and only those, through shared memory) and in the network namespace of the node's rank 0.
  Each rank enters its own NIC's namespace before MPI starts (minitorch.comm's worker). MPI then
  moves bytes between ranks of a node through shared memory, and between nodes over TCP (UCX,
  `UCX_TLS=tcp`) through the ranks' NICs: every byte between nodes crosses a veth, and its counters.
- **Removed afterwards, whatever happens.** `stop()` (the context manager's exit, also on Ctrl-C)
  kills what runs in the namespaces and deletes them, the links and the files. A guardian process
  started with the cluster does the same when the process that owns it dies any other way (kill -9,
  a crashed kernel), and the next start removes what a dead owner left.

Needs Linux, root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (`ip`, `tc` with the tbf qdisc),
util-linux (`nsenter`, `unshare`) and the mpich wheel. `cluster_status()` says whether this machine
has all of it, and why not.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

PREFIX = "mtc"                               # every name a cluster creates starts with it
STATE = Path("/run/minitorch-cluster")        # minitorch.comm.CLUSTER_DIR: cluster files, launchers, the lock
SUBNET = "10.213.{k}"                         # cluster k's addresses: 10.213.k.0/24
MAX_CLUSTERS = 64
MTU = 9000
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class ClusterUnavailable(RuntimeError):
    """This machine cannot make an emulated cluster (the reason is the message)."""


class ClusterError(RuntimeError):
    """Making or removing a cluster failed (the command and its output are in the message)."""


# ----------------------------------------------------------------------------------- small helpers

def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (no shell); a ClusterError naming it and its output if it fails and check."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise ClusterError(f"`{' '.join(cmd)}`: {exc}") from None
        return subprocess.CompletedProcess(cmd, 1, "", str(exc))
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def parse_rate(link: str | float | None) -> float | None:
    """A link's rate in bits per second: '2gbit' -> 2e9, '500mbit' -> 5e8, 1e9 -> 1e9; None: unshaped.
    (tc's units; note that tc reads 'mbps' as megaBYTES per second, which is refused here.)"""
    if link is None:
        return None
    if isinstance(link, (int, float)) and not isinstance(link, bool):
        if link > 0:
            return float(link)
    elif isinstance(link, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)\s*", link.lower())
        if m and float(m.group(1)) > 0:
            return float(m.group(1)) * UNITS[m.group(2)]
    raise ValueError(f"link must be a rate such as '2gbit', '500mbit' (or bits per second, > 0), got {link!r}")


def _tc_rate(bits: float) -> str:
    return f"{int(round(bits))}bit"


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether process pid runs (and, given its start time from /proc, is the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started is None or _start_time(pid) == started


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


_STATUS: tuple[bool, str] | None = None


def cluster_status() -> tuple[bool, str]:
    """(True, what it will be made of) if this machine can make an emulated cluster, else (False,
    why not). Checked once per process: the platform, the privileges, the tools, a throw-away network
    namespace with a veth pair, a bridge and a tbf qdisc (gone with the process that made it), and MPI."""
    global _STATUS
    if _STATUS is None:
        _STATUS = _probe()
    return _STATUS


def _privileged() -> bool:
    """Whether this process may make namespaces: root, or CAP_NET_ADMIN and CAP_SYS_ADMIN."""
    try:
        with open("/proc/self/status") as f:
            caps = int(next(line.split()[1] for line in f if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        caps = 0
    need = (1 << 12) | (1 << 21)  # CAP_NET_ADMIN, CAP_SYS_ADMIN
    return os.geteuid() == 0 or caps & need == need


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"an emulated cluster needs Linux network namespaces (this is {sys.platform})"
    if not _privileged():
        return False, ("an emulated cluster needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to make network "
                       "namespaces; the simulator's two-level topology (run(..., nodes=..., alpha_inter=..., "
                       "beta_inter=...)) stands in")
    for tool in ("ip", "tc", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return False, f"an emulated cluster needs `{tool}` (iproute2, util-linux), which is not installed here"
    from minitorch.comm import mpi_status

    ok, why = mpi_status()
    if not ok:
        return False, f"MPI cannot start here: {why}"
    script = ("ip link add mtcprobe0 type veth peer name mtcprobe1 && ip link add mtcprobebr type bridge && "
              "tc qdisc add dev mtcprobe0 root tbf rate 1gbit burst 64kb latency 20ms")
    done = _sh("unshare", "--net", "--mount", "--uts", "--ipc", "sh", "-c", script, check=False)
    if done.returncode != 0:
        return False, ("this machine does not let this process make network namespaces, veth pairs, bridges or "
                       f"tbf qdiscs ({(done.stderr or done.stdout).strip()[-200:]}); the simulator's two-level "
                       "topology stands in")
    return True, "Linux network namespaces, veth pairs on a bridge, tbf shaping, MPI over TCP (UCX)"


# ----------------------------------------------------------------------------------- the cluster

class EmulatedCluster:
    """`nodes` nodes of `ppn` ranks on this machine, each rank with a NIC sending and receiving at
    most `link` (a rate such as '2gbit'; None: as fast as a veth goes). See the module docstring.

    start() makes it (raises ClusterUnavailable where this machine cannot, with the reason) and sets
    MINITORCH_CLUSTER in this process, so that minitorch.comm.run(..., engine="mpi", nodes=k) runs on
    it; stop() removes everything. A context manager does both."""

    def __init__(self, nodes: int = 2, ppn: int = 2, link: str | float | None = "2gbit", mtu: int = MTU):
        for name, value in (("nodes", nodes), ("ppn", ppn), ("mtu", mtu)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmulatedCluster: {name} must be an integer >= 1, got {value!r}")
        if nodes * ppn > 250:
            raise ValueError(f"EmulatedCluster: at most 250 ranks (one address each in a /24), got {nodes} x {ppn}")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"EmulatedCluster: mtu must be in [1280, 65535], got {mtu}")
        self.nodes, self.ppn, self.mtu = nodes, ppn, mtu
        self.rate = parse_rate(link)  # bits per second, or None
        self.queue = "20ms"  # tbf: how long a packet may wait in the bucket's queue
        self.link = link if link is None or isinstance(link, str) else f"{self.rate / 1e9:g}gbit"
        self.index: int | None = None
        self._token = ""
        self._guard: subprocess.Popen | None = None
        self._env_before: str | None = None

    # -- names
    @property
    def name(self) -> str:
        return f"{PREFIX}{self.index}"

    def netns(self, node: int, local: int) -> str:
        """The network namespace of rank `local` of node `node` (its NIC's; also the veth's host-side name)."""
        return f"{self.name}n{node}r{local}"

    def address(self, node: int, local: int) -> str:
        return f"{SUBNET.format(k=self.index)}.{node * self.ppn + local + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def dir(self) -> Path:
        return STATE / self.name

    @property
    def cluster_file(self) -> Path:
        """The file minitorch.comm reads (hosts, launcher, environment): STATE/<name>.json."""
        return STATE / f"{self.name}.json"

    @property
    def burst(self) -> int | None:
        """The token bucket's depth in bytes: half a millisecond at the link's rate (at least 64 KiB).
        tbf releases a bucket's worth at full speed after an idle moment; a shallower bucket misses the
        rate (the timer cannot refill it often enough)."""
        return None if self.rate is None else max(64 << 10, int(self.rate / 8 * 5e-4))

    def describe(self) -> str:
        shaped = (f"each rank's NIC shaped to {self.link} ({self.rate / 8e6:.0f} MB/s each way, tbf burst "
                  f"{self.burst // 1024} KiB)") if self.rate else "NICs not shaped (veth speed)"
        return (f"emulated cluster {self.name}: {self.nodes} nodes x {self.ppn} rank{'s' * (self.ppn != 1)}, {shaped}, MTU {self.mtu}; "
                "shared memory inside a node, TCP (UCX) between nodes, no added latency; all on this machine's "
                f"{os.cpu_count()} cores")

    def __repr__(self) -> str:
        state = "not started" if self.index is None else self.name
        return f"<EmulatedCluster {self.nodes} nodes x {self.ppn} ranks, link {self.link}, {state}>"

    # -- start and stop
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> EmulatedCluster:
        """Make the cluster (see the module docstring). On any failure or interruption, whatever was
        made is removed before the exception propagates."""
        if self.index is not None:
            raise RuntimeError(f"{self.name} is already started")
        ok, why = cluster_status()
        if not ok:
            raise ClusterUnavailable(why)
        STATE.mkdir(parents=True, exist_ok=True)
        try:
            with _locked():
                remove_stale()
                self.index = _free_index()
                self.dir.mkdir(parents=True, exist_ok=True)
                self._token = os.urandom(8).hex()  # this cluster's, not an earlier one's of the same name
                _write_json(self.dir / "state.json", {"owner": os.getpid(), "started": _start_time(os.getpid()),
                                                      "nodes": self.nodes, "ppn": self.ppn, "token": self._token})
                _sh("ip", "link", "add", self.bridge, "type", "bridge")  # (the name claims the index)
            self._guard = _start_guardian(self.name, self._token)
            self._make()
            self._write_cluster_file()
        except BaseException:
            if self.index is not None:
                self.stop()
            raise
        self._env_before = os.environ.get("MINITORCH_CLUSTER")
        os.environ["MINITORCH_CLUSTER"] = str(self.cluster_file)
        return self

    def _make(self) -> None:
        sub = SUBNET.format(k=self.index)
        br = self.bridge
        _sh("ip", "link", "set", br, "addrgenmode", "none")  # no IPv6 chatter on the counters
        _sh("ip", "addr", "add", f"{sub}.254/24", "dev", br)
        _sh("ip", "link", "set", br, "up")
        for node in range(self.nodes):
            for local in range(self.ppn):
                ns = self.netns(node, local)
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", ns, "mtu", str(self.mtu), "type", "veth", "peer", "name", "eth0",
                    "mtu", str(self.mtu), "netns", ns)
                _sh("ip", "link", "set", ns, "addrgenmode", "none")
                _sh("ip", "-n", ns, "link", "set", "eth0", "addrgenmode", "none")
                _sh("ip", "link", "set", ns, "master", br, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(node, local)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                if self.rate is not None:
                    tbf = ("root", "tbf", "rate", _tc_rate(self.rate), "burst", str(self.burst), "latency", self.queue)
                    _sh("tc", "qdisc", "add", "dev", ns, *tbf)                    # what the rank receives
                    _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)      # what the rank sends
        launcher = self.dir / "launch"
        cases = "\n".join(f"  {self.address(n, 0)}) node={n} ;;" for n in range(self.nodes))
        launcher.write_text(f"""#!/bin/sh
# hydra's ssh launcher for emulated cluster {self.name} (course/cluster.py): [-x] HOST COMMAND...
# starts COMMAND (hydra's proxy) as node HOST: in the network namespace of the node's rank 0, with a
# mount, UTS and IPC namespace of its own (its /dev/shm, its hostname); MINITORCH_NODE tells each rank
# which node it is on (minitorch.comm enters the rank's own network namespace from it).
[ "$1" = "-x" ] && shift
case "$1" in
{cases}
  *) echo "{self.name}: no node $1" >&2; exit 255 ;;
esac
shift
exec nsenter --net=/run/netns/{self.name}n$node""r0 unshare --mount --uts --ipc --propagation private \\
  /bin/sh -c "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname {self.name}-node$node && MINITORCH_NODE=$node && export MINITORCH_NODE && exec $*"
""")
        launcher.chmod(0o755)

    def _write_cluster_file(self) -> None:
        _write_json(self.cluster_file, {
            "name": self.name, "description": self.describe(), "index": self.index, "nodes": self.nodes,
            "ppn": self.ppn, "link": self.link, "hosts": [self.address(n, 0) for n in range(self.nodes)],
            "launcher": "ssh", "launcher_exec": str(self.dir / "launch"),
            "localhost": f"{SUBNET.format(k=self.index)}.254",
            "env": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
                    "UCX_RNDV_THRESH": "inf", "UCX_WARN_UNUSED_ENV_VARS": "n"},
            "rank_netns": f"/run/netns/{self.name}n{{node}}r{{local}}", "shared_machine": True,
            "owner": os.getpid(), "created": time.time()})

    def stop(self) -> list[str]:
        """Remove everything the cluster made (idempotent); returns what could not be removed (empty
        when all went). A Ctrl-C while it runs is held until it is done."""
        if self.index is None:
            return []
        interrupted = False
        left: list[str] = []
        while True:
            try:
                with _locked():
                    left = teardown(self.name)
                break
            except KeyboardInterrupt:
                interrupted = True
        if self._guard is not None:
            try:
                self._guard.stdin.close()  # the guardian finds nothing left and exits
                self._guard.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                try:  # (a late one would do no harm: it removes only the cluster with its token)
                    self._guard.kill()
                    self._guard.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._guard = None
        if os.environ.get("MINITORCH_CLUSTER") == str(self.cluster_file):
            if self._env_before is None:
                os.environ.pop("MINITORCH_CLUSTER", None)
            else:
                os.environ["MINITORCH_CLUSTER"] = self._env_before
        self.index = None
        if interrupted:
            raise KeyboardInterrupt
        return left

    # -- using it
    def run(self, fn: Callable, nranks: int | None = None, *args: Any, **kwargs: Any) -> Any:
        """minitorch.comm.run(fn, nranks, *args, engine="mpi", nodes=self.nodes, **kwargs) on this
        cluster (nranks: default, every rank of it)."""
        from minitorch.comm import run

        if self.index is None:
            raise RuntimeError("start the cluster first")
        before = os.environ.get("MINITORCH_CLUSTER")
        os.environ["MINITORCH_CLUSTER"] = str(self.cluster_file)
        try:
            return run(fn, nranks or self.nodes * self.ppn, *args, engine="mpi",
                       nodes=kwargs.pop("nodes", self.nodes), **kwargs)
        finally:
            if before is None:
                os.environ.pop("MINITORCH_CLUSTER", None)
            else:
                os.environ["MINITORCH_CLUSTER"] = before

    def nics(self) -> list[str]:
        """The host-side names of the ranks' NICs (veths), in rank order (node by node)."""
        if self.index is None:
            raise RuntimeError("start the cluster first")
        return [self.netns(node, local) for node in range(self.nodes) for local in range(self.ppn)]

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per rank (rank order): (bytes its NIC sent, bytes it received) so far (read_nic_bytes)."""
        return read_nic_bytes(self.nics())


def read_nic_bytes(nics: list[str]) -> list[tuple[int, int]]:
    """Per NIC of an emulated cluster (EmulatedCluster.nics()): (bytes the rank sent, bytes it received)
    so far, from the counters of the veth's end on this machine's side (what the rank sends arrives
    there: that end's rx). Readable from the cluster's ranks too: they see this machine's /sys."""
    out = []
    for name in nics:
        stats = Path("/sys/class/net") / name / "statistics"
        out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
    return out


# ----------------------------------------------------------------------------------- state, teardown

class _locked:
    """An exclusive lock on STATE/lock (clusters are made and removed one at a time)."""

    def __enter__(self) -> None:
        STATE.mkdir(parents=True, exist_ok=True)
        self.fh = open(STATE / "lock", "a+")
        fcntl.flock(self.fh, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _names() -> tuple[list[str], list[str]]:
    """(network namespaces, links) on this machine whose names start with PREFIX."""
    ns = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).stdout.splitlines()
          if line.startswith(PREFIX)]
    links = [line.split()[1].split("@")[0].rstrip(":") for line in _sh("ip", "-o", "link", check=False).stdout.splitlines()
             if len(line.split()) > 1 and line.split()[1].startswith(PREFIX)]
    return ns, links


def _free_index() -> int:
    ns, links = _names()
    used = {int(m.group(1)) for name in ns + links if (m := re.match(rf"{PREFIX}(\d+)", name))}
    used |= {int(p.name[len(PREFIX):]) for p in STATE.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()}
    routes = _sh("ip", "-o", "route", check=False).stdout + _sh("ip", "-o", "addr", check=False).stdout
    for k in range(MAX_CLUSTERS):
        if k not in used and f"{SUBNET.format(k=k)}." not in routes:
            return k
    raise ClusterError(f"no free cluster index (0..{MAX_CLUSTERS - 1} are taken): `python -m course.cluster down`")


def _processes_of(name: str) -> list[int]:
    """Processes that belong to cluster `name`: those in its network namespaces, and mpiexec's whose
    command line names its launcher."""
    pids: set[int] = set()
    ns, _ = _names()
    for n in ns:
        if re.fullmatch(rf"{name}n\d+r\d+", n):
            pids |= {int(p) for p in _sh("ip", "netns", "pids", n, check=False).stdout.split() if p.isdigit()}
    marker = str(STATE / name / "launch").encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    pids.add(int(entry))
        except OSError:
            pass
    pids.discard(os.getpid())
    return sorted(pids)


def teardown(name: str) -> list[str]:
    """Remove cluster `name` (mtc<k>): kill its processes, delete its links and namespaces and its
    files. Returns what is still there afterwards (nothing, normally)."""
    if not re.fullmatch(rf"{PREFIX}\d+", name):
        raise ValueError(f"teardown: not a cluster name: {name!r}")
    for _ in range(3):
        pids = _processes_of(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
        if not pids:
            break
    ns, links = _names()
    mine = re.compile(rf"{name}(br|n\d+r\d+)")
    for link in links:
        if mine.fullmatch(link):
            _sh("ip", "link", "del", link, check=False)  # a veth's peer in the namespace goes with it
    for n in ns:
        if mine.fullmatch(n):
            _sh("ip", "netns", "del", n, check=False)
    for path in (STATE / f"{name}.json", STATE / f"{name}.tmp"):
        path.unlink(missing_ok=True)
    shutil.rmtree(STATE / name, ignore_errors=True)
    ns, links = _names()
    left = [f"network namespace {n}" for n in ns if mine.fullmatch(n)] + \
           [f"link {x}" for x in links if mine.fullmatch(x)] + \
           [f"process {p}" for p in _processes_of(name)]
    return left


def clusters() -> list[dict]:
    """Every emulated cluster this machine knows of: {name, owner, alive, nodes, ppn, file}."""
    out, seen = [], set()
    for state in sorted(STATE.glob(f"{PREFIX}*/state.json")) if STATE.is_dir() else []:
        try:
            data = json.loads(state.read_text())
        except (OSError, ValueError):
            data = {}
        name = state.parent.name
        seen.add(name)
        owner = int(data.get("owner", 0) or 0)
        out.append({"name": name, "owner": owner, "alive": owner > 0 and _alive(owner, data.get("started")),
                    "nodes": data.get("nodes"), "ppn": data.get("ppn"), "file": str(STATE / f"{name}.json")})
    ns, links = _names()
    for name in sorted({m.group(0) for x in ns + links if (m := re.match(rf"{PREFIX}\d+", x))} - seen):
        out.append({"name": name, "owner": 0, "alive": False, "nodes": None, "ppn": None, "file": None})
    return out


def remove_stale() -> list[str]:
    """Remove the clusters whose owner has died (or that have no owner on record); their names."""
    gone = []
    for c in clusters():
        if not c["alive"]:
            teardown(c["name"])
            gone.append(c["name"])
    return gone


def leftovers() -> list[str]:
    """What emulated clusters left on this machine: namespaces, links and processes named mtc..."""
    ns, links = _names()
    found = [f"network namespace {n}" for n in ns] + [f"link {x}" for x in links]
    for c in clusters():
        found += [f"process {p} of {c['name']}" for p in _processes_of(c["name"])]
    return found


# ----------------------------------------------------------------------------------- guardian, CLI

def _start_guardian(name: str, token: str) -> subprocess.Popen:
    """A process that removes cluster `name` once this one has gone: it waits on a pipe from this
    process (end of file: this process closed it, or died) and on this process's id, then tears down
    whatever of the cluster is left, unless the name has since been claimed by another cluster (whose
    state file holds another token). In a session of its own, so a Ctrl-C to this one does not reach it."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", "import sys; from course.cluster import _guard; "
                             "_guard(sys.argv[1], int(sys.argv[2]), sys.argv[3])", name, str(os.getpid()), token],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env, cwd=root)


def _guard(name: str, owner: int, token: str = "") -> None:
    import threading

    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), done.set()), daemon=True).start()
    started = _start_time(owner)
    while not done.wait(1.0):
        if not _alive(owner, started):
            break
    with _locked():
        try:
            claimed = json.loads((STATE / name / "state.json").read_text()).get("token")
        except (OSError, ValueError, AttributeError):
            claimed = None  # removed already (or never written): what is left of the name is ours
        if claimed is None or claimed == token:
            teardown(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.cluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a cluster and keep it until Ctrl-C")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--ppn", type=int, default=2)
    up.add_argument("--link", default="2gbit", help="each rank's NIC rate, e.g. 2gbit; 'none': unshaped")
    sub.add_parser("status", help="the emulated clusters on this machine")
    sub.add_parser("down", help="remove every emulated cluster on this machine")
    args = ap.parse_args(argv)
    if args.cmd == "status":
        ok, why = cluster_status()
        print(("can make emulated clusters: " if ok else "cannot make emulated clusters: ") + why)
        for c in clusters():
            print(f"  {c['name']}: {c['nodes']} nodes x {c['ppn']} ranks, owner {c['owner']} "
                  f"({'running' if c['alive'] else 'gone: stale'}), {c['file']}")
        return 0
    if args.cmd == "down":
        with _locked():
            names = [c["name"] for c in clusters()]
            left = [x for n in names for x in teardown(n)]
        print(f"removed {', '.join(names) if names else 'nothing'}" + (f"; left: {left}" if left else ""))
        return 1 if left else 0
    cluster = EmulatedCluster(args.nodes, args.ppn, None if args.link.lower() == "none" else args.link)
    try:
        cluster.start()
    except (ClusterUnavailable, ClusterError, ValueError) as exc:
        print(f"cannot start an emulated cluster: {exc}")
        return 1
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        print(cluster.describe())
        print(f"cluster file: {cluster.cluster_file}")
        print(f"In a notebook or script on this machine, run(fn, {args.nodes * args.ppn}, engine=\"mpi\", "
              f"nodes={args.nodes}) runs on it (minitorch.comm finds it). Ctrl-C stops it and removes everything.",
              flush=True)
        while not stop:
            signal.pause()
    finally:
        name = cluster.name
        left = cluster.stop()
        print(f"{name} removed" + (f"; left: {left}" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
