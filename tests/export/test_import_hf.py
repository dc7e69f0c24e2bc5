"""`attnserve import-hf` on a tiny random MarianMTModel built from a config (no download): the
service's greedy and beam outputs equal `model.generate`, and its attention maps equal those
transformers returns with `output_attentions=True`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from export.hf_import import UnsupportedModel, import_hf, parse_task
from model.tokenizer import Tokenizer
from service.generation.search import generate, teacher_forced_attention
from service.runtime import CPU, ModelRuntime

pytestmark = pytest.mark.anyio

TEXTS = ["abc de", "a", "fgh", "ij klm", "no", "a b c", "mlk", "ab cd ef", "o n m l", "gf ed"]
MAX_NEW_TOKENS = 12


def _bf16(tensor: Any) -> Any:
    return tensor.to(torch.bfloat16).to(torch.float32)


def tiny_marian(tokenizer_path: Path, directory: Path) -> Any:
    """A seeded random MarianMTModel over the tiny tokenizer's 20 ids, saved with its tokenizer
    files; weights rounded to bfloat16 (what a repository stores), so the service's numbers are
    the model's own."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    config = transformers.MarianConfig(
        vocab_size=tokenizer.vocab_size, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
        decoder_start_token_id=tokenizer.pad_id, forced_eos_token_id=None, scale_embedding=True,
        activation_function="swish", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.5,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.copy_(torch.randn_like(model.final_logits_bias))
        for name, parameter in model.named_parameters():
            if "embed_positions" not in name:
                parameter.copy_(_bf16(parameter))
        model.final_logits_bias.copy_(_bf16(model.final_logits_bias))
    model.save_pretrained(directory)
    shutil.copyfile(tokenizer_path, directory / "source.spm")
    shutil.copyfile(tokenizer_path, directory / "target.spm")
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}), encoding="utf-8")
    return model


@pytest.fixture(scope="module")
def imported(tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """(the transformers model with eager attention, its folder, the imported repository)."""
    root = tmp_path_factory.mktemp("import-hf")
    tiny_marian(tiny_tokenizer, root / "hf")
    out = root / "models" / "tiny-marian"
    import_hf(root / "hf", out, task="translate-en-de", variants=("fp32",), threads=1)
    model = transformers.MarianMTModel.from_pretrained(root / "hf", local_files_only=True,
                                                       attn_implementation="eager").eval()
    return model, root / "hf", out


@pytest.fixture(scope="module")
def runtime(imported: tuple[Any, Path, Path]) -> ModelRuntime:
    return ModelRuntime.load(imported[2], [CPU], threads=1, variant="fp32")


def _sources(runtime: ModelRuntime) -> list[list[int]]:
    return [[*runtime.tokenizer.encode(t), runtime.eos_id] for t in TEXTS]


def _hf_generate(model: Any, source: list[int], beams: int) -> list[int]:
    """transformers' tokens after the start token, up to (without) EOS."""
    settings = transformers.GenerationConfig(
        num_beams=beams, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, early_stopping=True, length_penalty=1.0,
        decoder_start_token_id=model.config.decoder_start_token_id, pad_token_id=model.config.pad_token_id,
        eos_token_id=model.config.eos_token_id, bos_token_id=model.config.bos_token_id,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([source]), attention_mask=torch.ones(1, len(source), dtype=torch.long),
                             generation_config=settings)
    tokens = out[0, 1:].tolist()
    return tokens[: tokens.index(model.config.eos_token_id)] if model.config.eos_token_id in tokens else tokens


def test_manifest_records_the_start_token_and_the_conversion(imported: tuple[Any, Path, Path]) -> None:
    manifest = json.loads((imported[2] / "manifest.json").read_text())
    assert manifest["model_config"]["decoder_start_id"] == 0
    assert manifest["model_config"]["position_layout"] == "halves"
    assert (manifest["task"], manifest["target_language"]) == ("translate", "de")
    assert manifest["exporter"]["source"]["architecture"] == "marian"
    assert manifest["exporter"]["parity"]["greedy_rows_identical"] > 0
    assert "step_graph_logits" in manifest["exporter"]["parity"]["max_abs_diff"]
    assert manifest["variants"]["fp32"]["step_decoder"] == "decoder_step.onnx"


@pytest.mark.parametrize("beams", [1, 3])
def test_outputs_equal_transformers_generate(imported: tuple[Any, Path, Path], runtime: ModelRuntime,
                                             beams: int) -> None:
    model = imported[0]
    sources = _sources(runtime)
    expected = [_hf_generate(model, source, beams) for source in sources]
    batched = generate(runtime, sources, beams, MAX_NEW_TOKENS)
    assert [r.tokens for r in batched] == expected
    assert len({len(t) for t in expected}) > 1  # outputs of several lengths: some stop at EOS


def test_attention_equals_transformers(imported: tuple[Any, Path, Path], runtime: ModelRuntime) -> None:
    model = imported[0]
    for source in _sources(runtime)[:4]:
        target = [5, 9, 7, 11]
        maps = teacher_forced_attention(runtime, source, target)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([maps.decoder_ids]),
                        output_attentions=True, return_dict=True)
        assert maps.decoder_ids[0] == model.config.decoder_start_token_id
        for ours, theirs in [(maps.cross, out.cross_attentions), (maps.encoder, out.encoder_attentions),
                             (maps.decoder, out.decoder_attentions)]:
            for layer, expected in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(layer, expected[0].numpy(), atol=1e-5)


async def test_translate_over_http(imported: tuple[Any, Path, Path]) -> None:
    from service.api.app import create_app
    from tests.service.conftest import serving, tiny_settings

    model, _, repository = imported
    tokenizer = Tokenizer.from_file(repository / "tokenizer.model")
    expected = tokenizer.decode(_hf_generate(model, [*tokenizer.encode(TEXTS[0]), tokenizer.eos_id], 3))
    async with serving(create_app(tiny_settings(repository.parent))) as client:
        response = await client.post("/v1/translate", json={"text": TEXTS[0], "beam_size": 3,
                                                            "max_new_tokens": MAX_NEW_TOKENS})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["text"] == expected


def test_refuses_a_vocabulary_with_other_ids(imported: tuple[Any, Path, Path], tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(imported[1], folder)
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab["<pad>"], vocab["</s>"] = vocab["</s>"], vocab["<pad>"]
    (folder / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(UnsupportedModel, match="vocab.json"):
        import_hf(folder, tmp_path / "out", task="translate-en-de", variants=("fp32",))


def test_parse_task() -> None:
    assert parse_task("translate-en-de") == ("translate", "en", "de")
    assert parse_task("summarize-en") == ("summarize", "en", "en")
    with pytest.raises(ValueError):
        parse_task("translate-en")


def test_cli_imports_a_folder(imported: tuple[Any, Path, Path], tmp_path: Path) -> None:
    from attnserve.cli import main

    out = tmp_path / "translate-en-de"
    assert main(["import-hf", "--model-dir", str(imported[1]), "--task", "translate-en-de", "--out", str(out),
                 "--variants", "fp32", "--threads", "1"]) == 0
    assert (out / "manifest.json").is_file()
    assert main(["import-hf", "--model-dir", str(imported[1]), "--task", "translate-en", "--out", str(out)]) == 2
