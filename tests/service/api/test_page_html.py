"""The web page is one self-contained file: it loads nothing from another origin (no CDN), so
that it works offline and its Content-Security-Policy can stay strict."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "service" / "api" / "static" / "index.html"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # names the inline SVG elements; never fetched


def test_the_page_loads_nothing_from_elsewhere() -> None:
    html = PAGE.read_text(encoding="utf-8")
    assert set(re.findall(r"https?://[^\s\"'<>)`]*", html)) <= {SVG_NAMESPACE}
    sources = re.findall(r"\b(?:src|href|action|srcset|poster|data)\s*=\s*[\"']([^\"']*)", html)
    assert all(s.startswith(("#", "data:")) for s in sources), sources
    assert all(u.strip("'\" ").startswith("data:") for u in re.findall(r"url\(([^)]*)\)", html))
    assert "@import" not in html and "<iframe" not in html
    assert not re.search(r"<script[^>]*\bsrc\s*=", html)
    assert not re.search(r"<link[^>]*rel=[\"']?stylesheet", html)
    # what the script fetches: this origin's API, by path
    assert set(re.findall(r"\b(?:fetch|api|streamApi|send)\(\s*[`\"']([^`\"']*)", html)) <= {
        "/v1/models", "/v1/attention", "/v1/${task}"}
