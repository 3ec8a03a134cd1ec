"""`hybridrec export`: the exported program against the eager model, score.py (torch and numpy
only) against the library's preprocessing and `hybridrec predict`, int8/bf16 tables."""

import csv
import gzip
import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.data.chunk import ParseReport
from hybridrec.data.criteo import read_criteo
from hybridrec.data.encode import ModuloEncoder, VocabEncoder
from hybridrec.data.preprocess import load_encoders
from hybridrec.data.tabular import CsvReader, TabularSpec
from hybridrec.errors import ConfigError
from hybridrec.serve import export as ex
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.run import load_run_model

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=128",
         "data.eval_batch_size=512", "train.progress=false", "train.max_steps=25", "optim.warmup_steps=5"]
TEMPLATE = Path(ex.__file__).with_name("score_template.py")


def _criteo_run(shared_dataset, root: Path, *, multi_hot: str = "", extra=()) -> tuple[Path, Path]:
    """A tiny trained run on synthetic Criteo days (the last held out, shared: read-only);
    ``(run, raw dir)``."""
    synth = ("--multi-hot", "3", "--multi-hot-fields", multi_hot) if multi_hot else ()
    data = shared_dataset(days=3, rows=1500, synth=synth,
                          preprocess=("--multi-hot-fields", multi_hot) if multi_hot else ())
    assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={root / 'run'}",
                 *SMALL, *extra]) == 0
    return root / "run", data.parent / "raw"


