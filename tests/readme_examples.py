"""The examples of the user manual (README.md and docs/api.md, `MANUAL`) as data, and the rule
that compares what they print with what the manual says they print.

An example is a fenced `bash` block whose command is `curl`, or a fenced `python` block,
immediately followed by a fenced `json` or `text` block: the documented output. Rules:

- json: the output parses as JSON and matches the documented value: equal scalars, lists of
  the same length, dicts with the same keys. The string `"..."` matches any value, and a
  dict entry `"...": "..."` allows keys the page does not list.
- text: line by line, blank lines ignored; `...` inside a line matches any characters, and a
  line that is only `...` matches any number of lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANUAL = ("README.md", "docs/api.md")  # the pages whose examples CI runs, relative to a checkout
DOCUMENTED_ADDRESS = "localhost:8000"
ANY = "..."

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    """A runnable block of a manual page and the output documented after it."""

    language: str  # "bash" or "python"
    code: str
    output_language: str  # "json" or "text"
    output: str
    line: int  # line of the page where the block starts

    def run(self, address: str, python: str = sys.executable, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run the block against a server at `address` (host:port); curl fails on an HTTP error."""
        code = self.code.replace(DOCUMENTED_ADDRESS, address)
        if self.language == "bash":
            argv = ["bash", "-c", 'curl() { command curl --fail-with-body "$@"; }\nset -e\n' + code]
        else:
            argv = [python, "-c", code]
        env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)


def examples(markdown: str) -> list[Example]:
    """Every runnable block with its documented output, in order. A `curl` block without a
    documented output is an error: each one must say what it prints."""
    blocks = [(m.group(1), m.group(2), markdown.count("\n", 0, m.start()) + 1, m.start(), m.end())
              for m in _FENCE.finditer(markdown)]
    found = []
    for (language, code, line, _, end), following in zip(blocks, blocks[1:] + [None]):
        is_curl = language == "bash" and code.lstrip().startswith("curl ")
        if not (is_curl or language == "python"):
            continue
        documented = following is not None and following[3] == end and following[0] in ("json", "text")
        if not documented:
            if is_curl:
                raise ValueError(f"line {line}: a curl example without its output after it")
            continue
        found.append(Example(language, code, following[0], following[1], line))
    return found


def mismatch(example: Example, printed: str) -> str | None:
    """None when `printed` matches the documented output, else where it differs."""
    if example.output_language == "json":
        try:
            actual = json.loads(printed)
        except json.JSONDecodeError as error:
            return f"not JSON ({error}): {printed[:200]!r}"
        return json_mismatch(json.loads(example.output), actual)
    return text_mismatch(example.output, printed)


def json_mismatch(expected: Any, actual: Any, path: str = "$") -> str | None:
    """None when `actual` matches the documented `expected` (rules in the module docstring)."""
    if expected == ANY:
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected an object, got {actual!r:.80}"
        open_ended = expected.get(ANY) == ANY
        keys = [k for k in expected if not (open_ended and k == ANY)]
        missing = [k for k in keys if k not in actual]
        extra = [k for k in actual if k not in expected] if not open_ended else []
        if missing or extra:
            return f"{path}: missing keys {missing}, undocumented keys {extra}"
        for key in keys:
            if (found := json_mismatch(expected[key], actual[key], f"{path}.{key}")) is not None:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{path}: expected a list of {len(expected)}, got {actual!r:.80}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            if (found := json_mismatch(e, a, f"{path}[{i}]")) is not None:
                return found
        return None
    if type(expected) is not type(actual) or expected != actual:
        return f"{path}: expected {expected!r}, got {actual!r:.80}"
    return None


def text_mismatch(expected: str, actual: str) -> str | None:
    """None when the lines of `actual` match the documented lines (rules in the module docstring)."""
    want = [line for line in expected.splitlines() if line.strip()]
    got = [line for line in actual.splitlines() if line.strip()]
    patterns = [None if line.strip() == ANY else
                re.compile(".*".join(re.escape(part) for part in line.split(ANY)) + r"\Z") for line in want]

    def match(i: int, j: int) -> bool:
        if i == len(patterns):
            return j == len(got)
        if patterns[i] is None:
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and patterns[i].match(got[j]) is not None and match(i + 1, j + 1)

    if match(0, 0):
        return None
    return f"the output does not match the documented lines; got {len(got)} lines, first: {got[:3]!r}"
