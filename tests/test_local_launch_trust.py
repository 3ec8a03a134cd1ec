"""A local launch reaches no further than this machine and lives no longer than its launcher:
every listening socket of a live 2-rank run and of a live parameter-server run is on
loopback; a run directory is held by one training at a time; ``kill -9`` of the launcher
leaves no rank alive. A launch of several machines binds the interface it is given alone."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launch import SMALL  # the launch tests' small model

from hybridrec.cli.launch import failure_line
from hybridrec.cli.rendezvous import bound_store
from hybridrec.errors import ConfigError
from hybridrec.train import run_lock

pytestmark = pytest.mark.distributed



@pytest.fixture(scope="module")
def dataset(shared_dataset):
    return shared_dataset(days=2, rows=4000)


def _start(dataset, run, *extra):
    cmd = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={dataset}",
           f"train.run_dir={run}", *SMALL, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


# -- the sockets of a process tree, from /proc -----------------------------------------------
def _tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def _socket_inodes(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_target.startswith("socket:["):
                    inodes.add(int(with_target[8:-1]))
        except OSError:
            continue
    return inodes


def _address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw)
    return socket.inet_ntop(socket.AF_INET, raw[::-1])


def listening(pids: set[int]) -> set[str]:
    """``address:port`` of every listening TCP socket, and every unconnected UDP socket (one
    that takes datagrams from anyone), the processes hold. A connected UDP socket, such as the
    C library's resolver opens for a DNS query, only hears its peer: it is not listed."""
    inodes = _socket_inodes(pids)
    found = set()
    for name, v6 in (("tcp", False), ("tcp6", True), ("udp", False), ("udp6", True)):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            local, remote, state, inode = f[1], f[2], f[3], int(f[9])
            unconnected = int(remote.split(":")[0], 16) == 0
            if inode in inodes and (state == "0A" or (name.startswith("udp") and unconnected)):
                addr, port = local.split(":")
                found.add(f"{_address(addr, v6)}:{int(port, 16)}")
    return found


def _loopback(endpoint: str) -> bool:
    addr = endpoint.rsplit(":", 1)[0]
    return addr.startswith(("127.", "::ffff:127.")) or addr in ("::1", "::ffff:127.0.0.1")


def _listeners_while_training(proc, run: Path, timeout_s: float = 150) -> set[str]:
    """Every listening socket the run's processes held, sampled until it has trained a few
    steps (metrics.jsonl written) and a little after."""
    seen: set[str] = set()
    deadline, trained_at = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= listening(_tree(proc.pid))
        if trained_at is None and (run / "metrics.jsonl").is_file():
            trained_at = time.monotonic()
        if trained_at is not None and time.monotonic() - trained_at > 2:
            break
        time.sleep(0.2)
    assert trained_at is not None, f"the run did not train (exit {proc.poll()}): {_stderr(proc)}"
    return seen


def _stderr(proc) -> str:
    if proc.poll() is None:
        return "(still running)"
    return proc.stderr.read()[-3000:]


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_parameter_server_run_listens_on_loopback_only(dataset, tmp_path):
    run = tmp_path / "run"
    proc = _start(dataset, run, "dist.nproc=1", "dist.num_ps=1", "train.epochs=50", "train.eval_every=0")
    try:
        seen = _listeners_while_training(proc, run)
    finally:
        _stop(proc)
    _assert_loopback(seen)


def _assert_loopback(seen: set[str]) -> None:
    # the store, and at least one of gloo's pairs per rank: a test that saw nothing proves nothing
    assert len(seen) >= 3, seen
    assert all(_loopback(s) for s in seen), f"listening beyond loopback: {sorted(s for s in seen if not _loopback(s))}"


