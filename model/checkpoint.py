"""Save and load weights (safetensors) and the optimizer state beside them, without pickle.

A checkpoint directory holds:
  checkpoint.safetensors   model weights (tied aliases stored once), dtype of choice
  config.json              the `ModelConfig`
  optimizer.safetensors    AdamW moments and the RNG state (training runs only)
  trainer_state.json       step, epoch, position in the epoch, best validation loss
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.config import ModelConfig
from model.transformer import Transformer

WEIGHTS_FILE = "checkpoint.safetensors"
CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor (tied embeddings) kept under its first name only."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor
    return state


def save_weights(model: Transformer, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write checkpoint.safetensors (optionally cast, e.g. to bfloat16) and config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        for name, t in unique_state_dict(model).items()
    }
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"config": json.dumps(model.config.to_dict())})
    model.config.save(directory / CONFIG_FILE)


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Build a `Transformer` from a checkpoint directory, weights in float32, in eval mode."""
    directory = Path(directory)
    config = read_config(directory)
    model = Transformer(config)
    state = {k: v.to(torch.float32) for k, v in load_file(str(directory / WEIGHTS_FILE)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    aliases = {"target_embedding.tokens.weight", "output_projection.weight"} if config.tie_embeddings else set()
    if unexpected or set(missing) - aliases:
        raise ValueError(f"checkpoint {directory} does not match its config: missing={missing} unexpected={unexpected}")
    return model.to(device).eval()


def read_config(directory: str | Path) -> ModelConfig:
    """The model config: config.json when present, else the weights file's own metadata."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).exists():
        return ModelConfig.load(directory / CONFIG_FILE)
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as weights:
        return ModelConfig.from_dict(json.loads(weights.metadata()["config"]))


def save_training_state(
    directory: str | Path, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]
) -> None:
    """Write the optimizer moments, the RNG state and the trainer's counters."""
    directory = Path(directory)
    optimizer_state = optimizer.state_dict()
    tensors = {"rng_state": torch.get_rng_state()}
    for index, values in optimizer_state["state"].items():
        for key, value in values.items():
            tensors[f"state.{index}.{key}"] = torch.as_tensor(value).contiguous()
    save_file(tensors, str(directory / OPTIMIZER_FILE))
    state = dict(trainer_state, param_groups=optimizer_state["param_groups"])
    (directory / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def load_training_state(directory: str | Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the optimizer and RNG state written by `save_training_state`; returns the counters."""
    directory = Path(directory)
    trainer_state = json.loads((directory / TRAINER_STATE_FILE).read_text())
    tensors = load_file(str(directory / OPTIMIZER_FILE))
    torch.set_rng_state(tensors.pop("rng_state"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": trainer_state.pop("param_groups")})
    return trainer_state
