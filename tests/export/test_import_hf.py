"""`attnserve import-hf` on a tiny random MarianMTModel and BartForConditionalGeneration built
from a config (no download): the service's greedy and beam outputs equal `model.generate`, and
its attention maps equal those transformers returns with `output_attentions=True`. The Marian
model comes twice: with one SentencePiece model whose ids are the model's ("marian"), and in the
OPUS-MT layout ("opus": source.spm and target.spm trained apart, a joint vocab.json with `</s>`
0, `<unk>` 1 and `<pad>` last), whose tokenization must be transformers' MarianTokenizer's."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import sentencepiece as spm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from export.hf_import import BART_SPM, UnsupportedModel, import_hf, parse_task
from model.config import ModelConfig
from model.tokenizer import Tokenizer, VocabTokenizer
from model.transformer import Transformer
from service.generation.search import generate, teacher_forced_attention
from service.repository.manifest import sha256_file
from service.runtime import CPU, ModelRuntime

pytestmark = pytest.mark.anyio

TEXTS = ["abc de", "a", "fgh", "ij klm", "no", "a b c", "mlk", "ab cd ef", "o n m l", "gf ed"]
# the OPUS-style folder's languages: words its source.spm and target.spm are trained on
OPUS_SOURCE_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "a", "dog", "ran", "to", "the", "hat"]
OPUS_TARGET_WORDS = ["die", "katze", "sass", "auf", "der", "matte", "und", "ein", "hund", "lief", "zum", "hut"]
# sources with target-only words, characters neither model has ("C", "!", "?"), a language code
OPUS_TEXTS = ["the cat sat", "a dog", "the mat and the hat", "katze", "the hund ran", "on a mat",
              "dog ran to the cat", "the Cat!", "a", "hat on  the dog?", ">>de<< the cat", "ran"]
OPUS_LANGUAGE_CODE = ">>de<<"  # in the vocabulary, in neither SentencePiece model
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


def _random_marian(vocab_size: int, pad: int, eos: int, bos: int, seed: int) -> Any:
    """A seeded random MarianMTModel (OPUS-MT's settings: swish, scaled embeddings, pad as the
    decoder's start), weights rounded to bfloat16."""
    config = transformers.MarianConfig(
        vocab_size=vocab_size, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=pad, eos_token_id=eos, bos_token_id=bos, decoder_start_token_id=pad,
        forced_eos_token_id=None, scale_embedding=True, activation_function="swish", dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, init_std=0.5,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    _round_weights(model, keep="embed_positions")  # sinusoids: computed, not stored
    return model


def tiny_marian(tokenizer_path: Path, directory: Path) -> Any:
    """A seeded random MarianMTModel over the tiny tokenizer's 20 ids, saved with its tokenizer
    files (source.spm = target.spm, vocab.json with the SentencePiece ids)."""
    tokenizer = Tokenizer.from_file(tokenizer_path)
    model = _random_marian(tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, seed=0)
    model.save_pretrained(directory)
    shutil.copyfile(tokenizer_path, directory / "source.spm")
    shutil.copyfile(tokenizer_path, directory / "target.spm")
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}), encoding="utf-8")
    return model


def _train_spm(words: list[str], seed: int) -> bytes:
    """A small unigram SentencePiece model of lines of `words`, with sentencepiece's default
    special pieces (`<unk>` 0, `<s>` 1, `</s>` 2, no pad), as OPUS-MT's models have."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 6))) for _ in range(300)]
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40,
                                   model_type="unigram", hard_vocab_limit=False, character_coverage=1.0,
                                   minloglevel=2, num_threads=1)
    return model.getvalue()


def opus_vocab(*models: bytes) -> dict[str, int]:
    """The joint vocabulary of OPUS-MT's vocab.json: `</s>` 0, `<unk>` 1, the pieces of the models
    (each once, in their order), a language code, `<pad>` last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for proto in models:
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab[OPUS_LANGUAGE_CODE] = len(vocab)
    vocab["<pad>"] = len(vocab)
    return vocab


