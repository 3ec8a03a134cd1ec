"""Helper threads run their torch operators without an OpenMP team (hybridrec.threads)."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from hybridrec.data.loader import _Prefetcher
from hybridrec.threads import single_threaded

OPENMP = "OpenMP" in torch.__config__.parallel_info()


@pytest.fixture
def two_threads():
    """This thread's torch on 2 threads for the test, as it was after."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.mark.skipif(not OPENMP, reason="torch without OpenMP")
def test_single_threaded_changes_the_calling_thread_only(two_threads):
    seen = {}

    def helper():
        seen["before"] = torch.get_num_threads()
        seen["done"] = single_threaded()
        seen["after"] = torch.get_num_threads()
        seen["sum"] = int(torch.arange(1 << 20, dtype=torch.int64).sum())  # a parallel operator, run serially

    th = threading.Thread(target=helper)
    th.start()
    th.join()
    assert seen == {"before": 2, "done": True, "after": 1, "sum": (1 << 20) * ((1 << 20) - 1) // 2}
    assert torch.get_num_threads() == 2  # the caller's own count is untouched


@pytest.mark.skipif(not OPENMP, reason="torch without OpenMP")
def test_the_loader_thread_runs_single_threaded(two_threads):

    def source():
        for _ in range(3):
            yield torch.get_num_threads()

    pf = _Prefetcher(source(), depth=2)
    try:
        assert list(pf) == [1, 1, 1]
    finally:
        pf.close()
    assert torch.get_num_threads() == 2


PROBE = """
import json, resource, sys, threading
import torch
from hybridrec.threads import single_threaded
torch.set_num_threads(2)
x, y = torch.randn(256, 512), torch.empty(256, 512)
ready, done = threading.Event(), threading.Event()
def helper():  # one parallel operator, then the thread stays alive (and so would its team)
    if sys.argv[1] == "single":
        single_threaded()
    torch.randint(0, 10, (1 << 20,), dtype=torch.int32).to(torch.int64)
    ready.set()
    done.wait()
th = threading.Thread(target=helper)
th.start()
ready.wait()
for _ in range(100):
    y.copy_(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
for _ in range(2000):  # parallel operators of the main thread, ~50 us of Python apart: longer
    y.copy_(x)        # than a throttled spin (~100 pauses), far shorter than a full one (ms)
    sum(range(3000))
after = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
done.set()
th.join()
print(json.dumps({"switches": after - before}))
"""


def switches(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["switches"]


@pytest.mark.slow
@pytest.mark.skipif(not OPENMP or (os.cpu_count() or 1) < 2, reason="needs GNU OpenMP and 2 CPUs")
def test_a_helper_threads_team_makes_every_parallel_operator_sleep_and_wake():
    """The mechanism of the module docstring, counted: with a second team alive, the main
    thread's team member sleeps after each of 2,000 operators (a voluntary context switch
    each); with the helper single-threaded it keeps spinning (0)."""
    multi, single = switches("multi"), switches("single")
    assert multi > 1000, multi  # (measured 3,997-4,000: both team members sleep and wake)
    assert single < 100, single


# A process whose fork server was started before any launch, by code that read no
# OMP_NUM_THREADS (as a user's own multiprocessing, or the tests' run_ranks, may do), then
# `hybridrec train dist.nproc=2` through the CLI's main() in that process: the launch reuses
# that server (multiprocessing keeps one per process), whose OpenMP took every core.
_FOREIGN_SERVER = """
import multiprocessing, sys
from multiprocessing import forkserver
multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])
forkserver.ensure_running()
from hybridrec.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.skipif(not OPENMP or (os.cpu_count() or 1) < 2, reason="needs OpenMP and 2 CPUs")
def test_ranks_forked_from_a_server_started_elsewhere_run_omp_num_threads(shared_dataset, tmp_path):
    """Each rank runs OMP_NUM_THREADS threads (1, torchrun's default for several ranks), as
    ranks of a new interpreter do, not the count the fork server's OpenMP read when another
    process's code started it (every core: 2 ranks x 2 threads on 2 cores, and results not bit
    for bit a new interpreter's)."""
    data = shared_dataset(days=2, rows=400)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", _FOREIGN_SERVER, "train", f"data.path={data}",
                           f"train.run_dir={run}", "dist.nproc=2", "train.max_steps=3", "train.progress=false",
                           "model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1",
                           "data.batch_size=64"],
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["versions"]["threads"] == 1
