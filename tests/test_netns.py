"""The namespace cluster: a 2-rank gloo all_reduce through capped links, groups whose
links to each other alone are capped (timed transfers, byte counters), and teardown
after normal exit, an exception, a timeout, SIGTERM and a killed earlier run."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybridrec.bench import netns
from hybridrec.bench.netns import ClusterUnavailableError, netns_cluster, parse_rate

SRC = str(Path(netns.__file__).resolve().parents[2])


def _probe() -> str | None:
    """None when this process can build a cluster, else why not."""
    try:
        netns.probe_support()
    except ClusterUnavailableError as e:
        return str(e)
    return None


_WHY_NOT = _probe()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no namespace cluster: {_WHY_NOT}")


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def ours() -> list[str]:
    """Namespaces made by this test process (other clusters on the machine are not ours)."""
    mine = f"{netns.PREFIX}{os.getpid()}-"
    return [n for n in netns.list_namespaces() if n.startswith(mine)]


ALL_REDUCE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    print("RESULT", t[0].item(), t.sum().item(), os.environ["MASTER_ADDR"],
          os.environ["GLOO_SOCKET_IFNAME"], flush=True)
    dist.destroy_process_group()
""")


@needs_netns
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_all_reduce_through_capped_links(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALL_REDUCE)
    with netns_cluster(2, "20mbit") as c:
        assert sorted(ours()) == sorted(c.namespaces)
        qdiscs = _out("tc", "-n", c.nodes[1].netns, "qdisc", "show", "dev", "eth0")
        assert "tbf" in qdiscs and "20Mbit" in qdiscs
        res = c.run([c.torchrun_argv(r, [str(script)]) for r in range(2)], timeout_s=90,
                    env={"OMP_NUM_THREADS": "1"})
    assert all(r.ok for r in res), res[0].stderr[-2000:] + res[1].stderr[-2000:]
    for r in res:
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
        assert line.split()[1:] == ["3.0", "3000.0", "10.77.0.1", "eth0"]
    assert ours() == []


@needs_netns
@pytest.mark.timeout(60)
def test_teardown_after_an_exception_and_a_timeout():
    with pytest.raises(RuntimeError, match="boom"), netns_cluster(2, "10mbit"):
        assert len(ours()) == 3
        raise RuntimeError("boom")
    assert ours() == []
    with netns_cluster(2, None) as c:  # uncapped: no qdisc, still a working cluster
        start = time.monotonic()
        # The second command leaves a child in a session of its own (as torchrun's workers):
        # the timeout must still end it.
        res = c.run([["sleep", "60"], ["sh", "-c", "setsid sleep 60 & sleep 60"]], timeout_s=1.0)
        assert time.monotonic() - start < 15
        assert [r.timed_out for r in res] == [True, True] and not any(r.ok for r in res)
        assert all(netns._netns_pids(n) == [] for n in c.namespaces)
        failed = c.run([["false"], ["sleep", "60"]], timeout_s=30, grace_s=0.5)
        assert failed[0].returncode == 1 and not failed[0].timed_out
        assert failed[1].returncode < 0 and time.monotonic() - start < 25
    assert ours() == []


