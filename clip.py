"""CLIP, the backbone CLIP4IDC adapts: the image and text towers, their tokenizer and preprocessing.

CLIP (Contrastive Language-Image Pre-training; Radford et al., 2021, "Learning Transferable Visual Models From
Natural Language Supervision", section 2.4) embeds an image with a vision transformer (ViT) and a caption with a
causal text transformer into one space where matching pairs have a high cosine similarity. CLIP4IDC (CLIP for
Image Difference Captioning; Guo et al., 2022) starts from OpenAI's ViT-B/32 and re-uses both towers: encoder.py
runs this file's vision blocks over an image pair, adapt.py compares the result with this file's text embedding.

This file rebuilds OpenAI's CLIP from scratch in plain PyTorch (github.com/openai/CLIP, clip/model.py,
clip/simple_tokenizer.py, clip/clip.py's load) with OpenAI's parameter names, so that OpenAI's state dict
loads with strict=True. It holds, top to bottom:
    1. the model: pre-LN residual attention blocks (LayerNorm before each sub-layer), the vision transformer,
       CLIP, build_model (the reading path's first stop);
    2. the byte-level BPE (byte-pair encoding) tokenizer and tokenize() (a side trip of the reading path);
    3. image preprocessing, OpenAI's (resize + centre crop) and CLIP4IDC's (resize to a square);
  and a demo. How the files reach the machine (the checksummed download cache of the weights and the vocabulary,
  OpenAI's TorchScript archives read without running them, and load(), which builds the model from a weights file
  as openai/CLIP's clip.load) is plumbing/clip_files.py's, as openai/CLIP keeps clip/clip.py apart from model.py.

What differs from the reference (here: openai/CLIP):
  - batch-first tensors (B, L, D) everywhere; OpenAI's blocks are sequence-first (L, B, D);
  - attention through torch.nn.functional.scaled_dot_product_attention (is_causal for the text tower)
    instead of nn.MultiheadAttention with an explicit -inf mask; the parameters keep its names;
  - weights stay float32 (OpenAI converts them to float16 on a GPU); mixed precision is autocast's job, and both
    towers' residual streams stay float32 under it (the blocks' products run in bfloat16/float16);
  - a weights file is read without running it (plumbing/clip_files.py); there is no jit=True mode;
  - the tokenizer reads any merges file in OpenAI's format, so a small dataset can bring a small
    vocabulary (the synthetic dataset does); with OpenAI's file it is OpenAI's tokenizer, id for id.

Run:  python clip.py --bpe-path FILE    tokenize a caption, push a random tiny CLIP through, print the shapes
      (the vocabulary from --bpe-path or CLIP_BPE_PATH; without one, the shapes only; timings: python -m bench clip)

Shape letters: B batch, R image side in pixels (224), P patch side (32), G = R/P patches per side (7),
N = G*G patches per image (49), D vision width (768), W text width (512), E joint embedding width (512),
T tokens per caption (<= 77), L tokens in a block's sequence (N+1 or T), H heads, V vocabulary (49408).
"""
import argparse
import collections
import gzip
import html
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import ftfy
import numpy as np
import regex
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image


class FileError(RuntimeError):
    """A weights or vocabulary file that cannot be used: corrupt, truncated, of the wrong kind, or not the
    download its checksum names. The fix is to get the file again, so the scripts print it as one line."""


# ---------------------------------------------------------------------------------------------------
# 1. The model
# ---------------------------------------------------------------------------------------------------

HEAD_WIDTH = 64          # OpenAI's rule: heads = width // 64
MLP_RATIO = 4            # the MLP (multilayer perceptron) of a block is 4x the width
QUICK_GELU_SCALE = 1.702  # QuickGELU: x * sigmoid(1.702 x), approximating the GELU (Gaussian error linear unit)
METADATA_KEYS = ("input_resolution", "context_length", "vocab_size")  # non-weight tensors in OpenAI's archives


