"""Building the corpora: sentence split, pairing, filters, splits by md5, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.data import (
    OTHER,
    SPLITS,
    SUMMARIZE,
    TRANSLATE,
    aligned_pairs,
    build_summarization,
    build_translation,
    other_sentences,
    prepare,
    source_reject,
    split_of,
    split_sentences,
    summarization_pair,
    translation_reject,
)
from model.ddtp import Description, read_descriptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ddtp"
EN = FIXTURES / "Translation-en"
IT = FIXTURES / "Translation-it"
OPTIONS: dict = {"vocab_size": 300, "valid_fraction": 0.2, "test_fraction": 0.2,
           "show_progress": False}


def desc(synopsis: str, *paragraphs: str) -> Description:
    return Description(md5="0" * 32, synopsis=synopsis, paragraphs=paragraphs)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("data")
    return out, prepare(EN, IT, out, **OPTIONS)


@pytest.mark.parametrize(("text", "expected"), [
    ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
    ("It is (e.g. GNU) fine. Next one.", ["It is (e.g. GNU) fine.", "Next one."]),
    ("Use e.g. Foo here. Then «Bar» it.", ["Use e.g. Foo here.", "Then «Bar» it."]),
    ("Version 2.0 is out. È nuova.", ["Version 2.0 is out.", "È nuova."]),
    ("Between 500 B.C. and 500 A.D. it ran.", ["Between 500 B.C. and 500 A.D. it ran."]),
    ('He said "hi." Then left.', ['He said "hi."', "Then left."]),
    ("no split.lowercase. and more", ["no split.lowercase. and more"]),
])
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_aligned_pairs_split_sentences_when_counts_match() -> None:
    en = desc("a tool", "First. Second.", "Only one here. And two. And three.")
    it = desc("uno strumento", "Primo. Secondo.", "Solo uno qui e due.")
    assert aligned_pairs(en, it) == [
        ("a tool", "uno strumento"),
        ("First.", "Primo."),
        ("Second.", "Secondo."),
        ("Only one here. And two. And three.", "Solo uno qui e due."),
    ]


def test_aligned_pairs_synopsis_only_when_paragraph_counts_differ() -> None:
    en = desc("a tool", "One.", "Two.")
    it = desc("uno strumento", "Uno. Due.")
    assert aligned_pairs(en, it) == [("a tool", "uno strumento")]


@pytest.mark.parametrize(("src", "tgt", "reason"), [
    ("library for foo", "libreria per foo", None),
    ("", "qualcosa", "empty"),
    ("1.0", "1.0 ", "no letters"),
    ("Same text here", "same text here", "untranslated"),
    ("word " * 151, "parola " * 151, "too long"),
    ("a short one", "una frase molto molto molto più lunga di quella inglese", "length ratio"),
])
def test_translation_reject(src: str, tgt: str, reason: str | None) -> None:
    assert translation_reject(src.strip(), tgt.strip()) == reason


def test_summarization_pair() -> None:
    assert summarization_pair(desc("short", "only a few words here")) is None
    long_body = desc("a synopsis", " ".join(f"w{i}" for i in range(400)))
    src, tgt = summarization_pair(long_body)
    assert tgt == "a synopsis"
    assert src.split() == [f"w{i}" for i in range(300)]


def test_split_of_is_deterministic_and_seeded() -> None:
    md5s = [f"{i:032x}" for i in range(4000)]
    first = [split_of(m, seed=0) for m in md5s]
    assert first == [split_of(m, seed=0) for m in md5s]
    assert first != [split_of(m, seed=1) for m in md5s]
    for split, share in (("valid", 0.02), ("test", 0.02)):
        assert abs(first.count(split) / len(md5s) - share) < 0.01


def test_corpora_splits_are_disjoint_by_md5() -> None:
    en = read_descriptions(EN, show_progress=False)
    it = read_descriptions(IT, show_progress=False)
    splits = {m: split_of(m, 0, 0.2, 0.2) for m in en}
    for corpus in (build_translation(en, it, splits, show_progress=False),
                   build_summarization(en, splits)):
        sets = corpus.descriptions
        assert all(sets[s] for s in SPLITS)
        assert not (sets["train"] & sets["valid"] or sets["train"] & sets["test"]
                    or sets["valid"] & sets["test"])
        for split in SPLITS:
            assert all(splits[m] == split for m in sets[split])
        pairs = [set(corpus.examples[s]) for s in SPLITS]
        assert not (pairs[0] & pairs[1] or pairs[0] & pairs[2] or pairs[1] & pairs[2])


def test_translation_drops_untranslated_and_keeps_real_pairs() -> None:
    en = read_descriptions(EN, show_progress=False)
    it = read_descriptions(IT, show_progress=False)
    corpus = build_translation(en, it, {m: "train" for m in en}, show_progress=False)
    pairs = corpus.examples["train"]
    assert corpus.dropped.get("untranslated", 0) > 0
    assert all(s.casefold() != t.casefold() for s, t in pairs)
    assert ("tool to manage all your version control repos",
            "strumento per gestire tutti i propri repository di controllo delle versioni"
            ) in pairs
    assert len(pairs) == len(set(pairs))


def test_prepare_writes_files_and_stats(prepared: tuple[Path, dict]) -> None:
    out, stats = prepared
    for task in (TRANSLATE, SUMMARIZE):
        folder = out / task
        assert (folder / "tokenizer.model").exists() and (folder / "tokenizer.vocab").exists()
        on_disk = json.loads((folder / "stats.json").read_text("utf-8"))
        assert on_disk == stats[task]
        for split in SPLITS:
            src = (folder / f"{split}.src").read_text("utf-8").split("\n")
            tgt = (folder / f"{split}.tgt").read_text("utf-8").split("\n")
            assert src[-1] == tgt[-1] == ""  # one example a line, newline-terminated
            assert len(src) - 1 == len(tgt) - 1 == on_disk["splits"][split]["examples"] > 0
            assert all(line and "\t" not in line for line in src[:-1] + tgt[:-1])
        assert on_disk["tokenizer"]["pad_id"] == 0 and on_disk["tokenizer"]["eos_id"] == 3
        assert on_disk["tokens"]["train"]["tgt"]["mean"] > 0
    summaries = (out / SUMMARIZE / "train.src").read_text("utf-8").splitlines()
    assert all(20 <= len(line.split()) <= 300 for line in summaries)


def test_prepare_is_deterministic(prepared: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = prepared
    prepare(EN, IT, tmp_path, **OPTIONS)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for name in files:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_prepare_rejects_unknown_task(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        prepare(EN, IT, tmp_path, tasks=["translate-xx"], **OPTIONS)


def test_other_sentences_come_from_descriptions_without_a_translation() -> None:
    en = read_descriptions(EN, show_progress=False)
    it = read_descriptions(IT, show_progress=False)
    untranslated = [m for m in en if m not in it]
    assert untranslated  # the fixture has English-only descriptions
    corpus = build_translation(en, it, {m: split_of(m) for m in en}, show_progress=False)
    sources = {s for split in SPLITS for s, _ in corpus.examples[split]}
    sentences, described = other_sentences(en, it, sources)
    assert 0 < described <= len(untranslated) and len(sentences) >= described
    assert len(sentences) == len(set(sentences))
    assert all(source_reject(s) is None for s in sentences)
    own = {s for m in untranslated for s in [en[m].synopsis, *(x for p in en[m].paragraphs for x in split_sentences(p))]}
    assert set(sentences) <= own
    recurring = "See http://www.haskell.org/ for more information on Haskell."
    assert recurring in sources and recurring in own  # boilerplate of translated and untranslated descriptions
    assert not set(sentences) & sources  # no translation example came from them
    assert recurring in other_sentences(en, it)[0]  # without the corpus's sources it would be kept
    assert "WebP Image format GdkPixbuf loader" in sentences  # a synopsis of one of them
    assert other_sentences(en, it, sources, count=3)[0] == sentences[:3]  # the same order, cut
    assert other_sentences(en, it, sources, seed=1)[0] != sentences  # another seed, another order
    assert other_sentences(en, en)[0] == []  # every description translated: nothing


def test_source_reject_is_translation_reject_of_one_side() -> None:
    assert source_reject("") == "empty" and source_reject("123 456") == "no letters"
    assert source_reject(" ".join(["w"] * 151)) == "too long" and source_reject("a tool") is None
    assert translation_reject("", "123") == "empty"  # the first rule that applies to either side
    assert translation_reject("same", "Same") == "untranslated"
    assert translation_reject(" ".join(["w"] * 151), " ".join(["w"] * 151)) == "untranslated"
    assert translation_reject(" ".join(["w"] * 151), " ".join(["v"] * 151)) == "too long"


def test_prepare_writes_the_other_sentences(prepared: tuple[Path, dict]) -> None:
    out, stats = prepared
    lines = (out / TRANSLATE / f"{OTHER}.src").read_text("utf-8").splitlines()
    assert len(lines) == stats[TRANSLATE][OTHER]["examples"] > 0
    assert stats[TRANSLATE][OTHER]["descriptions"] > 0 and OTHER not in stats[SUMMARIZE]
    assert not (out / SUMMARIZE / f"{OTHER}.src").exists()