def tiny_opus(tokenizer_path: Path, directory: Path) -> Any:
    """A seeded random MarianMTModel over an OPUS-style tokenizer (its own: the tiny tokenizer is
    not used), saved with `MarianTokenizer.save_pretrained`: source.spm and target.spm trained on
    different words, vocab.json joining their pieces (`opus_vocab`), eos `</s>` (also bos, as in
    OPUS-MT's configs), pad `<pad>` the decoder's start."""
    files = directory.parent / "opus-tokenizer"
    files.mkdir()
    source, target = _train_spm(OPUS_SOURCE_WORDS, seed=0), _train_spm(OPUS_TARGET_WORDS, seed=1)
    (files / "source.spm").write_bytes(source)
    (files / "target.spm").write_bytes(target)
    vocab = opus_vocab(source, target)
    (files / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(str(files / "source.spm"), str(files / "target.spm"),
                                             str(files / "vocab.json"))
    # a seed whose greedy and beam outputs stop at EOS at several lengths
    model = _random_marian(len(vocab), vocab["<pad>"], vocab["</s>"], vocab["</s>"], seed=20)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def marian_tokenizer(folder: Path) -> Any:
    """transformers' MarianTokenizer of a folder."""
    return transformers.MarianTokenizer.from_pretrained(folder, local_files_only=True)


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
    texts: list[str]  # sources in the folder's language


BUILDERS = {"marian": (tiny_marian, "translate-en-de"), "bart": (tiny_bart, "summarize-en"),
            "opus": (tiny_opus, "translate-en-de")}
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
    return Imported(architecture, model, root / "hf", out, OPUS_TEXTS if architecture == "opus" else TEXTS)


@pytest.fixture(scope="module")
def runtime(imported: Imported) -> ModelRuntime:
    return ModelRuntime.load(imported.repository, [CPU], threads=1, variant="fp32")


def _sources(imported: Imported, runtime: ModelRuntime) -> list[list[int]]:
    return [[*runtime.tokenizer.encode(t), runtime.eos_id] for t in imported.texts]


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
    # the start token (pad, last of the vocabulary) is read from the folder's vocab.json
    "opus": {"position_layout": "halves", "embedding_norm": False, "activation": "swish",
             "scale_embedding": True, "max_target_len": 64},
}


def test_manifest_records_the_start_token_and_the_conversion(imported: Imported) -> None:
    manifest = json.loads((imported.repository / "manifest.json").read_text())
    config = manifest["model_config"]
    expected = dict(EXPECTED_CONFIG[imported.architecture])
    if imported.architecture == "opus":
        vocab = json.loads((imported.folder / "vocab.json").read_text())
        expected["decoder_start_id"] = vocab["<pad>"]
        assert vocab["<pad>"] == len(vocab) - 1 == config["vocab_size"] - 1
        assert manifest["special_ids"] == {"pad": vocab["<pad>"], "unk": vocab["<unk>"], "bos": vocab["<pad>"],
                                           "eos": vocab["</s>"]}
    assert {k: config[k] for k in expected} == expected
    task, _, language = BUILDERS[imported.architecture][1].partition("-")
    assert (manifest["task"], manifest["source_language"]) == (task, language.split("-")[0])
    source = manifest["exporter"]["source"]
    assert source["architecture"] == imported.model.config.model_type
    if imported.architecture == "bart":  # BART's forced tokens are recorded as not applied
        assert source["generation_settings_not_applied"] == {"forced_bos_token_id": 2, "forced_eos_token_id": 3}
    assert manifest["exporter"]["parity"]["greedy_rows_identical"] > 0
    assert "step_graph_logits" in manifest["exporter"]["parity"]["max_abs_diff"]
    assert manifest["variants"]["fp32"]["step_decoder"] == "decoder_step.onnx"


def test_manifest_records_the_tokenizer_files(imported: Imported) -> None:
    """One SentencePiece model as tokenizer.model; OPUS-MT's three files as they are, by role,
    each with its sha256."""
    manifest = json.loads((imported.repository / "manifest.json").read_text())
    if imported.architecture != "opus":
        assert (manifest["tokenizer_kind"], manifest["tokenizer"]) == ("sentencepiece", "tokenizer.model")
        assert "tokenizer.model" in manifest["files"]
        return
    roles = {"source": "source.spm", "target": "target.spm", "vocab": "vocab.json"}
    assert (manifest["tokenizer_kind"], manifest["tokenizer_files"]) == ("sentencepiece_vocab", roles)
    assert not (imported.repository / "tokenizer.model").exists()
    for name in roles.values():
        assert (imported.repository / name).read_bytes() == (imported.folder / name).read_bytes()
        assert manifest["files"][name] == sha256_file(imported.folder / name)


