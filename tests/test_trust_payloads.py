"""Nothing read from a checkpoint or an export runs code: a pickle planted where a loader
would unpickle it is refused, in one line naming the file and the entry, before it is read.

The payloads are real: a ``__reduce__`` that creates a marker file when unpickled (each
kind's first test shows torch's own loader running it), planted as an attacker would: a
checkpoint gains a ``BytesStorageMetadata`` entry whose bytes are appended to a ``.distcp``
file, with the manifest's checksums resealed by the project's own :func:`seal`; an exported
``model.pt2`` gets a weight marked ``use_pickle``, a guard or a shape expression of Python.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import hybridrec
from hybridrec.cli.main import main
from hybridrec.parallel.checkpoint_io import (
    CHECKSUMS,
    MANIFEST,
    CheckpointError,
    SafeFileSystemReader,
    checked_files,
    checksum_files,
    checksum_problem,
    quiet,
    seal,
)
from hybridrec.serve import score_template
from hybridrec.train.checkpointing import checkpoint as ckpt

KEY = "extra.note"  # the planted entry: a new field of the checkpoint's extra state


class Payload:
    """Unpickled, it creates ``marker`` (the pickle names builtins.exec, not this class)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def payload_bytes(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


def plant(directory: Path, marker: Path, *, skeleton: str = "extra", key: str = KEY) -> None:
    """Append the payload to a ``.distcp`` file of the DCP directory ``directory``, add a
    ``BytesStorageMetadata`` entry ``key`` for it to ``.metadata``, a tensor placeholder
    for it to the manifest's ``skeleton`` (what makes a load ask for ``key``), and reseal
    the manifest's checksums when it has them."""
    data = payload_bytes(marker)
    distcp = min(directory.glob("*.distcp"))
    offset = distcp.stat().st_size
    with open(distcp, "ab") as f:
        f.write(data)
    md = pickle.loads((directory / ".metadata").read_bytes())  # (the test's own file)
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(key)] = _StorageInfo(distcp.name, offset, len(data))
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    meta = json.loads((directory / MANIFEST).read_text())
    place = meta
    for part in skeleton.split("."):
        place = place[part]
    place[key.rpartition(".")[2]] = {"__tensor__": key, "dtype": "float32", "shape": [1]}
    if CHECKSUMS in meta:
        del meta[CHECKSUMS]
        meta = seal(meta, checksum_files(directory, checked_files(directory)))
    (directory / MANIFEST).write_text(json.dumps(meta))


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("hybridrec: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _refused(text: str, where: str = ".metadata") -> None:
    assert f"{where}: refused: {KEY!r} is a pickled object (bytes in __0_0.distcp), which is never unpickled" \
        in text, text


@pytest.fixture(scope="module")
def world(tiny_data, trained_run):
    """A dataset, a run with checkpoints at steps 2 and 4, and its export (shared: read-only)."""
    run = trained_run(tiny_data, 4, "train.checkpoint_every=2", "train.keep_checkpoints=3", export=True)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]
    return {"data": tiny_data, "run": run, "raw": tiny_data.parent / "raw" / "day_1.tsv", "art": run.parent / "art"}


def _train_args(data: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", "data.batch_size=64",
            "train.progress=false", f"train.max_steps={steps}", "train.checkpoint_every=2",
            "train.keep_checkpoints=3", *extra]


def _tampered_run(world, dest: Path, marker: Path, *, every: bool = True) -> Path:
    """A copy of the run with the payload planted in every checkpoint (else the newest)."""
    run = shutil.copytree(world["run"], dest)
    found = ckpt.list_checkpoints(run)
    for _, path in found if every else found[-1:]:
        plant(path, marker)
        assert checksum_problem(path, json.loads((path / MANIFEST).read_text())) is None  # resealed
    return run


# -- checkpoints ------------------------------------------------------------------------
def test_the_planted_payload_runs_under_dcps_own_reader(world, tmp_path):
    """What the refusals below stop: DCP's reader and default planner unpickle the bytes
    entry (torch.load(weights_only=False)) and the payload runs."""
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker)
    with quiet():
        dcp.load({KEY: torch.empty(1)}, storage_reader=dcp.FileSystemReader(ckpt.step_dir(run, 4)), no_dist=True)
    assert marker.exists()


