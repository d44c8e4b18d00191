"""The caption decoder of CLIP4IDC's second stage ("IDC finetuning", IDC = image difference captioning), and
greedy decoding with a key/value cache.

The pair encoder turns an image pair into M = 100 visual tokens of width E (2 x (49 patches + the CLS, or class,
token), after the inter-image layers). This file turns those tokens into a sentence, with the reference's caption
model. The reference is github.com/sushizixin/CLIP4IDC at commit ca49461: its modules/module_decoder.py,
configured by modules/decoder-base/decoder_config.json; "post-LN" below means a LayerNorm after each residual sum:

    caption tokens -> LayerNorm(word embedding + position embedding) -> dropout
    visual tokens  -> 3 post-LN self-attention layers; the output of every layer is kept
    3 post-LN decoder layers; layer i = masked self-attention over the caption tokens,
                                        cross-attention to the output of visual layer i (layer-wise pairing),
                                        feed-forward
    head: dense(E -> E), GELU (Gaussian error linear unit), LayerNorm, then a linear map to V whose weight IS the
          word embedding, plus a bias

The word embedding (also the output weight) and the position embedding are meant to be CLIP's own
token_embedding.weight and positional_embedding: the caller passes those Parameters in and they are shared,
not copied. The decoder starts from random init (normal, std 0.02; zero biases; LayerNorm (1, 0)).

Decoding is greedy, as in the reference (its main_task_caption.py, `greedy_decode`): from SOT (the start-of-text
token), append the most likely next token. With `use_cache=True` the visual layers and every decoder layer's
cross-attention keys/values are computed once per batch, and each step feeds only the newest caption token,
reading the earlier tokens' self-attention keys/values from a cache. `use_cache=False` is the reference's
algorithm: the whole model (visual layers included) on the whole prefix at every step. Both give the same
tokens; the test suite checks it.

What differs from the reference (each marked `# differs from reference:` below):
- decoding stops per caption at EOT (the end-of-text token) and ends when every caption has stopped, after at
  most `max_len` steps; the reference always runs `max_words` = 32 steps and cuts the text at EOT: with
  max_len = 32 the texts are the same, a caption that never writes EOT included;
- attention masks are boolean (a masked key gets -inf) instead of an additive -10000;
- attention runs through torch's scaled_dot_product_attention instead of an explicit softmax.

Use (caption.py):
    decoder = CaptionDecoder(DecoderConfig(vocab_size=V), clip.token_embedding.weight, clip.positional_embedding)
    logits = decoder(visual, caption_in)                          # (B, T, V), teacher forcing
    states = decoder.caption_states(visual, caption_in)           # or: the head only where the loss looks
    logits = decoder.to_logits(states[caption_out != pad_id])     # (number of target tokens, V)
    tokens = decoder.eval().greedy_decode(visual, sot_id, eot_id, max_len=22)   # (B, <= 22)
    texts = [ids_to_text(row, tokenizer.decode, eot_id) for row in tokens]

The whole file is the lesson, top to bottom: the building blocks, the caption decoder (training forward, then
greedy decoding), ids_to_text, and a demo at the end.

Run:  python decoder.py                        a tiny random decoder decodes a batch with and without the cache
      (full-size timings of greedy decoding and of a training step: python -m bench decoder)

Shape letters: B pairs in the batch, M = 100 visual tokens per pair, T caption tokens, E = 512 width,
H = 8 attention heads, E/H = 64 width per head, V = 49408 vocabulary, L = 3 layers per stack.
"""
import argparse
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_TEXT = "!"  # CLIP's id 0, which the reference pads captions with; its decoded text is cut at the first "!"


