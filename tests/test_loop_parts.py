"""The training loop over parts (hybridrec.train.loop.parts): a part added to a trainer sees
every hook in order, a part's pause is where Hogwild's threads stop, and every kind of
embedding collection answers the one interface the step and the checkpointer call."""

from __future__ import annotations

import pytest

from hybridrec.train.build import build_trainer
from hybridrec.train.loop import hogwild
from hybridrec.train.loop.parts import Part
from hybridrec.train.setup.configure import build_config
from hybridrec.train.setup.recipes import recipe

SMALL = ["model.embedding_dim=8", "model.bottom_mlp=16,8", "model.top_mlp=16,1", "data.batch_size=128",
         "data.eval_batch_size=4000", "train.progress=false", "train.threads=1", "train.eval_every=0"]


@pytest.fixture(scope="module")
def data(shared_dataset):
    return shared_dataset(days=2, rows=2000)  # 15 batches of 128


def _trainer(data, run_dir, *extra):
    return build_trainer(build_config(recipe("demo"), overrides=[f"data.path={data}", f"train.run_dir={run_dir}",
                                                                 *SMALL, *extra]))


class Recorder(Part):
    """Writes down every hook it sees; with ``every``, asks for a pause there."""

    def __init__(self, every: int = 0, claimed=None) -> None:
        self.every, self.claimed, self.seen = every, claimed, []

    def start(self, loop):
        self.seen.append(("start", loop.step))

    def end_step(self, loop, step):
        self.seen.append(("end_step", step))

    def after_step(self, loop, done):
        self.seen.append(("after_step", done.step))
        if self.claimed is not None and self.every and done.step % self.every == 0:
            self.seen.append(("claimed", self.claimed(loop)))

    def pause_at(self, step):
        return (step // self.every + 1) * self.every if self.every else None

    def after_save(self, loop, step, seconds):
        self.seen.append(("after_save", step))

    def finish(self, loop, end):
        self.seen.append(("finish", end.stopped_early, end.trained))

    def close(self, loop):
        self.seen.append(("close", loop.step))

    def summary(self):
        return {"recorder": len(self.seen)}


def test_a_part_sees_every_hook_in_order(data, tmp_path):
    trainer = _trainer(data, tmp_path / "run", "train.max_steps=7", "train.checkpoint_every=3")
    rec = Recorder()
    trainer.parts.append(rec)
    result = trainer.fit()
    assert result.step == 7
    steps = [("end_step", s) for s in range(1, 8)]
    assert [x for x in rec.seen if x[0] == "end_step"] == steps
    assert [x for x in rec.seen if x[0] == "after_step"] == [("after_step", s) for s in range(1, 8)]
    # every step is closed before the loop's work after it; saves after steps 3, 6 and the end
    for s in range(1, 8):
        assert rec.seen.index(("end_step", s)) < rec.seen.index(("after_step", s))
    assert [x[1] for x in rec.seen if x[0] == "after_save"] == [3, 6, 7]
    assert rec.seen[0] == ("start", 0)
    assert rec.seen[-3:] == [("after_save", 7), ("finish", False, True), ("close", 7)]  # (its finish follows the save's)
    assert result.parts["recorder"] == len(rec.seen)


def test_a_resumed_finished_run_closes_without_steps(data, tmp_path):
    _trainer(data, tmp_path / "run", "train.max_steps=4").fit()
    again = _trainer(data, tmp_path / "run", "train.max_steps=4")
    rec = Recorder()
    again.parts.append(rec)
    result = again.fit()
    assert result.step == 4
    assert rec.seen == [("start", 4), ("finish", False, False), ("close", 4)]  # nothing trained, nothing saved


def test_hogwild_threads_stop_at_a_parts_pause(data, tmp_path):
    """Hogwild has no schedule of its own: a part asking for a pause every 4 steps finds,
    at each of them, that no thread has claimed a step past it."""
    trainer = _trainer(data, tmp_path / "run", "train.max_steps=14", "train.workers=2",
                       "train.save_checkpoints=false")
    assert isinstance(trainer.source, hogwild.HogwildSteps)
    rec = Recorder(every=4, claimed=lambda loop: loop.source._claimed)
    trainer.parts.append(rec)
    assert trainer.fit().step == 14
    claimed = [(rec.seen[i - 1][1], x[1]) for i, x in enumerate(rec.seen) if x[0] == "claimed"]
    assert claimed == [(4, 4), (8, 8), (12, 12)]


def test_every_collection_answers_the_interface(data, tmp_path):
    """The single-device collection and a parameter server's client: the same methods."""
    from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
    from hybridrec.parallel.plan import Shard, ShardingPlan, TablePlan
    from hybridrec.ps.client import RemoteEmbeddingCollection

    tables = [TableConfig(name="t", num_embeddings=10, embedding_dim=4)]
    local = EmbeddingBagCollection(tables)
    assert (local.spans_ranks, local.holds_tables, local.plan_dict(), local.shard_of("t")) == (False, True, None, None)
    assert list(local.local_weights()) == ["t"] and local.updated_collections() == {"tables": local}
    assert local.step_grads() == {"tables": []}
    plan = ShardingPlan(world_size=1, local_world_size=1, tables={
        "t": TablePlan(table="t", sharding_type="table_wise", num_embeddings=10, embedding_dim=4,
                       shards=[Shard(rank=0, rows=(0, 10), cols=(0, 4))])})
    remote = RemoteEmbeddingCollection(tables, plan, trainer=0)
    assert (remote.spans_ranks, remote.holds_tables, remote.plan_dict()) == (True, False, None)
    assert remote.local_weights() == {} and remote.updated_collections() == {}
    assert remote.step_grads() == {"ps": []}


class StepCounter(Part):
    """A part that reports a number: the steps it saw, in summary.json as ``counted_steps``."""

    def __init__(self) -> None:
        self.steps = 0

    def after_step(self, loop, done):
        self.steps += 1

    def summary(self):
        return {"counted_steps": self.steps}


def test_a_new_part_reports_in_summary_json(data, tmp_path):
    """A part defined here, added through the Python entry point, is built into the real
    trainer and its number lands in summary.json beside every built-in part's entries."""
    import json

    from hybridrec.train.run import train

    cfg = build_config(recipe("demo"), overrides=[f"data.path={data}", f"train.run_dir={tmp_path / 'run'}",
                                                  *SMALL, "train.max_steps=5"])
    counter = StepCounter()
    returned = train(cfg, extra_parts=[counter])
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["counted_steps"] == returned["counted_steps"] == 5
    assert written["step"] == 5
    # the built-in parts' entries, and the absent parts' keys (no synchronizer, no early stop)
    assert written["sync"] is None and written["stop_reason"] == "planned_steps" and written["early_stop"] is None
    assert written["recovery"] is None and written["ps"] is None
    assert written["eval"]["auc"] is not None and written["eval_history"] == []
    assert written["run"] is not None and written["checkpoint_interval"] is not None
