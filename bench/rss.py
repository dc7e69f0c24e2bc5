"""Peak resident memory of a process and its children, sampled by a background thread."""

from __future__ import annotations

import threading

import psutil


def tree_rss_bytes(pid: int) -> int:
    """Current RSS of process `pid` plus all its descendants (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class PeakRss:
    """Polls `tree_rss_bytes(pid)` every `interval_s` until stopped; `peak_bytes` is the maximum."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"rss-{pid}", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop polling (after one last sample); returns the peak in bytes."""
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.pid))
        self._stop.set()
        self._thread.join()
        return self.peak_bytes

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20
