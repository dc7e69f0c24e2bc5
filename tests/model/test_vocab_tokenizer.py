"""`VocabTokenizer`: two SentencePiece models and a piece -> id vocabulary (the OPUS-MT layout),
without torch or transformers (tests/export/test_import_hf.py compares it with MarianTokenizer)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm

from model.tokenizer import VocabFiles, VocabTokenizer, load_tokenizer

SOURCE_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "a", "dog", "ran", "to", "the", "hat"]
TARGET_WORDS = ["il", "gatto", "era", "sul", "tappeto", "e", "un", "cane", "corse", "al", "cappello"]
CODE = ">>it<<"  # a language code: in the vocabulary, in neither model


def _train(words: list[str], seed: int) -> bytes:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 6))) for _ in range(300)]
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40,
                                   model_type="unigram", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return model.getvalue()


@pytest.fixture(scope="module")
def models() -> tuple[spm.SentencePieceProcessor, spm.SentencePieceProcessor]:
    return (spm.SentencePieceProcessor(model_proto=_train(SOURCE_WORDS, 0)),
            spm.SentencePieceProcessor(model_proto=_train(TARGET_WORDS, 1)))


def _joint_vocab(*models: spm.SentencePieceProcessor) -> dict[str, int]:
    """`</s>` 0, `<unk>` 1, every non-special piece of the models once, the code, `<pad>` last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for model in models:
        for i in range(model.get_piece_size()):
            if not (model.is_control(i) or model.is_unknown(i)):
                vocab.setdefault(model.id_to_piece(i), len(vocab))
    vocab[CODE] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


@pytest.fixture(scope="module")
def files(models: tuple[spm.SentencePieceProcessor, spm.SentencePieceProcessor],
          tmp_path_factory: pytest.TempPathFactory) -> VocabFiles:
    folder = tmp_path_factory.mktemp("opus")
    source, target = models
    found = VocabFiles(folder / "source.spm", folder / "target.spm", folder / "vocab.json")
    found.source.write_bytes(source.serialized_model_proto())
    found.target.write_bytes(target.serialized_model_proto())
    found.vocab.write_text(json.dumps(_joint_vocab(source, target)), encoding="utf-8")
    return found


@pytest.fixture(scope="module")
def tok(files: VocabFiles) -> VocabTokenizer:
    loaded = load_tokenizer(files)
    assert isinstance(loaded, VocabTokenizer)
    return loaded


def test_special_ids_come_from_the_vocabulary(tok: VocabTokenizer, files: VocabFiles) -> None:
    vocab = json.loads(files.vocab.read_text())
    assert (tok.eos_id, tok.unk_id, tok.pad_id, tok.vocab_size) == (
        vocab["</s>"], vocab["<unk>"], vocab["<pad>"], len(vocab))
    assert tok.bos_id == tok.pad_id  # Marian's decoder starts from pad


def test_each_side_encodes_with_its_model(tok: VocabTokenizer, files: VocabFiles,
                                          models: tuple[spm.SentencePieceProcessor, ...]) -> None:
    vocab = json.loads(files.vocab.read_text())
    source, target = models
    for text in ["the cat sat", "il gatto", "the Cat!", "", "cane  e gatto"]:
        for model, encode, encode_batch in [(source, tok.encode, tok.encode_batch),
                                            (target, tok.encode_target, tok.encode_target_batch)]:
            expected = [vocab.get(p, tok.unk_id) for p in model.encode(text, out_type=str)]
            assert encode(text) == expected and encode_batch([text]) == [expected]
    assert tok.encode("il gatto") != tok.encode_target("il gatto")
    assert tok.unk_id in tok.encode("the Cat!")  # "C" and "!": in neither model nor the vocabulary


def test_a_leading_language_code_is_one_piece(tok: VocabTokenizer) -> None:
    ids, spans = tok.encode_with_offsets(f"{CODE} the cat")
    assert tok.pieces(ids[:1]) == [CODE] and spans[0] == (0, len(CODE))
    assert ids[1:] == tok.encode(" the cat")
    assert tok.encode(">>xx<< the cat")[0] == tok.unk_id  # a code the vocabulary lacks


@pytest.mark.parametrize("text", ["the cat sat on a mat", "the  Cat! ran", "il gatto", f"{CODE} a dog"])
def test_offsets_map_pieces_into_text(tok: VocabTokenizer, text: str) -> None:
    for encode, with_offsets in [(tok.encode, tok.encode_with_offsets),
                                 (tok.encode_target, tok.encode_target_with_offsets)]:
        ids, spans = with_offsets(text)
        assert ids == encode(text)
        for piece, i, (start, end) in zip(tok.pieces(ids), ids, spans, strict=True):
            if i != tok.unk_id:
                assert text[start:end].lstrip(" ") == piece.lstrip("\u2581")


def test_decode_drops_specials_and_detokenizes_with_the_target_model(
        tok: VocabTokenizer, models: tuple[spm.SentencePieceProcessor, ...]) -> None:
    _, target = models
    ids = tok.encode_target("il gatto e un cane")
    assert tok.decode([*ids, tok.eos_id]) == "il gatto e un cane"
    assert tok.decode([tok.pad_id, *ids[:2], tok.unk_id, *ids[2:], tok.eos_id, tok.pad_id]) == tok.decode(ids)
    source_only = [i for i in tok.encode("the hat") if tok.pieces([i])[0] not in
                   {target.id_to_piece(j) for j in range(target.get_piece_size())}]
    assert source_only  # pieces the target model lacks are kept, their "▁" a space
    assert tok.decode([*ids, *source_only]).endswith(
        "".join(tok.pieces(source_only)).replace("\u2581", " ").rstrip())


def test_decode_with_offsets_spans_each_piece_in_the_decoded_text(tok: VocabTokenizer) -> None:
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(10))]
        text, spans = tok.decode_with_offsets(ids)
        assert text == tok.decode(ids) and len(spans) == len(ids)
        assert "".join(text[s:e] for s, e in spans) == text
        for piece, i, (start, end) in zip(tok.pieces(ids), ids, spans, strict=True):
            if i in (tok.pad_id, tok.eos_id, tok.unk_id):
                assert start == end
            else:
                assert text[start:end].strip() == piece.replace("\u2581", " ").strip()
    assert tok.decode_with_offsets([]) == ("", [])


@pytest.mark.parametrize(("change", "message"), [
    (lambda v: v.pop("<pad>"), "lacks <pad>"),
    (lambda v: v.update({"<pad>": len(v) + 3}), "0..n-1"),
    (lambda v: v.update({"extra": 0}), "0..n-1"),
])
def test_refuses_a_vocabulary_that_is_not_a_numbering(files: VocabFiles, tmp_path: Path, change, message: str) -> None:
    vocab = json.loads(files.vocab.read_text())
    change(vocab)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=message):
        VocabTokenizer.from_files(files._replace(vocab=path))