@dataclass
class DecoderConfig:
    hidden: int = 512            # E: width of every layer; CLIP's joint width, so CLIP's embeddings can be tied in
    heads: int = 8               # H: attention heads, 64 channels each
    ffn: int = 2048              # inner width of the feed-forward block
    layers: int = 3              # L: visual self-attention layers, and as many decoder layers (paired one to one)
    dropout: float = 0.1         # on embeddings and on every sub-layer's output before the residual sum
    attention_dropout: float = 0.1  # on attention probabilities
    vocab_size: int = 49408      # V: CLIP's BPE vocabulary (smaller for the synthetic dataset's own vocabulary)
    max_positions: int = 77      # rows of the position embedding: CLIP's text context length
    visual_tokens: int = 100     # M: tokens per pair from the pair encoder, 2 x (49 patches + CLS) for ViT-B/32
    layer_norm_eps: float = 1e-12  # the reference's TF-style LayerNorm: the same formula as nn.LayerNorm
    init_std: float = 0.02       # std of the normal init of weights and fresh embeddings

    def __post_init__(self):
        if self.hidden % self.heads != 0:
            raise ValueError(f"DecoderConfig: hidden={self.hidden} is not a multiple of heads={self.heads}; "
                             "pick a width that splits evenly over the heads")


# ---------------------------------------------------------------------------------------------------------
# Building blocks


