"""Tests of decoder.py: the caption transformer and greedy decoding with a key/value cache.

Run them with:  python -m pytest test_part_decoder.py -q
"""
import pytest
import torch
import torch.nn as nn

from test_all import shared  # noqa: F401  (the project's test header; these tests need nothing from ../shared)
from decoder import CaptionDecoder, DecoderConfig, ids_to_text

# A tiny decoder: 3 + 3 layers as the reference, narrow and with a 50-token vocabulary. Its init is wider than
# the reference's 0.02 so that a random model's greedy captions differ from pair to pair.
TINY = DecoderConfig(hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=40, visual_tokens=6, init_std=0.1)
SOT_ID, EOT_ID = TINY.vocab_size - 2, TINY.vocab_size - 1


def tiny_decoder(seed=0, config=TINY):
    torch.manual_seed(seed)
    return CaptionDecoder(config).eval()


def visual_tokens(batch, seed=1, config=TINY):
    return torch.randn(batch, config.visual_tokens, config.hidden, generator=torch.Generator().manual_seed(seed))


def never_emit(decoder, token):
    with torch.no_grad():
        decoder.output_bias[token] = -1e4


# --- the model ---


def test_forward_returns_one_row_of_logits_per_caption_token():
    decoder = tiny_decoder()
    caption_in = torch.randint(0, TINY.vocab_size, (3, 7))
    assert decoder(visual_tokens(3), caption_in).shape == (3, 7, TINY.vocab_size)


def test_the_full_size_decoder_has_the_reference_parameter_count():
    decoder = CaptionDecoder(DecoderConfig())
    embeddings = 49408 * 512 + 77 * 512 + 2 * 512  # word, position, their LayerNorm
    attention = 4 * (512 * 512 + 512) + 2 * 512  # query, key, value, out, LayerNorm
    feed_forward = 512 * 2048 + 2048 + 2048 * 512 + 512 + 2 * 512
    head = 512 * 512 + 512 + 2 * 512 + 49408  # dense, LayerNorm, output bias; the output weight is the word embedding
    expected = embeddings + 3 * (attention + feed_forward) + 3 * (2 * attention + feed_forward) + head
    assert expected == 47_719_680
    assert sum(p.numel() for p in decoder.parameters()) == expected


def test_a_fresh_decoder_starts_from_the_reference_init():
    torch.manual_seed(0)
    decoder = CaptionDecoder(DecoderConfig(hidden=64, heads=4, ffn=128, vocab_size=2000))
    assert torch.equal(decoder.output_bias, torch.zeros(2000))
    assert torch.equal(decoder.head_norm.weight, torch.ones(64)) and torch.equal(decoder.head_norm.bias, torch.zeros(64))
    assert torch.equal(decoder.caption_layers[2].feed_forward.down.bias, torch.zeros(64))
    assert abs(decoder.word_embedding.std().item() - 0.02) < 0.001
    assert abs(decoder.visual_layers[0].self_attention.query.weight.std().item() - 0.02) < 0.002


def test_decoder_layer_i_cross_attends_to_the_output_of_visual_layer_i():
    decoder = tiny_decoder()
    visual_outputs, cross_attention_sources = [], []
    for visual_layer, caption_layer in zip(decoder.visual_layers, decoder.caption_layers):
        visual_layer.register_forward_hook(lambda module, args, output: visual_outputs.append(output))
        caption_layer.cross_attention.key.register_forward_hook(
            lambda module, args, output: cross_attention_sources.append(args[0]))
    decoder(visual_tokens(2), torch.randint(0, TINY.vocab_size, (2, 4)))
    assert len(visual_outputs) == len(cross_attention_sources) == 3
    for visual_output, source in zip(visual_outputs, cross_attention_sources):
        assert source is visual_output
    assert not torch.equal(visual_outputs[0], visual_outputs[2])


