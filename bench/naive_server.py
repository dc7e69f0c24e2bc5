"""The naive baseline: FastAPI around the PyTorch model's reference greedy decoding, one request
at a time (what wrapping `model.decoding.greedy_decode` in a web app gives).

    python -m bench.naive_server --model-dir models/translate-en-it --port 8100

Answers `POST /v1/translate` and `POST /v1/summarize` with `{"text": ...}` like the service
(same response shape, one output), and `GET /health/ready`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel


class Body(BaseModel):
    """The request body: one text."""

    text: str


def create_app(model_dir: Path) -> Any:
    """The FastAPI app; the handler is `async` and blocks, so requests run strictly one by one."""
    import torch
    from fastapi import FastAPI

    from model.checkpoint import load_model
    from model.decoding import greedy_decode, pad_batch
    from model.tokenizer import Tokenizer

    model = load_model(model_dir)
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.model")
    config = model.config
    app = FastAPI(title="naive PyTorch server")

    @app.get("/health/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    async def generate(body: Body) -> dict[str, Any]:
        ids = tokenizer.encode(body.text)[: config.max_source_len - 1] + [config.eos_id]
        with torch.inference_mode():
            result = greedy_decode(model, pad_batch([ids], config.pad_id), config.max_target_len)[0]
        output = {"text": tokenizer.decode(result.tokens), "finish_reason": result.finish_reason,
                  "input_tokens": len(ids), "output_tokens": len(result.tokens)}
        return {"model": model_dir.name, "outputs": [output],
                "usage": {"input_tokens": len(ids), "output_tokens": len(result.tokens)}}

    app.post("/v1/translate")(generate)
    app.post("/v1/summarize")(generate)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="a model repository folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's)")
    args = parser.parse_args(argv)
    import torch
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    uvicorn.run(create_app(args.model_dir), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
