"""Shared fixtures: a tiny seeded Transformer trained in seconds on a sequence-reversal task."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# One intra-op thread: the tiny models gain nothing from two, and on a loaded 2-core machine
# oversubscribed threads make them orders of magnitude slower.
torch.set_num_threads(1)

from model.batching import ParallelExamples
from model.checkpoint import load_model
from model.config import ModelConfig
from model.training import TrainConfig, TrainResult, train
from model.transformer import Transformer

TINY_CONFIG = ModelConfig(
    vocab_size=20, d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=128,
    dropout=0.0, max_source_len=16, max_target_len=16,
)


def reversal_examples(count: int, seed: int) -> ParallelExamples:
    """Random sequences of ids 4..19 (3-8 long) and their reversal."""
    rng = random.Random(seed)
    sources = [[rng.randrange(4, 20) for _ in range(rng.randrange(3, 9))] for _ in range(count)]
    return ParallelExamples(sources, [s[::-1] for s in sources])


@dataclass
class TrainedTiny:
    directory: Path
    result: TrainResult
    valid: ParallelExamples

    def load(self) -> Transformer:
        return load_model(self.directory / "last")


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory: pytest.TempPathFactory) -> TrainedTiny:
    """The tiny model trained for 400 steps (about 15 s on 2 cores)."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-run")
    config = TrainConfig(max_tokens=640, learning_rate=3e-3, warmup_steps=50, max_steps=400,
                         eval_every=100, save_every=400, precision="fp32", seed=0)
    valid = reversal_examples(100, seed=1)
    result = train(TINY_CONFIG, config, reversal_examples(3000, seed=0), valid, directory, progress=False)
    return TrainedTiny(directory, result, valid)


@pytest.fixture
def random_tiny() -> Transformer:
    """An untrained tiny model (seeded), in eval mode."""
    torch.manual_seed(0)
    return Transformer(TINY_CONFIG).eval()


TINY_ALPHABET = "abcdefghijklmno"  # with "▁" and the 4 specials: a 20-piece tokenizer, the tiny vocab


def _tiny_texts(count: int, seed: int) -> list[str]:
    """Short lines of 1-2 words over `TINY_ALPHABET`."""
    rng = random.Random(seed)
    return [" ".join("".join(rng.choice(TINY_ALPHABET) for _ in range(rng.randrange(1, 4)))
                     for _ in range(rng.randrange(1, 3))) for _ in range(count)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece model of exactly 20 pieces (specials, "▁", one per letter of
    `TINY_ALPHABET`): the tiny models' vocabulary, so "abc de" is 7 of their token ids."""
    from model.tokenizer import Tokenizer, train_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(_tiny_texts(300, seed=0)) + "\n", encoding="utf-8")
    path = train_tokenizer([corpus], directory / "tokenizer", vocab_size=TINY_CONFIG.vocab_size)
    assert Tokenizer.from_file(path).vocab_size == TINY_CONFIG.vocab_size
    return path