def test_a_later_caption_token_never_changes_an_earlier_logit():
    decoder = tiny_decoder()
    visual = visual_tokens(2)
    caption_in = torch.randint(0, TINY.vocab_size, (2, 10))
    changed = caption_in.clone()
    changed[:, 6:] = torch.randint(0, TINY.vocab_size, (2, 4))
    before, after = decoder(visual, caption_in), decoder(visual, changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_padding_after_the_caption_does_not_change_logits_at_real_positions():
    decoder = tiny_decoder()
    visual = visual_tokens(2)
    caption_in = torch.randint(0, TINY.vocab_size, (2, 5))
    padded = torch.cat([caption_in, torch.zeros(2, 4, dtype=torch.long)], dim=1)  # (2, 9), padded with id 0
    padding = torch.tensor([[False] * 5 + [True] * 4] * 2)
    logits = decoder(visual, padded, padding)
    assert logits.shape == (2, 9, TINY.vocab_size)
    torch.testing.assert_close(logits[:, :5], decoder(visual, caption_in), rtol=0, atol=1e-5)


def test_padding_may_not_cover_the_start_token():
    decoder = tiny_decoder()
    padding = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="SOT"):
        decoder(visual_tokens(1), torch.zeros(1, 4, dtype=torch.long), padding)


def test_visual_tokens_of_the_wrong_shape_are_refused_with_the_expected_shape():
    decoder = tiny_decoder()
    with pytest.raises(ValueError, match=r"\(B, 6, 32\)"):
        decoder(torch.randn(2, 32), torch.zeros(2, 3, dtype=torch.long))


def test_dropout_is_active_in_training_and_off_in_evaluation():
    decoder = tiny_decoder()
    visual, caption_in = visual_tokens(2), torch.randint(0, TINY.vocab_size, (2, 6))
    assert torch.equal(decoder(visual, caption_in), decoder(visual, caption_in))
    decoder.train()
    assert not torch.equal(decoder(visual, caption_in), decoder(visual, caption_in))


# --- tied weights ---


def test_the_output_weight_is_the_word_embedding():
    decoder = tiny_decoder()
    caption_in = torch.tensor([[SOT_ID, 3, 4]])
    with torch.no_grad():
        decoder.word_embedding[7] = 0.0  # token 7 is not in the input, so only the output map reads this row
        decoder.output_bias[7] = 2.5
    logits = decoder(visual_tokens(1), caption_in)
    assert torch.equal(logits[..., 7], torch.full((1, 3), 2.5))


def test_clip_embeddings_passed_in_are_shared_not_copied():
    torch.manual_seed(0)
    token_embedding = nn.Embedding(TINY.vocab_size, TINY.hidden)  # stands in for CLIP's token_embedding
    positional_embedding = nn.Parameter(torch.randn(TINY.max_positions, TINY.hidden))  # and its positional_embedding
    word_values, position_values = token_embedding.weight.detach().clone(), positional_embedding.detach().clone()
    decoder = CaptionDecoder(TINY, token_embedding.weight, positional_embedding)
    assert decoder.word_embedding is token_embedding.weight
    assert decoder.position_embedding is positional_embedding
    assert torch.equal(token_embedding.weight, word_values) and torch.equal(positional_embedding, position_values)
    both = nn.ModuleDict({"token_embedding": token_embedding, "decoder": decoder})
    assert sum(p.numel() for p in both.parameters()) == sum(p.numel() for p in decoder.parameters())
    decoder(visual_tokens(1), torch.tensor([[SOT_ID, 3]]))[0, -1, 9].backward()
    assert token_embedding.weight.grad[9].abs().sum() > 0  # token 9 was only an output: its gradient is the output map's


def test_embeddings_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="word_embedding has shape"):
        CaptionDecoder(TINY, word_embedding=nn.Parameter(torch.zeros(TINY.vocab_size + 1, TINY.hidden)))


# --- greedy decoding ---


@pytest.mark.parametrize("batch, max_len, init_std", [(1, 1, 0.1), (1, 22, 0.1), (4, 7, 0.1), (9, 22, 0.1),
                                                      (9, 40, 0.1), (5, 22, 0.02)])
