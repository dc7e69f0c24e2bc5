"""Long documents on real models: the tiny reversal model (onnxruntime, SentencePiece), and the
committed translate-en-it on a multi-paragraph package description (slow).

A document's output must join, in the document's layout, the outputs its sentences get alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")  # the tiny model's fixtures train it

from model.tokenizer import Tokenizer
from service.api.app import create_app
from service.api.documents import split
from tests.service.conftest import serving, tiny_settings

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRANSLATE = ROOT / "models" / "translate-en-it"


async def translate_alone(client: httpx.AsyncClient, texts: list[str]) -> list[str]:
    """Each text translated by a request of its own, one after the other."""
    outputs = []
    for text in texts:
        response = await client.post("/v1/translate", json={"text": text})
        assert response.status_code == 200, response.text
        outputs.append(response.json()["outputs"][0]["text"])
    return outputs


# Lines over the tiny alphabet; the third (17 tokens) is over the tiny model's 15.
TINY_DOCUMENT = "  abc de\nfgh\n\n\tabc de fgh ij kl\nmno  \n"


async def test_the_tiny_model_translates_a_document_like_its_pieces_alone(
    served_tiny_models: Path, tiny_repository_tokenizer: Any
) -> None:
    document = split(TINY_DOCUMENT, tiny_repository_tokenizer, 15, "en", "text")
    assert document.segments == ["abc de", "fgh", "abc de fgh ij", "kl", "mno"]
    async with serving(create_app(tiny_settings(served_tiny_models))) as client:
        response = await client.post("/v1/translate", json={"text": TINY_DOCUMENT})
        alone = await translate_alone(client, document.segments)
        streamed = await client.post("/v1/translate", json={"text": TINY_DOCUMENT, "stream": True})
        with_maps = await client.post("/v1/translate", json={"text": "abc de\nfgh",
                                                              "return_attention": True})
        with_scores = await client.post("/v1/translate", json={"text": "abc de\nfgh",
                                                               "return_scores": True})
    assert response.status_code == 200, response.text
    [out] = response.json()["outputs"]
    assert out["text"] == document.join(alone)
    assert out["input_tokens"] == sum(len(ids) + 1 for ids in document.ids)
    events = [json.loads(line[len("data: "):])
              for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1]["output"] == out
    assert "".join(e["delta"] for e in events) == out["text"]
    # attention maps relate one source to one output: the text is not split
    [mapped] = with_maps.json()["outputs"]
    assert mapped["input_tokens"] == len(tiny_repository_tokenizer.encode("abc de\nfgh")) + 1
    assert len(mapped["attention"][0]) == mapped["input_tokens"]
    # so do scores: one score for the whole text's one output
    [scored] = with_scores.json()["outputs"]
    assert scored["input_tokens"] == mapped["input_tokens"]
    assert len(scored["token_scores"]) == scored["output_tokens"]


# A package description in the style of Debian's: a synopsis, paragraphs of several sentences,
# a list, and closing paragraphs.
PARAGRAPHS = [
    ["tool to convert and tag audio files"],
    [("Audiotag is a command line tool to convert audio files between formats and to edit "
      "their tags."),
     "It reads and writes MP3, Ogg Vorbis, FLAC, Opus and WAV files.",
     ("It can convert a whole directory of files with one command, using all the processors "
      "of the computer.")],
    ["The program keeps the tags of the original files when it converts them.",
     "It can also query a CDDB or MusicBrainz server to lookup metadata and tag your files.",
     "A simple configuration file sets the default formats and the quality of the encoder.",
     "The configuration can be changed for a single run with command line options."],
    ["Features include:"],
    ["conversion between all the supported formats;"],
    ["batch processing of whole directories;"],
    ["editing of tags from the command line;"],
    ["support for embedded cover art and lyrics."],
    [("Audiotag can also normalize the volume of a collection, so that all the tracks play at "
      "the same loudness."),
     "It detects silence at the start and at the end of a track and can remove it.",
     ("Files can be renamed from their tags with a pattern, and tags can be filled in from the "
      "names of the files.")],
    ["The program can be used from scripts and cron jobs.",
     "Its output is easy to parse, and its exit status tells whether a conversion failed.",
     "A progress bar is shown when the program runs in a terminal.",
     ("Errors are written to the standard error stream, together with the name of the file "
      "that could not be converted, and the other files are still converted.")],
    ["Several encoders can run at the same time on different files.",
     ("The number of parallel jobs is chosen automatically from the number of processors, but "
      "it can also be set by the user.")],
    ["The program supports the playlists of most media players.",
     ("It can convert a playlist together with the files it lists, and it writes a new "
      "playlist that points to the converted files.")],
    ["This package replaces the tagconv package.",
     ("The old commands are still available as symbolic links, so that existing scripts keep "
      "working."),
     "They will be removed in a future release."],
    [("The library behind the program is written in C and has no dependencies besides the "
      "codecs."),
     "It is suitable for both desktop systems and small embedded devices.",
     "The source code is distributed under the GNU General Public License version 2."],
    ["This package contains the command line program and its manual pages.",
     "The graphical interface is available in the audiotag-gtk package.",
     ("The shared library is available in the libaudiotag1 package, and the header files "
      "needed to build programs that use it are in the libaudiotag-dev package.")],
    ["This package provides the documentation in HTML format.",
     ("It also contains examples of configuration files and scripts that show how to convert "
      "a music collection automatically."),
     "The examples can be copied to your home directory and modified as needed."],
    ["Audiotag is developed by a small team of volunteers.",
     "Bug reports and patches are welcome.",
     ("Please send them to the Debian bug tracking system, so that they reach the maintainers "
      "of the package and the authors of the program.")],
]
ITEMS = range(4, 8)  # the list's items: lines after "Features include:", marked " * "


def layout(paragraphs: list[list[str]]) -> str:
    """The paragraphs' sentences joined by a space, each on a line of its own after a blank
    line, except the list's items, each on the next line after " * "."""
    text = ""
    for i, sentences in enumerate(paragraphs):
        if i:
            text += "\n * " if i in ITEMS else "\n\n"
        text += " ".join(sentences)
    return text + "\n"


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_TRANSLATE.is_dir(), reason="no committed translate-en-it")
async def test_a_3000_character_description_translates_whole(tmp_path: Path) -> None:
    description = layout(PARAGRAPHS)
    assert 2800 <= len(description) <= 3500
    sentences = [s for p in PARAGRAPHS for s in p]
    tokenizer = Tokenizer.from_file(DEFAULT_TRANSLATE / "tokenizer.model")
    assert split(description, tokenizer, 255, "en", "text").segments == sentences
    models = tmp_path / "models"
    models.mkdir()
    (models / "translate-en-it").symlink_to(DEFAULT_TRANSLATE)
    async with serving(create_app(tiny_settings(models, threads=2))) as client:
        [card] = (await client.get("/v1/models")).json()["models"]
        assert card["max_source_len"] == 256
        response = await client.post("/v1/translate", json={"text": description})
        alone = await translate_alone(client, sentences)
    assert response.status_code == 200, response.text
    [out] = response.json()["outputs"]
    assert out["finish_reason"] == "eos"
    # the layout: as many paragraphs and lines, the list's marks and indentation kept
    assert out["text"].count("\n\n") == description.count("\n\n")
    assert out["text"].count("\n") == description.count("\n")
    assert [line.startswith(" * ") for line in out["text"].split("\n")] == \
        [line.startswith(" * ") for line in description.split("\n")]
    # every sentence translated as it is alone, in the description's layout
    translated = iter(alone)
    expected = layout([[next(translated) for _ in p] for p in PARAGRAPHS])
    assert out["text"] == expected
    for source, target in zip(sentences, alone, strict=True):
        assert target and target != source
