"""Hogwild training threads (train.workers): every batch trained once, coherent steps,
logs and checkpoints, learning; serialized threads equal one thread; refusals."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter

import pytest
import torch

from hybridrec.cli.main import main
from hybridrec.errors import ConfigError
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.sparse.keyed_jagged import KeyedJagged
from hybridrec.train.build import build_loaders, build_trainer
from hybridrec.train.loop import hogwild
from hybridrec.train.setup.configure import build_config
from hybridrec.train.setup.recipes import recipe
from hybridrec.train.setup.rules import workers_problem
from hybridrec.train.setup.tables import load_dataset

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=128",
         "data.eval_batch_size=4000", "train.progress=false", "train.threads=1"]


@pytest.fixture(scope="module")
def data(shared_dataset):
    return shared_dataset(days=2, rows=4000)  # 31 batches of 128


def _config(data, run_dir, *extra):
    return build_config(recipe("demo"), overrides=[f"data.path={data}", f"train.run_dir={run_dir}", *SMALL, *extra])


def _fingerprint(batch) -> str:
    h = hashlib.sha1()
    for t in (batch.dense, batch.labels, batch.sparse.values, batch.sparse.lengths):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_two_workers_train_every_batch_once_with_coherent_logs_and_checkpoints(data, tmp_path, monkeypatch):
    trained, threads = [], set()
    real_step = hogwild.training_step

    def spy(model, batch, **kw):  # the threads' step, recording what it trains
        trained.append(_fingerprint(batch))
        threads.add(threading.get_ident())
        return real_step(model, batch, **kw)

    monkeypatch.setattr(hogwild, "training_step", spy)
    run = tmp_path / "run"
    cfg = _config(data, run, "train.workers=2", "train.epochs=2", "train.eval_every=10",
                  "train.checkpoint_every=9", "train.keep_checkpoints=10", "train.log_every=5")
    result = build_trainer(cfg).fit()

    train_loader, _ = build_loaders(cfg, load_dataset(cfg))
    per_epoch = len(train_loader)
    expected = [_fingerprint(train_loader.batch(train_loader.rows(s, epoch=e)))
                for e in range(2) for s in range(per_epoch)]
    assert result.step == 2 * per_epoch == len(trained)
    assert Counter(trained) == Counter(expected)  # every batch of both epochs, each once
    assert threading.get_ident() not in threads and len(threads) >= 2

    for k in (9, 18, 27, 36, 45, 54):  # each saved while every thread was paused after step k
        m = json.loads((run / "checkpoints" / f"step-{k:08d}" / "manifest.json").read_text())
        assert m["step"] == k and m["sparse_opt"]["step"] == k
        assert (m["extra"]["loader"]["epoch"], m["extra"]["loader"]["step"]) == divmod(k, per_epoch)
        assert m["extra"]["run_totals"]["samples"] == k * 128
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20, 30, 40, 50, 60, 62]
    losses = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
    assert [s for s, _ in losses] == [*range(5, 61, 5), 62]
    assert losses[-1][1] < losses[0][1]  # it learns
    assert result.eval_metrics["auc"] > 0.6  # above chance (the teacher's ceiling is ~0.84)


def test_serialized_workers_equal_one_thread(data, tmp_path, monkeypatch):
    """Threads made to take turns (claim, then train, under one lock) must train exactly
    what one thread trains: aliased weights, shared optimizer state, per-thread lookups
    and the schedule all plumbed right (stateful optimizers, pauses for evaluation)."""
    common = ["train.max_steps=20", "train.eval_every=7", "optim.dense=adam", "optim.sparse=lazy_adam",
              "optim.warmup_steps=5", "train.save_checkpoints=false"]
    one = build_trainer(_config(data, tmp_path / "one", *common))
    one.fit()

    turn = threading.Lock()
    real_claim, real_step = hogwild.HogwildSteps._claim, hogwild.training_step

    def claim(self):
        turn.acquire()
        got = real_claim(self)
        if got is None:
            turn.release()
        return got

    def step(*args, **kw):
        try:
            return real_step(*args, **kw)
        finally:
            turn.release()

    monkeypatch.setattr(hogwild.HogwildSteps, "_claim", claim)
    monkeypatch.setattr(hogwild, "training_step", step)
    three = build_trainer(_config(data, tmp_path / "three", *common, "train.workers=3"))
    three.fit()
    a, b = one.model.state_dict(), three.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = one.optim.dense.state_dict()["state"], three.optim.dense.state_dict()["state"]
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]), (i, k)


def test_lookups_are_per_thread():
    """Two threads' forwards on one collection: each pops its own lookups' gradients."""
    ebc = EmbeddingBagCollection([TableConfig(name="t", num_embeddings=10, embedding_dim=4)])
    kjts = [KeyedJagged(["t"], torch.tensor([1, 2, 2]), torch.tensor([2, 1])),
            KeyedJagged(["t"], torch.tensor([7]), torch.tensor([1]))]
    inside, got = threading.Barrier(2), {}

    def work(i):
        out = ebc(kjts[i])
        inside.wait()  # both forwards parked before either pops
        out.values.sum().mul(i + 1).backward()
        got[i] = ebc.pop_sparse_grads()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    (_, ids0, rows0, _), = got[0]
    (_, ids1, rows1, _), = got[1]
    assert ids0.tolist() == [1, 2] and torch.equal(rows0, torch.tensor([[1.0] * 4, [2.0] * 4]))
    assert ids1.tolist() == [7] and torch.equal(rows1, torch.full((1, 4), 2.0))
    assert ebc.pop_sparse_grads() == []


@pytest.mark.parametrize("extra, words", [
    (["dist.nproc=2"], "DES"),
    (["dist.nproc=2", "dist.num_ps=1"], "DDP does not support concurrent backward"),
    (["dist.nproc=2", "dist.num_ps=1", "dist.dense_sync=allreduce"], "one collective per step"),
])
def test_refused_combinations_are_one_line(data, tmp_path, capsys, extra, words):
    code = main(["train", f"data.path={data}", f"train.run_dir={tmp_path / 'r'}", "train.workers=2", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.workers=2" in err[0] and words in err[0]
    assert not (tmp_path / "r").exists()


def test_workers_checks():
    cfg = build_config(overrides=["train.workers=2", "dist.num_ps=1", "dist.dense_sync=none"])
    assert workers_problem(cfg, 2) is None  # parameter-server trainers with their own replicas
    cfg = build_config(overrides=["train.workers=2", "dist.num_ps=1", "sync.algorithm=ma"])
    assert workers_problem(cfg, 2) is None  # a synchronizer: no per-step all-reduce
    cfg = build_config(overrides=["train.workers=2"])
    assert workers_problem(cfg, 1) is None and "DES" in workers_problem(cfg, 2)  # e.g. torchrun's ranks
    with pytest.raises(ConfigError, match="train.workers must be >= 1"):
        build_config(overrides=["train.workers=0"])


@pytest.mark.slow  # a trainer and a server process through the launcher: 8-20 s, mostly start-up
def test_parameter_server_trainer_with_two_workers(data, tmp_path):
    """Threads pull and push on their own; the trainer's checkpoints wait for every
    thread's push, and the servers count every step once."""
    run = tmp_path / "ps"
    assert main(["train", "--recipe", "demo", f"data.path={data}", f"train.run_dir={run}", *SMALL,
                 "data.prefetch=0", "dist.num_ps=1", "train.workers=2", "train.max_steps=12",
                 "train.checkpoint_every=5", "train.keep_checkpoints=5"]) == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["step"] == 12 and s["ps"]["steps_pushed"] == 12 and s["ps"]["staleness_max"] >= 0
    assert s["comm"]["by_category"]["ps_push"]["calls"] == 12  # one push per step (one server)
    for k in (5, 10, 12):
        m = json.loads((run / "checkpoints" / f"step-{k:08d}" / "manifest.json").read_text())
        assert m["step"] == k and m["sparse_opt"]["step"] == k
        assert (run / "checkpoints" / f"step-{k:08d}" / "ps" / "manifest.json").is_file()
    assert 0.0 < s["eval"]["auc"] < 1.0
