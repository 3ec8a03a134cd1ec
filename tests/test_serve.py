"""`hybridrec serve`: a real server process started with the CLI on a free loopback port and
talked to over HTTP. Its probabilities are `hybridrec predict`'s (rows and columns); a new
version published under concurrent requests is swapped in with no request failing and
every response scored by the one version it names; a corrupt or mismatched version is
refused while the old one serves; bad requests get a 4xx and one line; it listens on
loopback only. The published layout (serve/published.py) is tested on its own first."""

import contextlib
import csv
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybridrec.cli.main import DEBUG_ENV, main
from hybridrec.errors import ConfigError, DataError
from hybridrec.serve import published

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

NAMES = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
ROWS = 300
WAIT_S = 240  # the longest any wait for the server may take on a loaded machine


# ---------------------------------------------------------------- the published layout


def _fake_export(tag: str):
    def make(out: Path) -> dict:
        out.mkdir()
        (out / "export.json").write_text(json.dumps({"tag": tag}))
        return {"tag": tag}

    return make


def test_publish_names_versions_in_order_and_points_latest_at_the_newest(tmp_path):
    assert published.latest(tmp_path) is None and published.versions(tmp_path) == []
    names = [published.publish(tmp_path, _fake_export(t), info={"trained_rows": i}) for i, t in enumerate("abc")]
    assert names == ["v1", "v2", "v3"] and published.versions(tmp_path) == names
    assert published.latest_name(tmp_path) == "v3"
    assert (published.published_dir(tmp_path) / "LATEST").read_text() == "v3\n"
    info = published.info(published.latest(tmp_path))
    assert info["tag"] == "c" and info["trained_rows"] == 2 and info["published_at"] <= time.time()
    # Leftovers of a writer (staging directories, temporary files) are never versions.
    (published.published_dir(tmp_path) / ".staging-1-2").mkdir()
    (published.published_dir(tmp_path) / "v9.tmp").mkdir()
    assert published.versions(tmp_path) == names


def test_prune_keeps_the_newest_and_never_the_latest_one(tmp_path):
    for t in "abcd":
        published.publish(tmp_path, _fake_export(t))
    assert published.prune(tmp_path, 2) == ["v1", "v2"]
    assert published.versions(tmp_path) == ["v3", "v4"]
    published.publish(tmp_path, _fake_export("e"), keep=1)
    assert published.versions(tmp_path) == ["v5"] and published.latest_name(tmp_path) == "v5"
    # LATEST naming an older version (a publisher rolled back) keeps that one too.
    (published.published_dir(tmp_path) / "LATEST").write_text("v5\n")
    published.publish(tmp_path, _fake_export("f"))
    (published.published_dir(tmp_path) / "LATEST").write_text("v5\n")
    published.prune(tmp_path, 1)
    assert published.versions(tmp_path) == ["v5", "v6"]
    with pytest.raises(ConfigError, match="keep at least 1"):
        published.prune(tmp_path, 0)


