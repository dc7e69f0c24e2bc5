"""Read Debian DDTP `Translation-<lang>` files into descriptions keyed by `Description-md5`.

A file is a sequence of deb822 stanzas separated by blank lines:

    Package: 0ad
    Description-md5: d943033bedada21853d2ae54a2578a7b
    Description-it: gioco di strategia in tempo reale di guerra antica
     0 A.D. (pronunciato "zero a d") è un gioco di strategia ...
     .
     Questo pacchetto contiene ...

The first line of `Description-<lang>` is the synopsis; continuation lines start with one
space and a line holding only ` .` separates paragraphs. The file may be plain, or
xz, gzip or lz4 compressed (apt leaves lz4 files in /var/lib/apt/lists); the format is
detected from the file's first bytes, not its name.
"""

from __future__ import annotations

import gzip
import io
import logging
import lzma
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZIP_MAGIC = b"\x1f\x8b"
_LZ4_MAGIC = b"\x04\x22\x4d\x18"
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class Description:
    """One package description: its md5, one-line synopsis and unwrapped paragraphs."""

    md5: str
    synopsis: str
    paragraphs: tuple[str, ...]

    @property
    def body(self) -> str:
        """The paragraphs joined with a space (the long description as one line)."""
        return " ".join(self.paragraphs)


def normalize_space(text: str) -> str:
    """NFC-normalise, drop control characters and collapse runs of whitespace to one space."""
    text = _CONTROL.sub(" ", unicodedata.normalize("NFC", text))
    return " ".join(text.split())


def open_text(path: str | Path) -> io.TextIOWrapper:
    """Open a plain, xz, gzip or lz4 file for reading as UTF-8 text."""
    path = Path(path)
    with path.open("rb") as f:
        magic = f.read(6)
    raw: IO[bytes]
    if magic.startswith(_XZ_MAGIC):
        raw = lzma.open(path, "rb")  # noqa: SIM115 (the caller closes the wrapper)
    elif magic.startswith(_GZIP_MAGIC):
        raw = gzip.open(path, "rb")  # type: ignore[assignment]  # noqa: SIM115
    elif magic.startswith(_LZ4_MAGIC):
        try:
            import lz4.frame
        except ImportError as e:
            raise RuntimeError(
                f"{path} is lz4-compressed but the `lz4` module is not installed: "
                f"`pip install lz4`, or decompress it first with `lz4 -d {path.name}`"
            ) from e
        raw = lz4.frame.open(path, "rb")
    else:
        raw = path.open("rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None)


def iter_stanzas(lines: Iterable[str]) -> Iterator[dict[str, list[str]]]:
    """Yield each deb822 stanza as {field: [first line, continuation lines...]}."""
    stanza: dict[str, list[str]] = {}
    field: str | None = None
    for line in lines:
        line = line.rstrip("\r\n")
        if not line.strip():
            if stanza:
                yield stanza
            stanza, field = {}, None
        elif line[0] in " \t":
            if field is not None:
                stanza[field].append(line)
        elif ":" in line:
            field, _, value = line.partition(":")
            field = field.strip()
            stanza[field] = [value.strip()]
        else:
            logger.debug("skipping malformed line %r", line[:80])
    if stanza:
        yield stanza


def parse_description(md5: str, lines: list[str]) -> Description:
    """Build a `Description` from a `Description-<lang>` field's lines (synopsis first)."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines[1:]:
        if line.strip() == ".":
            paragraphs.append(normalize_space(" ".join(current)))
            current = []
        else:
            current.append(line)
    paragraphs.append(normalize_space(" ".join(current)))
    return Description(
        md5=md5,
        synopsis=normalize_space(lines[0]),
        paragraphs=tuple(p for p in paragraphs if p),
    )


def description_field(stanza: dict[str, list[str]]) -> str | None:
    """The stanza's `Description-<lang>` field name (not `Description-md5`), if any."""
    for name in stanza:
        if name.startswith("Description-") and name != "Description-md5":
            return name
    return None


def read_descriptions(path: str | Path, show_progress: bool = True) -> dict[str, Description]:
    """Parse a Translation file into descriptions keyed by md5, first occurrence kept."""
    from tqdm import tqdm

    descriptions: dict[str, Description] = {}
    stanzas = duplicates = skipped = 0
    with open_text(path) as f:
        bar = tqdm(iter_stanzas(f), desc=f"parse {Path(path).name}", unit=" stanzas",
                   disable=not show_progress, mininterval=1.0)
        for stanza in bar:
            stanzas += 1
            field = description_field(stanza)
            md5 = (stanza.get("Description-md5") or [""])[0].lower()
            if field is None or not _MD5.match(md5):
                skipped += 1
                continue
            if md5 in descriptions:
                duplicates += 1
                continue
            descriptions[md5] = parse_description(md5, stanza[field])
    logger.info("%s: %d stanzas, %d unique descriptions (%d duplicate md5s, %d skipped)",
                path, stanzas, len(descriptions), duplicates, skipped)
    return descriptions