def test_eval_refuses_the_checkpoint(world, tmp_path, capsys):
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker)
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"hybridrec: error: {ckpt.step_dir(run, 4)}: loading the checkpoint failed: "), line
    _refused(line)
    assert "no older checkpoint loads either: step-00000002: .metadata: refused" in line, line
    assert not marker.exists()


def test_predict_refuses_the_checkpoint(world, tmp_path, capsys):
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker)
    capsys.readouterr()
    assert main(["predict", str(run), str(world["raw"]), "--out", str(tmp_path / "p.csv")]) == 2
    _refused(_error_line(capsys.readouterr().err))
    assert not marker.exists() and not (tmp_path / "p.csv").exists()


def test_export_refuses_the_checkpoint(world, tmp_path, capsys):
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "art")]) == 2
    _refused(_error_line(capsys.readouterr().err))
    assert not marker.exists() and not (tmp_path / "art").exists()


def test_hybridrec_load_refuses_the_checkpoint(world, tmp_path):
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker)
    with pytest.raises(CheckpointError) as e:
        hybridrec.load(run, checkpoint="latest")
    _refused(str(e.value))
    assert not marker.exists()


def test_a_resume_skips_the_checkpoint_and_says_why(world, tmp_path, capsys):
    marker = tmp_path / "marker"
    run = _tampered_run(world, tmp_path / "run", marker, every=False)
    (run / "summary.json").unlink()  # as if it had stopped before the end
    capsys.readouterr()
    assert main(_train_args(world["data"], run, 6)) == 0
    err = capsys.readouterr().err
    (warned,) = [x for x in err.splitlines() if "skipped the checkpoint" in x]
    _refused(warned)
    assert f"resumed from step 2 ({ckpt.step_dir(run, 2)})" in err, err
    assert not marker.exists()


def test_init_from_refuses_the_checkpoint(world, tmp_path, capsys):
    marker = tmp_path / "marker"
    source = _tampered_run(world, tmp_path / "source", marker)
    capsys.readouterr()
    assert main(_train_args(world["data"], tmp_path / "new", 2, f"train.init_from={ckpt.step_dir(source, 4)}")) == 2
    _refused(_error_line(capsys.readouterr().err))
    assert not marker.exists()


def test_the_reader_refuses_a_planned_bytes_item_before_reading_it(world, tmp_path):
    """:meth:`SafeFileSystemReader.read_data` refuses a bytes read item however the plan was
    made (here by DCP's planner from the metadata as DCP itself reads it)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    marker = tmp_path / "marker"
    run = shutil.copytree(world["run"], tmp_path / "run")
    path = ckpt.step_dir(run, 4)
    reader = SafeFileSystemReader(path)  # (made before the payload is planted: its check passed)
    plant(path, marker)
    with pytest.raises(CheckpointError) as e:  # (made after: refused at once)
        SafeFileSystemReader(path)
    _refused(str(e.value))
    metadata = dcp.FileSystemReader(path).read_metadata()  # (DCP's: the bytes entry let through)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({KEY: torch.empty(1)}, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    with pytest.raises(CheckpointError) as e:
        reader.read_data(planner.create_local_plan(), planner)
    assert str(e.value) == (f"{path / '__0_0.distcp'}: refused: {KEY!r} is a pickled object, which is never "
                            "unpickled (a checkpoint holds tensors only)")
    assert not marker.exists()


def test_a_shard_delta_of_the_dcp_layout_is_refused(tmp_path):
    """An incremental save of the earlier layout (a DCP directory) read by
    :meth:`ShardDeltas.apply`, a rolled-back rank's path in partial recovery."""
    from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
    from hybridrec.parallel.checkpoint_io import FORMAT, write_json
    from hybridrec.train.checkpointing.deltas import DELTA_KIND, ShardDeltas
    from hybridrec.train.loop.sparse_optim import RowWiseAdagrad

    marker = tmp_path / "marker"
    ebc = EmbeddingBagCollection([TableConfig(name="t0", num_embeddings=20, embedding_dim=4)], seed=0)
    opt = RowWiseAdagrad(ebc, lr=0.1)
    deltas = ShardDeltas(ebc, opt, directory=tmp_path / "d", plan=None, every=1)
    rows = {"g0.ids": torch.tensor([2, 5]), "g0.weight": torch.full((2, 4), 7.0),
            **{f"g0.state.{k}": torch.full((2, *v.shape[1:]), 3.0) for k, v in opt.row_state(0).items()}}
    old = deltas.dir / "step-00000004"
    old.mkdir(parents=True)
    with quiet():
        dcp.save(rows, storage_writer=dcp.FileSystemWriter(old), no_dist=True)
    write_json(old / MANIFEST, {"format": FORMAT, "kind": DELTA_KIND, "step": 4, "base_step": 2, "plan": None,
                                "rows": 2, "pending_rows": 0, "mode": "touched", "groups": [0],
                                "extra": {}})
    plant(old, marker)
    before = ebc.group_weight(0).clone()
    with pytest.raises(CheckpointError) as e:
        deltas.apply(2, 9)
    _refused(str(e.value), where=str(old / ".metadata"))
    assert torch.equal(ebc.group_weight(0), before) and not marker.exists()