def test_a_failed_publication_leaves_nothing_and_latest_as_it_was(tmp_path):
    published.publish(tmp_path, _fake_export("a"))

    def broken(out: Path):
        out.mkdir()
        (out / "model.pt2").write_bytes(b"half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        published.publish(tmp_path, broken)
    with pytest.raises(DataError, match="no export.json"):
        published.publish(tmp_path, lambda out: out.mkdir())
    assert published.versions(tmp_path) == ["v1"] and published.latest_name(tmp_path) == "v1"
    assert sorted(p.name for p in published.published_dir(tmp_path).iterdir()) == ["LATEST", "v1"]


def test_a_latest_that_names_no_version_is_an_error(tmp_path):
    published.published_dir(tmp_path).mkdir()
    (published.published_dir(tmp_path) / "LATEST").write_text("../../etc\n")
    with pytest.raises(DataError, match="not a version name"):
        published.latest(tmp_path)


def test_loopback_hosts():
    from hybridrec.serve.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")


# ---------------------------------------------------------------- a trained run and its rows


@pytest.fixture(scope="module")
def trained(shared_dataset, trained_run, tmp_path_factory):
    """A tiny Criteo-format run with checkpoints at steps 6 and 12, ``ROWS`` raw rows of its
    held-out day (as a file and as JSON rows, label included) and each checkpoint's
    `hybridrec predict` probabilities of those rows."""
    root = tmp_path_factory.mktemp("serve")
    data = shared_dataset(days=3, rows=600)
    run = trained_run(data, 12, "data.eval_batch_size=256", "train.checkpoint_every=6")  # (shared: read-only)
    lines = (data.parent / "raw" / "day_2.tsv").read_text().splitlines()[:ROWS]
    raw = root / "rows.tsv"
    raw.write_text("".join(line + "\n" for line in lines))
    rows = [{n: (None if v == "" else int(v) if n[0] in "lI" else v) for n, v in zip(NAMES, line.split("\t"))}
            for line in lines]
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step-00000006", "step-00000012"]
    expected = {c.name: _predict(run, raw, root / f"{c.name}.csv", c) for c in checkpoints}
    # (the two checkpoints score differently, so a response scored by the wrong one shows)
    assert np.abs(expected["step-00000006"] - expected["step-00000012"]).max() > 1e-4
    return {"run": run, "rows": rows, "raw": raw, "checkpoints": checkpoints, "expected": expected}


def _predict(run: Path, raw: Path, out: Path, checkpoint: Path) -> np.ndarray:
    assert main(["predict", str(run), str(raw), "--out", str(out), "--checkpoint", str(checkpoint)]) == 0
    with open(out) as f:
        return np.array([float(r["probability"]) for r in csv.DictReader(f)])


def _copy_run(trained, dest: Path) -> Path:
    """The trained run, copied (each test publishes into a run of its own)."""
    return Path(shutil.copytree(trained["run"], dest))


def _columns(rows: list[dict]) -> dict:
    return {n: [r[n] for r in rows] for n in NAMES}


# ---------------------------------------------------------------- a server process


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log_file = proc, url, log

    def log(self) -> str:
        return self.log_file.read_text()

    def client(self, **kw) -> "httpx.Client":
        return httpx.Client(base_url=self.url, timeout=WAIT_S, **kw)


@contextlib.contextmanager
def serving(path: Path, log: Path, *options: str):
    """``hybridrec serve PATH --port 0 OPTIONS`` as a process of its own, until the block ends."""
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "RANK", "WORLD_SIZE")}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "hybridrec", "serve", str(path), "--port", "0",
                                 "--threads", "1", *options], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env, start_new_session=True)
    try:
        yield Served(proc, _address(proc, log), log)
    finally:
        _stop(proc)


def _address(proc: subprocess.Popen, log: Path) -> str:
    """The server's address from its first line (it prints it once it listens)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            assert proc.poll() is None, f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}"
            continue
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return m.group(1)
    raise AssertionError(f"the server did not start in {WAIT_S} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def _wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"no metric {name}"
    return float(m.group(1))


# ---------------------------------------------------------------- one export, served


@pytest.fixture(scope="module")
def export_server(trained, tmp_path_factory):
    """``hybridrec export`` of the run's newest checkpoint, served with small caps."""
    root = tmp_path_factory.mktemp("export_server")
    art = root / "art"
    assert main(["export", str(trained["run"]), "--out", str(art), "--eval-rows", "256"]) == 0
    with serving(art, root / "serve.log", "--max-rows", str(ROWS), "--max-body-mb", "0.25") as served:
        yield served


