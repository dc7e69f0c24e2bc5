"""Build the training corpora from DDTP descriptions, deterministically.

- `translate-en-it`: English → Italian pairs from descriptions joined on md5: the synopses,
  and the paragraphs when both sides have as many paragraphs, split into sentences when
  both sides split into as many sentences.
- `summarize-en`: an English long description (paragraphs joined) → its synopsis.
- `translate-en-it/other.src`: English sentences no translation example came from (the
  descriptions without an Italian translation), a second workload for benchmarks.

Descriptions go to train/valid/test by a hash of (seed, md5), the same for both tasks, so
no description is in two splits. Output: `<out>/<task>/{train,valid,test}.{src,tgt}` (one
example a line), `stats.json`, and the task's `tokenizer.model` / `.vocab`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.ddtp import Description, read_descriptions

logger = logging.getLogger(__name__)

TRANSLATE = "translate-en-it"
SUMMARIZE = "summarize-en"
TASKS = (TRANSLATE, SUMMARIZE)
SPLITS = ("train", "valid", "test")

MAX_WORDS = 150  # longest translation example kept (words, either side)
MAX_LENGTH_RATIO = 2.5  # (longer + 10) / (shorter + 10) characters, translation pairs
MIN_BODY_WORDS = 20  # shortest long description kept for summarization
MAX_BODY_WORDS = 300  # longer summarization sources are cut to this many words
MIN_TEST_EXAMPLES = {TRANSLATE: 1000, SUMMARIZE: 300}  # warn below these
OTHER = "other"  # `translate-en-it/other.src`: sentences of the descriptions without a translation
OTHER_EXAMPLES = 2000

Pair = tuple[str, str]

# A sentence ends with . ! or ? (maybe closed by a quote or bracket) before a space and an
# upper-case letter, digit, quote or bracket.
_SENTENCE_END = re.compile(r"""([.!?]["'”»)\]]?)\s+(?=["'“«(\[]?[A-ZÀ-ÖØ-Þ0-9])""")
_ABBREVIATION = re.compile(r"(?:\b(?:e\.g|i\.e|vs|cf|etc|es|ecc|ca|approx|Mr|Dr|St|No|nr)|\b[A-Z])\.$",
                           re.IGNORECASE)
_LETTER = re.compile(r"[^\W\d_]")


def split_sentences(text: str) -> list[str]:
    """Split a paragraph into sentences with a regex (no split after e.g., i.e., initials)."""
    parts = _SENTENCE_END.split(text)
    # re.split with one group gives [s0, end0, s1, end1, ..., sN]
    sentences: list[str] = []
    current = ""
    for i in range(0, len(parts), 2):
        current += parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
        if i + 1 < len(parts) and _ABBREVIATION.search(current):
            current += " "
            continue
        sentences.append(current.strip())
        current = ""
    if current.strip():
        sentences.append(current.strip())
    return [s for s in sentences if s]


def split_of(md5: str, seed: int = 0, valid_fraction: float = 0.02,
             test_fraction: float = 0.02) -> str:
    """The split of a description: a fixed function of (seed, md5)."""
    digest = hashlib.sha256(f"{seed}:{md5}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + valid_fraction:
        return "valid"
    return "train"


def aligned_pairs(en: Description, it: Description) -> list[Pair]:
    """Candidate en→it pairs of one description, before filtering."""
    pairs: list[Pair] = [(en.synopsis, it.synopsis)]
    if len(en.paragraphs) != len(it.paragraphs):
        return pairs
    for en_par, it_par in zip(en.paragraphs, it.paragraphs):
        en_sents, it_sents = split_sentences(en_par), split_sentences(it_par)
        if len(en_sents) == len(it_sents) > 1:
            pairs.extend(zip(en_sents, it_sents))
        else:
            pairs.append((en_par, it_par))
    return pairs


def source_reject(src: str, max_words: int = MAX_WORDS) -> str | None:
    """Why a translation source is dropped on its own (a short reason), or None to keep it."""
    if not src:
        return "empty"
    if not _LETTER.search(src):
        return "no letters"
    if len(src.split()) > max_words:
        return "too long"
    return None


def translation_reject(src: str, tgt: str, max_words: int = MAX_WORDS) -> str | None:
    """Why a translation pair is dropped (a short reason, the first that applies: a side empty
    or without letters, the target a copy of the source, a side too long (`source_reject`'s
    rules), the two lengths too far apart), or None to keep it."""
    reasons = {source_reject(src, max_words), source_reject(tgt, max_words)}
    for reason in ("empty", "no letters"):
        if reason in reasons:
            return reason
    if src.casefold() == tgt.casefold():
        return "untranslated"
    if "too long" in reasons:
        return "too long"
    short, long_ = sorted((len(src), len(tgt)))
    if (long_ + 10) / (short + 10) > MAX_LENGTH_RATIO:
        return "length ratio"
    return None


def summarization_pair(desc: Description, min_words: int = MIN_BODY_WORDS,
                       max_words: int = MAX_BODY_WORDS) -> Pair | None:
    """(body, synopsis) of an English description, or None when unusable."""
    words = desc.body.split()
    if len(words) < min_words or not _LETTER.search(desc.synopsis):
        return None
    return " ".join(words[:max_words]), desc.synopsis


@dataclass
class Corpus:
    """The examples of one task per split, with the descriptions they came from."""

    task: str
    examples: dict[str, list[Pair]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    descriptions: dict[str, set[str]] = field(
        default_factory=lambda: {s: set() for s in SPLITS})
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def _assign(corpus: Corpus, candidates: Mapping[str, Sequence[Pair]],
            splits: Mapping[str, str]) -> Corpus:
    """Put each description's pairs in its split; an identical pair is kept once only.

    Splits are filled test first, then valid, then train, so a pair that repeats across
    descriptions stays in the held-out split and is removed from training.
    """
    seen: set[Pair] = set()
    for split in ("test", "valid", "train"):
        for md5, pairs in candidates.items():
            if splits[md5] != split:
                continue
            for pair in pairs:
                if pair in seen:
                    corpus.drop("duplicate")
                    continue
                seen.add(pair)
                corpus.examples[split].append(pair)
                corpus.descriptions[split].add(md5)
    return corpus


def build_translation(en: Mapping[str, Description], it: Mapping[str, Description],
                      splits: Mapping[str, str], show_progress: bool = True) -> Corpus:
    """The `translate-en-it` corpus from descriptions keyed by md5 (English order kept)."""
    from tqdm import tqdm

    corpus = Corpus(TRANSLATE)
    candidates: dict[str, list[Pair]] = {}
    for md5 in tqdm([m for m in en if m in it], desc="pair en-it", unit=" descriptions",
                    disable=not show_progress, mininterval=1.0):
        kept = []
        for src, tgt in aligned_pairs(en[md5], it[md5]):
            reason = translation_reject(src, tgt)
            if reason:
                corpus.drop(reason)
            else:
                kept.append((src, tgt))
        candidates[md5] = kept
    return _assign(corpus, candidates, splits)


def build_summarization(en: Mapping[str, Description], splits: Mapping[str, str]) -> Corpus:
    """The `summarize-en` corpus: body → synopsis of each usable English description."""
    corpus = Corpus(SUMMARIZE)
    candidates: dict[str, list[Pair]] = {}
    for md5, desc in en.items():
        pair = summarization_pair(desc)
        if pair is None:
            corpus.drop("short body")
        else:
            candidates[md5] = [pair]
    return _assign(corpus, candidates, splits)


def other_sentences(en: Mapping[str, Description], it: Mapping[str, Description], seen: Collection[str] = (),
                    seed: int = 0, count: int = OTHER_EXAMPLES) -> tuple[list[str], int]:
    """Up to `count` English sentences no translation example came from, and how many
    descriptions gave them: the synopsis and each paragraph's sentences (`split_sentences`) of
    the descriptions without an Italian translation, taken in the order of a hash of (seed,
    md5), each kept once, only if `source_reject` keeps it and it is not in `seen` (the
    translation corpus's sources: boilerplate sentences recur across descriptions)."""
    def rank(md5: str) -> bytes:
        return hashlib.sha256(f"other:{seed}:{md5}".encode()).digest()

    sentences: list[str] = []
    taken: set[str] = set()
    described = 0
    for md5 in sorted((m for m in en if m not in it), key=rank):
        description = en[md5]
        found = [description.synopsis] + [s for paragraph in description.paragraphs for s in split_sentences(paragraph)]
        before = len(sentences)
        for sentence in found:
            if len(sentences) < count and not source_reject(sentence) and sentence not in seen and sentence not in taken:
                taken.add(sentence)
                sentences.append(sentence)
        described += len(sentences) > before
        if len(sentences) >= count:
            break
    return sentences, described


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


def write_corpus(corpus: Corpus, out_dir: Path) -> dict[str, Any]:
    """Write `{split}.src/.tgt` files; returns per-split sizes and word counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes: dict[str, Any] = {}
    for split in SPLITS:
        pairs = corpus.examples[split]
        _write_lines(out_dir / f"{split}.src", (s for s, _ in pairs))
        _write_lines(out_dir / f"{split}.tgt", (t for _, t in pairs))
        sizes[split] = {
            "examples": len(pairs),
            "descriptions": len(corpus.descriptions[split]),
            "src_words": sum(len(s.split()) for s, _ in pairs),
            "tgt_words": sum(len(t.split()) for _, t in pairs),
        }
    return sizes


def token_stats(tokenizer_path: Path, corpus: Corpus) -> dict[str, Any]:
    """Mean / 99th percentile / max token counts of sources and targets per split."""
    from model.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    stats: dict[str, Any] = {}
    for split in SPLITS:
        pairs = corpus.examples[split]
        if not pairs:
            continue
        entry = {}
        for side, texts in (("src", [s for s, _ in pairs]), ("tgt", [t for _, t in pairs])):
            lengths = sorted(len(ids) for ids in tok.encode_batch(texts))
            entry[side] = {
                "mean": round(sum(lengths) / len(lengths), 2),
                "p99": lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))],
                "max": lengths[-1],
            }
        stats[split] = entry
    return stats


def prepare(
    en_path: str | Path,
    it_path: str | Path | None,
    out: str | Path = "data",
    vocab_size: int = 8000,
    tasks: Sequence[str] = TASKS,
    seed: int = 0,
    valid_fraction: float = 0.02,
    test_fraction: float = 0.02,
    show_progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Build and write every task's corpus and tokenizer; returns each task's stats."""
    from model.tokenizer import Tokenizer, train_tokenizer, trainer_settings

    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; choose from {list(TASKS)}")
    if TRANSLATE in tasks and it_path is None:
        raise ValueError(f"{TRANSLATE} needs the Italian file (--it)")
    en = read_descriptions(en_path, show_progress)
    it = read_descriptions(it_path, show_progress) if TRANSLATE in tasks and it_path else {}
    splits = {md5: split_of(md5, seed, valid_fraction, test_fraction) for md5 in en}
    all_stats: dict[str, dict[str, Any]] = {}
    for task in tasks:
        start = time.perf_counter()
        corpus = (build_translation(en, it, splits, show_progress) if task == TRANSLATE
                  else build_summarization(en, splits))
        task_dir = Path(out) / task
        sizes = write_corpus(corpus, task_dir)
        model_path = train_tokenizer(
            [task_dir / "train.src", task_dir / "train.tgt"], task_dir / "tokenizer",
            vocab_size=vocab_size, seed=seed)
        stats: dict[str, Any] = {
            "task": task,
            "sources": {"en": str(en_path), **({"it": str(it_path)} if task == TRANSLATE else {})},
            "seed": seed,
            "split_fractions": {"valid": valid_fraction, "test": test_fraction},
            "splits": sizes,
            "dropped": dict(sorted(corpus.dropped.items())),
            "tokenizer": {"file": model_path.name,
                          **trainer_settings(vocab_size, seed)},
            "tokens": token_stats(model_path, corpus),
        }
        stats["tokenizer"]["actual_vocab_size"] = Tokenizer.from_file(model_path).vocab_size
        if task == TRANSLATE:
            sources = {src for split in SPLITS for src, _ in corpus.examples[split]}
            others, described = other_sentences(en, it, sources, seed)
            _write_lines(task_dir / f"{OTHER}.src", others)
            stats[OTHER] = {"examples": len(others), "descriptions": described,
                            "src_words": sum(len(s.split()) for s in others)}
        (task_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n",
                                             encoding="utf-8")
        logger.info("%s: %s examples (train/valid/test) in %.1fs -> %s", task,
                    "/".join(str(sizes[s]["examples"]) for s in SPLITS),
                    time.perf_counter() - start, task_dir)
        minimum = MIN_TEST_EXAMPLES[task]
        if sizes["test"]["examples"] < minimum:
            logger.warning("%s: only %d test examples (wanted >= %d); raise test_fraction",
                           task, sizes["test"]["examples"], minimum)
        all_stats[task] = stats
    return all_stats
