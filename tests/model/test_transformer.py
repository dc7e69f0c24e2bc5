"""The Transformer's attention, masks and KV cache behave as the paper and our API say."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.decoding import pad_batch
from model.embedding import sinusoidal_encoding
from model.multi_head_attention import causal_mask, padding_mask
from tests.conftest import TINY_CONFIG


def test_config_round_trip_and_validation(tmp_path):
    TINY_CONFIG.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == TINY_CONFIG
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({"vocab_size": 10, "colour": "red"})


def test_sinusoidal_encoding_matches_the_formula():
    positions = torch.tensor([[0, 1, 7]])
    encoding = sinusoidal_encoding(positions, 8)  # (1, 3, 8)
    assert encoding.shape == (1, 3, 8)
    for p in (0, 1, 7):
        for i in range(4):
            angle = p / 10000 ** (2 * i / 8)
            assert encoding[0, [0, 1, 7].index(p), 2 * i] == pytest.approx(torch.tensor(angle).sin().item(), abs=1e-5)
            assert encoding[0, [0, 1, 7].index(p), 2 * i + 1] == pytest.approx(torch.tensor(angle).cos().item(), abs=1e-5)


def test_masks():
    assert padding_mask(torch.tensor([[5, 6, 0]]), 0).tolist() == [[True, True, False]]
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_attention_shapes_and_rows_sum_to_one(random_tiny):
    config = random_tiny.config
    source = pad_batch([[5, 6, 7, 8, 3], [9, 10, 3]], config.pad_id)  # (2, 5), row 1 padded
    target = pad_batch([[2, 11, 12, 13], [2, 14]], config.pad_id)  # (2, 4)
    encoded = random_tiny.encode(source)
    output = random_tiny.decode(target, random_tiny.start_decoding(encoded), padding_mask(target, config.pad_id))
    h = config.n_heads
    assert len(encoded.attentions) == config.n_encoder_layers
    assert len(output.self_attentions) == len(output.cross_attentions) == config.n_decoder_layers
    for weights in encoded.attentions:
        assert weights.shape == (2, h, 5, 5)
    for weights in output.self_attentions:
        assert weights.shape == (2, h, 4, 4)
        # causal: zero above the diagonal
        assert torch.all(weights.triu(diagonal=1) == 0)
    for weights in output.cross_attentions:
        assert weights.shape == (2, h, 4, 5)
    for weights in encoded.attentions + output.cross_attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        assert torch.all(weights[1, :, :, 3:] == 0)  # padded source keys get no weight
    for weights in output.self_attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
        assert torch.all(weights[1, :, :, 2:] == 0)  # padded target keys get no weight


def test_causal_mask_hides_the_future(random_tiny):
    source = torch.tensor([[5, 6, 7, 3]])
    target = torch.tensor([[2, 8, 9, 10, 11]])
    changed = target.clone()
    changed[0, 3] = 15
    logits = random_tiny(source, target)
    logits_changed = random_tiny(source, changed)
    torch.testing.assert_close(logits[:, :3], logits_changed[:, :3])
    assert not torch.allclose(logits[:, 3:], logits_changed[:, 3:])


def test_incremental_decoding_equals_full_decoding(random_tiny):
    """Feeding the target one token at a time through the cache gives the teacher-forced logits."""
    source = pad_batch([[5, 6, 7, 8, 3], [9, 10, 3]], 0)
    target = torch.tensor([[2, 11, 12, 13], [2, 14, 15, 16]])
    full = random_tiny(source, target)  # (2, 4, V)
    cache = random_tiny.start_decoding(random_tiny.encode(source))
    steps = []
    for t in range(target.size(1)):
        output = random_tiny.decode(target[:, t : t + 1], cache)
        cache = output.cache
        steps.append(output.logits)
    assert cache.past_length == 4
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padded_past_with_positions_equals_unpadded(random_tiny):
    """A row whose cache is left-padded (continuous batching) decodes like the row alone."""
    source = torch.tensor([[5, 6, 7, 3]])
    target = torch.tensor([[2, 11, 12]])
    alone = random_tiny(source, target)[:, -1]
    padded_target = torch.tensor([[0, 0, 2, 11, 12]])
    mask = padded_target != 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = random_tiny.start_decoding(random_tiny.encode(source))
    output = random_tiny.decode(padded_target, cache, target_mask=mask, positions=positions)
    torch.testing.assert_close(output.logits[:, -1], alone, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_share_one_matrix(random_tiny):
    assert random_tiny.output_projection.weight is random_tiny.source_embedding.tokens.weight
    assert random_tiny.target_embedding.tokens.weight is random_tiny.source_embedding.tokens.weight