@pytest.fixture(scope="session")
def tiny_model_repository(trained_tiny: TrainedTiny, tiny_tokenizer: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`trained_tiny` exported into a model repository (task "translate", fp32 + int8, parity
    checked, quality measured on 40 rows), like models/<name>. The model reverses the pieces of
    its input: "abc de" -> "ed cba" (for sources of 3-8 pieces). Do not modify it: copy it."""
    from export.repository import write_repository

    root = tmp_path_factory.mktemp("tiny-repository")
    data_dir, rows = _tiny_test_split(root / "data", tiny_tokenizer)
    out = root / "tiny-reverse"
    write_repository(trained_tiny.load(), tiny_tokenizer, out, task="translate", source_language="en",
                     target_language="en", variants=("fp32", "int8"), data_dir=data_dir,
                     quality_rows=rows, threads=1)
    return out


def _tiny_test_split(data_dir: Path, tokenizer_path: Path) -> tuple[Path, int]:
    """A test split of 40 reversal rows (sources of 3-8 pieces) in `data_dir`; returns it and its rows."""
    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    texts = [t for t in _tiny_texts(200, seed=1) if 3 <= len(tokenizer.encode(t)) <= 8][:40]
    data_dir.mkdir()
    (data_dir / "test.src").write_text("\n".join(texts) + "\n", encoding="utf-8")
    reversed_texts = [tokenizer.decode(tokenizer.encode(t)[::-1]).strip() for t in texts]
    (data_dir / "test.tgt").write_text("\n".join(reversed_texts) + "\n", encoding="utf-8")
    return data_dir, len(texts)


@pytest.fixture(scope="session")
def tiny_data_dir(tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data folder for the tiny models: `tiny_model_repository`'s test split and a training
    split of 400 reversal pairs (train.src/train.tgt)."""
    from model.tokenizer import Tokenizer

    data_dir, _ = _tiny_test_split(tmp_path_factory.mktemp("tiny-data") / "data", tiny_tokenizer)
    tokenizer = Tokenizer.from_file(tiny_tokenizer)
    texts = _tiny_texts(400, seed=2)
    (data_dir / "train.src").write_text("\n".join(texts) + "\n", encoding="utf-8")
    reversed_texts = [tokenizer.decode(tokenizer.encode(t)[::-1]).strip() for t in texts]
    (data_dir / "train.tgt").write_text("\n".join(reversed_texts) + "\n", encoding="utf-8")
    return data_dir


@pytest.fixture
def tiny_repository_and_data(tiny_model_repository: Path, tiny_data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `tiny_model_repository` (to modify), and a copy of `tiny_data_dir` with a valid
    split (its first 100 training pairs), as the commands that calibrate on it read them."""
    copy = tmp_path / "tiny-reverse"
    shutil.copytree(tiny_model_repository, copy)
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    for side in ("src", "tgt"):
        lines = (data / f"train.{side}").read_text(encoding="utf-8").splitlines()[:100]
        (data / f"valid.{side}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return copy, data


@pytest.fixture(scope="session")
def tiny_fp16_repository(trained_tiny: TrainedTiny, tiny_tokenizer: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`trained_tiny` exported with the fp32 and fp16 variants (each with its step graph; quality
    measured on the 40 rows of `tiny_model_repository`'s test split), like models/<name> with
    the variants CUDA serves. Do not modify it: copy it."""
    from export.repository import write_repository

    root = tmp_path_factory.mktemp("tiny-fp16-repository")
    data_dir, rows = _tiny_test_split(root / "data", tiny_tokenizer)
    out = root / "tiny-reverse-fp16"
    write_repository(trained_tiny.load(), tiny_tokenizer, out, task="translate", source_language="en",
                     target_language="en", variants=("fp32", "fp16"), data_dir=data_dir, quality_rows=rows,
                     threads=1)
    return out


@pytest.fixture(scope="session")
def tiny_repository_model(tiny_model_repository: Path) -> Transformer:
    """The repository's own PyTorch weights (bf16-rounded: exactly what its graphs hold)."""
    return load_model(tiny_model_repository)


@pytest.fixture(scope="session")
def tiny_repository_tokenizer(tiny_model_repository: Path):  # -> model.tokenizer.Tokenizer
    from model.tokenizer import Tokenizer

    return Tokenizer.from_file(tiny_model_repository / "tokenizer.model")


@pytest.fixture(scope="session")
def tiny_runtime(tiny_model_repository: Path):  # -> service.runtime.ModelRuntime
    """The tiny repository on onnxruntime: CPU, one thread, the fp32 variant (equal to PyTorch)."""
    from service.runtime import CPU, ModelRuntime

    return ModelRuntime.load(tiny_model_repository, [CPU], threads=1, variant="fp32")


@pytest.fixture(scope="session")
def tiny_shortlist(tiny_model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A vocabulary shortlist for the tiny repository's int8 variant (`export.shortlist`): its step
    graph reading the projection's columns, the projection graph making them from `vocab`, and a
    table of 2 candidates per source piece from the reversal training pairs (no frequent pieces:
    the specials EOS and UNK only). Returns (step graph, projection graph, table)."""
    from export.shortlist import save_table, table_from_ids, write_shortlist_graphs
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    directory = tmp_path_factory.mktemp("tiny-shortlist")
    step = read_manifest(tiny_model_repository).variants["int8"].step_decoder
    assert step
    graph, projection = write_shortlist_graphs(tiny_model_repository / step, directory)
    tokenizer = Tokenizer.from_file(tiny_model_repository / "tokenizer.model")
    pairs = reversal_examples(3000, seed=0)
    table = table_from_ids(pairs.sources, pairs.targets, TINY_CONFIG.vocab_size, k=2, frequent=0,
                           specials=[tokenizer.eos_id, tokenizer.unk_id])
    save_table(table, directory / "shortlist.npz")
    return graph, projection, directory / "shortlist.npz"