def _alive(pids: set[int]) -> set[int]:
    """The processes among ``pids`` that still run (zombies waiting for their reaper are dead)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def test_a_live_two_rank_run_listens_on_loopback_holds_its_directory_and_dies_with_its_launcher(dataset, tmp_path):
    run = tmp_path / "run"
    # (far more epochs than the test lasts: the run must still hold its directory when the
    # second command, minutes later on a loaded machine, asks for it; the test kills it)
    first = _start(dataset, run, "dist.nproc=2", "train.epochs=100000", "train.eval_every=0")
    try:
        _assert_loopback(_listeners_while_training(first, run))
        second = subprocess.run([sys.executable, "-m", "hybridrec", "train", "--recipe", "demo",
                                 f"data.path={dataset}", f"train.run_dir={run}", *SMALL],
                                capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is being trained by another process (pid {first.pid}" in second.stderr
        ranks = _tree(first.pid) - {first.pid}
        assert len(_alive(ranks)) >= 3  # (the fork server and two ranks)
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(ranks), f"alive 10 s after the launcher's kill -9: {_alive(ranks)}"
    finally:
        _stop(first)
    os.close(run_lock.take(run, str(run)))  # the dead launcher's lock is free to take


# -- the pieces, in one process --------------------------------------------------------------
def test_the_run_lock_refuses_a_second_holder_and_is_taken_over_from_a_dead_one(tmp_path):
    run = tmp_path / "run"
    with (run_lock.holding(run, "runs/x"),
          pytest.raises(ConfigError, match=rf"runs/x is being trained by another process \(pid {os.getpid()}")):
        run_lock.take(run, "runs/x")
    fd = run_lock.take(run, "runs/x")  # released when its holder closed it
    os.close(fd)
    holder = subprocess.Popen([sys.executable, "-c", ("import sys, time; from pathlib import Path; "
                                "from hybridrec.train import run_lock; run_lock.take(Path(sys.argv[1]), 'x'); "
                                "print('held', flush=True); time.sleep(60)"), str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}"):
            run_lock.take(run, "x")
    finally:
        holder.kill()
        holder.wait()
    os.close(run_lock.take(run, "x"))


def test_a_refused_new_run_directory_is_removed_with_its_lock(tmp_path):
    run = tmp_path / "new"
    with pytest.raises(RuntimeError), run_lock.holding(run):
        assert (run / run_lock.LOCK_NAME).is_file()
        raise RuntimeError("refused")
    assert not run.exists()


def test_the_local_store_listens_on_loopback_only():
    store = bound_store(timeout_s=10)
    seen = listening({os.getpid()})
    assert f"127.0.0.1:{store.port}" in seen
    assert all(_loopback(s) for s in seen), seen


def test_the_probe_lists_what_takes_connections_from_anyone_and_not_a_connected_udp_socket():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as open_udp, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as connected_udp:
        tcp.bind(("0.0.0.0", 0))
        tcp.listen()
        open_udp.bind(("0.0.0.0", 0))
        connected_udp.connect(("127.0.0.1", open_udp.getsockname()[1]))  # as a resolver's query socket
        seen = listening({os.getpid()})
        assert f"0.0.0.0:{tcp.getsockname()[1]}" in seen
        assert f"0.0.0.0:{open_udp.getsockname()[1]}" in seen
        assert not any(s.endswith(f":{connected_udp.getsockname()[1]}") for s in seen), seen


class _Failure:
    def __init__(self, exitcode, pid=1234):
        self.exitcode, self.pid, self.timestamp, self.error_file_data = exitcode, pid, 0, {}


@pytest.mark.parametrize("oom, says", [(True, "out-of-memory killer: this machine's memory cgroup counted"),
                                       (False, "by another process: not the out-of-memory killer"),
                                       (None, "by another process, or by the kernel's out-of-memory killer")])
def test_a_sigkill_is_blamed_on_the_oom_killer_only_when_it_counted_one(oom, says):
    line, status = failure_line({1: _Failure(-signal.SIGKILL)}, oom_killed=oom)
    assert line.startswith("rank 1 (pid 1234) was killed by SIGKILL") and says in line
    assert status == 1


# -- several machines: the named interface alone ---------------------------------------------
def _interface_with_address() -> tuple[str, str]:
    """A network interface of this machine with an IPv4 address, other than loopback where
    there is one (a real interface makes "binds that address alone" mean something)."""
    from hybridrec.cli.rendezvous import interface_address, loopback_interface

    names = sorted(p.name for p in Path("/sys/class/net").iterdir())
    lo = loopback_interface()
    for name in [n for n in names if n != lo] + [lo]:
        try:
            return name, interface_address(name)
        except OSError:
            continue
    pytest.skip("no network interface with an IPv4 address")


def test_two_machines_rendezvous_and_train_on_the_named_interface_alone(dataset, tmp_path):
    """Two launchers on this machine stand for two machines (dist.nnodes=2, one rank each):
    they train one run together, and every socket of either binds the interface's address."""
    name, address = _interface_with_address()
    with socket.socket() as s:  # a free port for machine 0's rendezvous
        s.bind((address, 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    common = ["dist.nnodes=2", f"dist.master={address}:{port}", f"dist.interface={name}",
              "train.epochs=50", "train.max_steps=100", "train.eval_every=0"]
    machines = [_start(dataset, run, *common, f"dist.node_rank={r}") for r in (0, 1)]
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (run / "metrics.jsonl").is_file():
            seen |= listening(_tree(machines[0].pid) | _tree(machines[1].pid))
            time.sleep(0.2)
        for _ in range(10):
            seen |= listening(_tree(machines[0].pid) | _tree(machines[1].pid))
            time.sleep(0.2)
        for m in machines:
            m.wait(timeout=240)
    finally:
        for m in machines:
            _stop(m)
    assert [m.returncode for m in machines] == [0, 0], machines[0].stderr.read()[-2000:] + machines[1].stderr.read()[-2000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert len(seen) >= 3, seen  # the rendezvous, the ranks' store and gloo's pairs
    assert all(s.rsplit(":", 1)[0] in (address, f"::ffff:{address}") for s in seen), \
        f"listening beyond {name} ({address}): {sorted(seen)}"


def test_several_machines_need_a_master_an_interface_and_a_named_run(tmp_path):
    from hybridrec.train.setup.configure import build_config

    for extra, says in [(["dist.nnodes=2", f"train.run_dir={tmp_path / 'r'}", "dist.interface=lo"], "dist.master"),
                        (["dist.nnodes=2", f"train.run_dir={tmp_path / 'r'}", "dist.master=127.0.0.1:1234"],
                         "needs dist.interface"),
                        (["dist.nnodes=2", "dist.master=127.0.0.1:1234", "dist.interface=lo"], "name the run directory"),
                        (["dist.nnodes=2", "dist.node_rank=2", "dist.master=h:1", "dist.interface=lo",
                          "train.run_dir=r"], "dist.node_rank must be in [0, dist.nnodes=2)"),
                        (["dist.node_rank=1"], "needs dist.nnodes > 1")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            build_config(overrides=extra)
    build_config(overrides=["dist.nnodes=2", "dist.node_rank=1", "dist.master=h:1", "dist.interface=lo",
                            "train.run_dir=r"])
