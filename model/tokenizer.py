"""SentencePiece tokenizers: train one from text files, and a small wrapper to use one.

We train **unigram** models: sentencepiece's default, it segments into likelier,
more morpheme-like pieces than greedy BPE merges (Kudo 2018), which suits Italian
inflection, and it keeps subword regularisation (sampling) available for training. Special ids are fixed for every model: pad=0, unk=1,
bos=2, eos=3. This module does not import torch: the service uses `Tokenizer` without it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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


def _byte_to_char(text: str) -> list[int]:
    """For each UTF-8 byte offset of `text` (and its end), the character offset."""
    table: list[int] = []
    for i, ch in enumerate(text):
        table.extend([i] * len(ch.encode("utf-8")))
    table.append(len(text))
    return table