@pytest.mark.slow  # a server process: 5-30 s, mostly start-up
def test_predictions_are_hybridrec_predicts_as_rows_and_as_columns(trained, export_server):
    expected = trained["expected"]["step-00000012"]
    rows = trained["rows"]
    with export_server.client() as c:
        r = c.post("/v1/predict", json={"rows": rows})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == "art"
        np.testing.assert_allclose(r.json()["probabilities"], expected, rtol=0, atol=1e-6)
        r = c.post("/v1/predict", json={"columns": _columns(rows)})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["probabilities"], expected, rtol=0, atol=1e-6)
        for i in (0, 7, 123):  # one row a request
            r = c.post("/v1/predict", json={"rows": [rows[i]]})
            assert abs(r.json()["probabilities"][0] - expected[i]) <= 1e-6
        without_label = [{k: v for k, v in row.items() if k != "label"} for row in rows[:5]]
        r = c.post("/v1/predict", json={"rows": without_label})
        np.testing.assert_allclose(r.json()["probabilities"], expected[:5], rtol=0, atol=1e-6)
        model = c.get("/v1/model").json()
        assert model["version"] == "art" and model["step"] == 12 and model["trained_rows"] > 0
        assert model["columns"] == NAMES[1:] and model["following"] is None
        assert c.get("/healthz").json() == {"status": "ok", "version": "art"}
        metrics = c.get("/metrics").text
    assert _metric(metrics, "hybridrec_serve_rows_total") >= 2 * ROWS + 8
    assert 'hybridrec_serve_model_version{version="art"} 1.0' in metrics
    assert _metric(metrics, "hybridrec_serve_request_seconds_count") >= 6


