"""CommLedger: totals, compression ratios, per-step totals, predicted vs counted, threads."""

import json
import threading

import pytest
import torch

from hybridrec.comm import ByteCount, CommLedger, tensor_nbytes


def test_tensor_nbytes():
    assert tensor_nbytes(torch.zeros(3, 4)) == 48
    assert tensor_nbytes(torch.zeros(5, dtype=torch.float16)) == 10
    assert (
        tensor_nbytes([torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int8)]) == 19
    )


def test_totals_filters_and_ratio():
    led = CommLedger()
    led.record("output_dist", sent=100, received=80, table="t0", original=400)
    led.record("output_dist", sent=100, received=80, table="t1", direction="bwd")
    led.record("dense_allreduce", sent=50, received=50, direction="bwd")
    out = led.totals(category="output_dist")
    assert out == ByteCount(sent=200, received=160, original=500, calls=2)
    assert out.ratio == pytest.approx(2.5)  # (400 + 100) / 200: a measured byte ratio
    assert led.totals(table="t0").ratio == pytest.approx(4.0)
    assert led.totals(direction="bwd") == ByteCount(sent=150, received=130, original=150, calls=2)
    assert led.totals() == ByteCount(sent=250, received=210, original=550, calls=3)
    assert ByteCount().ratio is None


def test_summary_layout_and_per_step_totals():
    led = CommLedger()
    for step in range(3):
        led.record("input_dist", sent=10 * (step + 1), received=10, table="t0")
        led.record("output_dist", sent=64, received=64, table="t0", original=128)
        led.step_end()
    led.record("input_dist", sent=1000, received=0, table="t0")  # open step, half recorded
    s = led.summary()
    json.dumps(s, allow_nan=False)  # JSON-ready
    assert s["steps"] == 3
    assert s["total"]["sent"] == 60 + 3 * 64 + 1000
    assert s["by_category"]["output_dist"]["ratio"] == pytest.approx(2.0)
    assert s["by_table"]["t0"]["calls"] == 7
    assert s["by_direction"]["fwd"]["received"] == 30 + 3 * 64
    assert s["per_step"]["last"]["sent"] == 30 + 64
    assert s["per_step"]["last_by_category"]["input_dist"]["sent"] == 30
    # Means are over closed steps only: the open step's 1000 bytes are left out.
    assert s["per_step"]["mean"]["sent"] == pytest.approx((60 + 3 * 64) / 3)
    assert s["per_step"]["mean_by_category"]["input_dist"]["sent"] == pytest.approx(20)
    assert {e["category"] for e in s["entries"]} == {"input_dist", "output_dist"}
    assert led.totals(scope="step").sent == 1000


def test_predicted_equals_counted():
    led = CommLedger()
    led.predict("input_dist", sent=8, received=8, table="t0")  # lengths
    led.predict("input_dist", sent=32, received=24, table="t0")  # ids
    led.predict("output_dist", sent=256, received=256, table="t0")
    for _ in range(2):
        led.record("input_dist", sent=8, received=8, table="t0")
        led.record("input_dist", sent=32, received=24, table="t0")
        led.record("output_dist", sent=256, received=256, table="t0", original=512)
        led.step_end()
    for cat in ("input_dist", "output_dist"):
        pred = led.totals(scope="predicted", category=cat)
        last = led.totals(scope="last_step", category=cat)
        assert (pred.sent, pred.received) == (last.sent, last.received)
    cmp = led.summary()["predicted_vs_counted"]
    assert cmp["input_dist"]["predicted"] == {"sent": 40, "received": 32}
    assert all(c["match_last_step"] for c in cmp.values())
    assert cmp["output_dist"]["mean_per_step"]["sent"] == pytest.approx(256)
    led.reset(counted_only=True)
    assert led.steps == 0 and led.totals() == ByteCount()
    assert led.totals(scope="predicted").sent == 296
    led.reset()
    assert led.totals(scope="predicted") == ByteCount()


def test_record_validates():
    led = CommLedger()
    with pytest.raises(ValueError, match="sent"):
        led.record("x", sent=-1, received=0)
    with pytest.raises(ValueError, match="category"):
        led.record("", sent=1, received=0)
    with pytest.raises(TypeError):
        led.record("x", sent=1.5, received=0)
    with pytest.raises(ValueError, match="scope"):
        led.totals(scope="nope")


def test_thread_safe_counts():
    led = CommLedger()
    n_threads, n_calls = 4, 2000

    def worker(i: int) -> None:
        for _ in range(n_calls):
            led.record("sync", sent=3, received=2, table=f"t{i % 2}", direction="sync")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    total = led.totals(category="sync")
    assert total.calls == n_threads * n_calls
    assert total.sent == 3 * n_threads * n_calls and total.received == 2 * n_threads * n_calls
    assert led.totals(table="t0").calls == 2 * n_calls
