"""A cluster on one machine: one network namespace per rank, links capped by ``tc tbf``.

For benchmarks where the network is the bottleneck (1 Gbit/s, 200 Mbit/s) without a
second machine. The topology, for N ranks::

    netns <name>-r0   eth0 10.77.0.1/24 ==veth== p0 \\
    netns <name>-r1   eth0 10.77.0.2/24 ==veth== p1 -- br0      netns <name>-sw
    ...                                             /
    netns <name>-rN-1 eth0 10.77.0.N/24 ==veth== pN-1

Every rank has one full-duplex link to a switch (a Linux bridge in a namespace of its own,
so the host's interfaces, routes and qdiscs are never touched). Both directions of every
link are capped with a token bucket filter: rank -> switch on the rank's ``eth0``, switch
-> rank on the switch port ``p<i>``. As with a non-blocking switch, the bottleneck is each
rank's own link: N-1 senders into one rank share its downlink. There is no delay emulation
(netem is not available on the kernels this runs on); the RTT is that of veth (~20 us).

With ``group_size=M`` (hierarchical training: fast links inside a group, a slow one
between groups) ranks ``[g*M, (g+1)*M)`` sit on group ``g``'s bridge ``br<g>``, and every
group bridge has one more link, ``g<g> ==veth== c<g>``, to a core bridge ``core``; both
ends of it are capped at ``cross_rate``. All bridges live in the switch namespace and the
subnet stays one /24 (L2), so addresses and MASTER_ADDR do not change::

    r0, r1 -- br0 -- g0 ==veth== c0 \
                                      core      (all in netns <name>-sw; 2 groups of 2)
    r2, r3 -- br1 -- g1 ==veth== c1 /

Traffic inside a group never crosses a ``g``/``c`` link; every byte between groups leaves
its group through ``g<src>`` and enters the other through ``c<dst>`` (each group's own
link to the core is its bottleneck, as a machine's NIC would be).
:meth:`Cluster.cross_link_bytes` reads those links' interface counters.

The addresses exist only inside the cluster's namespaces, so clusters of different
processes never collide; so do the ports (rank 0's torchrun store listens on 29500 inside
``<name>-r0``). Namespace names are ``<prefix><pid>-<seq>-r<i>`` / ``-sw``: the owner's pid
tells a live cluster from the leftovers of a killed run, which :func:`remove_stale` deletes.

Worked example (2 ranks at 1 Gbit/s, torchrun in each namespace)::

    with netns_cluster(2, "1gbit") as c:
        results = c.run([c.torchrun_argv(r, ["-m", "hybridrec", "train", ...])
                         for r in range(c.world_size)], timeout_s=600)
    assert all(r.ok for r in results), results[0].stderr

Needs root (CAP_SYS_ADMIN to mount namespaces, CAP_NET_ADMIN for links and qdiscs), the
``ip`` and ``tc`` tools of iproute2, and kernel support for veth, bridge and sch_tbf;
:func:`require_support` and :func:`probe_support` say which is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridrec.errors import HybridrecError

PREFIX = "hrc-"
"""Name prefix of every namespace this module creates (unique to hybridrec)."""
SUBNET = "10.77.0"
"""The cluster's /24 (private); rank i is .i+1. It exists only inside the namespaces."""
IFNAME = "eth0"
"""The rank's interface inside its namespace (GLOO_SOCKET_IFNAME)."""
MAX_RANKS = 250

_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
_RATE_UNITS = {  # tc's units: *bit are bits/s, *bps are BYTES/s
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,
}
_seq = iter(range(1 << 30))  # clusters made by this process: unique names even when nested
_seq_lock = threading.Lock()


class ClusterUnavailableError(HybridrecError):
    """The namespace cluster cannot be built here; the message says what is missing."""


@dataclass(frozen=True)
class RankNode:
    """One rank's place in the cluster."""

    rank: int
    netns: str
    ifname: str
    address: str


@dataclass(frozen=True)
class RankResult:
    """What one rank's command did."""

    rank: int
    returncode: int
    """Exit status; negative = killed by that signal (e.g. at the timeout)."""
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# -- checks -----------------------------------------------------------------------------

