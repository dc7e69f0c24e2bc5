"""Stand-ins for the onnxruntime runtime and generation: a character tokenizer, a model that
reverses its input, and knobs to make it slow, failing or blocking."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
FAIL_CHAR = "#"  # a text with this character makes its whole batch raise
PAD, UNK, BOS, EOS = 0, 1, 2, 3


class CharTokenizer:
    """One id per character of `ALPHABET` (offset 4), `#` -> 1; surrounding spaces dropped."""

    pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

    def encode(self, text: str) -> list[int]:
        return [4 + ALPHABET.index(c) if c in ALPHABET else UNK for c in text.strip()]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Target-side texts: the same characters."""
        return self.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(ALPHABET[i - 4] if i >= 4 else "?" for i in ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.decode([i]) for i in ids]


@dataclass(frozen=True)
class Result:
    tokens: list[int]
    finish_reason: str
    score: float = 0.0


@dataclass
class FakeRuntime:
    """What the registry and the routes use of a runtime."""

    name: str
    task: str
    max_source_len: int = 64
    max_target_len: int = 64
    provider: str = "CPUExecutionProvider"
    variant: str = "fp32"
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)

    def warmup(self) -> None:
        pass


@dataclass
class FakeModel:
    """Reverses each source; records every batch; optionally slow (per batch, or per decoder
    step of a streamed batch: one with `hooks`, which it decodes step by step like greedy)."""

    delay_s: float = 0.0
    step_delay_s: float = 0.0
    batches: list[list[int]] = field(default_factory=list)  # source lengths of each batch
    steps: list[int] = field(default_factory=list)  # rows decoding at each step (streamed)
    seen: list[str] = field(default_factory=list)  # every source run, decoded
    threads: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: threading.Event | None = None  # when set: each batch waits for it (at most 30 s)
    returned: int = 0  # batches that returned (or raised)

    def generate(self, sources: list[list[int]], beam_size: int, max_new_tokens: int,
                 hooks: Sequence[Any] | None = None) -> list[Result]:
        try:
            return self._generate(sources, max_new_tokens, hooks)
        finally:
            with self.lock:
                self.returned += 1

    def _generate(self, sources: list[list[int]], max_new_tokens: int,
                  hooks: Sequence[Any] | None) -> list[Result]:
        with self.lock:
            self.batches.append([len(s) for s in sources])
            self.seen.extend(CharTokenizer().decode(s[:-1]) for s in sources)
            self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if self.delay_s:
            time.sleep(self.delay_s)
        if any(UNK in source for source in sources):
            raise RuntimeError("boom: the fake model fails on '#'")
        if hooks is None:
            return [reverse(source, max_new_tokens) for source in sources]
        return self._stepwise(sources, max_new_tokens, hooks)

    def _stepwise(self, sources: list[list[int]], max_new_tokens: int,
                  hooks: Sequence[Any]) -> list[Result]:
        final = [reverse(source, max_new_tokens) for source in sources]
        results: list[Result | None] = [None] * len(sources)
        active = list(range(len(sources)))
        step = 0
        while active:
            self.steps.append(len(active))
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            still = []
            for row in active:
                tokens = final[row].tokens
                if step == len(tokens):
                    results[row] = final[row]
                    continue
                if hooks[row] is not None and hooks[row].on_token is not None:
                    hooks[row].on_token(tokens[step])
                if hooks[row] is not None and hooks[row].cancelled:
                    results[row] = Result(tokens[: step + 1], "cancelled")
                elif step + 1 == len(tokens) and final[row].finish_reason == "length":
                    results[row] = final[row]
                else:
                    still.append(row)
            active, step = still, step + 1
        return [r if r is not None else Result([], "eos") for r in results]


@dataclass(eq=False)
class _Member:
    owner: Any
    final: Result
    hooks: Any
    emitted: int = 0


ROW_CACHE_BYTES = 1000  # what a row of `FakeRunningBatch` holds


