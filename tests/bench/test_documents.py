"""bench.documents: request bodies of consecutive sentences, and the report of the turns."""

from __future__ import annotations

from bench.documents import BASELINE, THIS, markdown, request_bodies


def test_request_bodies_take_consecutive_sentences_and_cycle() -> None:
    sentences = [f"s{i}." for i in range(5)]
    bodies = request_bodies(sentences, texts=2, per_text=2, count=2)
    assert bodies == [{"texts": ["s0. s1.", "s2. s3."]}, {"texts": ["s4. s0.", "s1. s2."]}]


def test_the_report_gives_each_servers_turns_and_rate() -> None:
    result = {"command": "python -m bench.documents", "requests": 2, "warmup": 1, "texts": 2, "sentences_per_text": 3,
              "turns": 2, "median_s": {THIS: [0.2, 0.3], BASELINE: [0.4, 0.5]},
              "sentences_per_s": {THIS: 24.0, BASELINE: 13.3}}
    text = markdown(result)
    assert f"| {THIS} | 0.200, 0.300 | 0.250 | 24.0 |" in text
    assert f"| {BASELINE} | 0.400, 0.500 | 0.450 | 13.3 |" in text


def test_the_report_gives_the_singles_beside_the_large_requests() -> None:
    turn = {"singles_p50_s": 0.02, "singles_p95_s": 0.07, "large_median_s": 0.3, "singles_errors": 0, "large_requests": 4}
    result = {"command": "python -m bench.documents", "requests": 2, "warmup": 1, "texts": 2, "sentences_per_text": 3,
              "turns": 1, "median_s": {THIS: [0.2]}, "sentences_per_s": {THIS: 24.0},
              "singles_concurrency": 8, "singles": 100, "beside_singles": {THIS: [turn]}}
    text = markdown(result)
    assert "Beside 8 clients sending 100 test sentences one per request, per turn" in text
    assert f"| {THIS} | 0.020 | 0.070 | 0.300 |" in text
