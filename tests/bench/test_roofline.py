"""The roofline: FLOPs of a translation counted by hand, and the measured GEMM ceiling."""

from __future__ import annotations

import pytest

from bench import roofline

SHAPES = roofline.Shapes(vocab_size=10, d_model=4, n_encoder_layers=2, n_decoder_layers=1, d_ff=8)


def test_encoder_flops_by_hand() -> None:
    # per layer and token: q, k, v, out 4*16 + FFN 2*4*8 = 128 MACs; 3 tokens: 384; attention 2*3*3*4 = 72
    # two layers: 2 * 456 = 912; cross keys/values of one decoder layer: 3 tokens * 2*16 = 96
    assert roofline.encoder_flops(SHAPES, 3) == 2.0 * (912 + 96)


def test_decoder_step_flops_by_hand() -> None:
    # projections 6*16 + FFN 64 = 160; attention at position 1 over 3 sources: 2*2*4 + 2*3*4 = 40;
    # output projection 4*10 = 40
    assert roofline.decoder_step_flops(SHAPES, 1, 3) == 2.0 * (160 + 40 + 40)


def test_sentence_flops_add_one_step_per_token_and_eos() -> None:
    expected = roofline.encoder_flops(SHAPES, 3) + sum(roofline.decoder_step_flops(SHAPES, p, 3) for p in range(3))
    assert roofline.sentence_flops(SHAPES, 3, 2) == expected
    assert roofline.workload_flops(SHAPES, [3, 3], [2, 2]) == expected
    with pytest.raises(ValueError, match="one target length per source"):
        roofline.workload_flops(SHAPES, [3], [])


def test_shapes_from_a_model_config() -> None:
    config = {"vocab_size": 8000, "d_model": 256, "n_heads": 4, "n_encoder_layers": 4, "n_decoder_layers": 3,
              "d_ff": 1024, "dropout": 0.1}
    shapes = roofline.Shapes.from_config(config)
    assert shapes == roofline.Shapes(8000, 256, 4, 3, 1024)
    assert (64, 256, 8000) in roofline.gemm_shapes(shapes)


def test_gemm_ceiling_is_measured_for_both_types() -> None:
    pytest.importorskip("onnx")
    result = roofline.peaks(SHAPES, threads=1, seconds=0.05)
    for kind in ("int8", "fp32"):
        assert len(result[kind]["points"]) == len(roofline.gemm_shapes(SHAPES))
        assert result[kind]["peak_gflops"] == max(p["gflops"] for p in result[kind]["points"]) > 0


def test_fraction_of_the_ceiling() -> None:
    assert roofline.fraction(100.0, 2e9, 1000.0) == pytest.approx(0.2)
    assert roofline.fraction(None, 2e9, 1000.0) is None


def test_a_levers_run_on_the_roofline() -> None:
    """Each variant's and CTranslate2's share, the FLOPs taken at the variant's mean output length."""
    levers = {"variants": {"defaults (continuous batching)": {"sentences": 10, "target_tokens": 52, "sentences_per_s": 100.0},
                           "two server processes": {"sentences": 10, "target_tokens": 60, "sentences_per_s": 150.0}},
              "ctranslate2": {"sentences_per_s": 300.0}}
    result = roofline.levers_fractions(levers, SHAPES, [7, 9, 12], 500.0)
    assert result["mean_target_tokens"] == 5  # 52 / 10, rounded
    flops = roofline.workload_flops(SHAPES, [7, 9, 12], [5, 5, 5])
    assert result["flops_per_sentence"] == flops and result["int8_peak_gflops"] == 500.0
    assert result["fraction_int8"] == {"defaults (continuous batching)": round(100 * flops / 500e9, 4),
                                       "two server processes": round(150 * flops / 500e9, 4),
                                       "CTranslate2": round(300 * flops / 500e9, 4)}
    assert "CTranslate2" not in roofline.levers_fractions({**levers, "ctranslate2": None}, SHAPES, [7], 500.0)[
        "fraction_int8"]


def test_the_command_writes_the_roofline_beside_the_run(tiny_model_repository, tmp_path) -> None:
    pytest.importorskip("onnx")
    import json
    import shutil

    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_model_repository, model)
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    shutil.copy(tiny_model_repository.parent / "data" / "test.src", tmp_path / "data" / "tiny" / "test.src")
    run = tmp_path / "run"
    run.mkdir()
    levers = {"sentences": 4, "split": "test", "ctranslate2": {"sentences_per_s": 20.0},
              "variants": {"defaults (continuous batching)": {"sentences": 4, "target_tokens": 12, "sentences_per_s": 10.0}}}
    (run / "levers.json").write_text(json.dumps(levers))
    assert roofline.main(["--levers", str(run), "--model", str(model), "--data-dir", str(tmp_path / "data"),
                          "--seconds", "0.02"]) == 0
    result = json.loads((run / "roofline.json").read_text())
    assert result["mean_target_tokens"] == 3 and result["int8_peak_gflops"] > 0
    assert set(result["fraction_int8"]) == {"defaults (continuous batching)", "CTranslate2"}
    # the FLOPs of the run's own sentences: the first 4 of the test split, as the model tokenizes them
    from bench import workload
    from model.tokenizer import Tokenizer
    from service.repository.manifest import read_manifest

    manifest = read_manifest(model)
    work = workload.load(tmp_path / "data", "tiny", manifest.task, Tokenizer.from_file(model / "tokenizer.model"),
                         manifest.max_source_len, 4)
    shapes = roofline.Shapes.from_config(manifest.model_config)
    assert result == roofline.levers_fractions(levers, shapes, [len(ids) for ids in work.source_ids],
                                               result["int8_peak_gflops"])
    assert result["flops_per_sentence"] > roofline.workload_flops(shapes, [1] * 4, [3] * 4)