@pytest.mark.parametrize("beams", [1, 3])
def test_outputs_equal_transformers_generate(imported: Imported, runtime: ModelRuntime, beams: int) -> None:
    model = imported.model
    sources = _sources(imported, runtime)
    expected = [_hf_generate(model, source, beams) for source in sources]
    batched = generate(runtime, sources, beams, MAX_NEW_TOKENS)
    assert [r.tokens for r in batched] == expected
    assert len({len(t) for t in expected}) > 1  # outputs of several lengths: some stop at EOS


def test_attention_equals_transformers(imported: Imported, runtime: ModelRuntime) -> None:
    model = imported.model
    for source in _sources(imported, runtime)[:4]:
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

    if imported.architecture == "opus":  # tokenized and detokenized by transformers
        reference = marian_tokenizer(imported.folder)
        sources = reference(imported.texts).input_ids
        expected = reference.batch_decode([_hf_generate(imported.model, s, beams) for s in sources],
                                          skip_special_tokens=True, use_source_tokenizer=False)
    else:
        tokenizer = Tokenizer.from_file(imported.repository / "tokenizer.model")
        expected = [tokenizer.decode(_hf_generate(imported.model, [*tokenizer.encode(t), tokenizer.eos_id], beams))
                    for t in imported.texts]
    route = ROUTES[json.loads((imported.repository / "manifest.json").read_text())["task"]]
    async with serving(create_app(tiny_settings(imported.repository.parent))) as client:
        response = await client.post(route, json={"texts": imported.texts, "beam_size": beams,
                                                  "max_new_tokens": MAX_NEW_TOKENS})
    assert response.status_code == 200, response.text
    assert [output["text"] for output in response.json()["outputs"]] == expected


OPUS_ONLY = pytest.mark.parametrize("imported", ["opus"], indirect=True)


@OPUS_ONLY
def test_opus_tokenizer_equals_marian_tokenizer(imported: Imported, runtime: ModelRuntime) -> None:
    """The served tokenizer encodes sources by source.spm and target texts by target.spm as
    MarianTokenizer does (pieces through vocab.json, unk for the others), and decodes as its
    `decode(skip_special_tokens=True)` with the target model."""
    reference, ours = marian_tokenizer(imported.folder), runtime.tokenizer
    assert isinstance(ours, VocabTokenizer)
    texts = [*imported.texts, "", "die katze lief zum hund", "der Hut?", "the  matte"]
    assert [[*ours.encode(t), ours.eos_id] for t in texts] == reference(texts).input_ids
    assert [[*ids, ours.eos_id] for ids in ours.encode_batch(texts)] == reference(texts).input_ids
    targets = reference(text_target=texts).input_ids
    assert [[*ours.encode_target(t), ours.eos_id] for t in texts] == targets
    assert [[*ids, ours.eos_id] for ids in ours.encode_target_batch(texts)] == targets
    assert targets != reference(texts).input_ids  # the two models tokenize some texts differently
    assert ours.unk_id in [i for ids in targets for i in ids]

    rng = random.Random(0)  # any ids: specials, the language code, pieces of either model
    sequences = [*targets, *[[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(12))] for _ in range(200)]]
    assert [ours.decode(ids) for ids in sequences] == reference.batch_decode(
        sequences, skip_special_tokens=True, use_source_tokenizer=False)
    assert [ours.pieces(ids) for ids in sequences] == [reference.convert_ids_to_tokens(ids) for ids in sequences]


@OPUS_ONLY
def test_opus_offsets_span_the_pieces(imported: Imported, runtime: ModelRuntime) -> None:
    """Source and target offsets give each piece its characters; decoding's spans cover the
    decoded text in order, a dropped special piece spanning nothing."""
    tokenizer = runtime.tokenizer
    specials = {tokenizer.pad_id, tokenizer.eos_id, tokenizer.unk_id}
    for text in [*OPUS_TEXTS, "die katze lief", "der Hut?"]:
        for encode, encode_with_offsets in [(tokenizer.encode, tokenizer.encode_with_offsets),
                                            (tokenizer.encode_target, tokenizer.encode_target_with_offsets)]:
            ids, spans = encode_with_offsets(text)
            assert ids == encode(text)
            for piece, i, (start, end) in zip(tokenizer.pieces(ids), ids, spans, strict=True):
                if i != tokenizer.unk_id:
                    assert text[start:end].lstrip(" ") == piece.lstrip("\u2581"), (text, piece)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(12))]
        text, spans = tokenizer.decode_with_offsets(ids)
        assert text == tokenizer.decode(ids)
        assert "".join(text[start:end] for start, end in spans) == text
        for piece, i, (start, end) in zip(tokenizer.pieces(ids), ids, spans, strict=True):
            if i in specials:
                assert start == end
            else:
                assert text[start:end].strip() == piece.replace("\u2581", " ").strip(), (ids, piece)