def split_heads(x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """The rows of B sequences (B*S, E) -> (B, H, S, E/H)."""
    return x.view(batch, -1, heads, x.shape[-1] // heads).transpose(1, 2)  # (B, H, S, E/H)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, E/H) -> the rows (B*S, E)."""
    batch, heads, length, head_width = x.shape
    return x.transpose(1, 2).reshape(batch * length, heads * head_width)  # (B*S, E)


def rows(x: torch.Tensor) -> torch.Tensor:
    """(B, S, E) -> (B*S, E): a product computed on the rows, as torch computes one on (B, S, E) anyway, without
    the reshape of its output back to (B, S, E) where the next step reshapes it again."""
    return x.reshape(-1, x.shape[-1])  # (B*S, E)


class Attention(nn.Module):
    """Multi-head attention with a post-LN residual: LayerNorm(x + dropout(out(attend(query(x), keys, values)))).

    Keys and values come in already projected (`keys_values`), so that self-attention, cross-attention and
    cached decoding all share this one forward: cached decoding only changes where the keys come from.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.heads = config.heads
        self.attention_dropout = config.attention_dropout
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def keys_values(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the tokens `source` (B, S, E), each (B, H, S, E/H)."""
        batch = source.shape[0]
        return (split_heads(self.key(rows(source)), batch, self.heads),
                split_heads(self.value(rows(source)), batch, self.heads))

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
        # x (B, T, E) queries; keys, values (B, H, S, E/H); mask (B, 1, T, S) bool, True = may attend
        query = split_heads(self.query(rows(x)), x.shape[0], self.heads)  # (B, H, T, E/H)
        # differs from reference: a boolean mask (-inf) instead of adding -10000; every query keeps at least
        # one key, so the softmax is the same up to float rounding (exp(-10000) is 0 in float32).
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal,
            dropout_p=self.attention_dropout if self.training else 0.0)  # (B, H, T, E/H)
        return self.norm(x + self.dropout(self.out(merge_heads(attended)).view(x.shape)))  # (B, T, E)


class FeedForward(nn.Module):
    """Post-LN feed-forward block: LayerNorm(x + dropout(down(GELU(up(x)))))."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.ffn)
        self.down = nn.Linear(config.ffn, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(rows(x)))  # (B*T, ffn); the exact erf GELU, as the reference's "gelu"
        return self.norm(x + self.dropout(self.down(hidden).view(x.shape)))  # (B, T, E)


class VisualLayer(nn.Module):
    """Self-attention over the visual tokens (no mask: every pair has all M tokens), then feed-forward."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attention = Attention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, visual: torch.Tensor) -> torch.Tensor:
        keys, values = self.self_attention.keys_values(visual)  # (B, H, M, E/H) each
        return self.feed_forward(self.self_attention(visual, keys, values))  # (B, M, E)


class CaptionLayer(nn.Module):
    """Masked self-attention over the caption tokens, cross-attention to visual tokens, feed-forward.

    The self-attention keys/values are passed in rather than computed here: the training forward projects
    the whole caption, cached decoding appends the newest token's keys/values to the cache.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attention = Attention(config)
        self.cross_attention = Attention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, caption: torch.Tensor, self_keys: torch.Tensor, self_values: torch.Tensor,
                visual_keys: torch.Tensor, visual_values: torch.Tensor,
                self_mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
        # caption (B, T, E); self_keys/values (B, H, T', E/H) with T' >= T; visual_keys/values (B, H, M, E/H)
        caption = self.self_attention(caption, self_keys, self_values, self_mask, causal)  # (B, T, E)
        caption = self.cross_attention(caption, visual_keys, visual_values)  # (B, T, E)
        return self.feed_forward(caption)  # (B, T, E)


# ---------------------------------------------------------------------------------------------------------
# The caption decoder


class CaptionDecoder(nn.Module):
    """CLIP4IDC's caption model: visual tokens (B, M, E) and caption tokens (B, T) -> next-token logits (B, T, V).

    word_embedding (V, E) and position_embedding (max_positions, E): pass CLIP's token_embedding.weight and
    positional_embedding to share them (the reference ties both; the output weight is the word embedding
    too); leave them None for fresh ones. Shared Parameters are left as they are, not re-initialised.
    """

    def __init__(self, config: DecoderConfig, word_embedding: Optional[nn.Parameter] = None,
                 position_embedding: Optional[nn.Parameter] = None):
        super().__init__()
        self.config = config
        if word_embedding is None:
            word_embedding = nn.Parameter(torch.randn(config.vocab_size, config.hidden) * config.init_std)
        if position_embedding is None:
            position_embedding = nn.Parameter(torch.randn(config.max_positions, config.hidden) * config.init_std)
        for name, given, shape in (("word_embedding", word_embedding, (config.vocab_size, config.hidden)),
                                   ("position_embedding", position_embedding, (config.max_positions, config.hidden))):
            if tuple(given.shape) != shape:
                raise ValueError(f"CaptionDecoder: {name} has shape {tuple(given.shape)}, the config asks for "
                                 f"{shape}; set DecoderConfig.vocab_size/max_positions/hidden from CLIP's sizes")
        self.word_embedding = word_embedding  # (V, E), also the output weight
        self.position_embedding = position_embedding  # (max_positions, E)
        self.embedding_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.visual_layers = nn.ModuleList([VisualLayer(config) for _ in range(config.layers)])
        self.caption_layers = nn.ModuleList([CaptionLayer(config) for _ in range(config.layers)])
        # The head: the reference's BertPredictionHeadTransform (modules/module_decoder.py), then the tied output
        # map plus its own bias.
        self.head_dense = nn.Linear(config.hidden, config.hidden)
        self.head_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self._init_weights()

    def _init_weights(self):
        # The reference's init_weights (modules/until_module.py): normal(0, 0.02) weights, zero biases, LayerNorm
        # weight 1 and bias 0.
        # Embeddings passed in (CLIP's) are left alone; fresh ones were drawn above with the same std.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    # --- the pieces of the forward pass, shared by training and both decoding algorithms ---

    def embed(self, caption_tokens: torch.Tensor, first_position: int = 0) -> torch.Tensor:
        """LayerNorm(word + position) then dropout; caption_tokens (B, T) sit at first_position, +1, ..."""
        length = caption_tokens.shape[1]
        positions = self.position_embedding[first_position:first_position + length]  # (T, E)
        return self.embedding_dropout(self.embedding_norm(F.embedding(caption_tokens, self.word_embedding)
                                                          + positions))  # (B, T, E)

    def encode_visual(self, visual: torch.Tensor) -> list[torch.Tensor]:
        """The visual self-attention layers; returns every layer's output, L x (B, M, E)."""
        outputs = []
        for layer in self.visual_layers:
            visual = layer(visual)  # (B, M, E)
            outputs.append(visual)
        return outputs

    def to_logits(self, caption_states: torch.Tensor) -> torch.Tensor:
        """The head: (..., E) -> (..., V). The output weight is the word embedding itself."""
        hidden = self.head_norm(F.gelu(self.head_dense(caption_states)))  # (..., E)
        return F.linear(hidden, self.word_embedding, self.output_bias)  # (..., V)

    def caption_states(self, visual: torch.Tensor, caption_in: torch.Tensor,
                       caption_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The last decoder layer's output (B, T, E), before the head.

        A caller that needs logits only at some positions (the loss ignores padding) can select those rows
        and call `to_logits` on them, instead of computing all (B, T, V).
        """
        self._check_inputs(visual, caption_in, caption_padding)
        caption = self.embed(caption_in)  # (B, T, E)
        mask = None
        if caption_padding is not None:
            # The reference's decoder mask: a query may not attend to later tokens nor to padding. For a
            # caption padded at the end, the padding part changes only the outputs at padded positions.
            length = caption_in.shape[1]
            earlier = torch.ones(length, length, dtype=torch.bool, device=caption_in.device).tril()  # (T, T)
            mask = earlier & ~caption_padding[:, None, None, :]  # (B, 1, T, T)
        visual_states = self.encode_visual(visual)  # L x (B, M, E)
        for layer, visual_state in zip(self.caption_layers, visual_states):
            self_keys, self_values = layer.self_attention.keys_values(caption)  # (B, H, T, E/H) each
            visual_keys, visual_values = layer.cross_attention.keys_values(visual_state)  # (B, H, M, E/H) each
            caption = layer(caption, self_keys, self_values, visual_keys, visual_values,
                            self_mask=mask, causal=mask is None)  # (B, T, E)
        return caption

    def forward(self, visual: torch.Tensor, caption_in: torch.Tensor,
                caption_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced logits.

        visual (B, M, E) float: the pair encoder's tokens; caption_in (B, T) int: [SOT] + caption, padded;
        caption_padding (B, T) bool, True at padded positions (None: no padding). Returns (B, T, V): at
        position t, the scores of the token that follows caption_in[:, :t+1].
        """
        return self.to_logits(self.caption_states(visual, caption_in, caption_padding))  # (B, T, V)

    # --- greedy decoding ---

    @torch.no_grad()
    def greedy_decode(self, visual: torch.Tensor, sot_id: int, eot_id: int, max_len: int = 22,
                      use_cache: bool = True) -> torch.Tensor:
        """Greedy captions for a batch of pairs: visual (B, M, E) -> token ids (B, S), S <= max_len, SOT left out.

        A caption ends with its first eot_id; a row that has stopped is filled with eot_id while others go on,
        and decoding ends as soon as every row has stopped.
        use_cache=True: visual layers and cross-attention keys/values once, self-attention keys/values cached.
        use_cache=False: the reference's algorithm, the full model on the whole prefix at every step.
        """
        if self.training:
            raise RuntimeError("CaptionDecoder.greedy_decode: the model is in training mode, so dropout would "
                               "make decoding random; call .eval() first")
        if not 1 <= max_len <= self.config.max_positions:
            raise ValueError(f"greedy_decode: max_len={max_len} must be in 1..{self.config.max_positions}: the last "
                             f"step feeds SOT and max_len - 1 tokens, which must fit the {self.config.max_positions} positions")
        for name, token in (("sot_id", sot_id), ("eot_id", eot_id)):
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(f"greedy_decode: {name}={token} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        self._check_inputs(visual)
        batch = visual.shape[0]

        if use_cache:
            visual_states = self.encode_visual(visual)  # L x (B, M, E), once
            visual_keys_values = [layer.cross_attention.keys_values(state)  # L x 2 x (B, H, M, E/H), once
                                  for layer, state in zip(self.caption_layers, visual_states)]
            self_keys_values = [None] * len(self.caption_layers)  # per layer: 2 x (B, H, t, E/H), grows by 1 a step

            def next_logits(tokens: torch.Tensor) -> torch.Tensor:
                # Feed only the newest token (B, 1); earlier tokens are in the cache.
                caption = self.embed(tokens[:, -1:], first_position=tokens.shape[1] - 1)  # (B, 1, E)
                for i, layer in enumerate(self.caption_layers):
                    keys, values = layer.self_attention.keys_values(caption)  # (B, H, 1, E/H) each
                    if self_keys_values[i] is not None:
                        keys = torch.cat([self_keys_values[i][0], keys], dim=2)  # (B, H, t, E/H)
                        values = torch.cat([self_keys_values[i][1], values], dim=2)  # (B, H, t, E/H)
                    self_keys_values[i] = (keys, values)
                    # The newest token may attend to every cached token: no mask needed.
                    caption = layer(caption, keys, values, *visual_keys_values[i])  # (B, 1, E)
                return self.to_logits(caption[:, -1])  # (B, V)
        else:
            def next_logits(tokens: torch.Tensor) -> torch.Tensor:
                return self(visual, tokens)[:, -1]  # (B, V), recomputing everything for the whole prefix

        tokens = torch.full((batch, 1), sot_id, dtype=torch.long, device=visual.device)  # (B, 1)
        finished = torch.zeros(batch, dtype=torch.bool, device=visual.device)  # (B,)
        for _ in range(max_len):
            next_token = next_logits(tokens).argmax(dim=-1)  # (B,)
            next_token = next_token.masked_fill(finished, eot_id)  # stopped rows keep emitting EOT
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)  # (B, t + 1)
            finished |= next_token == eot_id
            # differs from reference: it always runs max_words = 32 steps; we stop once every caption has ended.
            if bool(finished.all()):
                break
        return tokens[:, 1:]  # (B, S), S <= max_len

    @torch.no_grad()
    def greedy_decode_static(self, visual: torch.Tensor, sot_id: int, eot_id: int, max_len: int = 22) -> torch.Tensor:
        """greedy_decode with its cache at fixed shapes, for a GPU to replay as one graph: token ids (B, max_len).

        The self-attention keys and values go into tensors of max_len rows, written one row a step and attended
        under a mask of the rows written so far; every step has the same shapes and none reads a value back to
        the host, so all max_len steps run (a row that has ended keeps emitting eot_id). The same tokens as
        greedy_decode's, padded with eot_id (tested). torch.compile or CUDA graphs can capture the whole loop."""
        if self.training:
            raise RuntimeError("CaptionDecoder.greedy_decode_static: call .eval() first (dropout would be random)")
        self._check_inputs(visual)
        batch, heads, head_width = visual.shape[0], self.config.heads, self.config.hidden // self.config.heads
        visual_keys_values = [layer.cross_attention.keys_values(state)  # L x 2 x (B, H, M, E/H), once
                              for layer, state in zip(self.caption_layers, self.encode_visual(visual))]
        cache = [[visual.new_zeros(batch, heads, max_len, head_width) for _ in range(2)]  # L x 2 x (B, H, S, E/H)
                 for _ in self.caption_layers]
        rows = torch.arange(max_len, device=visual.device)  # (S,)
        token = torch.full((batch,), sot_id, dtype=torch.long, device=visual.device)  # (B,)
        finished = torch.zeros(batch, dtype=torch.bool, device=visual.device)  # (B,)
        out = []
        for step in range(max_len):
            caption = self.embed(token[:, None], first_position=step)  # (B, 1, E)
            written = (rows <= step)[None, None, None, :]  # (1, 1, 1, S): the rows this step may attend to
            for (keys, values), layer, visual_kv in zip(cache, self.caption_layers, visual_keys_values):
                new_keys, new_values = layer.self_attention.keys_values(caption)  # (B, H, 1, E/H) each
                keys[:, :, step] = new_keys[:, :, 0]
                values[:, :, step] = new_values[:, :, 0]
                caption = layer(caption, keys, values, *visual_kv, self_mask=written)  # (B, 1, E)
            token = self.to_logits(caption[:, -1]).argmax(dim=-1).masked_fill(finished, eot_id)  # (B,)
            finished = finished | (token == eot_id)
            out.append(token)
        return torch.stack(out, dim=1)  # (B, max_len)

    def _check_inputs(self, visual: torch.Tensor, caption_in: Optional[torch.Tensor] = None,
                      caption_padding: Optional[torch.Tensor] = None):
        expected = (self.config.visual_tokens, self.config.hidden)
        if visual.dim() != 3 or tuple(visual.shape[1:]) != expected or not visual.is_floating_point():
            raise ValueError(f"CaptionDecoder: visual must be float (B, {expected[0]}, {expected[1]}) "
                             f"(B pairs, M visual tokens, E width), got {visual.dtype} {tuple(visual.shape)}; "
                             "pass the pair encoder's token output, or fix DecoderConfig.visual_tokens/hidden")
        if caption_in is None:
            return
        if caption_in.dim() != 2 or caption_in.shape[0] != visual.shape[0] or caption_in.is_floating_point():
            raise ValueError(f"CaptionDecoder: caption_in must be integer ids (B, T) with B={visual.shape[0]} "
                             f"as visual, got {caption_in.dtype} {tuple(caption_in.shape)}")
        if caption_in.shape[1] > self.config.max_positions:
            raise ValueError(f"CaptionDecoder: caption_in has {caption_in.shape[1]} tokens, more than the "
                             f"{self.config.max_positions} positions; truncate the captions")
        if caption_padding is not None:
            if caption_padding.shape != caption_in.shape or caption_padding.dtype != torch.bool:
                raise ValueError(f"CaptionDecoder: caption_padding must be bool {tuple(caption_in.shape)} like "
                                 f"caption_in, got {caption_padding.dtype} {tuple(caption_padding.shape)}")
        # caption_padding must not mark the first token (SOT): a query with no key to attend to is undefined.
        # data.caption_tokens always puts SOT first; checking the values here would make every training step
        # wait for the GPU, so only the shapes and types are checked.


def ids_to_text(ids: Sequence[int], decode: Callable[[list[int]], str], eot_id: int, pad_text: str = PAD_TEXT) -> str:
    """Token ids of one generated caption -> text, as the reference: cut at the first EOT, decode (pass
    clip's tokenizer.decode), cut at the first pad_text ("!", CLIP's id 0, which the reference pads with), strip."""
    ids = [int(i) for i in ids]
    if eot_id in ids:
        ids = ids[:ids.index(eot_id)]
    return decode(ids).split(pad_text, 1)[0].strip()


# ---------------------------------------------------------------------------------------------------------
# Demo


def demo():
    torch.manual_seed(0)
    config = DecoderConfig(hidden=64, heads=4, ffn=128, vocab_size=300, visual_tokens=100)
    decoder = CaptionDecoder(config).eval()
    visual = torch.randn(4, config.visual_tokens, config.hidden)  # (B, M, E)
    caption_in = torch.randint(0, config.vocab_size, (4, 12))  # (B, T)
    print(f"visual tokens {tuple(visual.shape)}, caption tokens {tuple(caption_in.shape)} "
          f"-> logits {tuple(decoder(visual, caption_in).shape)}")
    sot_id, eot_id = config.vocab_size - 2, config.vocab_size - 1
    cached = decoder.greedy_decode(visual, sot_id, eot_id, max_len=22, use_cache=True)
    recomputed = decoder.greedy_decode(visual, sot_id, eot_id, max_len=22, use_cache=False)
    print(f"greedy decoding with the cache {tuple(cached.shape)}, without {tuple(recomputed.shape)}; "
          f"same tokens: {torch.equal(cached, recomputed)}")
    print("first caption's ids:", cached[0].tolist())
    print("as text (ids shown as words):", ids_to_text(cached[0], lambda ids: " ".join(f"w{i}" for i in ids), eot_id))


if __name__ == "__main__":
    argparse.ArgumentParser(description="Caption decoder demo: a tiny random decoder decodes a batch with and "
                                        "without the cache (timings: python -m bench decoder)").parse_args()
    demo()
