"""The model repository's `manifest.json`: what a model is, how to call it, and the sha256 of
every file in its folder. Torch-free: the service reads it with the standard library only.

    models/<name>/manifest.json
    models/<name>/tokenizer.model, checkpoint.safetensors
    models/<name>/source.spm, target.spm, vocab.json   instead of tokenizer.model: an imported
                                                       Marian tokenizer (`tokenizer_kind`)
    models/<name>/encoder.onnx, decoder.onnx           fp32
    models/<name>/decoder_step.onnx                    fp32 (continuous batching's step)
    models/<name>/encoder.fp16.onnx, decoder.fp16.onnx fp16, sharing fp32's weights.bin
    models/<name>/decoder_step.fp16.onnx               fp16 step (float16 caches in its I/O)
    models/<name>/int8/...                             int8, with its own weights.bin
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from model.config import ModelConfig

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2  # 2: standard ONNX external data (1 stored packed bfloat16 weights)
TASKS = ("translate", "summarize")
# tokenizer_kind -> the roles of its files in `tokenizer_files` ("sentencepiece": `tokenizer` alone,
# `model.tokenizer.Tokenizer`; "sentencepiece_vocab": `model.tokenizer.VocabTokenizer`)
TOKENIZER_KINDS: dict[str, tuple[str, ...]] = {"sentencepiece": (), "sentencepiece_vocab": ("source", "target", "vocab")}


class ManifestError(Exception):
    """The manifest is missing or malformed, or the repository does not match it."""


class MissingFile(ManifestError):
    """A file the manifest lists is not in the repository."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: listed in {MANIFEST_FILE} but missing")
        self.path = path


class EmptyFile(ManifestError):
    """A file the manifest lists has zero bytes (e.g. an interrupted copy or an LFS miss)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: zero bytes")
        self.path = path


class HashMismatch(ManifestError):
    """A file's sha256 differs from the one the manifest records."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: sha256 {actual[:12]}... does not match the manifest's {expected[:12]}...")
        self.path, self.expected, self.actual = path, expected, actual


SHORTLIST_FILES = ("step_decoder", "projection", "table")  # the files a variant's `shortlist` names


@dataclass
class Variant:
    """One runnable pair of graphs (fp32 at the repository root, others in sub-folders)."""

    encoder: str  # path relative to the repository
    decoder: str
    precision: str  # "fp32" | "fp16" | "int8"
    providers: list[str]  # execution providers it is meant for, in order of preference
    servable: bool  # False when its quality loss exceeds the bound (or was not measured)
    quality: dict[str, Any] | None = None
    note: str = ""
    # the decoder step over each row's own cache (`export.step_graph`) for continuous
    # batching; "" when the variant has none (the running batch then uses `decoder`)
    step_decoder: str = ""
    # a vocabulary shortlist for that step graph (`export.shortlist`), or None: "step_decoder"
    # (the step graph reading the projection's columns), "projection" (the graph making them
    # from the shortlist's ids), "table" (the lexical table), how the table was built ("score",
    # "k", "n") and its measured cost ("quality")
    shortlist: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.shortlist is not None and not all(isinstance(self.shortlist.get(key), str) and self.shortlist[key]
                                                  for key in SHORTLIST_FILES):
            raise ValueError(f"a variant's shortlist must name its {' and '.join(SHORTLIST_FILES)}")


