"""`GET /v1/models`: every model, its state, execution provider, variant and batch counters;
and their names in OpenAI's list (`object`, `data`), which its clients read.

With `api_key` set it needs the token (unless `public_metadata`). A load error is shown without
the server's file-system paths (`service.core.registry.public_error`); the log has them.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from service.api.auth import require_api_key_for_metadata
from service.api.routes.deps import RegistryDep, SettingsDep
from service.api.schemas import BatchCounters, ErrorBody, ModelCard, ModelList, OpenAIModel
from service.core.registry import ModelEntry

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key_for_metadata)])


@router.get("/v1/models", responses={401: {"model": ErrorBody}})
async def list_models(registry: RegistryDep, settings: SettingsDep) -> ModelList:
    """The models found in the models folder, loaded or not."""
    now = int(time.time())
    return ModelList(models=[_card(entry, settings.shortlist_rows, settings.gpu_memory_limit_mb, settings.workers)
                             for entry in registry.entries],
                     data=[OpenAIModel(id=entry.name, created=now) for entry in registry.entries])


def _card(entry: ModelEntry, shortlist_rows: int, gpu_memory_limit_mb: int, processes: int) -> ModelCard:
    runtime, batcher = entry.runtime, entry.batcher
    counters = batcher.counters if batcher is not None else None
    continuous = batcher.continuous if batcher is not None else False
    shortlisted = continuous and getattr(runtime, "shortlist", None) is not None
    return ModelCard(
        name=entry.name,
        task=entry.task,
        state=entry.state,
        ready=entry.state == "ready",
        provider=runtime.provider if runtime else None,
        variant=runtime.variant if runtime else None,
        max_source_len=runtime.max_source_len if runtime else None,
        max_target_len=runtime.max_target_len if runtime else None,
        step_graph=getattr(runtime, "step", None) is not None if runtime else None,
        lone_step=getattr(runtime, "lone", None) is not None if runtime else None,
        gpu_memory_limit_mb=gpu_memory_limit_mb if runtime and runtime.provider == "CUDAExecutionProvider" else None,
        error=entry.error,
        batching=BatchCounters(
            continuous=continuous,
            shortlist_rows=shortlist_rows if shortlisted else 0,
            workers=len(batcher.batchers) if batcher is not None else 0,
            processes=processes,
            batches=counters.batches if counters else 0,
            rows=counters.rows if counters else 0,
            max_batch_rows=counters.max_batch_rows if counters else 0,
            cancelled=counters.cancelled if counters else 0,
            running=batcher.running if batcher is not None else 0,
            cache_bytes=batcher.cache_bytes if batcher is not None else 0,
            max_cache_bytes=counters.max_cache_bytes if counters else 0,
        ),
    )