@OPUS_ONLY
async def test_opus_target_side_over_http(imported: Imported) -> None:
    """`/v1/attention` labels a given target with target.spm's pieces and returns transformers'
    maps of it; `target_prefix` is tokenized by target.spm, and the output is transformers'
    generation forced through those tokens, decoded by MarianTokenizer."""
    from service.api.app import create_app
    from tests.service.conftest import serving, tiny_settings

    reference, model = marian_tokenizer(imported.folder), imported.model
    source, target, prefix = "the cat sat on a mat", "die katze lief", "die katze"
    source_ids, target_ids = reference(source).input_ids, reference(text_target=target).input_ids[:-1]
    prefix_ids = reference(text_target=prefix).input_ids[:-1]
    assert prefix_ids != reference(prefix).input_ids[:-1]  # a source tokenization would differ
    start = model.config.decoder_start_token_id
    with torch.no_grad():
        maps = model(input_ids=torch.tensor([source_ids]), decoder_input_ids=torch.tensor([[start, *target_ids]]),
                     output_attentions=True, return_dict=True)
        settings = transformers.GenerationConfig(
            num_beams=1, do_sample=False, max_new_tokens=MAX_NEW_TOKENS - len(prefix_ids), decoder_start_token_id=start,
            pad_token_id=model.config.pad_token_id, eos_token_id=model.config.eos_token_id)
        forced = model.generate(torch.tensor([source_ids]), decoder_input_ids=torch.tensor([[start, *prefix_ids]]),
                                generation_config=settings)
    expected_text = reference.decode(forced[0, 1:], skip_special_tokens=True, use_source_tokenizer=False)

    async with serving(create_app(tiny_settings(imported.repository.parent))) as client:
        attention = await client.post("/v1/attention", json={"source": source, "target": target, "kinds": ["cross"],
                                                              "decimals": 6})
        prefixed = await client.post("/v1/translate", json={"texts": [source], "target_prefix": prefix,
                                                            "max_new_tokens": MAX_NEW_TOKENS})
    assert attention.status_code == 200, attention.text
    body = attention.json()
    assert [t["piece"] for t in body["source_tokens"]] == reference.convert_ids_to_tokens(source_ids)
    assert [t["piece"] for t in body["target_tokens"]] == reference.convert_ids_to_tokens([*target_ids, reference.eos_token_id])
    for text, tokens in [(source, body["source_tokens"]), (target, body["target_tokens"])]:
        assert [text[t["start"]:t["end"]].lstrip(" ") for t in tokens[:-1]] == [
            t["piece"].lstrip("\u2581") for t in tokens[:-1]]
    for ours, theirs in zip(body["attention"]["cross"], maps.cross_attentions, strict=True):
        np.testing.assert_allclose(np.asarray(ours), theirs[0].numpy(), atol=1e-5)
    assert prefixed.status_code == 200, prefixed.text
    [output] = prefixed.json()["outputs"]
    assert output["text"] == expected_text
    assert output["text"].startswith(prefix)


def test_refuses_a_tokenizer_with_other_ids(imported: Imported, tmp_path: Path) -> None:
    """Marian: a vocab.json whose pad and eos are not the model's; OPUS: a separate target
    vocabulary; BART: the Hub's byte-level BPE files without a SentencePiece model."""
    folder = tmp_path / "hf"
    shutil.copytree(imported.folder, folder)
    if imported.architecture == "marian":
        vocab = json.loads((folder / "vocab.json").read_text())
        vocab["<pad>"], vocab["</s>"] = vocab["</s>"], vocab["<pad>"]
        (folder / "vocab.json").write_text(json.dumps(vocab))
        reason = "vocab.json's pad/eos ids"
    elif imported.architecture == "opus":
        shutil.copyfile(folder / "vocab.json", folder / "target_vocab.json")
        reason = "separate source and target vocabularies"
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
