"""The issue's targets: each one's ratio from a results dict, and whether it is met."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """One target: `ratio` compared with `bound` (`at_least` or at most); None = not measured."""

    name: str
    description: str
    ratio: float | None
    bound: float
    at_least: bool
    note: str = ""

    @property
    def status(self) -> str:
        if self.ratio is None:
            return "not measured"
        met = self.ratio >= self.bound if self.at_least else self.ratio <= self.bound
        return "met" if met else "missed"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def best_service(results: dict[str, Any], level: str) -> dict[str, Any] | None:
    """The fastest closed-loop run at `level` (e.g. "c64") of continuous batching, over the
    server's default and each batch-worker setting tried (`continuous_w<N>`)."""
    runs = [run for name, node in (_get(results, "service") or {}).items()
            if name == "continuous" or name.startswith(("continuous_w", "continuous_p"))
            if (run := _get(node, "closed", level)) is not None and run.get("sentences_per_s") is not None]
    return max(runs, key=lambda run: run["sentences_per_s"], default=None)


def evaluate(results: dict[str, Any], top_concurrency: int, rss_limit_mb: float = 600.0) -> list[Target]:
    """The targets of the issues, computed from the harness's results (translation task).

    Paths read: service/continuous, service/continuous_w<workers> and service/continuous_p<processes>
    closed/c<N> (the best of them),
    in_process/best (its grid's best point), naive/closed/c1,
    ctranslate2/int8_greedy_batch and int8_greedy_single, service/continuous/peak_rss_mb, and the
    open loops of service/continuous and service/dynamic.
    """
    best = best_service(results, f"c{top_concurrency}")
    service_top = best["sentences_per_s"] if best else None
    roofline = _get(results, "roofline", "service_fraction_int8")
    service_c1_p50 = _get(results, "service", "continuous", "closed", "c1", "latency_p50_s")
    ct2_batch = _get(results, "ctranslate2", "int8_greedy_batch", "sentences_per_s")
    in_process = _get(results, "in_process", "best", "sentences_per_s")
    ct2_single_p50 = _get(results, "ctranslate2", "int8_greedy_single", "latency_p50_s")
    naive = _get(results, "naive", "closed", "c1", "sentences_per_s")
    naive_top = _get(results, "naive", "closed", f"c{top_concurrency}", "sentences_per_s")
    naive_best = max((v for v in (naive, naive_top) if v is not None), default=None)
    rss = _get(results, "service", "continuous", "peak_rss_mb")
    dynamic_p95 = _get(results, "service", "dynamic", "open", "latency_p95_s")
    continuous_p95 = _get(results, "service", "continuous", "open", "latency_p95_s")
    continuous = ratio(continuous_p95, dynamic_p95)
    return [
        Target("vs_ctranslate2_int8", f"service at concurrency {top_concurrency} (best batch-worker or process setting) / "
               "CTranslate2 int8 translate_batch (best point of its grid), sentences/s",
               ratio(service_top, ct2_batch), 1.0, True),
        Target("in_process_vs_ctranslate2_int8", "ONNX in-process (best point of its grid) / CTranslate2 int8 "
               "translate_batch (best point of its grid), sentences/s", ratio(in_process, ct2_batch), 1.3, True,
               "" if in_process is not None else "in-process grid not measured"),
        Target("vs_naive_pytorch", f"service at concurrency {top_concurrency} / naive PyTorch server "
               "(best of its runs), sentences/s", ratio(service_top, naive_best), 5.0, True),
        Target("latency_c1_vs_ctranslate2", "service p50 at concurrency 1 / CTranslate2 int8 single-sentence "
               "p50", ratio(service_c1_p50, ct2_single_p50), 0.5, False),
        Target("continuous_p95", "p95 at 70% offered load, continuous / dynamic batching", continuous, 0.7,
               False, "" if continuous is not None else "continuous or dynamic open loop not measured"),
        Target("roofline_int8", f"service at concurrency {top_concurrency}: FLOPs/s / the machine's int8 "
               "matrix-multiply peak", roofline, 0.2, True, "" if roofline is not None else "roofline not measured"),
        Target("server_rss", f"server peak RSS with both models / {rss_limit_mb:.0f} MB",
               ratio(rss, rss_limit_mb), 1.0, False),
    ]