@needs_netns
@pytest.mark.timeout(60)
def test_sigterm_tears_down_and_stale_namespaces_are_removed():
    code = ("import sys, time; from hybridrec.bench.netns import netns_cluster\n"
            "with netns_cluster(2, '10mbit') as c:\n"
            "    print(*c.namespaces, flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    names = proc.stdout.readline().split()
    assert len(names) == 3 and set(names) <= set(netns.list_namespaces())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not set(names) & set(netns.list_namespaces())
    # A run killed with SIGKILL leaves its namespaces; the next cluster deletes them.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-0-r0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netns.find_stale()[0]
        with netns_cluster(1, "10mbit"):
            assert stale not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    assert ours() == []


def test_clear_error_without_root_or_tools():
    with pytest.raises(ClusterUnavailableError, match="needs root.*effective uid 1000"):
        netns.require_support(euid=1000, cap_eff=0, which=lambda tool: "/usr/sbin/" + tool)
    with pytest.raises(ClusterUnavailableError, match="without CAP_NET_ADMIN"):
        netns.require_support(euid=0, cap_eff=1 << 21, which=lambda tool: "/usr/sbin/" + tool)
    with pytest.raises(ClusterUnavailableError, match="iproute2's tc"):
        netns.require_support(euid=0, cap_eff=~0, which=lambda t: None if t == "tc" else t)
    netns.require_support(euid=0, cap_eff=(1 << 12) | (1 << 21), which=lambda tool: tool)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to start an unprivileged process")
def test_an_unprivileged_process_gets_the_clear_error():
    # The system interpreter: the project's may live under a directory nobody cannot read.
    code = ("from hybridrec.bench.netns import netns_cluster\n"
            "with netns_cluster(2, '1gbit'): pass\n")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "env", f"PYTHONPATH={SRC}", "/usr/bin/python3", "-c", code],
                          capture_output=True, text=True, timeout=60, check=False)
    if "ModuleNotFoundError" in proc.stderr or "Permission denied" in proc.stderr:
        pytest.skip(f"an unprivileged python cannot import the package here: {proc.stderr[-300:]}")
    assert proc.returncode != 0
    assert "ClusterUnavailableError" in proc.stderr and "needs root" in proc.stderr


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("200mbit") == 200 * 10**6
    assert parse_rate("12.5mbps") == 100 * 10**6  # tc: bps = bytes per second
    assert parse_rate(None) is None and parse_rate("none") is None and parse_rate(0) is None
    for bad in ("1000", "1 gigabit", "-1gbit", "1kbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


# A one-way TCP transfer; the receiver times it from the first byte to the last, so that
# interpreter start-up and connection set-up are not part of it.
TRANSFER = textwrap.dedent("""
    import socket, sys, time
    if sys.argv[1] == "recv":
        srv = socket.create_server(("0.0.0.0", int(sys.argv[2])))
        conn, _ = srv.accept()
        buf, total = bytearray(1 << 16), conn.recv_into(bytearray(1 << 16))
        start = time.monotonic()
        while n := conn.recv_into(buf):
            total += n
        print("RECEIVED", total, time.monotonic() - start, flush=True)
    else:
        _, _, addr, port, nbytes = sys.argv
        deadline = time.monotonic() + 10
        while True:  # the receiver may not be listening yet
            try:
                conn = socket.create_connection((addr, int(port)), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        conn.sendall(bytes(int(nbytes)))
        conn.close()
""")


def _transfer(c, script, src: int, dst: int, nbytes: int, port: int) -> float:
    """Seconds rank ``src`` takes to send ``nbytes`` to rank ``dst`` (the others idle)."""
    py = [sys.executable, str(script)]
    commands = [["true"]] * c.world_size
    commands[dst] = [*py, "recv", str(port)]
    commands[src] = [*py, "send", c.nodes[dst].address, str(port), str(nbytes)]
    res = c.run(commands, timeout_s=30)
    assert all(r.ok for r in res), [r.stderr[-500:] for r in res]
    _, total, seconds = res[dst].stdout.split()
    assert int(total) == nbytes
    return float(seconds)


@needs_netns
@pytest.mark.timeout(90)
def test_groups_cap_only_the_traffic_between_groups(tmp_path):
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    nbytes = 2_000_000  # 1 s at the 16 Mbit/s between groups; ms inside a group
    with netns_cluster(4, "1gbit", group_size=2, cross_rate="16mbit") as c:
        assert len(ours()) == 5 and [c.group_of(r) for r in range(4)] == [0, 0, 1, 1]
        qdiscs = _out("tc", "-n", c.switch, "qdisc", "show")
        for dev in ("g0", "c0", "g1", "c1"):
            assert re.search(rf"tbf \w+: dev {dev} .*rate 16Mbit", qdiscs), qdiscs
        before = c.cross_bytes()
        inside = _transfer(c, script, src=1, dst=0, nbytes=nbytes, port=29600)
        after_inside = c.cross_bytes()
        links_before = c.cross_link_bytes()
        across = _transfer(c, script, src=2, dst=0, nbytes=nbytes, port=29601)
        after_across = c.cross_bytes()
        links_after = c.cross_link_bytes()
    assert ours() == []
    # Inside a group: 1 Gbit/s (16 ms), nowhere near the 1 s a 16 Mbit/s cap would take.
    assert inside < 0.4, (inside, across)
    assert 0.8 * nbytes * 8 / 16e6 < across < 4.0, (inside, across)
    # Only stray frames (IPv6 neighbour discovery) cross the core during the intra transfer;
    # the inter-group one crosses it once, with headers, ACKs and retransmissions on top.
    assert after_inside - before < 0.02 * nbytes
    assert nbytes < after_across - after_inside < 1.3 * nbytes
    (out0, in0), (out1, in1) = (tuple(b - a for a, b in zip(x, y))
                                for x, y in zip(links_before, links_after))
    assert out1 > nbytes and in0 > nbytes  # group 1 -> core -> group 0: the data
    assert out0 < 0.1 * nbytes and in1 < 0.1 * nbytes  # the other way: ACKs


def test_group_size_must_divide_world_size():
    # Refused before anything is made (no privileges needed to get this far).
    for bad in (3, 0, -2, 2.0):
        with pytest.raises(ValueError, match="group_size must be a positive divisor"), \
                netns_cluster(4, "1gbit", group_size=bad, cross_rate="10mbit"):
            pass
    with pytest.raises(ValueError, match="cross_rate='10mbit' needs group_size"), \
            netns_cluster(4, "1gbit", cross_rate="10mbit"):
        pass


@needs_netns
@pytest.mark.timeout(60)
def test_grouped_cluster_is_torn_down_after_an_exception():
    cluster = netns_cluster(6, None, group_size=3, cross_rate="10mbit")
    with pytest.raises(RuntimeError, match="boom"), cluster as c:
        assert sorted(ours()) == sorted(c.namespaces) and len(c.namespaces) == 7
        links = _out("ip", "-n", c.switch, "-br", "link").split()
        assert {"br0", "br1", "core", "g0@c0", "c1@g1", "p5@if2"} <= set(links)
        assert len(c.cross_link_bytes()) == 2 and netns.find_stale()[0] == []
        raise RuntimeError("boom")
    assert ours() == []
    with netns_cluster(2, "10mbit") as c:  # no groups: today's single bridge, no counters
        assert c.num_groups == 1 and c.cross_link_bytes() == [] and c.cross_bytes() == 0
        links = _out("ip", "-n", c.switch, "-br", "link")
        assert "core" not in links and "br1" not in links
    assert ours() == []


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(60)
def test_grouped_cluster_after_ctrl_c_and_sigkill():
    # The group bridges and links live in the switch namespace: deleting it deletes them,
    # so Ctrl-C's teardown and remove_stale() after a SIGKILL leave nothing behind either.
    code = ("import time; from hybridrec.bench.netns import netns_cluster\n"
            "with netns_cluster(4, None, group_size=2, cross_rate='10mbit') as c:\n"
            "    print(*c.namespaces, flush=True)\n"
            "    time.sleep(60)\n")
    for sig in (signal.SIGINT, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONPATH": SRC})
        names = proc.stdout.readline().split()
        assert len(names) == 5 and set(names) <= set(netns.list_namespaces())
        proc.send_signal(sig)
        proc.wait(timeout=30)
        if sig == signal.SIGKILL:
            assert set(names) <= set(netns.find_stale()[0])
            assert set(names) <= set(netns.remove_stale())
        assert not set(names) & set(netns.list_namespaces())
