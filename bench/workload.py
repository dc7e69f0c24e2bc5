"""The fixed workload: the first N lines of a model's test split (or of its `other` sentences,
the translation model's second set: `model.data.other_sentences`), cut to the model's source limit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.tokenizer import Tokenizer

SPLITS = ("test", "other")  # what a workload reads: <data-dir>/<model>/<split>.src
SOURCE_MARGIN = 16  # tokens kept free under max_source_len (at most a quarter of it): re-encoding
# a cut text may add a few


@dataclass(frozen=True)
class Workload:
    """Texts for one model and their token ids (each ending with EOS), as the runtime takes them."""

    model: str
    task: str
    texts: list[str]
    source_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.texts)


def read_lines(path: Path, count: int) -> list[str]:
    """The first `count` non-empty lines of a text file (fewer if it is shorter)."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[:count]


def load(data_dir: Path, model: str, task: str, tokenizer: Tokenizer, max_source_len: int,
         count: int, split: str = "test") -> Workload:
    """`count` sentences of `data_dir/<model>/<split>.src`, each cut to fit the model's source limit."""
    if split not in SPLITS:
        raise ValueError(f"split one of {SPLITS}, got {split!r}")
    path = data_dir / model / f"{split}.src"
    if not path.is_file():
        raise FileNotFoundError(f"no {split} split for {model}: {path}")
    limit = max(1, max_source_len - min(SOURCE_MARGIN, max_source_len // 4))
    texts, ids = [], []
    for line in read_lines(path, count):
        tokens = tokenizer.encode(line)
        if len(tokens) > limit:
            line = tokenizer.decode(tokens[:limit]).strip()
            tokens = tokenizer.encode(line)[:limit]
        texts.append(line)
        ids.append(tokens + [tokenizer.eos_id])
    return Workload(model, task, texts, ids)
