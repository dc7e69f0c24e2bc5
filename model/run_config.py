"""A training run's file (YAML or TOML): task, data, model shape and optimisation settings.

    task: translate-en-it
    data_dir: data/translate-en-it      # from `attnserve prepare-data`
    run_dir: runs/translate-en-it       # checkpoints (resumed when present)
    model: {d_model: 256, n_heads: 4, ...}   # ModelConfig fields; vocab and ids come from the tokenizer
    train: {max_tokens: 6000, ...}      # TrainConfig fields
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from model.batching import ParallelExamples
from model.config import ModelConfig
from model.tokenizer import Tokenizer
from model.training import TrainConfig

TASKS = ("translate-en-it", "summarize-en")


@dataclass(frozen=True)
class RunConfig:
    task: str
    data_dir: Path
    run_dir: Path
    model: dict[str, Any]
    train: TrainConfig

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / "tokenizer.model"

    def model_config(self, tokenizer: Tokenizer) -> ModelConfig:
        """The model config with vocabulary size and special ids taken from the tokenizer."""
        return ModelConfig.from_dict(
            dict(
                self.model,
                vocab_size=tokenizer.vocab_size,
                pad_id=tokenizer.pad_id,
                unk_id=tokenizer.unk_id,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
            )
        )


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run file; `.toml` is TOML, anything else YAML."""
    path = Path(path)
    text = path.read_text()
    values = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    if values.get("task") not in TASKS:
        raise ValueError(f"{path}: task must be one of {TASKS}, got {values.get('task')!r}")
    return RunConfig(
        task=values["task"],
        data_dir=Path(values["data_dir"]),
        run_dir=Path(values["run_dir"]),
        model=dict(values.get("model", {})),
        train=TrainConfig.from_dict(values.get("train", {})),
    )


def read_split(data_dir: str | Path, split: str) -> tuple[list[str], list[str]]:
    """The raw source and target lines of a split."""
    data_dir = Path(data_dir)
    sources = (data_dir / f"{split}.src").read_text(encoding="utf-8").splitlines()
    targets = (data_dir / f"{split}.tgt").read_text(encoding="utf-8").splitlines()
    if len(sources) != len(targets):
        raise ValueError(f"{data_dir}/{split}: {len(sources)} sources but {len(targets)} targets")
    return sources, targets


def load_examples(data_dir: str | Path, split: str, tokenizer: Tokenizer, config: ModelConfig) -> ParallelExamples:
    """Tokenize a split, cutting sources and targets to the model's maximum lengths (EOS included)."""
    sources, targets = read_split(data_dir, split)
    return ParallelExamples(
        [ids[: config.max_source_len - 1] for ids in tokenizer.encode_batch(sources)],
        [ids[: config.max_target_len - 1] for ids in tokenizer.encode_batch(targets)],
    )