@pytest.fixture(scope="module")
def onehot(shared_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    run, raw = _criteo_run(shared_dataset, root)
    art = root / "art"
    assert main(["export", str(run), "--out", str(art)]) == 0
    return run, raw, art


@pytest.fixture(scope="module")
def torch_numpy_only(tmp_path_factory) -> list[str]:
    """A Python command line whose imports reach torch (with its own requirements) and numpy
    only: ``-S`` (no site-packages) and a PYTHONPATH of links to those packages' files."""
    site = tmp_path_factory.mktemp("torch_numpy_only")
    for dist in _requirements(["torch", "numpy"]):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not top.endswith(".pth") and not (site / top).exists():
                (site / top).symlink_to(src)
    cmd = [sys.executable, "-s", "-S"]
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    probe = ("import importlib.util as u\n"
             "print([m for m in ('torch', 'numpy', 'hybridrec', 'pandas', 'pyarrow') if u.find_spec(m)])")
    r = subprocess.run([*cmd, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "['torch', 'numpy']", r.stdout + r.stderr
    return cmd, env


def _requirements(names: list[str]) -> list:
    """The installed distributions of ``names`` and of what they require (no extras)."""
    seen: dict = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            seen[name] = dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _score(art: Path, inp: Path, out: Path, env=None, *args) -> subprocess.CompletedProcess:
    cmd, environ = env if env is not None else ([sys.executable], None)
    return subprocess.run([*cmd, str(art / "score.py"), str(inp), str(out), *args], env=environ,
                          capture_output=True, text=True, timeout=120, check=False)


def _probabilities(path: Path) -> np.ndarray:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return np.array([float(r["probability"]) for r in rows])


def _library_batches(meta, chunks):
    """Raw chunks (the library's readers) -> Batches, encoded as preprocessing encodes."""
    enc = load_encoders(meta)
    for chunk in chunks:
        values, lengths, j = [], [], 0
        for f in meta.schema.features:
            if f.kind == "onehot":
                values.append(torch.from_numpy(enc[f.name](chunk.onehot[:, j]).astype(np.int64)))
                lengths.append(torch.ones(len(chunk), dtype=torch.int32))
                j += 1
            else:
                keys, n = chunk.multihot[f.name]
                values.append(torch.from_numpy(enc[f.name](keys).astype(np.int64)))
                lengths.append(torch.from_numpy(n.astype(np.int32)))
        kjt = KeyedJagged.from_lengths_per_key(meta.schema.feature_names, values, lengths)
        yield Batch(torch.from_numpy(chunk.dense), kjt, torch.from_numpy(chunk.labels).float())


def _eager(model, batches) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return torch.cat([torch.sigmoid(model(b)) for b in batches]).double().numpy()


def _eval_batch(meta, rows=300):
    from hybridrec.data.loader import ShardedLoader

    return next(iter(ShardedLoader(meta, split="eval", batch_size=rows, shuffle=False, prefetch=0)))


def test_exported_program_equals_eager_model(onehot):
    run, _, art = onehot
    _, meta, model, _, _ = load_run_model(run)
    model.eval()
    program = torch.export.load(str(art / "model.pt2")).module()
    batch = _eval_batch(meta)
    args = ex.batch_inputs(batch, meta)
    with torch.no_grad():
        want = torch.sigmoid(model(batch))
        for rows in (300, 64, 1):  # dynamic batch size, down to one row
            got = program(*(a[:rows] for a in args))
            assert got.shape == (rows,)
            assert (got - want[:rows]).abs().max().item() <= 1e-6
    record = json.loads((art / "export.json").read_text())
    held = record["held_out"]
    assert held["rows"] == 1500 and held["max_abs_diff"] <= 1e-6
    assert held["auc_exported"] == pytest.approx(held["auc_eager"], abs=1e-9)
    readme = (art / "README.md").read_text()
    assert "torch.export.load" in readme and "[B, 13]" in readme and "[B, 26]" in readme
    spec = json.loads((art / "preprocess" / "spec.json").read_text())
    assert spec["format"] == "criteo" and [f["name"] for f in spec["onehot"]] == [f"C{i}" for i in range(1, 27)]
    assert all((art / "preprocess" / f["vocab"]).is_file() for f in spec["onehot"])


@pytest.mark.slow
def test_score_py_with_torch_and_numpy_only_matches_library_and_predict(onehot, torch_numpy_only, tmp_path):
    run, raw, art = onehot
    _, meta, model, _, _ = load_run_model(run)
    lines = (raw / "day_2.tsv").read_bytes().splitlines(keepends=True)[:700]
    inp = tmp_path / "rows.tsv"
    inp.write_bytes(b"".join(lines))
    r = _score(art, inp, tmp_path / "p.csv", torch_numpy_only, "--batch-rows", "256")
    assert r.returncode == 0, r.stderr
    got = _probabilities(tmp_path / "p.csv")
    want = _eager(model, _library_batches(meta, read_criteo(inp)))
    assert got.shape == (700,) and np.abs(got - want).max() <= 1e-6
    # Without the label (39 fields, as Criteo's test.txt), gzipped: the same probabilities.
    unlabeled = tmp_path / "rows-nolabel.tsv.gz"
    with gzip.open(unlabeled, "wb") as f:
        f.write(b"".join(ln.split(b"\t", 1)[1] for ln in lines))
    assert _template().score(str(unlabeled), str(tmp_path / "q.csv"), root=art) == 700
    assert np.array_equal(_probabilities(tmp_path / "q.csv"), got)
    if not importlib.util.find_spec("hybridrec.serve.predict"):
        pytest.skip("no hybridrec predict to compare with")
    assert main(["predict", str(run), str(inp), "--out", str(tmp_path / "predict.csv")]) == 0
    assert np.abs(_probabilities(tmp_path / "predict.csv") - got).max() <= 1e-6


def test_score_py_names_a_bad_field(onehot, tmp_path, capsys):
    _, raw, art = onehot
    lines = (raw / "day_2.tsv").read_bytes().splitlines(keepends=True)[:5]
    fields = lines[3].split(b"\t")
    fields[16] = b"12zz"  # C3
    lines[3] = b"\t".join(fields)
    (tmp_path / "bad.tsv").write_bytes(b"".join(lines))
    st = _template()
    with pytest.raises(st.ScoreError) as e:
        st.score(str(tmp_path / "bad.tsv"), str(tmp_path / "p.csv"), root=art)
    assert str(e.value) == (f"{tmp_path / 'bad.tsv'}:4: field C3 (column 17): not a hexadecimal id of at "
                            "most 8 digits: b'12zz'")
    st.HERE = art  # (the command line, in this process: one line, status 2)
    assert st.main([str(tmp_path / "bad.tsv"), str(tmp_path / "p.csv")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"score.py: error: {e.value}"]


def test_int8_and_bf16_tables(onehot, tmp_path, capsys):
    run, _, art = onehot
    base = json.loads((art / "export.json").read_text())
    for tables, tol in (("bf16", 0.02), ("int8", 0.02)):
        out = tmp_path / tables
        assert main(["export", str(run), "--out", str(out), "--tables", tables]) == 0
        assert f"AUC exported ({tables})" in capsys.readouterr().out
        rec = json.loads((out / "export.json").read_text())
        held = rec["held_out"]
        assert 0 < held["max_abs_diff"] <= tol  # rounded tables, close probabilities
        assert abs(held["auc_exported"] - held["auc_eager"]) < 0.01
        assert rec["model_bytes"] < base["model_bytes"]


def test_onnx_is_written_or_says_why(onehot, tmp_path):
    run, _, _ = onehot
    _, meta, model, _, _ = load_run_model(run)
    serving = ex.ServingModel(model, onehot=[f.name for f in meta.schema.onehot], multihot=[])
    why = ex.export_onnx(serving, ex.example_inputs(meta), tmp_path / "model.onnx")
    if importlib.util.find_spec("onnxscript") is None:
        assert why is not None and "onnxscript" in why and not (tmp_path / "model.onnx").exists()
    else:
        assert why is None and (tmp_path / "model.onnx").is_file()


def test_quantize_rows_error_is_half_a_step():
    w = torch.randn(50, 16) * torch.rand(50, 1) * 3
    w[7] = 0.25  # a constant row: exact
    codes, sb = ex.quantize_rows(w)
    back = codes.float() * sb[:, :1] + sb[:, 1:]
    assert codes.dtype == torch.uint8 and torch.equal(back[7], w[7])
    step = (w.max(1).values - w.min(1).values) / 255
    assert ((back - w).abs() <= step[:, None] / 2 + 1e-6).all()


@pytest.mark.slow
def test_multihot_deepfm(shared_dataset, tmp_path):
    run, raw = _criteo_run(shared_dataset, tmp_path, multi_hot="C1,C5", extra=["model.arch=deepfm"])
    art = tmp_path / "art"
    assert main(["export", str(run), "--out", str(art)]) == 0
    _, meta, model, _, _ = load_run_model(run)
    batch = _eval_batch(meta)
    args = ex.batch_inputs(batch, meta)
    assert len(args) == 4 and args[3].shape == (300, 2) and args[2].numel() == int(args[3].sum())
    program = torch.export.load(str(art / "model.pt2")).module()
    model.eval()
    with torch.no_grad():
        assert (program(*args) - torch.sigmoid(model(batch))).abs().max().item() <= 1e-6
    lines = (raw / "day_2.tsv").read_bytes().splitlines(keepends=True)[:400]
    (tmp_path / "rows.tsv").write_bytes(b"".join(lines))
    assert _template().score(str(tmp_path / "rows.tsv"), str(tmp_path / "p.csv"), root=art) == 400
    want = _eager(model, _library_batches(meta, read_criteo(tmp_path / "rows.tsv", multihot=("C1", "C5"))))
    assert np.abs(_probabilities(tmp_path / "p.csv") - want).max() <= 1e-6


def _template():
    spec = importlib.util.spec_from_file_location("score_template", TEMPLATE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_score_py_parses_csv_as_the_library_does(tmp_path):
    """score.py's CSV reading (hashing, multi-hot cells, missing and NaN values, the dense
    transform) against hybridrec's CsvReader, on awkward cells."""
    st = _template()
    text = ("id,clicked,price,city,tags\n"
            "1,1,3.5,paris,a|b\n"
            "2,0,,\"lyon, fr\",\n"
            "3,0,nan,,c\n"
            "4,1,-2,paris,b|b|zz\n")
    (tmp_path / "x.csv").write_text(text)
    tab = TabularSpec(label="clicked", dense=["price"], categorical=["city"], multihot=["tags"])
    (chunk, _), = CsvReader(spec=tab).read(tmp_path / "x.csv", ParseReport())
    spec = {"csv": {"csv_delimiter": ",", "list_delimiter": "|"}, "dense": ["price"],
            "onehot": [{"name": "city"}], "multihot": [{"name": "tags"}]}
    with open(tmp_path / "x.csv", "rb") as f:
        (dense, onehot, bags), = st.csv_blocks(f, "x.csv", spec, 100)
    assert np.array_equal(st.transform(dense, "log1p"), chunk.dense)
    assert np.array_equal(onehot["city"], chunk.onehot[:, 0])
    assert np.array_equal(bags["tags"][0], chunk.multihot["tags"][0])
    assert np.array_equal(bags["tags"][1], chunk.multihot["tags"][1])


def test_score_py_parses_criteo_as_the_library_does(tmp_path):
    st = _template()
    lines = [
        "1\t5\t-3\t\t999999999999999999" + "\t7" * 9 + "\t" + "\t".join(["0aBc12fF", "", "1", "ffffffff"] * 6)
        + "\tdeadbeef" + "\t12,ab,0000000c",
        "0" + "\t" * 13 + "\t" * 25 + "\t",
    ]
    (tmp_path / "x.tsv").write_text("\n".join(lines) + "\n")
    (chunk,) = read_criteo(tmp_path / "x.tsv", multihot=("C26",))
    spec = {"dense": [f"I{i}" for i in range(1, 14)], "multihot": [{"name": "C26"}]}
    with open(tmp_path / "x.tsv", "rb") as f:
        (dense, onehot, bags), = st.criteo_blocks(f, "x.tsv", spec, 100)
    assert np.array_equal(st.transform(dense, "log1p"), chunk.dense)
    assert np.array_equal(np.stack([onehot[f"C{i}"] for i in range(1, 26)], 1), chunk.onehot)
    assert np.array_equal(bags["C26"][0], chunk.multihot["C26"][0])
    assert np.array_equal(bags["C26"][1], chunk.multihot["C26"][1])
    ids, lengths = st.sample_major([(np.array([1, 2, 3]), np.array([2, 1])), (np.array([7, 8]), np.array([1, 1]))])
    assert ids.tolist() == [1, 2, 7, 3, 8] and lengths.tolist() == [[2, 1], [1, 1]]


def test_score_py_encodes_keys_as_the_library_does(tmp_path):
    """Vocabularies (sorted, and grown by ``preprocess --grow``: keys appended), with and
    without a modulo first, and plain modulo tables."""
    st = _template()
    (tmp_path / "preprocess" / "vocab").mkdir(parents=True)
    keys = np.array([-1, 0, 1, 3, 7, 10, 42, 43, 1003, 107, 203])
    for vocab in (np.array([1, 3, 10, 42]), np.array([1, 3, 10, 42, 7, 0])):
        np.save(tmp_path / "preprocess" / "vocab" / "f.npy", vocab)
        for modulo in (None, 100):
            ours = st.Encoder({"name": "f", "modulo": modulo, "vocab": "vocab/f.npy"}, tmp_path)(keys)
            assert ours.tolist() == VocabEncoder(vocab, modulo)(keys).tolist()
    ours = st.Encoder({"name": "f", "modulo": 7, "vocab": None}, tmp_path)(keys)
    assert ours.tolist() == ModuloEncoder(7)(keys).tolist()


def test_export_refusals(onehot, tmp_path):
    run, _, art = onehot
    with pytest.raises(ConfigError, match="already exists"):
        ex.export_run(run, art)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not an export directory"):
        ex.export_run(run, tmp_path / "other", overwrite=True)
    with pytest.raises(ConfigError, match="--tables"):
        ex.export_run(run, tmp_path / "new", tables="int4")
    assert (tmp_path / "other" / "keep.txt").is_file() and not (tmp_path / "new").exists()