def test_a_servers_recovery_snapshot_is_refused(tmp_path):
    """A snapshot as a parameter server writes one (:func:`save_snapshot` of its state's
    skeleton) read as a server's recovery reads it (:func:`check_snapshot_dir`, whose
    refusal makes the server roll back, and ``read_snapshot`` of its weights, sparse optimizer
    state and version)."""
    from hybridrec.parallel.checkpoint_io import encode_skeleton
    from hybridrec.train.checkpointing.snapshots import (
        check_snapshot_dir,
        read_snapshot,
        save_snapshot,
    )

    marker = tmp_path / "marker"
    state = {"weights": {"t0@0": torch.randn(5, 4)}, "sparse_opt": {"lr": 0.1, "step": 3}, "version": 7}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_skeleton(state, "s", tensors)
    path = save_snapshot(tmp_path / "ps-00000", skeleton, tensors, {"server": 0, "step": 4}, sync=False)
    meta = json.loads((path / MANIFEST).read_text())
    assert read_snapshot(path, meta, ("weights", "sparse_opt", "version"))["version"] == 7  # (it reads as saved)
    plant(path, marker, skeleton="state.sparse_opt", key="s.sparse_opt.note")
    meta = json.loads((path / MANIFEST).read_text())
    refusal = (f"{path / '.metadata'}: refused: 's.sparse_opt.note' is a pickled object (bytes in __0_0.distcp), "
               "which is never unpickled (a checkpoint holds tensors only)")
    with pytest.raises(CheckpointError) as e:
        check_snapshot_dir({"boot": None}, path)
    assert str(e.value) == refusal
    with pytest.raises(CheckpointError) as e:  # (an Exception, which the server's recovery catches)
        read_snapshot(path, meta, ("weights", "sparse_opt", "version"))
    assert str(e.value) == refusal
    assert not marker.exists()


def test_a_truncated_recovery_snapshot_is_a_checkpoint_error(tmp_path):
    """DCP reports a short file as its CheckpointException, a BaseException that the
    recoveries' ``except Exception`` (roll this rank or server back) would let through:
    ``read_snapshot`` turns it into a :class:`CheckpointError` naming the snapshot."""
    from hybridrec.parallel.checkpoint_io import encode_skeleton
    from hybridrec.train.checkpointing.snapshots import read_snapshot, save_snapshot

    state = {"weights": {"t0@0": torch.randn(50, 4)}, "version": 7}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_skeleton(state, "s", tensors)
    path = save_snapshot(tmp_path / "ps-00000", skeleton, tensors, {"server": 0, "step": 4}, sync=False)
    meta = json.loads((path / MANIFEST).read_text())
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: .*truncated"):
        read_snapshot(path, meta, ("weights", "version"))


