"""The models the server serves: discovered under the models folder, loaded in the background.

Every sub-folder with a `manifest.json` is a model, named after its folder; its task is read
from the manifest at once, so requests for a loading or failed model get a 503. At startup one
background thread loads them one by one (hash check and sessions in the runtime's `load`,
then a warm-up inference); each model that loads gets its batchers (`BatcherPool`: one per batch
worker, see `Settings.batch_workers`) on the event loop and turns
ready. A model that fails stays listed as failed with its error: the server is live but
never ready (or, with `fail_on_model_error`, the app refuses to start: `wait_settled`). The
server is ready when every model is, and not while draining for shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.batching.batcher import Batcher, GenerateFn
from service.batching.in_flight import InFlightBatch
from service.batching.policy import BatchLimits
from service.batching.pool import BatcherPool
from service.core.errors import InvalidInput, ModelNotFound, NotReady, shorten
from service.core.settings import Settings
from service.observability import metrics
from service.runtime.protocol import Runtime

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a model folder's name: no path
TASKS = ("translate", "summarize")
State = Literal["loading", "ready", "failed"]


Loader = Callable[[Path], Runtime]
GeneratorFactory = Callable[[Runtime], GenerateFn]
# runtime -> a factory of its running batch (continuous batching)
RunningBatchFactory = Callable[[Runtime], Callable[[], InFlightBatch[Any]]]


def onnx_loader(settings: Settings) -> Loader:
    """Load a model folder with `ModelRuntime.load` and the configured providers."""

    def load(path: Path) -> Runtime:
        from service.runtime import ModelRuntime  # lazy: onnxruntime only when serving

        runtime: Runtime = ModelRuntime.load(
            path, providers=list(settings.providers), threads=settings.session_threads(),
            variant=settings.variant, spinning=settings.spinning,
            memory_arena=settings.cpu_memory_arena, step_graph=settings.step_graph, lone_step=settings.lone_step,
            gpu_memory_limit_mb=settings.gpu_memory_limit_mb,
            shortlist=settings.continuous_batching and settings.shortlist_rows > 0,
        )
        return runtime

    return load


def onnx_generator(settings: Settings) -> GeneratorFactory:
    """`service.generation.search.generate` bound to each runtime; every greedy result scored
    only with `settings.greedy_scores` (each step's log-softmax over the vocabulary costs
    throughput: `bench/results/levers-scores`), else only the rows that ask (`RowHooks.scores`)."""
    from service.generation.search import generate

    def bind(runtime: Runtime) -> GenerateFn:
        return functools.partial(generate, runtime, greedy_scores=settings.greedy_scores)  # type: ignore[arg-type]

    return bind


def onnx_running_batch(settings: Settings) -> RunningBatchFactory:
    """Continuous batching over each runtime, scored as in `onnx_generator`: on its step graph
    (`service.batching.slot_batch.SlotBatch`, its steps of at most `shortlist_rows` rows over
    the runtime's vocabulary shortlist when it has one) when it has one, else on the merged decoder
    (`service.batching.running_batch.RunningBatch`)."""
    from service.batching.running_batch import RunningBatch
    from service.batching.slot_batch import SlotBatch

    def bind(runtime: Runtime) -> Callable[[], InFlightBatch[Any]]:
        if getattr(runtime, "step", None) is not None:
            return functools.partial(SlotBatch, runtime, scores=settings.greedy_scores,  # type: ignore[arg-type]
                                     shortlist_rows=settings.shortlist_rows,
                                     shortlist_share=settings.shortlist_share)
        return functools.partial(RunningBatch, runtime, scores=settings.greedy_scores)  # type: ignore[arg-type]

    return bind


@dataclass
class ModelEntry:
    """One model folder and where it stands."""

    name: str
    path: Path
    task: str | None = None
    state: State = "loading"
    runtime: Runtime | None = None
    batcher: BatcherPool | None = None
    error: str | None = None
    languages: tuple[str, str] | None = None  # (source, target), from the manifest, while loading too


class ModelRegistry:
    """Loads the models in the background and hands out the ready ones."""

    def __init__(self, settings: Settings, loader: Loader, generator: GeneratorFactory,
                 running_batch: RunningBatchFactory | None = None) -> None:
        self.settings = settings
        self.draining = False
        self._loader = loader
        self._generator = generator
        self._running_batch = running_batch if settings.continuous_batching else None
        self._entries: dict[str, ModelEntry] = {}
        self._thread: threading.Thread | None = None
        self._settled: asyncio.Event | None = None
        self._control_lock: asyncio.Lock | None = None  # one load or unload at a time
        self._retiring: set[asyncio.Future[None]] = set()  # replaced versions' batchers, draining

    @property
    def entries(self) -> list[ModelEntry]:
        """Every discovered model, by name."""
        return list(self._entries.values())

    @property
    def ready(self) -> bool:
        """True when there are models, all of them ready, and the server is not draining."""
        return (
            not self.draining
            and bool(self._entries)
            and all(entry.state == "ready" for entry in self._entries.values())
        )

    def not_ready_reason(self) -> str:
        """Why `ready` is False, in one line."""
        if self.draining:
            return "the server is shutting down"
        if not self._entries:
            return "no models found in the models folder"
        waiting = [f"{e.name} ({e.state})" for e in self._entries.values() if e.state != "ready"]
        return "models not ready: " + ", ".join(waiting)

    def start(self) -> None:
        """Discover the model folders and load them in a background thread."""
        self._entries = {}
        for path in self._discover():
            task, languages = _manifest_head(path)
            self._entries[path.name] = ModelEntry(path.name, path, task=task, languages=languages)
        if not self._entries:
            logger.error("no models found in %s: the server will not turn ready",
                         self.settings.models_dir)
            return
        loop = asyncio.get_running_loop()
        self._settled = asyncio.Event()
        self._thread = threading.Thread(
            target=self._load_all, args=(loop,), name="model-loader", daemon=True
        )
        self._thread.start()

    async def wait_settled(self) -> list[ModelEntry]:
        """Wait until every model has loaded or failed; returns the failed ones."""
        if self._settled is not None:
            await self._settled.wait()
        return [entry for entry in self._entries.values() if entry.state == "failed"]

    def begin_draining(self) -> None:
        """Turn readiness to 503 now (SIGTERM); requests in flight or still arriving are served."""
        if not self.draining:
            logger.info("draining: readiness is now 503, in-flight requests finish")
        self.draining = True

    async def close(self, timeout_s: float) -> None:
        """Drain every batcher (at most `timeout_s`) and stop them."""
        self.begin_draining()
        batchers = [e.batcher for e in self._entries.values() if e.batcher is not None]
        await asyncio.gather(*(batcher.close(timeout_s) for batcher in batchers), *self._retiring)

    def folders(self) -> list[tuple[str, ModelEntry | None]]:
        """Every model folder under the models folder now and every model served, by name, with
        its entry (None: a folder not loaded)."""
        names = {path.name for path in self._discover(quiet=True)} | set(self._entries)
        return [(name, self._entries.get(name)) for name in sorted(names)]

    async def load(self, name: str) -> ModelEntry:
        """Load the model folder `name` of the models folder (again, when it is served) while
        the others serve: hash check, sessions and warm-up in a thread; once ready it takes the
        name, and the version it replaces drains in the background (its queued and running rows
        finish on it; requests after the swap reach the new one). A load that fails raises
        `InvalidInput` with the reason and leaves the version served (if any) serving.
        `ModelNotFound` for a name that is no model folder; `NotReady` while the models of the
        start still load, or while draining."""
        path = self._folder(name)
        async with self._control():
            task, languages = _manifest_head(path)
            entry = ModelEntry(name, path, task=task, languages=languages)
            start = time.perf_counter()
            try:
                runtime, generate = await asyncio.to_thread(self._load_one, entry)
            except Exception as error:  # noqa: BLE001 -- logged with its trace by _load_error
                raise InvalidInput(f"model {name!r} failed to load: {self._load_error(entry, error)}") from None
            if self.draining:
                raise NotReady("the server is shutting down")
            self._serve(entry, runtime, generate, time.perf_counter() - start)
            old = self._entries.get(name)
            self._entries = dict(sorted({**self._entries, name: entry}.items()))
            if old is not None:
                self._retire(old, keep_info=old.runtime is not None and (old.runtime.task, old.runtime.provider,
                             old.runtime.variant) == (runtime.task, runtime.provider, runtime.variant))
            logger.info("model %s %s", name, "reloaded" if old is not None else "loaded")
            return entry

    async def unload(self, name: str) -> None:
        """Stop serving model `name`: requests for it get a 404 at once, its queued and running
        rows finish in the background. `ModelNotFound` when it is not served."""
        async with self._control():
            entry = self._entries.get(name)
            if entry is None:
                raise ModelNotFound(f"model {shorten(repr(name))} is not loaded")
            self._entries = {key: value for key, value in self._entries.items() if key != name}
            self._retire(entry, keep_info=False)
            logger.info("model %s unloaded", name)

    def _folder(self, name: str) -> Path:
        """The folder of model `name`: a sub-folder of the models folder with a manifest."""
        path = self.settings.models_dir / name
        if (not _FOLDER_NAME.fullmatch(name) or name.startswith(".")
                or not (path / MANIFEST).is_file()):
            raise ModelNotFound(f"no model folder {shorten(repr(name))} in the models folder")
        return path

    @contextlib.asynccontextmanager
    async def _control(self) -> AsyncIterator[None]:
        """One load or unload at a time, after the models of the start have settled, not while draining."""
        if self.draining:
            raise NotReady("the server is shutting down")
        if self._settled is not None and not self._settled.is_set():
            raise NotReady("the models of the start are still loading")
        if self._control_lock is None:
            self._control_lock = asyncio.Lock()
        async with self._control_lock:
            yield

    def _retire(self, entry: ModelEntry, keep_info: bool) -> None:
        """Drain a replaced or unloaded version's batchers in the background; its `model_info`
        goes unless the version that replaces it has the same labels."""
        if entry.runtime is not None and not keep_info:
            with contextlib.suppress(KeyError):
                metrics.MODEL_INFO.remove(entry.name, entry.runtime.task, entry.runtime.provider,
                                          entry.runtime.variant)
        if entry.batcher is not None:
            task = asyncio.ensure_future(entry.batcher.close(self.settings.drain_timeout_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def resolve(self, task: str | None, name: str | None) -> ModelEntry:
        """The ready model `name` serving `task` (any task when None), or the task's default.

        Raises `ModelNotFound` for an unknown name or task, `NotReady` for a model that is
        loading or failed. While draining requests are still served (the batchers refuse new
        rows only once they close).
        """
        if name is None and task is None:
            raise ValueError("give a task or a model name")
        entry = self._entries.get(name) if name is not None else self._default_for(str(task))
        if entry is None:
            what = f"model {name!r}" if name is not None else f"{task} model"
            raise ModelNotFound(f"no {what} on this server")
        if task is not None and entry.task != task:
            raise ModelNotFound(f"model {entry.name!r} does not serve {task}")
        if entry.state == "failed":
            raise NotReady(f"model {entry.name!r} failed to load")
        if entry.state != "ready" or entry.runtime is None or entry.batcher is None:
            raise NotReady(f"model {entry.name!r} is still loading")
        return entry

    def _default_for(self, task: str) -> ModelEntry | None:
        """The first model (by name) of `task`, ready or not."""
        return next((e for e in self._entries.values() if e.task == task), None)

    def _discover(self, quiet: bool = False) -> list[Path]:
        """Sub-folders of the models folder that hold a manifest, sorted by name; unless
        `quiet`, what is not one is logged."""
        root = self.settings.models_dir
        if not root.is_dir():
            if not quiet:
                logger.error("models folder %s does not exist", root)
            return []
        folders = []
        for path in sorted(root.iterdir()):
            if not path.is_dir() or path.name.startswith("."):
                continue
            if (path / MANIFEST).is_file():
                folders.append(path)
            elif not quiet:
                logger.warning("skipping %s: no %s", path, MANIFEST)
        return folders

    def _load_all(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loader thread: load, check and warm up each model; publish on the event loop."""
        for entry in list(self._entries.values()):
            start = time.perf_counter()
            try:
                runtime, generate = self._load_one(entry)
            except Exception as error:  # noqa: BLE001 -- logged by _load_error; live, not ready
                self._publish(loop, self._on_failed, entry, self._load_error(entry, error))
                continue
            seconds = time.perf_counter() - start
            self._publish(loop, self._on_loaded, entry, runtime, generate, seconds)
        if self._settled is not None:
            self._publish(loop, self._settled.set)  # after every model's own callback

    def _load_one(self, entry: ModelEntry) -> tuple[Runtime, GenerateFn]:
        """Load, check and warm up `entry`'s folder (in a thread: it takes seconds)."""
        runtime = self._loader(entry.path)
        if runtime.task not in TASKS:
            raise ValueError(f"unknown task {runtime.task!r}")
        if entry.task is not None and runtime.task != entry.task:
            raise ValueError(f"task {runtime.task!r} differs from the manifest's")
        generate = self._generator(runtime)
        self._warm_up(runtime, generate)
        return runtime, generate

    @staticmethod
    def _load_error(entry: ModelEntry, error: Exception) -> str:
        """Log a failed load with its trace; returns its message without the server's paths."""
        logger.error("model %s failed to load from %s: %s: %s", entry.name, entry.path,
                     type(error).__name__, error, exc_info=error)
        return public_error(f"{type(error).__name__}: {error}", entry.path)

    @staticmethod
    def _warm_up(runtime: Runtime, generate: GenerateFn) -> None:
        """The runtime's own warm-up, then one short generation through the serving path."""
        runtime.warmup()
        tokenizer = runtime.tokenizer
        generate([tokenizer.encode("warm up")[:4] + [tokenizer.eos_id]], 1, 2)

    @staticmethod
    def _publish(loop: asyncio.AbstractEventLoop, callback: Callable[..., None],
                 *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed while loading (shutdown)
            pass

    def _on_loaded(
        self, entry: ModelEntry, runtime: Runtime, generate: GenerateFn, seconds: float
    ) -> None:
        if self.draining:  # finished loading during shutdown: nothing will be served
            return
        self._serve(entry, runtime, generate, seconds)
        if self.ready:
            logger.info("all %d models ready", len(self._entries))

    def _serve(self, entry: ModelEntry, runtime: Runtime, generate: GenerateFn, seconds: float) -> None:
        """Give a loaded model its batchers and turn it ready."""
        settings = self.settings
        workers = settings.batch_workers_on(runtime.provider)
        limits = BatchLimits(
            max_batch_size=settings.max_batch_size_on(runtime.provider),
            max_batch_tokens=settings.max_batch_tokens_on(runtime.provider),
            max_wait_s=settings.max_wait_ms / 1000,
            max_join_wait_s=settings.max_join_wait_ms / 1000,
            max_beam_wait_s=settings.max_beam_wait_ms / 1000,
            max_join_age=settings.max_join_age,
            # the model's queue shared among its batchers (a request of max_texts still fits)
            max_queue_size=max(-(-settings.max_queue_size // workers), settings.max_texts),
            retry_after_s=settings.retry_after_s,
        )
        running_batch = self._running_batch(runtime) if self._running_batch else None
        length_slack = max(1, limits.max_batch_size // 8) if settings.length_routing else 0
        entry.batcher = BatcherPool(entry.name, [
            Batcher(entry.name, generate, limits, running_batch, thread_name=f"batch-{entry.name}-{index}")
            for index in range(workers)], length_slack=length_slack)
        entry.batcher.start()
        entry.runtime = runtime
        entry.task = runtime.task
        entry.state = "ready"
        metrics.MODEL_INFO.labels(entry.name, runtime.task, runtime.provider,
                                  runtime.variant).set(1)
        metrics.MODEL_LOAD_SECONDS.labels(entry.name).set(seconds)
        logger.info("model %s ready: task %s, provider %s, variant %s, loaded in %.1fs",
                    entry.name, runtime.task, runtime.provider, runtime.variant, seconds)

    def _on_failed(self, entry: ModelEntry, message: str) -> None:
        entry.state = "failed"
        entry.error = message


# An absolute path of two or more parts (POSIX, or Windows with a drive letter).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])(?:[A-Za-z]:)?(?:[/\\][^\s/\\'\"`:;,()\[\]]+){2,}")


def public_error(message: str, model_path: Path) -> str:
    """`message` without the server's file-system paths: the model's folder becomes its name,
    any other absolute path its last part (".../decoder.onnx"). For `GET /v1/models`; the log
    keeps the full message."""
    for folder in {str(model_path.resolve()), str(model_path)}:
        message = message.replace(folder, model_path.name)
    return _ABSOLUTE_PATH.sub(lambda m: ".../" + re.split(r"[/\\]", m.group())[-1], message)


def _manifest_head(path: Path) -> tuple[str | None, tuple[str, str] | None]:
    """The `task` of a model folder's manifest and its (source, target) languages, each None
    when it cannot be read (yet)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        task, source, target = (manifest.get(key) for key in ("task", "source_language", "target_language"))
    except (OSError, ValueError, AttributeError):
        return None, None
    languages = (source, target) if isinstance(source, str) and isinstance(target, str) else None
    return (task if isinstance(task, str) else None), languages