@pytest.mark.slow
def test_bad_requests_get_a_4xx_and_one_line_and_the_server_stays_healthy(trained, export_server):
    rows = trained["rows"]
    no_c7 = [dict(r) for r in rows[:3]]
    del no_c7[1]["C7"]
    text_value = [dict(r) for r in rows[:3]]
    text_value[2]["I5"] = "many"
    tab = [dict(r) for r in rows[:2]]
    tab[1]["C3"] = "68fd\t1e64"
    nested = [dict(r) for r in rows[:2]]
    nested[0]["I2"] = {"value": 1}
    uneven = _columns(rows[:4])
    uneven["I3"] = uneven["I3"][:3]
    misspelt = [dict(r) for r in rows[:3]]
    misspelt[2]["C7x"] = misspelt[2].pop("C7")
    not_hex = [dict(r) for r in rows[:3]]
    not_hex[1]["C9"] = "zz12"
    float_id = [dict(r) for r in rows[:3]]
    float_id[0]["C2"] = 12.5
    two_ids = [dict(r) for r in rows[:4]]
    two_ids[3]["C26"] = ["68fd1e64", "80e26c9b"]
    long_int = [dict(r) for r in rows[:2]]
    long_int[1]["I13"] = 10**19
    padded = json.dumps({"rows": rows[:2]}) + " " * (300 * 1024)
    cases = [  # (body, status, words the message names)
        (b'{"rows": [', 400, ["malformed JSON"]),
        (b"[1, 2]", 400, ['"rows"', '"columns"']),
        (json.dumps({"rows": no_c7}), 400, ["rows[1]", "C7"]),
        (json.dumps({"columns": {k: v for k, v in _columns(rows[:2]).items() if k != "I9"}}), 400, ["I9"]),
        (json.dumps({"rows": text_value}), 400, ["row 2", "I5", "many"]),
        (json.dumps({"columns": uneven}), 400, ["I3", "3 values"]),
        (json.dumps({"rows": tab}), 400, ["row 1", "C3", "tab"]),
        (json.dumps({"rows": nested}), 400, ["row 0", "I2", "object"]),
        (json.dumps({"rows": misspelt}), 400, ["rows[2]", "no column C7", "given C7x"]),
        (json.dumps({"rows": not_hex}), 400, ["row 1: field C9 (column 23)", "not a hexadecimal id", "'zz12'"]),
        (json.dumps({"rows": float_id}), 400, ["row 0: field C2", "not a hexadecimal id", "'12.5'"]),
        (json.dumps({"rows": two_ids}), 400, ["row 3: field C26", "2 values where the field takes one"]),
        (json.dumps({"rows": long_int}), 400, ["row 1: field I13", "more than 18 digits"]),
        (json.dumps({"rows": rows + rows[:1]}), 413, [f"{ROWS + 1} rows", "--max-rows"]),
        (padded, 413, ["bytes", "--max-body-mb"]),
    ]
    with export_server.client() as c:
        for body, status, words in cases:
            r = c.post("/v1/predict", content=body)
            assert r.status_code == status, (body[:80], r.status_code, r.text)
            message = r.json()["error"]
            assert "\n" not in message and all(w in message for w in words), message

        # A burst of bad requests beside good ones: every good one is answered, and right.
        expected = trained["expected"]["step-00000012"]
        failures: list = []

        def bad(k: int) -> None:
            with export_server.client() as b:
                for i in range(20):
                    body, status, _ = cases[(k + i) % len(cases)]
                    if b.post("/v1/predict", content=body).status_code != status:
                        failures.append(("bad", k, i))

        def good(k: int) -> None:
            with export_server.client() as g:
                for i in range(10):
                    lo = (k * 37 + i * 11) % (ROWS - 16)
                    r = g.post("/v1/predict", json={"rows": rows[lo:lo + 16]})
                    if r.status_code != 200 or np.abs(np.array(r.json()["probabilities"]) - expected[lo:lo + 16]).max() > 1e-6:
                        failures.append(("good", k, i, r.status_code))

        threads = [threading.Thread(target=bad, args=(k,)) for k in range(4)]
        threads += [threading.Thread(target=good, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=WAIT_S)
        assert not any(t.is_alive() for t in threads) and not failures, failures
        assert c.get("/healthz").status_code == 200
        metrics = c.get("/metrics").text
    assert export_server.proc.poll() is None
    assert _metric(metrics, 'hybridrec_serve_errors_total{kind="too_many_rows"}') >= 1
    assert _metric(metrics, 'hybridrec_serve_errors_total{kind="body_too_large"}') >= 1


@pytest.mark.slow
def test_it_listens_on_loopback_only_by_default(export_server):
    from test_local_launch_trust import _tree, listening

    port = export_server.url.rsplit(":", 1)[1]
    seen = listening(_tree(export_server.proc.pid))
    assert f"127.0.0.1:{port}" in seen
    assert all(s.startswith("127.") for s in seen), seen


# ---------------------------------------------------------------- a run's published versions


@pytest.mark.slow  # a server process and three exports under load: 20-90 s
def test_a_hot_swap_under_concurrent_requests_fails_none_and_mixes_no_versions(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    early, late = (run / "checkpoints" / c.name for c in trained["checkpoints"])
    rows, expected = trained["rows"], trained["expected"]
    scored_by = {published.publish(run, published.checkpoint_export(run, str(early), eval_rows=256)): early.name}
    with serving(run, tmp_path / "serve.log", "--poll-s", "0.2", "--max-wait-ms", "5") as served:
        stop = threading.Event()
        seen: list[list] = [[] for _ in range(6)]
        failures: list = []

        def client(k: int) -> None:
            with served.client() as c:
                i = k
                while not stop.is_set():
                    lo, n = (i * 7) % (ROWS - 8), 1 + i % 8
                    try:
                        r = c.post("/v1/predict", json={"rows": rows[lo:lo + n]})
                    except httpx.HTTPError as e:
                        failures.append((k, i, repr(e)))
                        continue
                    if r.status_code != 200:
                        failures.append((k, i, r.status_code, r.text))
                    else:
                        seen[k].append((lo, n, r.json()))
                    i += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(len(seen))]
        for t in threads:
            t.start()
        try:
            _wait_until(lambda: all(seen), "every client answered")
            for checkpoint in (late, early):
                name = published.publish(run, published.checkpoint_export(run, str(checkpoint), eval_rows=256))
                scored_by[name] = checkpoint.name
                _wait_until(lambda name=name: all(s and s[-1][2]["version"] == name for s in seen),
                            f"every client answered by {name}")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=WAIT_S)
        with served.client() as c:
            model, metrics = c.get("/v1/model").json(), c.get("/metrics").text
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]
    order = list(scored_by)  # v1, v2, v3
    assert order == ["v1", "v2", "v3"] and model["version"] == "v3"
    assert model["following"].endswith("published/LATEST") and model["published_at"] is not None
    assert model["trained_rows"] > 0 and model["freshness_seconds"] >= 0
    for responses in seen:
        versions = [r["version"] for _, _, r in responses]
        assert set(versions) <= set(order)
        assert versions == sorted(versions, key=order.index), "a client saw the served version go back"
        for lo, n, r in responses:  # each response is the named version's numbers, exactly
            want = expected[scored_by[r["version"]]][lo:lo + n]
            np.testing.assert_allclose(r["probabilities"], want, rtol=0, atol=1e-6, err_msg=r["version"])
    assert {r["version"] for s in seen for _, _, r in s} == set(order)
    assert _metric(metrics, "hybridrec_serve_swaps_total") == 2
    assert not re.search(r"^hybridrec_serve_errors_total", metrics, re.MULTILINE)  # (none counted)