@pytest.mark.distributed
def test_partial_recovery_rolls_back_a_rank_whose_snapshot_is_refused(world, tmp_path):
    """Two ranks with partial recovery; rank 1 dies after step 5 and the run stops for good,
    rank 0's snapshot kept in RUN/recovery/. With the payload planted in it (read as the
    replicated state's donor, in old code the payload ran and the recovery reported
    success), the same command again refuses it in one line and rank 0 rolls back with
    rank 1 to the checkpoint of step 4."""
    marker, run = tmp_path / "marker", tmp_path / "run"
    argv = [sys.executable, "-m", "hybridrec", "train", "--recipe", "demo", f"data.path={world['data']}",
            f"train.run_dir={run}", "dist.nproc=2", "dist.timeout_s=60", "data.batch_size=32",
            "train.progress=false", "optim.sparse=rowwise_adagrad", "model.embedding_dim=8",
            "model.bottom_mlp=16,8", "model.top_mlp=16,1", "train.max_steps=5", "train.checkpoint_every=4",
            "train.recovery=partial", "train.inject_failure=1:5"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "kills itself" in proc.stderr, proc.stderr[-3000:]
    snapshot = run / "recovery" / "rank-00000"
    plant(snapshot, marker, skeleton="state.components", key="components.note")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"rank 0: its recovery snapshot is not used ({snapshot / '.metadata'}: refused: 'components.note' "
            "is a pickled object (bytes in __0_0.distcp), which is never unpickled") in proc.stderr, proc.stderr
    (event,) = json.loads((run / "summary.json").read_text())["recovery"]["events"]
    assert (event["survivors"], event["failed_ranks"], event["resumed_at_step"]) == ([], [1], 4)
    assert not marker.exists()


