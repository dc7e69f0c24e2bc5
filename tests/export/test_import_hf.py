"""`attnserve import-hf` on a tiny random MarianMTModel and BartForConditionalGeneration built
from a config (no download): the service's greedy and beam outputs equal `model.generate`, and
its attention maps equal those transformers returns with `output_attentions=True`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from export.hf_import import BART_SPM, UnsupportedModel, import_hf, parse_task
from model.config import ModelConfig
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.generation.search import generate, teacher_forced_attention
from service.runtime import CPU, ModelRuntime

pytestmark = pytest.mark.anyio

TEXTS = ["abc de", "a", "fgh", "ij klm", "no", "a b c", "mlk", "ab cd ef", "o n m l", "gf ed"]
MAX_NEW_TOKENS = 12


def _bf16(tensor: Any) -> Any:
    return tensor.to(torch.bfloat16).to(torch.float32)


def _round_weights(model: Any, keep: str | None = None) -> None:
    """A random logits bias, then every parameter rounded to bfloat16 (what a repository stores),
    so the service's numbers are the model's own; parameters named with `keep` stay as they are."""
    with torch.no_grad():
        model.final_logits_bias.copy_(_bf16(torch.randn_like(model.final_logits_bias)))
        for name, parameter in model.named_parameters():
            if keep is None or keep not in name:
                parameter.copy_(_bf16(parameter))


def tiny_marian(tokenizer_path: Path, directory: Path) -> Any:
    """A seeded random MarianMTModel over the tiny tokenizer's 20 ids, saved with its tokenizer
    files (source.spm = target.spm, vocab.json with the SentencePiece ids)."""
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
    _round_weights(model, keep="embed_positions")  # sinusoids: computed, not stored
    model.save_pretrained(directory)
    shutil.copyfile(tokenizer_path, directory / "source.spm")
    shutil.copyfile(tokenizer_path, directory / "target.spm")
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}), encoding="utf-8")
    return model


def tiny_bart(tokenizer_path: Path, directory: Path) -> Any:
    """A seeded random BartForConditionalGeneration over the tiny tokenizer's 20 ids (learned
    positions, layernorm_embedding, GELU, eos as the decoder's start, forced bos/eos as BART's
    checkpoints set them), saved with the tokenizer as sentencepiece.bpe.model."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    config = transformers.BartConfig(
        vocab_size=tokenizer.vocab_size, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
        decoder_start_token_id=tokenizer.eos_id, forced_eos_token_id=tokenizer.eos_id, scale_embedding=False,
        activation_function="gelu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.5,
    )
    torch.manual_seed(7)  # a seed whose greedy and beam outputs stop at EOS at several lengths
    model = transformers.BartForConditionalGeneration(config).eval()
    model.generation_config.forced_bos_token_id = tokenizer.bos_id
    with torch.no_grad():  # LayerNorms away from their initial 1 and 0, so copying them is tested
        for name, parameter in model.named_parameters():
            if "layernorm_embedding" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    _round_weights(model)
    model.save_pretrained(directory)
    shutil.copyfile(tokenizer_path, directory / BART_SPM)
    return model


class Imported(NamedTuple):
    architecture: str
    model: Any  # the transformers model, eager attention, generating as the service does
    folder: Path  # the Hugging Face folder
    repository: Path  # what import-hf wrote


