"""The training loop: label-smoothed cross-entropy, warm-up + inverse-sqrt schedule, gradient
clipping, token-budget batches, bf16 autocast, periodic validation, checkpoint save and resume."""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.batching import Batch, ParallelExamples, iterate_batches, to_device, token_budget_batches
from model.checkpoint import load_model, load_training_state, save_training_state, save_weights
from model.config import ModelConfig
from model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (the `train:` section of a run's YAML/TOML file)."""

    max_tokens: int = 6000  # padded tokens per batch (rows x longest side)
    learning_rate: float = 7e-4  # peak, reached at the end of warm-up
    warmup_steps: int = 1000
    schedule: str = "inverse_sqrt"  # or "cosine" (decays to 0 at max_steps)
    label_smoothing: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    max_steps: int = 10_000
    max_epochs: int = 100
    eval_every: int = 500
    save_every: int = 500
    seed: int = 1
    threads: int = 0  # 0: leave torch's default
    precision: str = "bf16"  # "bf16" autocast or "fp32"
    device: str = "auto"  # "auto" picks CUDA when present

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return cls(**values)


def learning_rate_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up to the peak, then inverse-sqrt (Vaswani et al.) or cosine decay."""
    step = max(step, 1)
    if step < config.warmup_steps:
        return config.learning_rate * step / config.warmup_steps
    if config.schedule == "cosine":
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return config.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))
    return config.learning_rate * math.sqrt(config.warmup_steps / step)


def sequence_loss(logits: torch.Tensor, target: torch.Tensor, pad_id: int, smoothing: float) -> torch.Tensor:
    """Mean label-smoothed cross-entropy over non-pad target tokens. logits (B, T, V), target (B, T)."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), target.flatten(), ignore_index=pad_id, label_smoothing=smoothing
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def validation_loss(model: Transformer, examples: ParallelExamples, config: TrainConfig, device: torch.device) -> float:
    """Per-token cross-entropy (no smoothing) over a whole split."""
    model.eval()
    cfg = model.config
    total, tokens = 0.0, 0
    for batch in iterate_batches(examples, token_budget_batches(examples, config.max_tokens, 0), cfg.pad_id, cfg.bos_id, cfg.eos_id):
        batch = to_device(batch, device)
        with autocast(device, config.precision):
            logits = model(batch.source, batch.target_input)
        n = batch.n_target_tokens
        total += float(sequence_loss(logits, batch.target_output, cfg.pad_id, 0.0)) * n
        tokens += n
    model.train()
    return total / max(tokens, 1)


@dataclass
class TrainResult:
    step: int
    epoch: int
    best_valid_loss: float
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    target_tokens_per_second: float = 0.0
    stopped: str = "max_steps"


class _StopRequested:
    """Turns SIGTERM/SIGINT into a flag so the loop can checkpoint before exiting."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        log.warning("signal %d: saving a checkpoint and stopping", signum)
        self.requested = True


def train(
    model_config: ModelConfig,
    config: TrainConfig,
    train_set: ParallelExamples,
    valid_set: ParallelExamples,
    run_dir: str | Path,
    max_minutes: float | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train (or resume, when `run_dir` holds a checkpoint) and return where it stopped.

    `run_dir/last/` is written every `save_every` steps and on exit; `run_dir/best/` holds the
    weights with the lowest validation loss.
    """
    run_dir = Path(run_dir)
    last_dir, best_dir = run_dir / "last", run_dir / "best"
    device = resolve_device(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)

    resuming = (last_dir / "trainer_state.json").exists()
    model = (load_model(last_dir, device) if resuming else Transformer(model_config).to(device)).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, betas=(0.9, 0.98), eps=1e-9, weight_decay=config.weight_decay
    )
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_valid_loss": float("inf"), "valid_losses": []}
    if resuming:
        state.update(load_training_state(last_dir, optimizer))
        log.info("resuming from step %d (epoch %d)", state["step"], state["epoch"])

    def checkpoint() -> None:
        save_weights(model, last_dir)
        save_training_state(last_dir, optimizer, state)

    stop = _StopRequested()
    previous_handlers = _install_handlers(stop)
    deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
    cfg = model.config
    result = TrainResult(state["step"], state["epoch"], state["best_valid_loss"], [tuple(v) for v in state["valid_losses"]])
    tokens_seen, started = 0, time.monotonic()
    bar = tqdm(total=config.max_steps, initial=state["step"], disable=not progress, unit="step", dynamic_ncols=True)
    try:
        while state["step"] < config.max_steps and state["epoch"] < config.max_epochs:
            indices = token_budget_batches(train_set, config.max_tokens, config.seed + state["epoch"])
            for batch in iterate_batches(train_set, indices[state["batch_in_epoch"]:], cfg.pad_id, cfg.bos_id, cfg.eos_id):
                _train_step(model, optimizer, to_device(batch, device), config, state["step"] + 1, device)
                state["step"] += 1
                state["batch_in_epoch"] += 1
                tokens_seen += batch.n_target_tokens
                result.target_tokens_per_second = tokens_seen / (time.monotonic() - started)
                bar.update(1)
                bar.set_postfix(epoch=state["epoch"], lr=f"{learning_rate_at(state['step'], config):.2e}",
                                tok_s=f"{result.target_tokens_per_second:.0f}")
                if state["step"] % config.eval_every == 0:
                    loss = validation_loss(model, valid_set, config, device)
                    state["valid_losses"].append((state["step"], loss))
                    log.info("step %d valid loss %.4f (%.0f target tok/s)", state["step"], loss, result.target_tokens_per_second)
                    if loss < state["best_valid_loss"]:
                        state["best_valid_loss"] = loss
                        save_weights(model, best_dir)
                if state["step"] % config.save_every == 0:
                    checkpoint()
                if stop.requested or (deadline and time.monotonic() > deadline):
                    result.stopped = "signal" if stop.requested else "time_limit"
                    return result
                if state["step"] >= config.max_steps:
                    break
            else:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
        result.stopped = "max_steps" if state["step"] >= config.max_steps else "max_epochs"
        return result
    finally:
        bar.close()
        checkpoint()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        result.step, result.epoch = state["step"], state["epoch"]
        result.best_valid_loss = state["best_valid_loss"]
        result.valid_losses = [tuple(v) for v in state["valid_losses"]]


def _train_step(
    model: Transformer, optimizer: torch.optim.Optimizer, batch: Batch, config: TrainConfig, step: int, device: torch.device
) -> float:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate_at(step, config)
    with autocast(device, config.precision):
        logits = model(batch.source, batch.target_input)  # (B, T, V)
    loss = sequence_loss(logits, batch.target_output, model.config.pad_id, config.label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
    optimizer.step()
    return float(loss.detach())


def _install_handlers(stop: _StopRequested) -> dict[int, Any]:
    """Route SIGTERM/SIGINT to `stop` (only possible on the main thread)."""
    try:
        return {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:
        return {}
