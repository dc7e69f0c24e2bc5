"""The service's settings: one pydantic-settings object, from `ATTNSERVE_*` variables and flags.

Flags of `attnserve serve` are passed as keyword arguments and win over the environment,
which wins over the defaults here. A list (`ATTNSERVE_PROVIDERS`) is written comma-separated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service import schemas

DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


class Settings(BaseSettings):
    """Where the models are, how onnxruntime runs them, and the batching and input limits."""

    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", frozen=True, extra="ignore")

    # Network (used by `attnserve serve`).
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    # Models and onnxruntime.
    models_dir: Path = Path("models")
    providers: Annotated[tuple[str, ...], NoDecode] = DEFAULT_PROVIDERS
    threads: int = Field(default=0, ge=0, description="intra-op threads; 0 = onnxruntime's")
    variant: str | None = Field(default=None, description="force fp32, fp16 or int8")

    # Dynamic batching.
    max_batch_size: int = Field(default=32, ge=1, description="rows (texts) per batch")
    max_batch_tokens: int = Field(default=8192, ge=1, description="padded tokens x beams")
    max_wait_ms: float = Field(default=5.0, ge=0, description="longest wait to fill a batch")
    max_queue_size: int = Field(default=256, ge=1, description="rows waiting, per model")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After of a 429")

    # Input limits (at most the hard caps of `service.schemas`).
    max_texts: int = Field(default=16, ge=1, le=schemas.MAX_TEXTS)
    max_text_chars: int = Field(default=2000, ge=1, le=schemas.MAX_TEXT_CHARS)
    max_input_tokens: int | None = Field(
        default=None, ge=1, description="source tokens per text; None = the model's limit"
    )
    default_max_new_tokens: int | None = Field(
        default=None, ge=1, le=schemas.MAX_NEW_TOKENS, description="None = the model's limit"
    )
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="larger: 413")

    # Attention maps (`POST /v1/attention`): a response holds layers x heads x queries x keys
    # numbers per kind, so both axes and the total are capped (422 beyond).
    attention_max_source_tokens: int = Field(
        default=128, ge=1, description="source tokens (without EOS) of /v1/attention"
    )
    attention_max_target_tokens: int = Field(
        default=128, ge=1, description="target tokens (given or generated, without EOS)"
    )
    attention_max_cells: int = Field(
        default=1_000_000, ge=1, description="weights in one /v1/attention response, all kinds"
    )

    # Deadlines and shutdown.
    request_timeout_s: float = Field(default=60.0, gt=0, description="per request")
    graceful_timeout_s: float = Field(default=30.0, ge=0, description="drain after SIGTERM")
    shutdown_delay_s: float = Field(
        default=0.0, ge=0, description="after SIGTERM, keep accepting (readiness 503) this long"
    )

    @field_validator("providers", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        """`"CUDAExecutionProvider, CPUExecutionProvider"` -> a tuple of names."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("providers")
    @classmethod
    def _providers_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one execution provider is needed")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.max_texts > self.max_queue_size:
            raise ValueError("max_texts must not exceed max_queue_size")
        return self