def parse_rate(rate: str | int | None) -> int | None:
    """Link rate in bits/s from tc's notation: ``"1gbit"``, ``"200mbit"``, ``"12.5mbps"``
    (bps = bytes/s, as in tc). An int is bits/s. ``None``, ``"none"`` or 0: uncapped.
    A bare number in a string is refused: tc would read it as bytes/s."""
    if rate is None or (isinstance(rate, int) and rate == 0):
        return None
    if isinstance(rate, int):
        if rate < 0:
            raise ValueError(f"link rate must be >= 0 bits/s, got {rate}")
        return rate
    text = rate.strip().lower()
    if text in ("none", "0", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", text)
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"link rate {rate!r}: expected a number with a tc unit, e.g. 1gbit, "
                         f"200mbit, 125mbps (bytes/s); units: {', '.join(_RATE_UNITS)}")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if bits < 8000:
        raise ValueError(f"link rate {rate!r} is below 8 kbit/s")
    return int(bits)


def format_rate(bits_per_s: int | None) -> str:
    if bits_per_s is None:
        return "uncapped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s} bit/s"


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def require_support(*, euid: int | None = None, cap_eff: int | None = None,
                    which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise :class:`ClusterUnavailableError` unless this process can build the cluster:
    ``ip`` and ``tc`` on PATH, effective uid 0 with CAP_NET_ADMIN and CAP_SYS_ADMIN.
    ``euid``/``cap_eff``/``which`` stand in for the real ones (tests)."""
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        raise ClusterUnavailableError(
            f"the network-namespace cluster needs iproute2's {' and '.join(missing)} on PATH "
            "(Debian/Ubuntu: apt-get install iproute2)")
    euid = os.geteuid() if euid is None else euid
    caps = _effective_caps() if cap_eff is None else cap_eff
    lacking = [name for name, bit in _CAPS.items() if not caps >> bit & 1]
    if euid != 0 or lacking:
        who = f"effective uid {euid}" + (f", without {' and '.join(lacking)}" if lacking else "")
        raise ClusterUnavailableError(
            "the network-namespace cluster needs root: it creates network namespaces, veth "
            "links and tc qdiscs (CAP_SYS_ADMIN and CAP_NET_ADMIN); this process has "
            f"{who}. Run it as root, e.g. `sudo -E env PATH=$PATH python ...`.")


def probe_support(prefix: str = PREFIX) -> None:
    """Build and delete a one-namespace cluster piece (veth, bridge, tbf): raises
    :class:`ClusterUnavailableError` naming the step the kernel or the tools refused."""
    require_support()
    name = f"{prefix}{os.getpid()}-probe"
    try:
        _run_tool("ip", "netns", "add", name)
        _run_tool("ip", "-n", name, "link", "add", "br0", "type", "bridge")
        _run_tool("ip", "-n", name, "link", "add", "veth0", "type", "veth", "peer", "name",
                  "veth1")
        _run_tool("tc", "-n", name, "qdisc", "add", "dev", "veth0", "root", "tbf", "rate",
                  "1mbit", "burst", "32kb", "latency", "50ms")
    finally:
        _delete_namespaces([name])


def _run_tool(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    # A session of its own: a Ctrl-C at the terminal must not kill `ip netns del` mid-teardown.
    proc = subprocess.run(argv, capture_output=True, text=True, start_new_session=True,
                          check=False)
    if check and proc.returncode != 0:
        raise ClusterUnavailableError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}. "
            "The cluster needs root and kernel support for network namespaces, veth, "
            "bridge and the tbf qdisc (sch_tbf).")
    return proc


# -- namespaces: listing, stale ones, teardown -------------------------------------------

def list_namespaces() -> list[str]:
    out = _run_tool("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _owner(name: str, prefix: str) -> int | None:
    m = re.fullmatch(re.escape(prefix) + r"(\d+)-(?:\d+-(?:sw|r\d+)|probe)", name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_stale(prefix: str = PREFIX) -> tuple[list[str], list[str]]:
    """``(stale, live)``: this module's namespaces whose owner process is gone, and those of
    clusters still running (in this or another process)."""
    stale, live = [], []
    for name in list_namespaces():
        owner = _owner(name, prefix)
        if owner is not None:
            (live if _alive(owner) else stale).append(name)
    return stale, live


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces (and the processes left in them) of killed earlier runs;
    returns their names. Live clusters are left alone."""
    stale, _ = find_stale(prefix)
    _delete_namespaces(stale)
    return stale


def _netns_pids(name: str) -> list[int]:
    out = _run_tool("ip", "netns", "pids", name, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Kill what runs inside ``names`` (only processes this module started live there),
    delete them, and return those that could not be deleted."""
    existing = set(list_namespaces())
    names = [n for n in names if n in existing]
    for name in names:
        for pid in _netns_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_netns_pids(n) for n in names):
        time.sleep(0.05)
    for name in names:  # deleting a namespace deletes the veth ends inside it, and their peers
        _run_tool("ip", "netns", "del", name, check=False)
    left = set(list_namespaces())
    return [n for n in names if n in left]


# -- the cluster --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    """A built cluster (see :func:`netns_cluster`); runs one command per rank."""

    nodes: tuple[RankNode, ...]
    switch: str
    """The namespace holding the bridge."""
    rate_bps: int | None
    """Cap of each direction of each rank's link in bits/s (None: uncapped veth)."""
    burst_bytes: int | None
    setup_commands: tuple[str, ...] = ()
    """The ``ip``/``tc`` commands that built it, in order (for reports)."""
    group_size: int | None = None
    """Ranks per group (one bridge each, joined by a core bridge); None: one bridge for all."""
    cross_rate_bps: int | None = None
    """Cap of each direction of each group's link to the core in bits/s (None: uncapped)."""

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size if self.group_size else 1

    def group_of(self, rank: int) -> int:
        return rank // self.group_size if self.group_size else 0

    def cross_link_bytes(self) -> list[tuple[int, int]]:
        """``[(out, in), ...]`` per group: bytes that left group g through its link to the
        core (tx of ``g<g>``) and that entered it (rx of ``g<g>``), counted by the kernel
        since the cluster was built, Ethernet headers included. ``[]`` without groups."""
        if not self.group_size:
            return []
        out = _run_tool("ip", "-n", self.switch, "-j", "-s", "link", "show").stdout
        stats = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        return [(stats[f"g{g}"]["tx"]["bytes"], stats[f"g{g}"]["rx"]["bytes"])
                for g in range(self.num_groups)]

    def cross_bytes(self) -> int:
        """Bytes sent from one group to another (both directions) since the cluster was
        built; the difference of two reads is what a step sent over the slow links. Each
        byte is counted once, where it left its group (a frame flooded to several groups
        is counted once too); with two groups this is both directions of their link."""
        return sum(out for out, _ in self.cross_link_bytes())

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    @property
    def namespaces(self) -> list[str]:
        return [n.netns for n in self.nodes] + [self.switch]

    def exec_argv(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[rank].netns, *argv]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for rank ``rank``: gloo binds to the cluster interface."""
        ifname = self.nodes[rank].ifname
        return {"GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname}

    def torchrun_argv(self, rank: int, script: Sequence[str], *, port: int = 29500,
                      python: str = sys.executable) -> list[str]:
        """torchrun for one node of ``world_size`` (one process per namespace); ``script``
        is what follows torchrun's options, e.g. ``["-m", "hybridrec", "train", ...]``."""
        return [python, "-m", "torch.distributed.run", f"--nnodes={self.world_size}",
                f"--node-rank={rank}", "--nproc-per-node=1", f"--master-addr={self.master_addr}",
                f"--master-port={port}", "--max-restarts=0", *script]

    def run(self, commands: Sequence[Sequence[str]], *, timeout_s: float = 600.0,
            env: Mapping[str, str] | None = None,
            rank_env: Sequence[Mapping[str, str]] | None = None,
            cwd: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None,
            grace_s: float = 30.0) -> list[RankResult]:
        """Run ``commands[i]`` inside rank i's namespace, all at once; wait for all.

        Every command gets its own process group. At ``timeout_s`` (or ``grace_s`` after a
        rank has failed, so that its peers stuck in a collective do not wait for the
        timeout) the rest are sent SIGTERM, then SIGKILL with everything else still
        running in the namespaces. Output goes to ``log_dir/rank<i>.{out,err}`` when given.
        Environment: ours, then :meth:`env`, then ``env``, then ``rank_env[i]``.
        """
        if len(commands) != self.world_size:
            raise ValueError(f"{len(commands)} commands for {self.world_size} ranks")
        with contextlib.ExitStack() as stack:
            if log_dir is None:
                log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hrc-logs-"))
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            procs, files = [], []
            start = time.monotonic()
            ends: dict[int, float] = {}
            timed_out: set[int] = set()
            try:
                for rank, argv in enumerate(commands):
                    out = stack.enter_context(open(Path(log_dir) / f"rank{rank}.out", "w+b"))
                    err = stack.enter_context(open(Path(log_dir) / f"rank{rank}.err", "w+b"))
                    files.append((out, err))
                    procs.append(subprocess.Popen(
                        self.exec_argv(rank, argv), stdout=out, stderr=err, cwd=cwd,
                        env={**os.environ, **self.env(rank), **(env or {}),
                             **(rank_env[rank] if rank_env else {})},
                        start_new_session=True))
                timed_out = self._wait(procs, ends, start + timeout_s, grace_s)
            finally:
                self._stop(procs)
            results = []
            for rank, (p, (out, err)) in enumerate(zip(procs, files)):
                out.seek(0)
                err.seek(0)
                results.append(RankResult(
                    rank, p.returncode, out.read().decode(errors="replace"),
                    err.read().decode(errors="replace"),
                    ends.get(rank, time.monotonic()) - start, rank in timed_out))
            return results

    @staticmethod
    def _wait(procs, ends: dict[int, float], deadline: float, grace_s: float) -> set[int]:
        failed_at = None
        while True:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in ends and p.poll() is not None:
                    ends[rank] = now
                    if p.returncode != 0 and failed_at is None:
                        failed_at = now
            running = [r for r in range(len(procs)) if r not in ends]
            if not running:
                return set()
            if now >= deadline:
                return set(running)
            if failed_at is not None and now - failed_at >= grace_s:
                return set()  # not a timeout: the failure is the failed rank's
            time.sleep(0.05)

    def _stop(self, procs) -> None:
        """SIGTERM the command groups still running, then SIGKILL whatever is left in the
        namespaces (torchrun starts its workers in sessions of their own)."""
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)
        for name in (n.netns for n in self.nodes):
            for pid in _netns_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def _burst(rate_bps: int, burst_bytes: int | None) -> int:
    # 1 ms of traffic, at least 16 full-size frames: tbf needs a bucket of at least the
    # bytes that arrive between two timer ticks to reach its rate; a much larger bucket
    # would let short messages pass at veth speed.
    return burst_bytes or max(rate_bps // 8 // 1000, 16 * 1514)


def build_cluster(names: Sequence[str], switch: str, rate_bps: int | None,
                  burst_bytes: int | None = None, *, group_size: int | None = None,
                  cross_rate_bps: int | None = None) -> Cluster:
    """Create the namespaces, bridges, veth links and qdiscs (see the module docstring).
    ``group_size`` must divide ``len(names)`` (checked by :func:`netns_cluster`)."""
    done: list[str] = []

    def step(*argv: str) -> None:
        _run_tool(*argv)
        done.append(shlex.join(argv))

    n_groups = len(names) // group_size if group_size else 1
    step("ip", "netns", "add", switch)
    for g in range(n_groups):
        step("ip", "-n", switch, "link", "add", f"br{g}", "type", "bridge")
        step("ip", "-n", switch, "link", "set", f"br{g}", "up")
    if group_size:
        _build_core(step, switch, n_groups, cross_rate_bps, burst_bytes)
    burst = _burst(rate_bps, burst_bytes) if rate_bps else None
    nodes = []
    for rank, name in enumerate(names):
        port, addr = f"p{rank}", f"{SUBNET}.{rank + 1}"
        bridge = f"br{rank // group_size}" if group_size else "br0"
        step("ip", "netns", "add", name)
        step("ip", "-n", name, "link", "set", "lo", "up")
        step("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
             "netns", name)
        step("ip", "-n", switch, "link", "set", port, "master", bridge, "up")
        step("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
        step("ip", "-n", name, "link", "set", IFNAME, "up")
        if rate_bps:
            for ns, dev in ((name, IFNAME), (switch, port)):  # up- and downlink
                _add_tbf(step, ns, dev, rate_bps, burst)
        nodes.append(RankNode(rank, name, IFNAME, addr))
    return Cluster(tuple(nodes), switch, rate_bps, burst, tuple(done), group_size,
                   cross_rate_bps)


def _build_core(step: Callable[..., None], switch: str, n_groups: int,
                cross_rate_bps: int | None, burst_bytes: int | None) -> None:
    """The core bridge and one link ``g<g> ==veth== c<g>`` from each group bridge to it.
    Both ends stay in the switch namespace; capping both (g: group -> core, c: core ->
    group) puts every inter-group byte through a ``cross_rate`` cap, and no intra-group
    byte ever reaches one (the group bridge forwards it port to port)."""
    step("ip", "-n", switch, "link", "add", "core", "type", "bridge")
    step("ip", "-n", switch, "link", "set", "core", "up")
    burst = _burst(cross_rate_bps, burst_bytes) if cross_rate_bps else None
    for g in range(n_groups):
        step("ip", "-n", switch, "link", "add", f"g{g}", "type", "veth", "peer", "name", f"c{g}")
        step("ip", "-n", switch, "link", "set", f"g{g}", "master", f"br{g}", "up")
        step("ip", "-n", switch, "link", "set", f"c{g}", "master", "core", "up")
        if cross_rate_bps:
            for dev in (f"g{g}", f"c{g}"):
                _add_tbf(step, switch, dev, cross_rate_bps, burst)


def _add_tbf(step: Callable[..., None], ns: str, dev: str, rate_bps: int, burst: int) -> None:
    step("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
         "burst", str(burst), "latency", "50ms")


class _Interrupts:
    """SIGTERM and SIGHUP raise SystemExit (so the teardown in ``finally`` runs, as it does
    for Ctrl-C); inside :meth:`critical` every such signal waits until the section ends,
    so building and tearing down are never cut in half."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.saved: dict[int, object] = {}

    def handler(self, signum, frame) -> None:
        if self.depth:
            self.pending = signum
            return
        self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.saved[sig] = signal.signal(sig, self.handler)
        try:
            yield
        finally:
            for sig, old in self.saved.items():
                signal.signal(sig, old)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                self._raise(signum)


def _check_groups(world_size: int, group_size: int | None,
                  cross_rate: str | int | None) -> int | None:
    """``cross_rate`` in bits/s, after refusing groups that do not tile the ranks and a
    ``cross_rate`` without groups (it would cap nothing, silently)."""
    if group_size is None:
        if cross_rate is not None:
            raise ValueError(f"cross_rate={cross_rate!r} needs group_size: without groups "
                             "there is no link between groups to cap")
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
            or world_size % group_size:
        raise ValueError(f"group_size must be a positive divisor of world_size={world_size}, "
                         f"got {group_size!r}")
    return parse_rate(cross_rate)


@contextlib.contextmanager
def netns_cluster(world_size: int, rate: str | int | None = "1gbit", *,
                  group_size: int | None = None, cross_rate: str | int | None = None,
                  prefix: str = PREFIX, burst_bytes: int | None = None) -> Iterator[Cluster]:
    """A cluster of ``world_size`` namespaces whose links carry ``rate`` each way.

    ``group_size=M`` (must divide ``world_size``): ranks ``[g*M, (g+1)*M)`` share group
    g's bridge through their ``rate`` links, and the groups are joined through links
    capped at ``cross_rate`` each way (None: uncapped); see the module docstring.

    Checks the privileges first (:func:`require_support`), deletes the namespaces of killed
    earlier runs (reported on stderr), and always deletes everything it made: on normal
    exit, exceptions, Ctrl-C, SIGTERM and SIGHUP (SIGKILL cannot be caught: the next run
    cleans up). ``burst_bytes``: tbf bucket (default 1 ms at ``rate``, >= 16 frames).
    """
    if not 1 <= world_size <= MAX_RANKS:
        raise ValueError(f"world_size must be in [1, {MAX_RANKS}], got {world_size}")
    rate_bps = parse_rate(rate)
    cross_rate_bps = _check_groups(world_size, group_size, cross_rate)
    require_support()
    stale = remove_stale(prefix)
    if stale:
        print(f"hybridrec: removed namespaces left by a killed earlier run: {', '.join(stale)}",
              file=sys.stderr)
    with _seq_lock:
        seq = next(_seq)
    base = f"{prefix}{os.getpid()}-{seq}"
    names, switch = [f"{base}-r{i}" for i in range(world_size)], f"{base}-sw"
    guard = _Interrupts()
    with guard.installed():
        try:
            with guard.critical():
                cluster = build_cluster(names, switch, rate_bps, burst_bytes,
                                        group_size=group_size, cross_rate_bps=cross_rate_bps)
            yield cluster
        finally:
            with guard.critical():
                left = _delete_namespaces([*names, switch])
            if left:
                print(f"hybridrec: could not delete namespaces {', '.join(left)}; "
                      f"remove them with `ip netns del NAME`", file=sys.stderr)