# -- exports ----------------------------------------------------------------------------
def _rewrite(src: Path, dst: Path, change) -> None:
    """A copy of the archive ``src`` with ``change(name, data) -> data`` applied to each entry."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w") as zo:
        for info in zi.infolist():
            zo.writestr(info, change(info.filename, zi.read(info)))


def _pickled_weight(marker: Path):
    """A weight marked ``use_pickle`` whose file is the payload."""
    state: dict = {}

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("_weights_config.json"):
            config = json.loads(data)
            fqn, meta = next(iter(config["config"].items()))
            meta["use_pickle"] = True
            state.update(fqn=fqn, file=meta["path_name"])
            return json.dumps(config).encode()
        return data

    def payload(name: str, data: bytes) -> bytes:
        return payload_bytes(marker) if name.endswith(f"/data/weights/{state['file']}") else data

    return change, payload, state


def _tampered_export(world, tmp_path: Path, marker: Path, what: str) -> Path:
    art = shutil.copytree(world["art"], tmp_path / "art")
    pt2, staged = art / "model.pt2", tmp_path / "staged.pt2"
    if what == "use_pickle":
        change, payload, _ = _pickled_weight(marker)
        _rewrite(pt2, staged, change)
        _rewrite(staged, pt2, payload)
        return art

    def program(name: str, data: bytes) -> bytes:
        if not name.endswith("/models/model.json"):
            return data
        p = json.loads(data)
        code = f"open({str(marker)!r}, 'w').close()"
        if what == "guard":  # (the loader compiles it into the module: a call runs it)
            p["guards_code"] = [f"{code} is None"]
        else:  # a shape expression: sympify evaluates it
            stack = [p]
            while stack:
                o = stack.pop()
                if isinstance(o, dict) and "expr_str" in o:
                    o["expr_str"] = f"Integer(exec({code!r}) is None)"
                    break
                stack.extend(o.values() if isinstance(o, dict) else o if isinstance(o, list) else [])
        return json.dumps(p).encode()

    _rewrite(pt2, staged, program)
    staged.replace(pt2)
    return art


def _score(art: Path, world, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(art / "score.py"), str(world["raw"]), str(out)],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["use_pickle", "guard", "expression"])
def test_the_planted_archive_runs_under_torch_export_load(world, tmp_path, what):
    """What score.py's check stops: torch.export.load (and, for a guard, the first call)
    runs the payload."""
    marker = tmp_path / "marker"
    art = _tampered_export(world, tmp_path, marker, what)
    code = ("import sys, torch\n"
            "try:\n"
            "    m = torch.export.load(sys.argv[1]).module()\n"
            "    m(*torch.export.load(sys.argv[1]).example_inputs[0])\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    subprocess.run([sys.executable, "-c", code, str(art / "model.pt2")], capture_output=True, text=True,
                   timeout=300, check=False)
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("what, why", [
    ("use_pickle", ("'{fqn}' is pickled (use_pickle), which torch.export.load would unpickle",)),
    ("guard", ("guard \"open(", "is not a comparison of input sizes (it would run as Python)")),
    ("expression", ("shape expression 'Integer(exec(", "is not one of sympy's (it would be evaluated as Python)")),
])
def test_score_py_refuses_the_archive(world, tmp_path, what, why):
    marker = tmp_path / "marker"
    art = _tampered_export(world, tmp_path, marker, what)
    out = tmp_path / "p.csv"
    proc = _score(art, world, out)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"score.py: error: {art / 'model.pt2'}: refused: model/"), line
    if what == "use_pickle":
        fqn = next(iter(json.loads(zipfile.ZipFile(art / "model.pt2").read(
            "model/data/weights/model_weights_config.json"))["config"]))
        assert line.endswith(f"data/weights/model_weights_config.json: {why[0].format(fqn=fqn)}"), line
    else:
        assert f"/models/model.json: {why[0]}" in line and line.endswith(why[1]), line
    assert not marker.exists() and not out.exists()
    assert score_template.archive_problem(art / "model.pt2") == line.split(": refused: ", 1)[1]


@pytest.mark.parametrize("what", ["use_pickle", "guard", "expression"])
def test_hybridrec_serve_refuses_the_archive(world, tmp_path, what):
    """``hybridrec serve`` loads an export (or a published version) through ``load_version``:
    the same check before torch reads the program."""
    from hybridrec.errors import DataError
    from hybridrec.serve.versions import load_version

    marker = tmp_path / "marker"
    art = _tampered_export(world, tmp_path, marker, what)
    with pytest.raises(DataError) as e:
        load_version(art)
    assert str(e.value) == f"{art / 'model.pt2'}: refused: {score_template.archive_problem(art / 'model.pt2')}"
    assert not marker.exists()


@pytest.mark.slow
def test_an_export_as_written_passes_the_check_and_scores(world, tmp_path):
    """The check accepts what ``hybridrec export`` writes (the export itself runs it before
    publishing), and score.py scores with it."""
    assert score_template.archive_problem(world["art"] / "model.pt2") is None
    proc = _score(world["art"], world, tmp_path / "p.csv")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p.csv").read_text().splitlines()[0] == "probability"


@pytest.mark.parametrize("entry, why", [
    ("data/weights/model.pt", "model/data/weights/model.pt: not part of a plain torch.export program"),
    ("data/aotinductor/model/x.so", "model/data/aotinductor/model/x.so: not part of a plain torch.export program"),
    ("data/constants/custom_obj_0", "model/data/constants/custom_obj_0: not part of a plain torch.export program"),
])
def test_entries_torch_would_unpickle_or_load_as_code_are_refused(world, tmp_path, entry, why):
    pt2 = tmp_path / "model.pt2"
    shutil.copyfile(world["art"] / "model.pt2", pt2)
    with zipfile.ZipFile(pt2, "a") as z:
        z.writestr(f"model/{entry}", payload_bytes(tmp_path / "marker"))
    assert score_template.archive_problem(pt2).startswith(why)


def test_an_older_formats_pickles_beside_the_archive_are_refused(world, tmp_path):
    """Entries outside the archive's directory make torch's reader fail, and
    torch.export.load then reads the file as its older format (serialized_*.pt, pickles)."""
    pt2 = tmp_path / "model.pt2"
    shutil.copyfile(world["art"] / "model.pt2", pt2)
    with zipfile.ZipFile(pt2, "a") as z:
        z.writestr("version", "1")
        z.writestr("serialized_example_inputs.pt", payload_bytes(tmp_path / "marker"))
    assert score_template.archive_problem(pt2) == (
        "its entries are not all in one directory (torch would read it as an older format, of pickles)")


def test_sample_inputs_that_weights_only_refuses_are_refused(world, tmp_path):
    """torch reads the sample inputs with weights_only=True, and when that fails, without."""
    pt2 = tmp_path / "model.pt2"
    _rewrite(world["art"] / "model.pt2", pt2,
             lambda name, data: payload_bytes(tmp_path / "marker") if name.endswith("sample_inputs/model.pt") else data)
    assert score_template.archive_problem(pt2) == (
        "model/data/sample_inputs/model.pt: holds objects other than tensors, which torch.export.load "
        "would unpickle (UnpicklingError)")
    assert not (tmp_path / "marker").exists()
