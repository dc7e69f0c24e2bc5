"""SentencePiece training and the `Tokenizer` wrapper: fixed ids, round trip, offsets."""

from __future__ import annotations

import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from model.ddtp import read_descriptions
from model.tokenizer import Tokenizer, train_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ddtp"
VOCAB = 300


def fixture_lines() -> list[str]:
    lines = []
    for name in ("Translation-en", "Translation-it"):
        for d in read_descriptions(FIXTURES / name, show_progress=False).values():
            lines.append(d.synopsis)
            lines.extend(d.paragraphs)
    return lines


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    text = folder / "train.txt"
    text.write_text("\n".join(fixture_lines()) + "\n", encoding="utf-8")
    return train_tokenizer([text], folder / "tok", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(model_path: Path) -> Tokenizer:
    return Tokenizer.from_file(model_path)


def test_files_written(model_path: Path) -> None:
    assert model_path.name == "tok.model"
    assert model_path.with_suffix(".vocab").exists()


def test_special_ids_are_fixed(tok: Tokenizer) -> None:
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.pieces([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]
    assert 100 < tok.vocab_size <= VOCAB


def test_encode_adds_no_bos_eos(tok: Tokenizer) -> None:
    ids = tok.encode("This package contains the library.")
    assert ids and all(i > 3 for i in ids)
    assert tok.encode_batch(["This package", "contains"]) == [
        tok.encode("This package"), tok.encode("contains")]


def test_unknown_character_is_unk(tok: Tokenizer) -> None:
    assert tok.unk_id in tok.encode("漢")


def test_round_trip(tok: Tokenizer) -> None:
    lines = [s for s in fixture_lines() if unicodedata.normalize("NFKC", s) == s]
    assert len(lines) > 100
    for line in lines:
        assert tok.decode(tok.encode(line)) == line
    assert tok.decode([tok.bos_id, *tok.encode("il pacchetto"), tok.eos_id, tok.pad_id]) == (
        "il pacchetto")


@pytest.mark.parametrize("text", [
    "This package contains the documentation.",
    "  Questo pacchetto è   già installato: l'utilità «mr»  ",
    "perché più città — naïve façade",
])
def test_offsets_map_pieces_into_text(tok: Tokenizer, text: str) -> None:
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert len(offsets) == len(ids)
    previous_end = 0
    for piece, (start, end) in zip(tok.pieces(ids), offsets):
        assert previous_end <= start <= end <= len(text)
        previous_end = end
        surface = piece.replace("\u2581", " ").strip()
        if piece != "<unk>":
            assert text[start:end].strip() == surface
    covered = "".join(text[s:e] for s, e in offsets)
    assert covered.split() == text.split()


@pytest.mark.parametrize("text", [
    "This package contains the documentation.",
    "perché più città — naïve façade",
    "漢 unknown",
])
def test_decode_with_offsets_spans_each_piece_in_the_decoded_text(tok: Tokenizer, text: str) -> None:
    ids = [*tok.encode(text), tok.eos_id]
    decoded, spans = tok.decode_with_offsets(ids)
    assert decoded == tok.decode(ids)
    assert len(spans) == len(ids) and spans[-1] == (len(decoded), len(decoded))  # eos: empty
    assert "".join(decoded[s:e] for s, e in spans) == decoded
    for piece, (start, end) in zip(tok.pieces(ids[:-1]), spans, strict=False):
        if piece != "<unk>":
            assert decoded[start:end].strip() == piece.replace("\u2581", " ").strip()
    assert tok.decode_with_offsets([]) == ("", [])


def test_tokenizer_module_does_not_import_torch(model_path: Path) -> None:
    code = (
        "import sys; from model.tokenizer import Tokenizer; "
        f"Tokenizer.from_file({str(model_path)!r}).encode('a b'); "
        "assert 'torch' not in sys.modules"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_training_is_deterministic(tmp_path: Path, model_path: Path) -> None:
    text = tmp_path / "train.txt"
    text.write_text("\n".join(fixture_lines()) + "\n", encoding="utf-8")
    again = train_tokenizer([text], tmp_path / "tok", vocab_size=VOCAB)
    assert again.read_bytes() == model_path.read_bytes()
