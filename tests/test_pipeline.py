"""TrainPipeline: one batch ahead, prefetch before the current batch trains, exact loader state."""

import pytest

from hybridrec.train.loop.pipeline import TrainPipeline


class Loader:
    """A loader of integers with the position semantics of ShardedLoader."""

    def __init__(self, n):
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield Item(self.pos - 1)

    def state_dict(self):
        return {"step": self.pos}


class Item:
    def __init__(self, i):
        self.sparse = i


class Recorder:
    def __init__(self):
        self.calls = []

    def start_input_dist(self, kjt):
        self.calls.append(kjt)
        return ("pending", kjt)


@pytest.mark.parametrize("enabled", [True, False])
def test_next_batch_is_prefetched_before_the_current_one_is_yielded(enabled):
    sparse = Recorder()
    pipe = TrainPipeline(Loader(5), sparse, enabled=enabled)
    seen = []
    for item, pending in pipe.batches(10):
        seen.append(item.sparse)
        assert pending == (("pending", item.sparse) if enabled else None)  # its own handle
        # While batch i trains, batch i+1 is already on its way (when there is one).
        expect = list(range(min(item.sparse + 2, 5))) if enabled else []
        assert sparse.calls == expect
        assert pipe.state_dict() == {"step": item.sparse + 1}  # not the batch taken ahead
    assert seen == [0, 1, 2, 3, 4]


def test_limit_reads_no_batch_past_the_last_trained_one():
    loader, sparse = Loader(10), Recorder()
    pipe = TrainPipeline(loader, sparse, enabled=True)
    assert [b.sparse for b, _ in pipe.batches(3)] == [0, 1, 2]
    assert sparse.calls == [0, 1, 2] and loader.pos == 3
    assert list(pipe.batches(0)) == []


def test_without_a_sharded_collection_it_is_a_plain_loop():
    pipe = TrainPipeline(Loader(3), object(), enabled=True)
    assert not pipe.enabled
    assert [b.sparse for b, _ in pipe.batches(5)] == [0, 1, 2]
