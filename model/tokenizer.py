"""SentencePiece tokenizers: train one from text files, and a small wrapper to use one.

We train **unigram** models: sentencepiece's default, it segments into likelier,
more morpheme-like pieces than greedy BPE merges (Kudo 2018), which suits Italian
inflection, and it keeps subword regularisation (sampling) available for training. Special ids are fixed for every model: pad=0, unk=1,
bos=2, eos=3. This module does not import torch: the service uses `Tokenizer` without it.

`VocabTokenizer` serves imported Marian models (OPUS-MT): a source and a target SentencePiece
model whose pieces a vocabulary maps to the model's ids. Both kinds encode source texts with
`encode*` and target texts (a prefix, a given output) with `encode_target*`.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import sentencepiece as spm

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def trainer_settings(vocab_size: int = 8000, seed: int = 0, num_threads: int = 2) -> dict[str, Any]:
    """The sentencepiece trainer options we use (without input and model_prefix)."""
    return {
        "vocab_size": vocab_size,
        "model_type": "unigram",
        "character_coverage": 1.0,
        "pad_id": PAD_ID,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "pad_piece": "<pad>",
        "unk_piece": "<unk>",
        "bos_piece": "<s>",
        "eos_piece": "</s>",
        "normalization_rule_name": "nmt_nfkc",
        # Every sentence is used (0 = no sampling), so the model does not depend on a
        # shuffle; the seed only fixes sentencepiece's own random generator.
        "input_sentence_size": 0,
        "shuffle_input_sentence": False,
        "max_sentence_length": 16384,
        "hard_vocab_limit": False,  # a tiny corpus gets a smaller vocabulary, not an error
        "num_threads": num_threads,
        "random_seed": seed,
    }


def train_tokenizer(
    inputs: Sequence[str | Path],
    model_prefix: str | Path,
    vocab_size: int = 8000,
    seed: int = 0,
    num_threads: int = 2,
) -> Path:
    """Train a unigram SentencePiece model on text files (one sentence a line).

    Writes `<model_prefix>.model` and `<model_prefix>.vocab`; returns the `.model` path.
    The sentences are fed from Python and the model comes back in memory, so the file
    records no paths and the same input gives the same bytes wherever it is written.
    """
    settings = trainer_settings(vocab_size, seed, num_threads)
    spm.set_random_generator_seed(settings.pop("random_seed"))
    logger.info("training sentencepiece %s (vocab %d) on %s",
                settings["model_type"], vocab_size, ", ".join(str(p) for p in inputs))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_read_lines(inputs), model_writer=model, minloglevel=2, **settings)
    model_path = Path(f"{model_prefix}.model")
    model_path.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with Path(f"{model_prefix}.vocab").open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n"
                     for i in range(sp.get_piece_size()))
    return model_path


def _read_lines(paths: Sequence[str | Path]) -> Iterator[str]:
    """Every line of the files, in order, without the newline."""
    for path in paths:
        with Path(path).open(encoding="utf-8") as f:
            for line in f:
                yield line.rstrip("\n")


class Tokenizer:
    """A loaded SentencePiece model with fixed special ids; `encode` adds no bos/eos."""

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        self._sp = processor

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a `.model` file."""
        return cls(spm.SentencePieceProcessor(model_file=str(path)))

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        return list(self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without bos/eos.

        One call per text: sentencepiece's list form starts a thread pool per call, which costs
        more than encoding a sentence and stalls when the cores are busy."""
        return [list(self._sp.encode(text, out_type=int)) for text in texts]

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a target-side text: the same model as a source's."""
        return self.encode(text)

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each target-side text: the same model as a source's."""
        return self.encode_batch(texts)

    def encode_target_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_with_offsets` of a target-side text: the same model as a source's."""
        return self.encode_with_offsets(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; pad/bos/eos are dropped."""
        return str(self._sp.decode([int(i) for i in ids]))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The piece (string form, with `▁` for a space) of each id."""
        return [str(self._sp.id_to_piece(int(i))) for i in ids]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, for each, its (start, end) character span in `text`.

        `text[start:end]` is the original text a piece came from (empty for a piece that
        only stands for a leading space sentencepiece added).
        """
        try:
            out = self._sp.encode(text, out_type="offset_mapping")
        except (ValueError, TypeError):  # sentencepiece < 0.2.1: byte offsets in a proto
            return self._offsets_from_proto(text)
        return [int(i) for i in out["ids"]], [(int(s), int(e)) for s, e in out["offsets"]]

    def decode_with_offsets(self, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
        """`decode(ids)` and, for each id, the (start, end) character span of its piece there.

        Special pieces (bos, eos, pad) span nothing (start == end); a piece with a leading `▁`
        spans its space too, except the first (decoding drops that space).
        """
        values = [int(i) for i in ids]
        try:
            proto = self._sp.decode(values, return_type="proto")  # type: ignore[call-arg]
        except (ValueError, TypeError):  # sentencepiece < 0.2.1
            proto = self._sp.decode(values, out_type="immutable_proto")  # type: ignore[arg-type]
        text = str(proto.text)
        char_at = _byte_to_char(text)
        return text, [(char_at[p.begin], char_at[p.end]) for p in proto.pieces]

    def _offsets_from_proto(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Offsets from the piece proto of older sentencepiece versions (byte offsets)."""
        proto = self._sp.encode(text, out_type="immutable_proto")  # type: ignore[arg-type]
        char_at = _byte_to_char(text)
        ids = [int(p.id) for p in proto.pieces]
        return ids, [(char_at[p.begin], char_at[p.end]) for p in proto.pieces]


EOS_PIECE, UNK_PIECE, PAD_PIECE = "</s>", "<unk>", "<pad>"
SPACE = "\u2581"  # "▁", SentencePiece's space


class VocabFiles(NamedTuple):
    """The files of a `VocabTokenizer` (a Marian folder's source.spm, target.spm, vocab.json)."""

    source: Path  # the source language's SentencePiece model
    target: Path  # the target language's SentencePiece model
    vocab: Path  # JSON object: piece -> the model's id


class VocabTokenizer:
    """Source and target SentencePiece models whose pieces a vocabulary maps to the model's
    ids (Marian's joint vocabulary, as transformers' `MarianTokenizer` reads it).

    Encoding a text: its side's SentencePiece pieces, each mapped by the vocabulary (a piece it
    lacks -> unk); a text starting with a language code (`>>fra<<`) gets the code as its first
    piece. Decoding ids: their pieces by the inverse vocabulary, the special ones (pad, eos,
    unk) dropped, the rest detokenized by the target model (`decode_pieces`), a `▁` it leaves
    (a piece the target model lacks) turned into a space, the text stripped: MarianTokenizer's
    `decode(ids, skip_special_tokens=True)` with the target model. Special ids: eos `</s>`, unk
    `<unk>`, pad `<pad>`; bos is pad, as Marian's decoder starts from pad and has no bos.
    The vocabulary must map its pieces to 0..n-1, each id once.
    """

    def __init__(self, source: spm.SentencePieceProcessor, target: spm.SentencePieceProcessor,
                 vocab: dict[str, int]) -> None:
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError("the vocabulary does not map its pieces to 0..n-1, each id once")
        missing = [p for p in (EOS_PIECE, UNK_PIECE, PAD_PIECE) if p not in vocab]
        if missing:
            raise ValueError(f"the vocabulary lacks {', '.join(missing)}")
        self._source, self._target, self._vocab = source, target, vocab
        self._pieces = sorted(vocab, key=vocab.__getitem__)  # id -> piece
        self._specials = {self.pad_id, self.eos_id, self.unk_id}

    @classmethod
    def from_files(cls, files: VocabFiles) -> VocabTokenizer:
        """Load the two SentencePiece models and the vocabulary (a JSON object piece -> id)."""
        vocab = json.loads(Path(files.vocab).read_text(encoding="utf-8"))
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise ValueError(f"{files.vocab}: not a JSON object of piece -> id")
        return cls(spm.SentencePieceProcessor(model_file=str(files.source)),
                   spm.SentencePieceProcessor(model_file=str(files.target)), vocab)

    @property
    def pad_id(self) -> int:
        return self._vocab[PAD_PIECE]

    @property
    def unk_id(self) -> int:
        return self._vocab[UNK_PIECE]

    @property
    def bos_id(self) -> int:
        return self.pad_id

    @property
    def eos_id(self) -> int:
        return self._vocab[EOS_PIECE]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of a source text, without eos."""
        return self._encode(self._source, text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each source text, without eos."""
        return [self._encode(self._source, text) for text in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a source text and the (start, end) character span of each in `text`."""
        return self._encode_with_offsets(self._source, text)

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a target-side text (by the target model), without eos."""
        return self._encode(self._target, text)

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each target-side text (by the target model), without eos."""
        return [self._encode(self._target, text) for text in texts]

    def encode_target_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_with_offsets` of a target-side text, by the target model."""
        return self._encode_with_offsets(self._target, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (by the target model); pad, eos and unk are dropped."""
        pieces = [self._pieces[int(i)] for i in ids if int(i) not in self._specials]
        return str(self._target.decode_pieces(pieces)).replace(SPACE, " ").strip()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's piece of each id."""
        return [self._pieces[int(i)] for i in ids]

    def decode_with_offsets(self, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
        """`decode(ids)` and, for each id, the (start, end) character span of its piece there.

        A dropped piece (pad, eos, unk) spans nothing, where the text before it ends; a piece
        with a leading `▁` spans its space too, except at the start (the text is stripped)."""
        values = [int(i) for i in ids]
        kept = [self._pieces[v] for v in values if v not in self._specials]
        if not kept:
            return "", [(0, 0)] * len(values)
        try:
            proto = self._target.decode(kept, return_type="proto")  # type: ignore[call-arg]
        except (ValueError, TypeError):  # sentencepiece < 0.2.1
            proto = self._target.decode(kept, out_type="immutable_proto")  # type: ignore[arg-type]
        raw = str(proto.text)
        char_at = _byte_to_char(raw)
        spaced = raw.replace(SPACE, " ")  # one character for one: the offsets stay
        text = spaced.strip()
        lead = len(spaced) - len(spaced.lstrip())

        def inside(offset: int) -> int:
            return min(max(char_at[offset] - lead, 0), len(text))

        found = iter([(inside(p.begin), inside(p.end)) for p in proto.pieces])
        spans, end = [], 0
        for value in values:
            if value in self._specials:
                spans.append((end, end))
            else:
                spans.append(next(found))
                end = spans[-1][1]
        return text, spans

    def _encode(self, model: spm.SentencePieceProcessor, text: str) -> list[int]:
        code, rest = _language_code(text)
        pieces = [code] if code else []
        pieces.extend(str(p) for p in model.encode(rest, out_type=str))
        return [self._vocab.get(p, self.unk_id) for p in pieces]

    def _encode_with_offsets(self, model: spm.SentencePieceProcessor,
                             text: str) -> tuple[list[int], list[tuple[int, int]]]:
        code, rest = _language_code(text)
        start = len(code)
        pieces, spans = ([code], [(0, start)]) if code else ([], [])
        try:
            out = model.encode(rest, out_type="offset_mapping")
            found = [(str(p), int(s), int(e)) for p, (s, e) in zip(out["pieces"], out["offsets"], strict=True)]
        except (ValueError, TypeError):  # sentencepiece < 0.2.1: byte offsets in a proto
            proto = model.encode(rest, out_type="immutable_proto")  # type: ignore[arg-type]
            char_at = _byte_to_char(rest)
            found = [(str(p.piece), char_at[p.begin], char_at[p.end]) for p in proto.pieces]
        for piece, begin, end in found:
            pieces.append(piece)
            spans.append((start + begin, start + end))
        return [self._vocab.get(p, self.unk_id) for p in pieces], spans


def _language_code(text: str) -> tuple[str, str]:
    """A leading language code (`>>fra<<`, up to the first `<<`) and the rest of `text`, as
    MarianTokenizer splits them; ("", text) without one."""
    end = text.find("<<") if text.startswith(">>") else -1
    return (text[: end + 2], text[end + 2:]) if end != -1 else ("", text)


def load_tokenizer(files: str | Path | VocabFiles) -> Tokenizer | VocabTokenizer:
    """A `Tokenizer` of a SentencePiece model file, or a `VocabTokenizer` of `VocabFiles`."""
    if isinstance(files, VocabFiles):
        return VocabTokenizer.from_files(files)
    return Tokenizer.from_file(files)


def _byte_to_char(text: str) -> list[int]:
    """For each UTF-8 byte offset of `text` (and its end), the character offset."""
    table: list[int] = []
    for i, ch in enumerate(text):
        table.extend([i] * len(ch.encode("utf-8")))
    table.append(len(text))
    return table
