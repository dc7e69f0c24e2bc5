"""The same sentences through the server's protocols, in alternating turns: `/v1/translate`
(JSON), KServe v2 over REST (`/v2/models/<name>/infer`, JSON tensors), KServe v2 over gRPC
(`ModelInfer`, raw tensor contents, as `tritonclient[grpc]` sends them) and OpenAI's chat
completions (`/v1/chat/completions`).

One server (`attnserve serve` with `--grpc-port`, the defaults otherwise) answers every arm; a
closed loop of `--concurrency` clients sends one sentence per request, each arm in turn (the
first arm rotating from turn to turn), after a warm-up of each. Per arm and turn: sentences/s,
latency percentiles, and the CPU per request of the server's event loop (the main thread:
HTTP parsing, JSON, gRPC's handlers; gRPC's own I/O threads count in the server's CPU) and of
this process, the load generator. The gRPC clients share one channel, as a client library's
stub does (one HTTP/2 connection); the HTTP clients have a keep-alive connection each.

    python -m bench.protocols --models models --data-dir data --concurrency 1 64 --repeats 3 \
        --out bench/results/protocols
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from bench import load
from bench.levers import cpu_seconds, event_loop_cpu_seconds
from bench.servers import free_port, service_process
from service.api import grpc_messages as pb
from service.api import open_inference

logger = logging.getLogger(__name__)

MODEL = "translate-en-it"
ARMS = ("v1 JSON", "KServe v2 REST", "KServe v2 gRPC", "OpenAI chat")


def infer_body(text: str) -> dict[str, Any]:
    """The REST infer request of one sentence (JSON tensor data)."""
    return {"inputs": [{"name": open_inference.INPUT, "shape": [1], "datatype": "BYTES",
                        "data": [text]}]}


def chat_body(text: str, model: str = MODEL) -> dict[str, Any]:
    """OpenAI's chat completion request of one sentence."""
    return {"model": model, "messages": [{"role": "user", "content": text}]}