@dataclass
class CLIPConfig:
    """CLIP's sizes; the defaults are ViT-B/32's. build_model reads them off a checkpoint instead."""
    embed_dim: int = 512            # E, the joint image-text embedding width
    image_resolution: int = 224     # R, input images are R x R
    vision_layers: int = 12         # residual blocks in the vision transformer
    vision_width: int = 768         # D; heads = D // 64 = 12
    vision_patch_size: int = 32     # P, so G = 224 // 32 = 7 and N = 49 patches
    context_length: int = 77        # longest caption in tokens, SOT and EOT included
    vocab_size: int = 49408         # V, BPE vocabulary size
    transformer_width: int = 512    # W, text transformer width
    transformer_heads: int = 8      # W // 64
    transformer_layers: int = 12    # residual blocks in the text transformer

    @property
    def vision_heads(self) -> int:
        # differs from reference: at least one head, so widths below 64 (tiny test models) work
        return max(1, self.vision_width // HEAD_WIDTH)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 and cast back, so it stays accurate under fp16/bf16 autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), the GELU approximation CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(QUICK_GELU_SCALE * x)


class SelfAttention(nn.Module):
    """Multi-head self-attention with nn.MultiheadAttention's parameter names and initialisation.

    q, k and v come from one stacked projection in_proj_weight (3D, D), as in OpenAI's checkpoint.
    """

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        assert d_model % n_head == 0, f"width {d_model} is not divisible by {n_head} heads"
        self.n_head = n_head
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        # nn.MultiheadAttention's init, which OpenAI's vision blocks keep (initialize_parameters skips them)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, batch: int, causal: bool = False) -> torch.Tensor:
        """x (B*L, D), the rows of B sequences -> (B*L, D): every position asks (its query) and answers (its key
        and value)."""
        D = x.shape[-1]
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(batch, -1, 3, self.n_head, D // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, L, D/H), the heads split in one view
        return self.heads(q, k, v, causal)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int,
               causal: bool = False) -> torch.Tensor:
        """The attention of the queries q (B*Q, D) over the keys k and values v (B*L, D) of B sequences, then
        out_proj: (B*Q, D). (B, Q, D) and (B, L, D) work too."""
        D = q.shape[-1]
        q, k, v = (t.view(batch, -1, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, *, D/H)
        return self.heads(q, k, v, causal)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """Each head's attention, the heads joined, then out_proj: q (B, H, Q, D/H), k and v (B, H, L, D/H) -> (B*Q, D)."""
        # differs from reference: fused scaled_dot_product_attention instead of nn.MultiheadAttention; with
        # causal, position i sees positions <= i only: the -inf mask OpenAI's text tower builds by hand
        x = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, Q, D/H)
        x = x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[3])       # (B*Q, D)
        return self.out_proj(x)


