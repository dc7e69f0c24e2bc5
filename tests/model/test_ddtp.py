"""Parsing DDTP Translation files: stanzas, synopsis, paragraphs, compression, dedup."""

from __future__ import annotations

import gzip
import lzma
import re
import sys
from pathlib import Path

import pytest

from model.ddtp import iter_stanzas, normalize_space, open_text, read_descriptions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ddtp"
EN = FIXTURES / "Translation-en"
IT = FIXTURES / "Translation-it"

SAMPLE = """\
Package: foo
Description-md5: 0123456789abcdef0123456789abcdef
Description-en: a   tool\tthat foos
 First line of the first
 paragraph, wrapped.
 .
 Second paragraph:
  * item one
  * item two
 .
 Third.

Package: foo-doc
Description-md5: 0123456789abcdef0123456789abcdef
Description-en: this duplicate md5 is ignored
 Whatever.

Package: bar
Description-md5: fedcba9876543210fedcba9876543210
Description-en: synopsis only
"""


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "Translation-en"
    path.write_text(SAMPLE, encoding="utf-8")
    return path


def test_synopsis_and_paragraphs(sample: Path) -> None:
    descriptions = read_descriptions(sample, show_progress=False)
    foo = descriptions["0123456789abcdef0123456789abcdef"]
    assert foo.synopsis == "a tool that foos"
    assert foo.paragraphs == (
        "First line of the first paragraph, wrapped.",
        "Second paragraph: * item one * item two",
        "Third.",
    )
    assert foo.body == " ".join(foo.paragraphs)


def test_synopsis_only_has_no_paragraphs(sample: Path) -> None:
    bar = read_descriptions(sample, show_progress=False)["fedcba9876543210fedcba9876543210"]
    assert bar.synopsis == "synopsis only"
    assert bar.paragraphs == ()


def test_duplicate_md5_keeps_first(sample: Path) -> None:
    descriptions = read_descriptions(sample, show_progress=False)
    assert len(descriptions) == 2
    assert descriptions["0123456789abcdef0123456789abcdef"].synopsis == "a tool that foos"


def test_iter_stanzas_fields() -> None:
    stanzas = list(iter_stanzas(SAMPLE.splitlines(keepends=True)))
    assert [s["Package"] for s in stanzas] == [["foo"], ["foo-doc"], ["bar"]]
    assert stanzas[0]["Description-en"][2] == " paragraph, wrapped."


def test_normalize_space() -> None:
    assert normalize_space("  a\tb \u00a0 c\x07d\n") == "a b c d"
    assert normalize_space("e\u0301") == "\u00e9"  # NFC


def test_fixture_unique_md5s() -> None:
    for path in (EN, IT):
        md5s = re.findall(r"^Description-md5: (\w+)$", path.read_text("utf-8"),
                          re.MULTILINE)
        descriptions = read_descriptions(path, show_progress=False)
        assert len(md5s) > len(set(md5s))  # the fixture holds shared descriptions
        assert sorted(descriptions) == sorted(set(md5s))
        for d in descriptions.values():
            assert d.synopsis
            assert all(p and "\n" not in p and "  " not in p for p in d.paragraphs)


def test_fixture_real_stanza() -> None:
    en = read_descriptions(EN, show_progress=False)["17d0edfe4920d396b9fcb614eb9d9ea0"]
    assert en.synopsis == "tool to manage all your version control repos"
    assert en.paragraphs[0].startswith("The mr(1) command can checkout, update, or perform")
    assert en.paragraphs[-1] == "This package also includes the webcheckout command."


@pytest.mark.parametrize("compress", [lzma.compress, gzip.compress], ids=["xz", "gz"])
def test_compressed_equals_plain(tmp_path: Path, compress) -> None:
    path = tmp_path / "Translation-it.compressed"  # format from the bytes, not the name
    path.write_bytes(compress(IT.read_bytes()))
    assert read_descriptions(path, show_progress=False) == read_descriptions(
        IT, show_progress=False)


def test_lz4_equals_plain(tmp_path: Path) -> None:
    lz4_frame = pytest.importorskip("lz4.frame")
    path = tmp_path / "Translation-it.lz4"
    path.write_bytes(lz4_frame.compress(IT.read_bytes()))
    assert read_descriptions(path, show_progress=False) == read_descriptions(
        IT, show_progress=False)


def test_lz4_without_module_is_a_clear_error(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "Translation-en.lz4"
    path.write_bytes(b"\x04\x22\x4d\x18" + b"\x00" * 16)
    monkeypatch.setitem(sys.modules, "lz4", None)
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    with pytest.raises(RuntimeError, match="pip install lz4"):
        open_text(path)
