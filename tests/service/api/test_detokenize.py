"""What each token adds to the text (`service.api.detokenize`): a token that completes no
character adds "" and the one that completes it adds the character; a space the tokenizer
strips at the end arrives with the next word; the texts join to the whole."""

from __future__ import annotations

from collections.abc import Sequence

from service.api.detokenize import token_texts

# ids of a byte-level vocabulary: 1-3 the three bytes of "€", 4 "▁a", 5 "b", 6 "▁"
PIECES = {1: b"\xe2", 2: b"\x82", 3: b"\xac", 4: b" a", 5: b"b", 6: b" "}


class Bytes:
    """Decodes as SentencePiece does: bytes joined, bad bytes as U+FFFD, ends stripped of spaces."""

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace").strip()


def test_a_character_of_three_byte_pieces_arrives_with_its_last() -> None:
    assert token_texts(Bytes(), [4, 1, 2, 3, 5]) == ["a", "", "", "€", "b"]


def test_a_trailing_space_arrives_with_the_next_word_and_the_texts_join() -> None:
    ids = [4, 6, 5, 4]
    found = token_texts(Bytes(), ids)
    assert found == ["a", "", " b", " a"] and "".join(found) == Bytes().decode(ids) == "a b a"


def test_an_output_cut_inside_a_character_keeps_what_it_decodes_to() -> None:
    ids = [4, 1, 2]  # a length limit in the middle of "€"
    found = token_texts(Bytes(), ids)
    assert "".join(found) == Bytes().decode(ids) == "a\ufffd"