@pytest.mark.slow  # a server process and four exports: 20-90 s
def test_a_run_serves_its_checkpoint_then_refuses_broken_versions_and_takes_a_good_one(trained, tmp_path):
    run = _copy_run(trained, tmp_path / "run")
    early, late = (run / "checkpoints" / c.name for c in trained["checkpoints"])
    rows, expected = trained["rows"][:40], trained["expected"]

    def corrupt(out: Path) -> dict:  # the program's file cut in half
        made = published.checkpoint_export(run, str(early), eval_rows=256)(out)
        model = out / "model.pt2"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        return made

    def other_format(out: Path) -> dict:  # a model of CSV rows with another first column
        made = published.checkpoint_export(run, str(early), eval_rows=256)(out)
        spec_file = out / "preprocess" / "spec.json"
        spec = json.loads(spec_file.read_text())
        spec["format"], spec["dense"][0] = "csv", "X1"
        spec_file.write_text(json.dumps(spec))
        return made

    def score(c, version: str, checkpoint: str) -> None:
        r = c.post("/v1/predict", json={"rows": rows})
        assert r.status_code == 200 and r.json()["version"] == version, r.text
        np.testing.assert_allclose(r.json()["probabilities"], expected[checkpoint][:40], rtol=0, atol=1e-6)

    with serving(run, tmp_path / "serve.log", "--poll-s", "0.2") as served, served.client() as c:
        # Nothing published: the run's best (here newest) checkpoint, exported into the run.
        assert (run / "serving" / late.name / "export.json").is_file()
        score(c, late.name, late.name)
        for maker, reason in ((corrupt, "model.pt2"), (other_format, "raw format is csv")):
            name = published.publish(run, maker)
            _wait_until(lambda name=name: f"refused version {name}" in served.log(), f"{name} refused")
            line = next(ln for ln in served.log().splitlines() if f"refused version {name}" in ln)
            assert reason in line and line.endswith(f"still serving {late.name}"), line
            score(c, late.name, late.name)
            assert c.get("/healthz").json()["version"] == late.name
        good = published.publish(run, published.checkpoint_export(run, str(early), eval_rows=256))
        _wait_until(lambda: c.get("/healthz").json()["version"] == good, f"{good} served")
        score(c, good, early.name)
        metrics = c.get("/metrics").text
    assert _metric(metrics, "hybridrec_serve_refused_versions_total") == 2
    assert _metric(metrics, "hybridrec_serve_swaps_total") == 1
    # Stopped by SIGTERM: uvicorn finishes its requests, then ends by that signal; nothing else logged.
    assert served.proc.returncode in (0, -signal.SIGTERM), served.log()[-2000:]
    assert all(line.startswith("hybridrec serve: ") for line in served.log().splitlines()), served.log()