def infer_message(text: str, model: str = MODEL) -> bytes:
    """The gRPC infer request of one sentence to `model`, serialized (raw input contents)."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=open_inference.INPUT, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(open_inference.serialize_bytes([text]))
    return bytes(request.SerializeToString())


async def grpc_closed_loop(target: str, texts: Sequence[str], concurrency: int,
                           model: str = MODEL) -> load.LoadResult:
    """`concurrency` clients over one channel, each sending the next sentence when its last
    answer came back, every sentence once; samples as `bench.load`'s (status 200, or 0 with the
    gRPC code)."""
    messages = [infer_message(text, model) for text in texts]
    result = load.LoadResult()
    next_index = 0
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:
        infer = channel.unary_unary(f"/{pb.SERVICE}/ModelInfer",
                                    request_serializer=lambda raw: raw,
                                    response_deserializer=pb.ModelInferResponse.FromString)

        async def user() -> None:
            nonlocal next_index
            while next_index < len(messages):
                message = messages[next_index]
                next_index += 1
                sent = time.perf_counter()
                try:
                    response = await infer(message, timeout=load.REQUEST_TIMEOUT_S)
                    status, error = (200, "") if response.raw_output_contents else (200, "no outputs")
                except grpc.aio.AioRpcError as rpc_error:
                    status, error = load.TRANSPORT_ERROR, f"{rpc_error.code().name}: {rpc_error.details()}"
                result.samples.append(load.Sample(sent - t0, status, time.perf_counter() - sent, error))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - t0
    return result


def run_arm(arm: str, base_url: str, grpc_target: str, texts: Sequence[str],
            concurrency: int, model: str = MODEL) -> load.LoadResult:
    """One closed loop of `arm` over `texts` to the translation model `model`."""
    if arm == "KServe v2 gRPC":
        return asyncio.run(grpc_closed_loop(grpc_target, texts, concurrency, model))
    if arm == "KServe v2 REST":
        url, bodies = f"{base_url}/v2/models/{model}/infer", [infer_body(t) for t in texts]
    elif arm == "OpenAI chat":
        bodies = [chat_body(t, model) for t in texts]
        return asyncio.run(load.closed_loop(f"{base_url}/v1/chat/completions", bodies, concurrency, outputs=False))
    else:
        url, bodies = f"{base_url}/v1/translate", load.text_bodies(texts, model=model)
    return asyncio.run(load.closed_loop(url, bodies, concurrency))


def measured(pid: int, work: Callable[[], load.LoadResult]) -> dict[str, Any]:
    """`work`'s figures and the CPU per answered request of the server (`pid`), its event loop
    and this process."""
    cpu, loop, generator = cpu_seconds(pid), event_loop_cpu_seconds(pid), time.process_time()
    result = work()
    answered = max(len(result.samples), 1)
    per_request = {
        "server_cpu_ms_per_request": 1000 * (cpu_seconds(pid) - cpu) / answered,
        "event_loop_ms_per_request": 1000 * (event_loop_cpu_seconds(pid) - loop) / answered,
        "load_generator_ms_per_request": 1000 * (time.process_time() - generator) / answered,
    }
    return {**result.stats().to_dict(), **{k: round(v, 3) for k, v in per_request.items()},
            "error_samples": result.error_samples}


def run(models_dir: Path, texts: list[str], concurrencies: Sequence[int], repeats: int,
        out_dir: Path, model: str = MODEL, flags: Sequence[str] = ()) -> dict[str, Any]:
    """Every arm at every concurrency, `repeats` turns, against one server (`attnserve serve`
    with `flags`) of `models_dir`, whose translation model `model` answers."""
    grpc_port = free_port()
    server = service_process(models_dir, out_dir / "server.log", ["--grpc-port", str(grpc_port), *flags])
    server.start()
    target = f"127.0.0.1:{grpc_port}"
    runs: list[dict[str, Any]] = []
    try:
        assert server.process is not None
        pid = server.process.pid
        for concurrency in concurrencies:
            for arm in ARMS:  # warm-up: connections, sessions, the arm's code paths
                run_arm(arm, server.url, target, texts[: 2 * concurrency], concurrency, model)
            for turn in range(repeats):
                order = ARMS[turn % len(ARMS):] + ARMS[: turn % len(ARMS)]
                for arm in order:
                    figures = measured(pid, lambda a=arm, c=concurrency: run_arm(
                        a, server.url, target, texts, c, model))
                    runs.append({"arm": arm, "concurrency": concurrency, "turn": turn, **figures})
                    logger.info("c%d turn %d %s: %.1f sentences/s", concurrency, turn, arm,
                                figures["sentences_per_s"])
    finally:
        server.stop()
    return {"model": model, "sentences": len(texts), "repeats": repeats, "runs": runs}


def markdown(results: dict[str, Any]) -> str:
    """Each arm's medians over the turns, by concurrency."""
    title = (f"# One sentence per request through each protocol ({results['sentences']} test "
             f"sentences, {results['repeats']} alternating turns; medians over the turns)")
    header = ("| clients | protocol | sentences/s (range) | p50 ms | p95 ms | server CPU ms/request "
              "| event loop ms/request | load generator ms/request | errors |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|---|---|"]
    for concurrency in sorted({r["concurrency"] for r in results["runs"]}):
        for arm in ARMS:
            runs = [r for r in results["runs"] if r["arm"] == arm and r["concurrency"] == concurrency]
            if not runs:
                continue
            rates = [r["sentences_per_s"] for r in runs]

            def median(key: str, scale: float = 1.0, runs: list[dict[str, Any]] = runs) -> str:
                return f"{scale * statistics.median(r[key] for r in runs):.2f}"

            lines.append(f"| {concurrency} | {arm} | {statistics.median(rates):.1f} ({min(rates):.1f}-"
                         f"{max(rates):.1f}) | {median('latency_p50_s', 1000)} | {median('latency_p95_s', 1000)} | "
                         f"{median('server_cpu_ms_per_request')} | {median('event_loop_ms_per_request')} | "
                         f"{median('load_generator_ms_per_request')} | {sum(r['errors'] for r in runs)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protocols", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--model", default=MODEL, help="the translation model (its test split in --data-dir)")
    parser.add_argument("--sentences", type=int, default=1000, help="test sentences per turn")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3, help="alternating turns")
    parser.add_argument("--out", type=Path, default=Path("bench/results/protocols"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    texts = (args.data_dir / args.model / "test.src").read_text(encoding="utf-8").splitlines()[: args.sentences]
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args.models, texts, args.concurrency, args.repeats, args.out, args.model)
    (args.out / "protocols.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "protocols.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
