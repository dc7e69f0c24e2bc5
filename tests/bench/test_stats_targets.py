"""Percentiles, throughput and the target ratios."""

from __future__ import annotations

import pytest

from bench.stats import percentiles, summarise, timed_calls
from bench.targets import Target, evaluate, ratio


def test_percentiles_interpolate_linearly() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    p50, p95, p99 = percentiles(values)
    assert p50 == pytest.approx(50.5)
    assert p95 == pytest.approx(95.05)
    assert p99 == pytest.approx(99.01)
    assert percentiles([]) == [None, None, None]


def test_summarise_rates() -> None:
    stats = summarise([0.1, 0.2, 0.3, 0.4], target_tokens=40, elapsed_s=2.0, errors=1)
    assert stats.sentences == 4
    assert stats.sentences_per_s == pytest.approx(2.0)
    assert stats.tokens_per_s == pytest.approx(20.0)
    assert stats.latency_p50_s == pytest.approx(0.25)
    assert stats.errors == 1
    with pytest.raises(ValueError, match="elapsed_s"):
        summarise([0.1], 1, 0.0)


def test_target_status() -> None:
    assert Target("a", "", 1.2, 1.0, True).status == "met"
    assert Target("a", "", 0.8, 1.0, True).status == "missed"
    assert Target("a", "", 1.6, 1.5, False).status == "missed"
    assert Target("a", "", 1.4, 1.5, False).status == "met"
    assert Target("a", "", None, 1.5, False).status == "not measured"
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(3.0, 2.0) == 1.5


def _run(sentences_per_s: float, p50: float = 0.1, p95: float = 0.2) -> dict[str, float]:
    return {"sentences_per_s": sentences_per_s, "latency_p50_s": p50, "latency_p95_s": p95}


def test_evaluate_reads_the_harness_layout() -> None:
    results = {
        "service": {"continuous": {"closed": {"c1": _run(10, p50=0.03), "c64": _run(120)},
                                   "peak_rss_mb": 450.0}},
        "naive": {"closed": {"c1": _run(20)}},
        "ctranslate2": {"int8_greedy_batch": _run(100), "int8_greedy_single": _run(40, p50=0.025)},
    }
    by_name = {t.name: t for t in evaluate(results, top_concurrency=64)}
    assert by_name["vs_ctranslate2_int8"].ratio == pytest.approx(1.2)
    assert by_name["vs_ctranslate2_int8"].status == "met"
    assert by_name["vs_naive_pytorch"].ratio == pytest.approx(6.0)
    assert by_name["latency_c1_vs_ctranslate2"].ratio == pytest.approx(1.2)
    assert by_name["server_rss"].ratio == pytest.approx(0.75)
    assert by_name["continuous_p95"].status == "not measured"
    assert by_name["in_process_vs_ctranslate2_int8"].status == "not measured"
    results["in_process"] = {"b64": _run(500), "best": _run(125)}  # the grid's best counts, not other runs
    in_process = {t.name: t for t in evaluate(results, top_concurrency=64)}["in_process_vs_ctranslate2_int8"]
    assert (in_process.ratio, in_process.status) == (pytest.approx(1.25), "missed")
    results["service"]["continuous"]["closed"]["c64"] = _run(90)
    by_name = {t.name: t for t in evaluate(results, top_concurrency=64)}
    assert by_name["vs_ctranslate2_int8"].status == "missed"
    assert by_name["vs_naive_pytorch"].ratio == pytest.approx(4.5)  # 90 / 20: under 5x
    assert by_name["vs_naive_pytorch"].to_dict()["status"] == "missed"
    results["service"]["continuous_w4"] = {"closed": {"c64": _run(110)}}  # the best batch-worker setting counts
    results["service"]["dynamic"] = {"closed": {"c64": _run(500)}}  # request-level batching does not
    assert {t.name: t for t in evaluate(results, top_concurrency=64)}["vs_ctranslate2_int8"].ratio == pytest.approx(1.1)
    results["service"]["continuous_p2"] = {"closed": {"c64": _run(120)}}  # and the best process setting
    assert {t.name: t for t in evaluate(results, top_concurrency=64)}["vs_ctranslate2_int8"].ratio == pytest.approx(1.2)
    results["service"]["continuous"]["open"] = _run(50, p95=0.3)
    results["service"]["dynamic"] = {"open": _run(50, p95=0.5)}
    by_name = {t.name: t for t in evaluate(results, top_concurrency=64)}
    assert by_name["continuous_p95"].ratio == pytest.approx(0.6)
    assert by_name["continuous_p95"].status == "met"  # 40% lower: at least the 30% asked


def test_timed_calls_sums_the_seconds_and_counts_the_calls_and_gives_the_class_its_method_back() -> None:
    import time

    class Worker:
        def work(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    a, b = Worker(), Worker()
    with timed_calls([a, b], "work") as seconds:
        assert a.work(0.01) == 0.01 and b.work(0.02) == 0.02
    assert 0.03 <= seconds[0] < 1.0 and seconds[1] == 2
    assert "work" not in vars(a) and "work" not in vars(b)  # the class's method again
    counted = seconds[0]
    a.work(0.01)
    assert seconds[0] == counted  # calls after the block are not counted


def test_timed_calls_nest_on_the_same_method() -> None:
    """An inner block counts its own calls, the outer one all of them, and each leaves the
    instance as it found it."""
    class Worker:
        def work(self) -> int:
            return 1

    worker = Worker()
    with timed_calls([worker], "work") as outer:
        worker.work()
        with timed_calls([worker], "work") as inner:
            worker.work()
        worker.work()
    assert (outer[1], inner[1]) == (3, 1) and "work" not in vars(worker)