@dataclass
class FakeRunningBatch:
    """Continuous batching with the fake model's outputs: one reversed token per `step` (after
    `step_delay_s`), rows leave when done (a join takes `join_delay_s`); records the owners of
    every step. A source holding `UNK` makes the step after it joined raise."""

    step_delay_s: float = 0.0
    join_delay_s: float = 0.0
    steps: list[list[Any]] = field(default_factory=list)  # the owners decoding at each step
    threads: set[str] = field(default_factory=set)
    members: list[_Member] = field(default_factory=list)
    pads_to_oldest: bool = True
    takes_beams: bool = False

    def __len__(self) -> int:
        return len(self.members)

    @property
    def oldest_age(self) -> int:
        return max((m.emitted for m in list(self.members)), default=0)

    @property
    def cache_bytes(self) -> int:
        """`ROW_CACHE_BYTES` per row decoding."""
        return ROW_CACHE_BYTES * len(self.members)

    def concatenate(self, sources: Sequence[list[int]], owners: Sequence[Any], max_new_tokens: Sequence[int],
            hooks: Sequence[Any] | None = None, beam_sizes: Sequence[int] | None = None) -> None:
        assert beam_sizes is None or set(beam_sizes) == {1}, "greedy rows only"
        if self.join_delay_s:
            time.sleep(self.join_delay_s)
        hooks = hooks if hooks is not None else [None] * len(sources)
        self.members += [_Member(owner, reverse(source, limit), hook)
                         for source, owner, limit, hook in zip(sources, owners, max_new_tokens, hooks, strict=True)]

    def generate_token(self) -> list[tuple[Any, Result]]:
        self.threads.add(threading.current_thread().name)
        self.steps.append([m.owner for m in self.members])
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if any(UNK in m.owner.source for m in self.members):
            raise RuntimeError("boom: the fake running batch fails on '#'")
        finished, kept = [], []
        for member in self.members:
            tokens = member.final.tokens
            if member.emitted == len(tokens):  # its EOS step (or nothing to say)
                finished.append((member.owner, member.final))
                continue
            token, member.emitted = tokens[member.emitted], member.emitted + 1
            if member.hooks is not None and member.hooks.on_token is not None:
                member.hooks.on_token(token)
            if member.emitted == len(tokens) and member.final.finish_reason == "length":
                finished.append((member.owner, member.final))
            elif member.hooks is not None and member.hooks.cancelled:
                finished.append((member.owner, Result(tokens[: member.emitted], "cancelled")))
            else:
                kept.append(member)
        self.members = kept
        return finished

    def filter(self, owners: Any) -> list[Any]:
        left = [m.owner for m in self.members if m.owner not in owners]
        self.members = [m for m in self.members if m.owner in owners]
        return left


def reverse(source: list[int], max_new_tokens: int) -> Result:
    """The fake model's output: the source (without EOS) reversed, cut at the token limit."""
    out = source[:-1][::-1]
    if len(out) >= max_new_tokens:
        return Result(out[:max_new_tokens], "length")
    return Result(out, "eos")


def write_models(root: Path, models: dict[str, str]) -> Path:
    """Folders `root/<name>/manifest.json` with the task of each model."""
    for name, task in models.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "manifest.json").write_text(json.dumps({"task": task}))
    return root


class FakeLoader:
    """Loads a FakeRuntime from a folder; can block until released, or fail for some names."""

    def __init__(self, failing: Sequence[str] = (), **runtime_options: object) -> None:
        self.failing = set(failing)
        self.release = threading.Event()
        self.release.set()
        self.runtime_options = runtime_options

    def __call__(self, path: Path) -> FakeRuntime:
        self.release.wait(timeout=30)
        if path.name in self.failing:
            raise ValueError(f"sha256 mismatch for {path.name}/encoder.onnx")
        task = json.loads((path / "manifest.json").read_text())["task"]
        return FakeRuntime(path.name, task, **self.runtime_options)  # type: ignore[arg-type]