def test_decoding_with_the_cache_gives_the_same_tokens_as_full_recompute(batch, max_len, init_std):
    config = DecoderConfig(**{**TINY.__dict__, "init_std": init_std})
    decoder = tiny_decoder(seed=batch, config=config)
    visual = visual_tokens(batch, seed=max_len, config=config)
    first = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=max_len)
    # Besides the real EOT, call "EOT" tokens that these captions do emit, so that rows stop at different steps.
    for eot_id in (EOT_ID, int(first[0, -1]), int(first[-1, 0])):
        cached = decoder.greedy_decode(visual, SOT_ID, eot_id, max_len=max_len, use_cache=True)
        recomputed = decoder.greedy_decode(visual, SOT_ID, eot_id, max_len=max_len, use_cache=False)
        assert cached.dtype == torch.long and cached.shape[0] == batch and cached.shape[1] <= max_len
        assert torch.equal(cached, recomputed)


def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_logits():
    decoder = tiny_decoder()
    never_emit(decoder, EOT_ID)
    visual = visual_tokens(6)
    tokens = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=15)
    assert tokens.shape == (6, 15)
    caption_in = torch.cat([torch.full((6, 1), SOT_ID), tokens[:, :-1]], dim=1)  # (6, 15)
    assert torch.equal(decoder(visual, caption_in).argmax(dim=-1), tokens)
    assert len({tuple(row) for row in tokens.tolist()}) > 1  # the pairs do steer the captions


def test_greedy_decoding_stops_at_eot():
    decoder = tiny_decoder()
    with torch.no_grad():
        decoder.output_bias[EOT_ID] = 1e4  # EOT wins at the first step
    tokens = decoder.greedy_decode(visual_tokens(3), SOT_ID, EOT_ID, max_len=22)
    assert tokens.tolist() == [[EOT_ID]] * 3


def test_each_caption_stops_at_its_own_eot_and_decoding_ends_when_all_have_stopped():
    decoder = tiny_decoder()
    never_emit(decoder, EOT_ID)
    visual = visual_tokens(6)
    free = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=22).tolist()  # never stops: 22 tokens each
    # Now call "EOT" the token found in the most captions but not in all of them.
    rows_with = {token: sum(token in row for row in free) for token in set(sum(free, []))}
    stop_token = max((rows, token) for token, rows in rows_with.items() if rows < len(free))[1]
    stops = [row.index(stop_token) + 1 if stop_token in row else 22 for row in free]  # tokens up to and with EOT
    assert min(stops) < 22 and max(stops) == 22
    tokens = decoder.greedy_decode(visual, SOT_ID, stop_token, max_len=22)
    assert tokens.shape == (6, 22)
    for row, free_row, stop in zip(tokens.tolist(), free, stops):
        assert row == free_row[:stop] + [stop_token] * (22 - stop)  # cut at its own EOT, then EOT to the end

    stopping = [i for i, stop in enumerate(stops) if stop < 22]
    assert len(stopping) >= 2
    early = decoder.greedy_decode(visual[stopping], SOT_ID, stop_token, max_len=22)
    assert early.shape == (len(stopping), max(stops[i] for i in stopping))  # ends with the last caption to stop


def test_greedy_decoding_refuses_training_mode():
    decoder = tiny_decoder().train()
    with pytest.raises(RuntimeError, match="eval"):
        decoder.greedy_decode(visual_tokens(1), SOT_ID, EOT_ID)


def test_max_len_must_fit_the_position_embedding():
    assert tiny_decoder().greedy_decode(visual_tokens(1), SOT_ID, EOT_ID, max_len=40).shape[1] <= 40
    with pytest.raises(ValueError, match="max_len=41"):
        tiny_decoder().greedy_decode(visual_tokens(1), SOT_ID, EOT_ID, max_len=41)


# --- ids to text ---


def test_ids_to_text_cuts_at_eot_then_at_the_pad_text():
    words = {1: "the", 2: "cube", 3: "moved", 0: "!", 9: "<|endoftext|>"}

    def decode(ids):
        return " ".join(words[i] for i in ids) + " "

    assert ids_to_text([1, 2, 3, 9, 1, 1], decode, eot_id=9) == "the cube moved"
    assert ids_to_text(torch.tensor([1, 2, 0, 3]), decode, eot_id=9) == "the cube"
    assert ids_to_text([9, 1], decode, eot_id=9) == ""