BUILDERS = {"marian": (tiny_marian, "translate-en-de"), "bart": (tiny_bart, "summarize-en")}
ROUTES = {"translate": "/v1/translate", "summarize": "/v1/summarize"}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def imported(request: pytest.FixtureRequest, tiny_tokenizer: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Imported:
    """Each architecture's tiny folder and the repository import-hf makes of it."""
    architecture = request.param
    build, task = BUILDERS[architecture]
    root = tmp_path_factory.mktemp(f"import-hf-{architecture}")
    build(tiny_tokenizer, root / "hf")
    out = root / "models" / f"tiny-{architecture}"
    import_hf(root / "hf", out, task=task, variants=("fp32",), threads=1)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(root / "hf", local_files_only=True,
                                                               attn_implementation="eager").eval()
    # the service applies no forced tokens (the manifest records them), so neither does the reference
    model.generation_config.forced_bos_token_id = None
    model.generation_config.forced_eos_token_id = None
    return Imported(architecture, model, root / "hf", out)


@pytest.fixture(scope="module")
def runtime(imported: Imported) -> ModelRuntime:
    return ModelRuntime.load(imported.repository, [CPU], threads=1, variant="fp32")


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


EXPECTED_CONFIG = {  # what tells the architectures apart in the manifest (tiny tokenizer: pad 0, eos 3)
    "marian": {"decoder_start_id": 0, "position_layout": "halves", "embedding_norm": False, "activation": "swish",
               "scale_embedding": True, "max_target_len": 64},
    "bart": {"decoder_start_id": 3, "position_layout": "learned", "embedding_norm": True, "activation": "gelu",
             "scale_embedding": False, "max_target_len": 63},
}


def test_manifest_records_the_start_token_and_the_conversion(imported: Imported) -> None:
    manifest = json.loads((imported.repository / "manifest.json").read_text())
    config = manifest["model_config"]
    assert {k: config[k] for k in EXPECTED_CONFIG[imported.architecture]} == EXPECTED_CONFIG[imported.architecture]
    task, _, language = BUILDERS[imported.architecture][1].partition("-")
    assert (manifest["task"], manifest["source_language"]) == (task, language.split("-")[0])
    source = manifest["exporter"]["source"]
    assert source["architecture"] == imported.architecture
    if imported.architecture == "bart":  # BART's forced tokens are recorded as not applied
        assert source["generation_settings_not_applied"] == {"forced_bos_token_id": 2, "forced_eos_token_id": 3}
    assert manifest["exporter"]["parity"]["greedy_rows_identical"] > 0
    assert "step_graph_logits" in manifest["exporter"]["parity"]["max_abs_diff"]
    assert manifest["variants"]["fp32"]["step_decoder"] == "decoder_step.onnx"


@pytest.mark.parametrize("beams", [1, 3])
def test_outputs_equal_transformers_generate(imported: Imported, runtime: ModelRuntime, beams: int) -> None:
    model = imported.model
    sources = _sources(runtime)
    expected = [_hf_generate(model, source, beams) for source in sources]
    batched = generate(runtime, sources, beams, MAX_NEW_TOKENS)
    assert [r.tokens for r in batched] == expected
    assert len({len(t) for t in expected}) > 1  # outputs of several lengths: some stop at EOS


def test_attention_equals_transformers(imported: Imported, runtime: ModelRuntime) -> None:
    model = imported.model
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


@pytest.mark.parametrize("beams", [1, 3])
async def test_generate_over_http(imported: Imported, beams: int) -> None:
    """The service's route of the task, all texts in one request: greedy rows run in the running
    batch on the step graph (each row at its own position), beams on the merged decoder."""
    from service.api.app import create_app
    from tests.service.conftest import serving, tiny_settings

    tokenizer = Tokenizer.from_file(imported.repository / "tokenizer.model")
    expected = [tokenizer.decode(_hf_generate(imported.model, [*tokenizer.encode(t), tokenizer.eos_id], beams))
                for t in TEXTS]
    route = ROUTES[json.loads((imported.repository / "manifest.json").read_text())["task"]]
    async with serving(create_app(tiny_settings(imported.repository.parent))) as client:
        response = await client.post(route, json={"texts": TEXTS, "beam_size": beams,
                                                  "max_new_tokens": MAX_NEW_TOKENS})
    assert response.status_code == 200, response.text
    assert [output["text"] for output in response.json()["outputs"]] == expected


def test_refuses_a_tokenizer_with_other_ids(imported: Imported, tmp_path: Path) -> None:
    """Marian: a vocab.json mapping pieces to other ids; BART: the Hub's byte-level BPE files
    without a SentencePiece model."""
    folder = tmp_path / "hf"
    shutil.copytree(imported.folder, folder)
    if imported.architecture == "marian":
        vocab = json.loads((folder / "vocab.json").read_text())
        vocab["<pad>"], vocab["</s>"] = vocab["</s>"], vocab["<pad>"]
        (folder / "vocab.json").write_text(json.dumps(vocab))
        reason = "vocab.json"
    else:
        (folder / BART_SPM).unlink()
        (folder / "vocab.json").write_text(json.dumps({"<s>": 0, "<pad>": 1, "</s>": 2, "Ġa": 3}))
        (folder / "merges.txt").write_text("#version: 0.2\nĠ a\n")
        reason = "byte-level BPE"
    with pytest.raises(UnsupportedModel, match=reason):
        import_hf(folder, tmp_path / "out", task="translate-en-de", variants=("fp32",))


def test_refuses_other_architectures(tmp_path: Path) -> None:
    config = transformers.T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    with pytest.raises(UnsupportedModel, match="model_type 't5'"):
        import_hf(tmp_path / "t5", tmp_path / "out", task="translate-en-de", variants=("fp32",))


def test_our_architecture_has_no_imported_parameters() -> None:
    """The defaults add no learned positions or embedding LayerNorm: checkpoints of our own
    models keep their parameter names."""
    names = Transformer(ModelConfig(vocab_size=20, d_model=8, n_heads=2)).state_dict()
    assert not [n for n in names if n.startswith(("source_embedding.", "target_embedding."))
                and not n.endswith("tokens.weight")]


def test_parse_task() -> None:
    assert parse_task("translate-en-de") == ("translate", "en", "de")
    assert parse_task("summarize-en") == ("summarize", "en", "en")
    with pytest.raises(ValueError):
        parse_task("translate-en")


def test_cli_imports_a_folder(imported: Imported, tmp_path: Path) -> None:
    from attnserve.cli import main

    task = BUILDERS[imported.architecture][1]
    out = tmp_path / task
    assert main(["import-hf", "--model-dir", str(imported.folder), "--task", task, "--out", str(out),
                 "--variants", "fp32", "--threads", "1"]) == 0
    assert (out / "manifest.json").is_file()
    assert main(["import-hf", "--model-dir", str(imported.folder), "--task", "translate-en", "--out", str(out)]) == 2