class ResidualAttentionBlock(nn.Module):
    """A pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        # names fixed by OpenAI's checkpoint: attn, ln_1, mlp.c_fc, mlp.c_proj, ln_2
        self.attn = SelfAttention(d_model, n_head)
        self.ln_1 = LayerNorm(d_model)
        self.mlp = nn.Sequential(collections.OrderedDict([
            ("c_fc", nn.Linear(d_model, MLP_RATIO * d_model)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(MLP_RATIO * d_model, d_model)),
        ]))
        self.ln_2 = LayerNorm(d_model)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        B, L, D = x.shape
        # the block on the B*L rows: the LayerNorms, the products and the sums treat every position alike, and a
        # product on rows is the one torch makes of (B, L, D) anyway, without the reshapes around each of them
        x = x.reshape(B * L, D)                                 # (B*L, D)
        x = x + self.attn(self.ln_1(x), B, causal=causal)  # (B*L, D)
        x = x + self.mlp(self.ln_2(x))                     # (B*L, D)
        return x.view(B, L, D)


class Transformer(nn.Module):
    """A stack of residual attention blocks."""
    # differs from reference: batch-first (B, L, D); OpenAI's blocks take (L, B, D) and CLIP permutes NLD -> LND

    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.ModuleList([ResidualAttentionBlock(width, heads) for _ in range(layers)])

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, causal=causal)  # (B, L, D)
        return x


class VisionTransformer(nn.Module):
    """ViT: cut the image into P x P patches, embed each, prepend a class token, run the blocks.

    embed() is separate so that encoder.py can embed the before and after images with it and then run
    the blocks itself over both (CLIP4IDC's intra- and inter-image layers).
    """

    def __init__(self, input_resolution: int, patch_size: int, width: int, layers: int, heads: int,
                 output_dim: int):
        super().__init__()
        assert input_resolution % patch_size == 0, \
            f"resolution {input_resolution} is not a multiple of patch {patch_size}"
        self.input_resolution = input_resolution
        self.output_dim = output_dim
        n_patches = (input_resolution // patch_size) ** 2  # N
        scale = width ** -0.5
        # names fixed by OpenAI's checkpoint: conv1, class_embedding, positional_embedding, ln_pre, ln_post, proj
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)  # patch embedding
        self.class_embedding = nn.Parameter(scale * torch.randn(width))                          # (D,)
        self.positional_embedding = nn.Parameter(scale * torch.randn(n_patches + 1, width))      # (N+1, D)
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads)
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))                         # (D, E)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised images (B, 3, R, R) -> token embeddings (B, N+1, D), class token first."""
        R = self.input_resolution
        assert images.ndim == 4 and tuple(images.shape[1:]) == (3, R, R), \
            f"expected images of shape (B, 3, {R}, {R}), got {tuple(images.shape)}"
        # differs from reference: the residual stream starts in float32 also under autocast (conv1 gives bf16 or
        # fp16 there), as the text tower's does: each block adds its bf16 output to a float32 stream. On the
        # synthetic test split this halves the bf16 pair embeddings' error (BENCHMARKS.md section 11)
        x = self.conv1(images).float()                                # (B, D, G, G)
        x = x.flatten(2).transpose(1, 2)                              # (B, N, D), patches row-major
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1)                                # (B, N+1, D)
        x = x + self.positional_embedding.to(x.dtype)                 # (B, N+1, D)
        return self.ln_pre(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.transformer(self.embed(images))  # (B, N+1, D)
        return self.ln_post(x[:, 0]) @ self.proj   # (B, E): the class token is the image embedding


class CLIP(nn.Module):
    """The two towers, their projections into the joint space, and the learned temperature."""

    def __init__(self, config: CLIPConfig):
        super().__init__()
        self.config = config
        self.context_length = config.context_length
        self.visual = VisionTransformer(config.image_resolution, config.vision_patch_size, config.vision_width,
                                        config.vision_layers, config.vision_heads, config.embed_dim)
        # names fixed by OpenAI's checkpoint: transformer, token_embedding, positional_embedding, ln_final, ...
        self.transformer = Transformer(config.transformer_width, config.transformer_layers, config.transformer_heads)
        self.token_embedding = nn.Embedding(config.vocab_size, config.transformer_width)                 # (V, W)
        self.positional_embedding = nn.Parameter(torch.empty(config.context_length, config.transformer_width))  # (T, W)
        self.ln_final = LayerNorm(config.transformer_width)
        self.text_projection = nn.Parameter(torch.empty(config.transformer_width, config.embed_dim))      # (W, E)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # log(1/temperature), learned, as in CLIP
        self.initialize_parameters()

    def initialize_parameters(self):
        """OpenAI's initialisation of the text side; the vision side keeps its constructors' init."""
        width, layers = self.transformer.width, self.transformer.layers
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        proj_std = width ** -0.5 * (2 * layers) ** -0.5  # residual outputs shrink with depth
        attn_std = width ** -0.5
        fc_std = (2 * width) ** -0.5
        for block in self.transformer.resblocks:
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=width ** -0.5)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.visual(images)  # (B, E)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> caption embeddings (B, E), read at each caption's EOT token."""
        assert tokens.ndim == 2 and tokens.shape[1] <= self.context_length, \
            f"expected token ids of shape (B, T <= {self.context_length}), got {tuple(tokens.shape)}"
        B, T = tokens.shape
        # T < 77 uses the first T positions, as CLIP4IDC does with its 32-token captions
        x = self.token_embedding(tokens) + self.positional_embedding[:T]  # (B, T, W)
        x = self.transformer(x, causal=True)                              # (B, T, W)
        x = self.ln_final(x)                                              # (B, T, W)
        # EOT has the largest id, so argmax finds it (the first one, if a caption holds several)
        eot = tokens.argmax(dim=-1)                                       # (B,)
        return x[torch.arange(B, device=x.device), eot] @ self.text_projection  # (B, E)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image_features = F.normalize(self.encode_image(images), dim=-1)  # (B, E)
        text_features = F.normalize(self.encode_text(tokens), dim=-1)    # (B', E)
        logits_per_image = self.logit_scale.exp() * image_features @ text_features.t()  # (B, B')
        return logits_per_image, logits_per_image.t()


