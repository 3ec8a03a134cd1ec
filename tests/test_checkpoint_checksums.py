"""Checkpoint files carry checksums in the manifest: a checkpoint whose bytes changed (64
flipped bytes, the file's size unchanged) or that lost its ``.metadata`` is skipped with a
warning, renamed to ``step-N.bad``, and the run resumes from the previous one. Every rank's
files are covered, by the synchronous and the background save; checkpoints saved before
the checksums still load."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import test_checkpoint_integrity as integrity
import torch
import torch.distributed as dist
from distributed import run_ranks

from hybridrec.cli.main import main
from hybridrec.parallel.checkpoint_io import CHECKSUMS, MANIFEST, checked_files, file_checksum
from hybridrec.parallel.topology import Topology
from hybridrec.train.checkpointing import checkpoint as ckpt
from hybridrec.train.checkpointing.checkpointer import Checkpointer
from hybridrec.train.run import load_run_model

# The integrity tests' one-process runs (their fixtures, used here as they are there): two
# checkpoints (steps 2 and 4) of an unfinished run.
_args = integrity._args
data = integrity.data
two_checkpoints = integrity.two_checkpoints


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """The same run trained to step 6 without a stop: what a resume from step 2 gives."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(_args(data, run, 6)) == 0
    return load_run_model(run, checkpoint="latest")[2].state_dict()


def flip(path: Path, n: int = 64, at: float = 0.5) -> None:
    """Invert ``n`` bytes of ``path`` from the fraction ``at`` of its length on; the size stays."""
    raw = bytearray(path.read_bytes())
    start = min(int(len(raw) * at), len(raw) - n)
    raw[start:start + n] = bytes(b ^ 0xFF for b in raw[start:start + n])
    size = path.stat().st_size
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == size


def _resume(data, two_checkpoints, tmp_path, capsys, damage) -> tuple[Path, str, str]:
    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    damage(ckpt.step_dir(run, 4))
    capsys.readouterr()
    assert main(_args(data, run, 6)) == 0
    err = capsys.readouterr().err
    warned = [x for x in err.splitlines() if "skipped the checkpoint" in x]
    assert len(warned) == 1, err
    assert f"skipped the checkpoint {ckpt.step_dir(run, 4)} (" in warned[0], warned[0]
    assert "renamed to step-00000004.bad; resuming from step-00000002" in warned[0], warned[0]
    assert f"resumed from step 2 ({ckpt.step_dir(run, 2)})" in err
    assert (ckpt.checkpoint_dir(run) / "step-00000004.bad").is_dir()  # kept, for a look
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]  # step 4 saved again, whole
    assert ckpt.problem(ckpt.step_dir(run, 4)) is None
    return run, warned[0], err


def _same_model(run: Path, straight: dict) -> None:
    got = load_run_model(run, checkpoint="latest")[2].state_dict()
    assert got.keys() == straight.keys()
    assert all(torch.equal(got[k], straight[k]) for k in got), [k for k in got if not torch.equal(got[k], straight[k])]


@pytest.mark.slow
def test_64_flipped_bytes_skip_the_checkpoint_and_the_run_resumes_from_the_previous_one(
        data, two_checkpoints, straight, tmp_path, capsys):
    (tensors,) = ckpt.step_dir(two_checkpoints, 4).glob("*.distcp")
    run, warned, _ = _resume(data, two_checkpoints, tmp_path, capsys, lambda d: flip(d / tensors.name))
    assert f"({tensors.name}: corrupt (crc32 " in warned and ", the manifest records " in warned, warned
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    _same_model(run, straight)  # trained from step 2 again: as if never stopped


def test_a_deleted_metadata_is_skipped_with_a_warning_not_overwritten(data, two_checkpoints, straight,
                                                                      tmp_path, capsys):
    run, warned, _ = _resume(data, two_checkpoints, tmp_path, capsys, lambda d: (d / ".metadata").unlink())
    assert "(not a complete checkpoint (no .metadata))" in warned, warned
    bad = ckpt.checkpoint_dir(run) / "step-00000004.bad"
    assert not (bad / ".metadata").exists() and (bad / MANIFEST).is_file()  # as it was found
    _same_model(run, straight)