@dataclass
class Manifest:
    """Everything the service needs to know about a model repository."""

    name: str
    task: str  # "translate" | "summarize"
    source_language: str
    target_language: str
    model_config: dict[str, Any]  # the ModelConfig fields, as stored (`config` reads them once)
    special_ids: dict[str, int]  # pad, unk, bos, eos
    max_source_len: int  # source tokens including the final EOS
    max_target_len: int  # generated tokens including EOS
    opset: int
    io: dict[str, dict[str, list[dict[str, Any]]]]  # {encoder|decoder|decoder_step: {inputs|outputs: [...]}}
    variants: dict[str, Variant]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    tokenizer: str = "tokenizer.model"  # kind "sentencepiece": the SentencePiece model ("" otherwise)
    tokenizer_kind: str = "sentencepiece"  # a key of TOKENIZER_KINDS
    tokenizer_files: dict[str, str] = field(default_factory=dict)  # role -> path, the kind's roles
    checkpoint: str = "checkpoint.safetensors"
    source_suffix: str = "eos"  # sources are tokenizer ids + [eos]
    quality: dict[str, Any] | None = None  # fp32 quality (same numbers as variants["fp32"])
    exporter: dict[str, Any] = field(default_factory=dict)  # tool versions and settings
    # `model_config` as a typed config, read once (not stored: `model_config` is)
    config: ModelConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.config = ModelConfig.from_dict(self.model_config)
        ids = {"pad": self.config.pad_id, "unk": self.config.unk_id, "bos": self.config.bos_id,
               "eos": self.config.eos_id}
        if self.special_ids != ids:
            raise ValueError(f"special_ids {self.special_ids} differ from model_config's {ids}")
        if self.tokenizer_kind not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer_kind must be one of {sorted(TOKENIZER_KINDS)}, got {self.tokenizer_kind!r}")
        roles = TOKENIZER_KINDS[self.tokenizer_kind]
        if sorted(self.tokenizer_files) != sorted(roles):
            raise ValueError(f"tokenizer_files of kind {self.tokenizer_kind!r} must name {list(roles)}, "
                             f"got {sorted(self.tokenizer_files)}")
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        del values["config"]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Manifest:
        values = dict(values)
        try:
            if values.get("format_version") != FORMAT_VERSION:
                raise ManifestError(f"format_version {values.get('format_version')!r} is not {FORMAT_VERSION}: "
                                    "re-export the model with this version's `attnserve export`")
            values["variants"] = {k: Variant(**v) for k, v in values["variants"].items()}
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            manifest = cls(**{k: v for k, v in values.items() if k in known})
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"malformed manifest: {error}") from error
        if manifest.task not in TASKS:
            raise ManifestError(f"task must be one of {TASKS}, got {manifest.task!r}")
        return manifest

    def tokenizer_paths(self) -> list[str]:
        """The tokenizer's files (relative paths): `tokenizer`, or those of `tokenizer_files`."""
        return [self.tokenizer] if self.tokenizer_kind == "sentencepiece" else list(self.tokenizer_files.values())

    def variant(self, name: str) -> Variant:
        try:
            return self.variants[name]
        except KeyError:
            raise ManifestError(f"{self.name} has no variant {name!r} (has {sorted(self.variants)})") from None


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def repository_files(directory: str | Path) -> list[str]:
    """Every file under `directory` except the manifest, as sorted POSIX relative paths."""
    root = Path(directory)
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )


def hash_files(directory: str | Path) -> dict[str, str]:
    root = Path(directory)
    return {name: sha256_file(root / name) for name in repository_files(root)}


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Record the sha256 of every file in `directory`, then write manifest.json there."""
    manifest.files = hash_files(directory)
    path = Path(directory) / MANIFEST_FILE
    path.write_text(json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_manifest(directory: str | Path) -> Manifest:
    """Parse manifest.json (no hash check: see `verify_files`)."""
    path = Path(directory) / MANIFEST_FILE
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(values, dict):
        raise ManifestError(f"{path}: not a JSON object")
    return Manifest.from_dict(values)


def verify_files(directory: str | Path, manifest: Manifest) -> None:
    """Check every listed file (present, non-empty, same sha256) and that the manifest lists
    every file its variants, tokenizer and checkpoint refer to; raises a `ManifestError`."""
    root = Path(directory)
    referenced = {*manifest.tokenizer_paths(), manifest.checkpoint}
    for variant in manifest.variants.values():
        referenced.update((variant.encoder, variant.decoder))
        if variant.step_decoder:
            referenced.add(variant.step_decoder)
        if variant.shortlist:
            referenced.update(variant.shortlist[key] for key in SHORTLIST_FILES)
    for name in sorted(referenced | set(manifest.files)):
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ManifestError(f"{name!r}: not a path inside the repository")
    unlisted = sorted(referenced - set(manifest.files))
    if unlisted:
        raise ManifestError(f"{root}: {', '.join(unlisted)} not covered by the manifest's hashes")
    for name, expected in sorted(manifest.files.items()):
        path = root / name
        if not path.is_file():
            raise MissingFile(name)
        if path.stat().st_size == 0:
            raise EmptyFile(name)
        actual = sha256_file(path)
        if actual != expected:
            raise HashMismatch(name, expected, actual)