def build_model(state_dict: dict[str, torch.Tensor]) -> CLIP:
    """A float32 CLIP in eval mode holding state_dict; every size is read off the tensor shapes (config_of)."""
    state_dict = {k: v for k, v in state_dict.items() if k not in METADATA_KEYS}
    config = config_of(state_dict)
    model = CLIP(config)
    # differs from reference: the weights stay float32; OpenAI converts them to fp16 (convert_weights)
    try:
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()})
    except RuntimeError as error:
        raise RuntimeError(f"the state dict does not fit {config}:\n{error}") from error
    return model.eval()


def config_of(state_dict: dict[str, torch.Tensor]) -> CLIPConfig:
    """CLIP's sizes, read off the shapes of a state dict in OpenAI's names, as openai/CLIP's build_model reads them."""
    try:
        conv1 = state_dict["visual.conv1.weight"]                     # (D, 3, P, P)
        grid = round((state_dict["visual.positional_embedding"].shape[0] - 1) ** 0.5)  # G
        width = state_dict["ln_final.weight"].shape[0]                # W
        config = CLIPConfig(
            embed_dim=state_dict["text_projection"].shape[1],
            image_resolution=conv1.shape[-1] * grid,
            vision_layers=sum(k.startswith("visual.transformer.resblocks.") and k.endswith(".attn.in_proj_weight")
                              for k in state_dict),
            vision_width=conv1.shape[0],
            vision_patch_size=conv1.shape[-1],
            context_length=state_dict["positional_embedding"].shape[0],
            vocab_size=state_dict["token_embedding.weight"].shape[0],
            transformer_width=width,
            transformer_heads=max(1, width // HEAD_WIDTH),
            transformer_layers=len({k.split(".")[2] for k in state_dict if k.startswith("transformer.resblocks.")}),
        )
    except KeyError as error:
        raise KeyError(f"the state dict has no {error}: it is not a CLIP ViT state dict with OpenAI's key names "
                       f"(ResNet CLIP is not supported)") from error
    return config


# ---------------------------------------------------------------------------------------------------
# 2. The byte-level BPE tokenizer (openai/CLIP clip/simple_tokenizer.py)
# ---------------------------------------------------------------------------------------------------

PAD_ID = 0               # tokenize() pads with id 0, which is also the token "!" (CLIP has no pad token)
SOT, EOT = "<|startoftext|>", "<|endoftext|>"  # start and end of text, the two special tokens
MAX_MERGES = 48_894      # CLIP's 49,408 ids = 256 bytes + 256 bytes-with-</w> + 48,894 merges + 2 specials


@lru_cache
def bytes_to_unicode() -> dict[int, str]:
    """A printable character for each of the 256 byte values, so BPE can work on strings.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...) get the
    characters from U+0100 on, in byte order. The vocabulary starts with these 256, in this order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


# The pre-tokenizer cuts cleaned text into words before BPE; merges never cross these boundaries.
PRE_TOKENIZER = regex.compile("|".join([
    r"<\|startoftext\|>|<\|endoftext\|>",  # the special tokens, kept whole
    r"'s|'t|'re|'ve|'m|'ll|'d",            # English contractions split off their word
    r"[\p{L}]+",                           # a run of letters, in any script
    r"[\p{N}]",                            # one digit: numbers are spelt digit by digit
    r"[^\s\p{L}\p{N}]+",                   # a run of anything else that is not white space
]), regex.IGNORECASE)


def basic_clean(text: str) -> str:
    # ftfy repairs mojibake and normalises quotes and widths; two more HTML unescapes as OpenAI does
    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def whitespace_clean(text: str) -> str:
    return regex.sub(r"\s+", " ", text).strip()


def read_merges(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The BPE merges of a gzip file in OpenAI's format: a #version header line, then one "a b" per line."""
    try:
        with gzip.open(path, "rb") as f:
            lines = f.read().decode("utf-8").split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise FileError(f"{path} is not a gzip-compressed BPE merges file ({error})") from error
    if "#version" not in lines[0]:
        raise FileError(f"{path} does not start with a #version line, so it is not a BPE merges file in "
                        f"OpenAI's format; its first line is {lines[0][:80]!r}")
    # differs from reference: any merges file, up to CLIP's 48,894 merges (OpenAI slices lines 1..48,894 of
    # its own file); a smaller file gives a smaller vocabulary, as the synthetic dataset's does
    merges = []
    for number, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        pair = tuple(line.split())
        if len(pair) != 2:
            raise FileError(f"{path}, line {number}: expected a merge 'a b', got {line!r}")
        merges.append(pair)
        if len(merges) == MAX_MERGES:  # OpenAI's file holds more; CLIP uses the first 48,894
            break
    return merges


def merge_pair(symbols, pair: tuple[str, str]) -> list[str]:
    """symbols with every occurrence of the adjacent pair merged into one symbol, left to right."""
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


class SimpleTokenizer:
    """CLIP's byte-level BPE: clean, lower-case, pre-tokenize, turn bytes into symbols, merge, look up ids."""

    def __init__(self, bpe_path: str | os.PathLike):
        self.bpe_path = Path(bpe_path)
        merges = read_merges(self.bpe_path)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        symbols = list(self.byte_encoder.values())
        # ids: 256 byte symbols, the same with "</w>" (end of word), one per merge, then the two specials
        vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [SOT, EOT]
        self.encoder = {s: i for i, s in enumerate(vocab)}
        self.decoder = dict(enumerate(vocab))
        self.bpe_ranks = {m: rank for rank, m in enumerate(merges)}  # a lower rank merges first
        self.vocab_size = len(vocab)
        self.sot_id = self.encoder[SOT]
        self.eot_id = self.encoder[EOT]
        self.pad_id = PAD_ID  # what tokenize() and data.py pad with
        self.cache = {SOT: [self.sot_id], EOT: [self.eot_id]}  # pre-token -> its ids; the specials are pre-filled

    def bpe(self, token: str) -> list[int]:
        """The ids of one pre-token (already mapped to byte symbols)."""
        if token in self.cache:
            return self.cache[token]
        word = [*token[:-1], token[-1] + "</w>"]  # symbols; the last one marks the end of the word
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, math.inf))
            if best not in self.bpe_ranks:
                break
            word = merge_pair(word, best)
        self.cache[token] = ids = [self.encoder[symbol] for symbol in word]
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of text, without SOT and EOT."""
        text = whitespace_clean(basic_clean(text)).lower()
        ids = []
        for pre_token in PRE_TOKENIZER.findall(text):
            ids.extend(self.bpe("".join(self.byte_encoder[b] for b in pre_token.encode("utf-8"))))
        return ids

    def decode(self, ids) -> str:
        """Text of token ids; each end of word becomes a space, so "hello world!" decodes as "hello world ! "."""
        ids = [int(i) for i in ids]
        unknown = [i for i in ids if i not in self.decoder]
        if unknown:
            raise ValueError(f"token ids {unknown[:5]} are outside the vocabulary of {self.vocab_size} ids "
                             f"read from {self.bpe_path}")
        symbols = "".join(self.decoder[i] for i in ids)
        return bytearray(self.byte_decoder[c] for c in symbols).decode("utf-8", errors="replace").replace("</w>", " ")


@lru_cache
def _tokenizer_for(path: Path) -> SimpleTokenizer:
    return SimpleTokenizer(path)


def get_tokenizer(bpe_path: str | os.PathLike) -> SimpleTokenizer:
    """The tokenizer of a vocabulary file, built once per resolved path (plumbing/clip_files.py finds OpenAI's)."""
    return _tokenizer_for(Path(bpe_path).resolve())


def tokenize(texts: str | list[str], tokenizer: SimpleTokenizer, context_length: int = 77,
             truncate: bool = False) -> torch.IntTensor:
    """Rows [SOT, ids..., EOT, PAD_ID...] of length context_length, one per text, int32 (as openai/CLIP).

    A text that does not fit raises, unless truncate: then it is cut and its last token becomes EOT.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    result = torch.full((len(texts), context_length), PAD_ID, dtype=torch.int32)  # (n, T)
    for row, text in enumerate(texts):
        ids = [tokenizer.sot_id, *tokenizer.encode(text), tokenizer.eot_id]
        if len(ids) > context_length:
            if not truncate:
                raise RuntimeError(f"text {row} ({text[:60]!r}...) is {len(ids)} tokens long, more than the context "
                                   f"length {context_length}; shorten it or pass truncate=True")
            ids = ids[:context_length - 1] + [tokenizer.eot_id]
        result[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return result


# ---------------------------------------------------------------------------------------------------
# 3. Image preprocessing (PIL + numpy; the same arithmetic as torchvision's transforms)
# ---------------------------------------------------------------------------------------------------

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # per-channel mean of CLIP's training images (RGB)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # and their standard deviation


def center_crop_to_uint8(image: Image.Image, n_px: int) -> np.ndarray:
    """OpenAI's preprocessing up to the pixels: shorter side to n_px (bicubic), centre crop -> (n_px, n_px, 3) uint8."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    new_long = int(n_px * long / short)  # truncated, as torchvision does
    size = (n_px, new_long) if width <= height else (new_long, n_px)
    if size != image.size:  # an image already at size is left alone (resizing RGBA would still change it)
        # Pillow resizes RGBA with premultiplied alpha and palette images with NEAREST; converting to RGB
        # first would change the pixels, so, as OpenAI does, convert after resize and crop
        image = image.resize(size, Image.Resampling.BICUBIC)
    left = int(round((size[0] - n_px) / 2))  # Python's round: half to even
    top = int(round((size[1] - n_px) / 2))
    image = image.crop((left, top, left + n_px, top + n_px)).convert("RGB")
    return np.array(image, dtype=np.uint8)  # (n_px, n_px, 3)


def resize_to_uint8(image: Image.Image, n_px: int = 224) -> np.ndarray:
    """CLIP4IDC's preprocessing up to the pixels: RGB, bicubic resize straight to n_px x n_px (aspect not kept)."""
    image = image.convert("RGB")
    if image.size != (n_px, n_px):
        image = image.resize((n_px, n_px), Image.Resampling.BICUBIC)
    return np.array(image, dtype=np.uint8)  # (n_px, n_px, 3)


def normalize(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 RGB pixels (..., H, W, 3) -> float32 (..., 3, H, W): /255, then CLIP's mean and std per channel."""
    if isinstance(pixels, np.ndarray):
        pixels = torch.from_numpy(np.require(pixels, requirements=["C", "W"]))  # copies only if read-only
    assert pixels.dtype == torch.uint8 and pixels.shape[-1] == 3, \
        f"expected uint8 RGB pixels of shape (..., H, W, 3), got {pixels.dtype} {tuple(pixels.shape)}"
    x = pixels.movedim(-1, -3).float() / 255                           # (..., 3, H, W) in [0, 1]
    mean, std = _channel_stats(x.device)                                # (3, 1, 1) each
    return (x - mean) / std                                             # (..., 3, H, W)


@lru_cache(maxsize=None)
def _channel_stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP_MEAN and CLIP_STD as (3, 1, 1) tensors on device, made once: a tensor built from Python numbers is a
    copy from the host, which on a GPU waits for the device, and normalize runs on every training batch."""
    return (torch.tensor(CLIP_MEAN, device=device).view(3, 1, 1), torch.tensor(CLIP_STD, device=device).view(3, 1, 1))


def transform(n_px: int):
    """OpenAI's preprocess: PIL image -> (3, n_px, n_px) float32. load() returns it."""
    def preprocess(image: Image.Image) -> torch.Tensor:
        return normalize(center_crop_to_uint8(image, n_px))
    return preprocess


def pair_transform(n_px: int = 224):
    """CLIP4IDC's preprocess for the before and after images: PIL image -> (3, n_px, n_px) float32."""
    # differs from reference: float32 throughout; CLIP4IDC's loader makes float64 arrays and casts them later
    def preprocess(image: Image.Image) -> torch.Tensor:
        return normalize(resize_to_uint8(image, n_px))
    return preprocess


# ---------------------------------------------------------------------------------------------------
# Demo
# ---------------------------------------------------------------------------------------------------

def demo(bpe_path: str | None = None):
    caption = "The small red metal cube changed to blue."
    try:
        if not bpe_path:
            raise FileNotFoundError("pass --bpe-path FILE or set CLIP_BPE_PATH")
        tokenizer = get_tokenizer(bpe_path)
        tokens = tokenize(caption, tokenizer=tokenizer)  # (1, 77)
        n = int((tokens[0] != PAD_ID).sum())
        print(f"{caption!r}\n  -> ids {tokens[0, :n].tolist()} + {77 - n} x PAD_ID (vocabulary of "
              f"{tokenizer.vocab_size}, SOT {tokenizer.sot_id}, EOT {tokenizer.eot_id})")
        print(f"  -> decoded {tokenizer.decode(tokens[0, 1:n - 1])!r}")
    except (FileNotFoundError, OSError) as error:
        print(f"tokenizer skipped, no vocabulary: {error}")
        tokenizer, tokens = None, None

    torch.manual_seed(0)
    config = CLIPConfig(embed_dim=32, image_resolution=64, vision_layers=2, vision_width=64, vision_patch_size=16,
                        vocab_size=tokenizer.vocab_size if tokenizer else 1000, transformer_width=64,
                        transformer_heads=1, transformer_layers=2)
    model = CLIP(config).eval()
    print(f"tiny random {config}")
    images = torch.randn(2, 3, config.image_resolution, config.image_resolution)
    tokens = tokens.repeat(3, 1) if tokens is not None else torch.randint(1, config.vocab_size - 1, (3, 77))
    with torch.no_grad():
        print(f"  images {tuple(images.shape)} -> visual.embed {tuple(model.visual.embed(images).shape)} "
              f"-> encode_image {tuple(model.encode_image(images).shape)}")
        print(f"  tokens {tuple(tokens.shape)} -> encode_text {tuple(model.encode_text(tokens).shape)}")
        logits_per_image, logits_per_text = model(images, tokens)
        print(f"  logits_per_image {tuple(logits_per_image.shape)}, logits_per_text {tuple(logits_per_text.shape)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="CLIP demo: tokenize a caption, push a tiny random CLIP through "
                                                 "(timings: python -m bench clip)")
    parser.add_argument("--bpe-path", default=os.environ.get("CLIP_BPE_PATH"), help="BPE vocabulary file (default: "
                        "$CLIP_BPE_PATH)")
    demo(parser.parse_args().bpe_path)