# -- the checks, file by file ----------------------------------------------------------------
def test_the_manifest_covers_every_file_and_finds_each_change(two_checkpoints, tmp_path):
    ck = shutil.copytree(ckpt.step_dir(two_checkpoints, 4), tmp_path / "ck")
    sums = json.loads((ck / MANIFEST).read_text())[CHECKSUMS]
    assert sums["algorithm"] == "crc32" and sorted(sums["files"]) == checked_files(ck) == [
        ".metadata", "__0_0.distcp"]
    assert all(file_checksum(ck / n) == v for n, v in sums["files"].items())
    assert ckpt.problem(ck) is None
    for name in sums["files"]:
        for at in (0.0, 0.5, 1.0):  # the start, the middle, the end of the file
            case = shutil.copytree(ck, tmp_path / f"{name}-{at}")
            flip(case / name, at=at)
            why = ckpt.problem(case)
            if name == ".metadata" and "crc32" not in why:  # (read first, by the safe unpickler)
                assert why.startswith(".metadata: truncated or corrupt ("), why
                continue
            assert why == (f"{name}: corrupt (crc32 {file_checksum(case / name)[1]}, the manifest "
                           f"records {sums['files'][name][1]})")
            # each of 2 ranks reads a share: together they read every file
            found = [ckpt.problem(case, share=(r, 2)) for r in range(2)]
            assert sum(w is not None for w in found) == 1, found
            assert ckpt.problem(case, share=None) is None  # (listing: no contents read)
    with open(tmp_path / "ck" / "__0_0.distcp", "ab") as f:  # longer than it was written
        f.write(b"\0" * 10)
    assert ckpt.problem(ck, share=None) == (f"__0_0.distcp: {sums['files']['__0_0.distcp'][0] + 10:,} "
                                            f"bytes, the manifest records {sums['files']['__0_0.distcp'][0]:,}")


def test_the_manifest_checks_itself_and_old_checkpoints_load_unchecked(two_checkpoints, tmp_path):
    ck = shutil.copytree(ckpt.step_dir(two_checkpoints, 4), tmp_path / "ck")
    meta = json.loads((ck / MANIFEST).read_text())
    (ck / MANIFEST).write_text(json.dumps({**meta, "step": 2}))  # another step, valid JSON
    assert ckpt.problem(ck, share=None).startswith(f"{MANIFEST}: corrupt (crc32 ")
    flip(ck / "__0_0.distcp")
    old = {k: v for k, v in meta.items() if k != CHECKSUMS}  # saved before the checksums
    (ck / MANIFEST).write_text(json.dumps(old))
    assert ckpt.problem(ck) is None  # nothing to check the contents against
    (ck / MANIFEST).write_text(json.dumps({**meta, CHECKSUMS: {**meta[CHECKSUMS], "files": {}}}))
    assert ckpt.problem(ck).startswith(f"{MANIFEST}: corrupt")
    for files in ({"../x": [1, "00000000"]}, {"__0_0.distcp": [1, "xyz"]}, []):
        sums = {**meta[CHECKSUMS], "files": files}
        (ck / MANIFEST).write_text(json.dumps({**meta, CHECKSUMS: sums}))
        assert ckpt.problem(ck) == f"{MANIFEST}: its checksums entry is unreadable (expected crc32 of each file)"


# -- two ranks: each rank's file, the synchronous and the background save ------------------------
def worker_two_ranks(topo: Topology, root: str) -> dict:
    """Step 1 saved in the foreground, step 2 in the background; rank 1's file of step 2
    gets 64 bytes flipped; both ranks resume from step 1."""
    from test_sharded_checkpoint import build, plan_a, snapshot

    model, dense, sparse = build(0, "rowwise_adagrad", plan_a(), topo)
    args = {"model": model, "dense_opt": dense, "sparse_opt": sparse, "components": []}
    Checkpointer(root, topo, **args).save(1)
    saved = snapshot(model, dense, sparse)
    with torch.no_grad():
        for _, w in model.sparse.local_shards().values():
            w.add_(1.0)
    background = Checkpointer(root, topo, background=True, **args)
    background.save(2)
    background.wait()
    out = {"manifests": {s: json.loads((p / MANIFEST).read_text())[CHECKSUMS] for s, p in ckpt.list_checkpoints(root)},
           "listed": {s: checked_files(p) for s, p in ckpt.list_checkpoints(root)}}
    if topo.rank == 1:
        flip(ckpt.step_dir(root, 2) / "__1_0.distcp")
    dist.barrier(group=topo.group)
    m2, d2, s2 = build(1, "rowwise_adagrad", plan_a(), topo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["restored"] = Checkpointer(root, topo, model=m2, dense_opt=d2, sparse_opt=s2,
                                       components=[]).restore_newest()
    out["warnings"] = [str(w.message) for w in caught if "skipped the checkpoint" in str(w.message)]
    out["same"] = (saved, snapshot(m2, d2, s2))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_checksum_every_rank_file_and_skip_the_damaged_one(tmp_path):
    from test_sharded_checkpoint import assert_same

    root = tmp_path / "run"
    r0, r1 = run_ranks(worker_two_ranks, 2, str(root))
    for step in (1, 2):  # the foreground and the background save alike
        files = r0["manifests"][step]["files"]
        assert sorted(files) == r0["listed"][step] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert r0["restored"] == r1["restored"] == (1, ckpt.step_dir(root, 1))
    (warned,) = r0["warnings"]  # one line, from rank 0
    assert r1["warnings"] == []
    assert f"skipped the checkpoint {ckpt.step_dir(root, 2)} (__1_0.distcp: corrupt (crc32 " in warned, warned
    assert "renamed to step-00000002.bad; resuming from step-00000001" in warned, warned
    assert (ckpt.checkpoint_dir(root) / "step-00000002.bad").is_dir()
    for r in (r0, r1):
        assert_same(*r["same"])
