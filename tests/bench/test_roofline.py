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
