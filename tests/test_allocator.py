"""train.allocator: the step's large temporaries reuse freed memory (no page faults)."""

import json
import platform
import subprocess
import sys

import pytest

from hybridrec.train.allocator import configure_allocator

PROBE = """
import json, resource, sys
import torch
from hybridrec.train.allocator import configure_allocator
done = configure_allocator(sys.argv[1])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's temporaries: several blocks of 8 MiB live at once, written, then freed
    return sum(float(x.sum()) for x in [torch.ones(2 << 20) for _ in range(4)])
step()
before = faults()
for _ in range(20):
    step()
print(json.dumps({"faults": faults() - before, "done": done}))
"""


def probe(mode):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_retain_reuses_freed_blocks_instead_of_faulting_new_pages():
    system, retain = probe("system"), probe("retain")
    assert system["done"] == {"mode": "system", "applied": False, "reason": "malloc's own settings"}
    assert retain["done"]["applied"] and retain["done"]["mmap_threshold"] == 32 << 20
    # without it, fresh pages again every step (4 x 2,048 per step), with it next to none
    assert system["faults"] > 20 * 2000
    assert retain["faults"] < system["faults"] / 10


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="allocator 'jemalloc': one of retain, system"):
        configure_allocator("jemalloc")
