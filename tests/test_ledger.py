"""CommLedger: totals, compression ratios, per-step totals, predicted vs counted step by step, threads."""

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


def test_predictions_accumulate_per_step_like_the_counts():
    led = CommLedger()
    for step in range(3):
        n = 8 * (step + 1)  # data-dependent bytes: a different prediction every step
        led.predict("input_dist", sent=n, received=2 * n, table="t0")
        led.record("input_dist", sent=n, received=2 * n, table="t0")
        led.predict("output_dist", sent=256, received=128, table="t0")
        led.predict("output_dist", sent=64, received=64, table="t0", direction="bwd")
        led.record("output_dist", sent=256, received=128, table="t0", original=512)
        led.record("output_dist", sent=64, received=64, table="t0", direction="bwd")
        led.record("dense_allreduce", sent=40, received=40, direction="bwd")  # nobody predicts it
        led.step_end()
    led.predict("input_dist", sent=1000, received=0, table="t0")  # open step: not compared yet
    cmp = led.summary()["predicted_vs_counted"]
    assert set(cmp) == {"input_dist", "output_dist"}
    entry = cmp["input_dist"]
    assert entry["predicted"] == entry["counted"] == {"sent": 48, "received": 96}
    assert entry["predicted_per_step"] == entry["counted_per_step"] == {"sent": 16, "received": 32}
    assert entry["match"] and entry["mismatched_steps"] == 0 and entry["first_mismatched_step"] is None
    assert set(cmp["output_dist"]["by_direction"]) == {"fwd", "bwd"}
    assert cmp["output_dist"]["by_direction"]["bwd"]["counted"] == {"sent": 192, "received": 192}
    assert all(c["match"] for c in cmp.values())
    assert led.totals(scope="predicted_last_step", category="input_dist").sent == 24
    assert led.totals(scope="predicted_step").sent == 1000
    assert led.totals(scope="predicted", category="input_dist").sent == 1048  # the open step too
    led.reset()
    assert led.steps == 0 and led.totals(scope="predicted") == ByteCount()
    assert led.summary()["predicted_vs_counted"] == {}


def test_a_step_that_differs_is_flagged_even_when_the_totals_agree():
    led = CommLedger()
    for predicted, counted in ((10, 12), (12, 10), (5, 5)):
        led.predict("input_dist", sent=predicted, received=0, table="t0")
        led.record("input_dist", sent=counted, received=0, table="t0")
        led.step_end()
    led.predict("output_dist", sent=8, received=0)  # predicted forward, counted backward
    led.record("output_dist", sent=8, received=0, direction="bwd")
    led.step_end()
    cmp = led.summary()["predicted_vs_counted"]
    entry = cmp["input_dist"]
    assert entry["predicted"] == entry["counted"] == {"sent": 27, "received": 0}
    assert not entry["match"]
    assert (entry["mismatched_steps"], entry["first_mismatched_step"]) == (2, 0)
    out = cmp["output_dist"]  # compared per predicted direction: bwd is nobody's prediction
    assert set(out["by_direction"]) == {"fwd"} and not out["match"]
    assert (out["predicted"], out["counted"]) == ({"sent": 8, "received": 0}, {"sent": 0, "received": 0})


def test_suspended_drops_records_and_predictions():
    led = CommLedger()
    with led.suspended():
        led.predict("output_dist", sent=8, received=8)
        led.record("output_dist", sent=8, received=8)
    led.step_end()
    assert led.totals() == ByteCount() and led.totals(scope="predicted") == ByteCount()
    assert led.summary()["predicted_vs_counted"] == {}


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
