"""`bench.model_reload`'s windows: the requests sent while a reload ran against those sent
outside, the settling seconds after each reload in neither."""

from __future__ import annotations

from bench import load
from bench.model_reload import SETTLE_S, markdown, windows


def test_requests_are_counted_in_their_window() -> None:
    samples = [load.Sample(sent_s=t, status=200, latency_s=latency) for t, latency in
               [(1.0, 0.01), (2.0, 0.02), (10.5, 0.5), (11.0, 0.3), (12.0 + SETTLE_S / 2, 0.2), (20.0, 0.03)]]
    samples.append(load.Sample(sent_s=10.2, status=0, latency_s=0.0, error="ClientOSError"))
    result = load.LoadResult(duration_s=30.0, samples=samples)
    found = windows(result, [(10.0, 12.0, 200)])
    assert found["during reloads"] == {"requests": 3, "seconds": 2.0, "sentences_per_s": 1.0,
                                       "p50_ms": 300.0, "p99_ms": 500.0}
    assert found["outside"] == {"requests": 3, "seconds": 30.0 - 2.0 - SETTLE_S, "sentences_per_s":
                                round(3 / (28.0 - SETTLE_S), 1), "p50_ms": 20.0, "p99_ms": 30.0}
    report = {"command": "c", "runs": {"16": {"requests": 7, "failed": 1, "reloads": [{"seconds": 2.0}],
                                              **found}}}
    assert "| 16 | 7 | 1 | 2.0 | 1.0, 300.0, 500.0 |" in markdown(report)
