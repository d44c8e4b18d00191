"""Looking inside: where the pair encoder and the caption decoder attend, and whether that is where the change is.

CLIP4IDC's code (github.com/sushizixin/CLIP4IDC at commit ca49461) ships a visualize.py that shows the CLS
(class) token's attention over the 7 x 7 patches; change captioning papers in the line of RCC (Robust Change
Captioning, Park et al., 2019, whose model is DUDA, the Dual Dynamic Attention model) score such maps with a
pointing game. This file does both, for the models of encoder.py and decoder.py, without touching their
arithmetic: the attention weights are computed again, from the same projections, by forward hooks that exist
only inside `encoder_attention` and `decode_with_attention`. Training and ordinary decoding run the fused
scaled_dot_product_attention and never see a hook. It is a diagnostic, off the reading path: the models do not
know about it.

Two views:
  1. the pair encoder: the before and after CLS tokens' attention over both images' patches in the
     inter-image blocks, and, for comparison, each CLS over its own image in the last intra-image block
     (there the images are still apart, so it cannot know what changed);
  2. the decoder: each generated word's cross-attention over the M = 100 pair tokens, averaged over heads,
     per caption layer.

The pointing game (Zhang et al., 2016; RCC's evaluate_pointing.py): is the patch with the highest attention
on the changed object? A pair's target is every patch position (of the N = 49) that the changed object's box
overlaps in the before image or in the after image (RCC's bbox_before / bbox_after, data.py); the highest
patch of either image counts by its position. Chance is the target's share of the N positions. Our rule
differs from RCC's, which upsamples each image's map to pixels and scores the two images apart.

Run:  python caption.py --data synth --pair BEFORE AFTER --explain OUT.png   one pair, with a trained model
      python caption.py --data synth --eval      also scores localisation and writes test_attention.png (and, with
                                                 results.py, results.html: every test pair with its attention map)

Shape letters: B pairs, H heads, N patches per image (49), L = 2(N+1) pair tokens (100; M in decoder.py),
K inter-image blocks, S generated tokens, Y caption layers, E width.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

import clip
import data
from losses import ieee_float32
from plumbing.progress import Progress

if TYPE_CHECKING:  # the models it reads, named for the reader, not loaded: check.py draws its contact sheets alone
    from decoder import CaptionDecoder
    from encoder import PairEncoder

VIEWS = ("intra", "inter", "decoder")  # the maps the pointing game scores, and the column names of its table
VIEW_NAMES = {"intra": "encoder, last intra-image block (each CLS over its own image)",
              "inter": "encoder, last inter-image block (both CLS over both images)",
              "decoder": "decoder cross-attention (mean over words and layers)"}


# -----------------------------------------------------------------------------
# Attention weights, computed again from a module's inputs


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, E) -> (B, H, S, E/H), as decoder.split_heads."""
    batch, length, width = x.shape
    return x.view(batch, length, heads, width // heads).transpose(1, 2)  # (B, H, S, E/H)


def attention_weights(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None,
                      causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) as scaled_dot_product_attention computes it: (B, H, T, d), (B, H, S, d) -> (B, H, T, S).

    mask (bool, True = may attend) and causal give a masked key the weight 0; each row sums to 1. Computed in
    IEEE float32 also under autocast and --tf32, which would otherwise run the product in bf16/fp16 or TF32 (and the
    pointing game's argmax could flip between near-equal patches).
    """
    with torch.autocast(query.device.type, enabled=False), ieee_float32():
        scores = query.float() @ keys.float().transpose(-2, -1) / math.sqrt(query.shape[-1])  # (B, H, T, S)
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()  # (T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(dim=-1)  # (B, H, T, S)


@contextmanager
def hooks(modules, hook):
    """hook(module, args) after every forward of these modules, only inside the with block."""
    handles = [m.register_forward_hook(lambda module, args, output: hook(module, args)) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def encoder_attention(encoder: PairEncoder, before: torch.Tensor, after: torch.Tensor) -> dict[str, torch.Tensor]:
    """encode_pair, plus the CLS tokens' attention, averaged over heads.

    Returns {"pair_tokens": (B, L, E), "intra": (B, 2, N+1): before CLS over the before image and after CLS over
    the after image in the last intra-image block, "inter": (B, K, 2, L): before CLS (token 0) and after CLS
    (token N+1) over all L tokens in each inter-image block}. Without such a block its entry is missing.
    """
    blocks = encoder.clip.visual.transformer.resblocks
    split, after_cls = encoder.config.intra_layers, encoder.n_patches + 1
    seen = {}

    def record(attn, args):  # attn is clip.SelfAttention; args: its input ln_1(x) as rows (B'*T, D), and B'
        rows, batch = args[0], args[1]
        with torch.autocast(rows.device.type, enabled=False), ieee_float32():  # float32 queries and keys
            q, k, _ = F.linear(rows.float().view(batch, -1, rows.shape[-1]), attn.in_proj_weight,
                               attn.in_proj_bias).chunk(3, dim=-1)  # 3 x (B', T, D)
        weights = attention_weights(split_heads(q, attn.n_head), split_heads(k, attn.n_head)).mean(dim=1)  # (B', T, T)
        seen.setdefault(attn, []).append(weights)

    watched = ([blocks[split - 1].attn] if split > 0 else []) + [block.attn for block in blocks[split:]]
    with hooks(watched, record), torch.no_grad():
        out = {"pair_tokens": encoder.encode_pair(before, after)["pair_tokens"]}  # (B, L, E)
    batch = before.shape[0]
    if split > 0:
        weights = seen[blocks[split - 1].attn][0]  # (2B, N+1, N+1): [befores; afters], each image alone
        out["intra"] = torch.stack([weights[:batch, 0], weights[batch:, 0]], dim=1)  # (B, 2, N+1)
    if split < len(blocks):
        out["inter"] = torch.stack([seen[block.attn][0][:, [0, after_cls]] for block in blocks[split:]],
                                   dim=1)  # (B, K, 2, L)
    return out


def decode_with_attention(decoder: CaptionDecoder, visual: torch.Tensor, sot_id: int, eot_id: int,
                          max_len: int = 22) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding (cached) and each step's cross-attention, averaged over heads.

    Returns the tokens (B, S), as decoder.greedy_decode, and the attention (B, S, Y, M): at step s, caption
    layer y, over the M pair tokens, while the decoder chose token s.
    """
    steps = {}

    def record(cross_attention, args):  # decoder.Attention; args (caption (B, 1, E), keys, values (B, H, M, E/H))
        with torch.autocast(args[0].device.type, enabled=False), ieee_float32():  # a float32 query
            query = split_heads(cross_attention.query(args[0].float()), cross_attention.heads)  # (B, H, 1, E/H)
        steps.setdefault(cross_attention, []).append(attention_weights(query, args[1]).mean(dim=1))  # (B, 1, M)

    layers = [layer.cross_attention for layer in decoder.caption_layers]
    with hooks(layers, record):
        tokens = decoder.greedy_decode(visual, sot_id, eot_id, max_len, use_cache=True)  # (B, S)
    attention = torch.stack([torch.cat(steps[layer], dim=1) for layer in layers], dim=2)  # (B, S, Y, M)
    return tokens, attention


# -----------------------------------------------------------------------------
# From attention to patch maps, and the pointing game


def patch_maps(attention: dict[str, torch.Tensor], decoder_attention: torch.Tensor, lengths: list[int],
               n_patches: int) -> dict[str, torch.Tensor]:
    """One map over both images' patches per view, (B, 2N) each: the CLS tokens' columns left out.

    intra: the two CLS rows side by side; inter: the last inter-image block, mean of the two CLS rows;
    decoder: mean over caption layers and the steps that wrote a word (lengths[b] of them, at least one).
    """
    before, after = slice(1, n_patches + 1), slice(n_patches + 2, 2 * n_patches + 2)  # patch tokens of each image
    maps = {}
    if "intra" in attention:
        maps["intra"] = attention["intra"][:, :, 1:].flatten(1)  # (B, 2N)
    if "inter" in attention:
        last = attention["inter"][:, -1].mean(dim=1)  # (B, L)
        maps["inter"] = torch.cat([last[:, before], last[:, after]], dim=1)  # (B, 2N)
    per_word = decoder_attention.mean(dim=2)  # (B, S, M)
    words = torch.stack([per_word[b, :max(1, n)].mean(dim=0) for b, n in enumerate(lengths)])  # (B, M)
    maps["decoder"] = torch.cat([words[:, before], words[:, after]], dim=1)  # (B, 2N)
    return maps


def box_patches(box: list[float], width: int, height: int, grid: int) -> np.ndarray:
    """The patches (grid x grid, row-major as the ViT's tokens) that a box [x, y, w, h] of a width x height
    image overlaps: the image is resized straight to a square, so a patch is a (width/grid x height/grid) cell."""
    x, y, w, h = box
    columns = np.arange(grid)
    across = (x < (columns + 1) * width / grid) & (x + w > columns * width / grid)  # (grid,)
    down = (y < (columns + 1) * height / grid) & (y + h > columns * height / grid)  # (grid,)
    return (down[:, None] & across[None, :]).reshape(-1)  # (grid * grid,)


def change_patches(pair: data.ImagePair, n_patches: int) -> np.ndarray | None:
    """(N,) bool: the patch positions on the changed object in the before or the after image; None without boxes."""
    boxes = pair.change_boxes or {}
    grid = math.isqrt(n_patches)
    target = np.zeros(n_patches, dtype=bool)
    for image, path in (("before", pair.before), ("after", pair.after)):
        if boxes.get(image):
            with Image.open(path) as picture:  # reads the header only
                target |= box_patches(boxes[image], *picture.size, grid)
    return target if target.any() else None


def pointing_hit(patch_map: np.ndarray, target: np.ndarray) -> bool:
    """Does the highest patch of a map over both images (2N,) fall on a target position (N,)?"""
    return bool(target[int(np.argmax(patch_map)) % len(target)])


def localisation_table(hits: dict[str, dict[str, list[bool]]], chance: dict[str, list[float]]) -> dict:
    """Per change type and over all change pairs: pairs, chance and each view's hit rate, in percent."""
    types = [t for t in (*data.CHANGE_TYPES, *sorted(set(chance) - set(data.CHANGE_TYPES))) if t in chance]
    table = {}
    for name, members in [*((t, [t]) for t in types), ("semantic change", types)]:
        shares = [s for t in members for s in chance[t]]
        row = {"pairs": len(shares), "chance": 100 * float(np.mean(shares))}
        for view in hits:
            row[view] = 100 * float(np.mean([h for t in members for h in hits[view][t]]))
        table[name] = row
    return table


def format_localisation(table: dict) -> str:
    views = [v for v in VIEWS if v in next(iter(table.values()))]
    lines = ["localisation (pointing game): % of change pairs whose highest-attention patch is on the changed "
             "object", *(f"  {v}: {VIEW_NAMES[v]}" for v in views),
             f"{'':<18}{'pairs':>6}{'chance':>9}" + "".join(f"{v:>9}" for v in views)]
    for name, row in table.items():
        lines.append(f"{name:<18}{row['pairs']:>6}{row['chance']:>9.1f}" + "".join(f"{row[v]:>9.1f}" for v in views))
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# A contact sheet of pairs


def contact_sheet(pairs: list[data.ImagePair], out: Path, model_view: bool = False, captions: int = 3,
                  predictions: dict[str, str] | None = None) -> Path:
    """A PNG with one row per pair: before | after | distractor, then its id, type and captions.

    With predictions ({evaluation id: caption}, as caption.py --eval writes them), each row shows the
    predicted caption of the change pair and of the distractor pair ("<id>_n") above the references.
    """
    tile = (data.IMAGE_SIZE, data.IMAGE_SIZE) if model_view else (240, 160)  # the model's input, or half of 480 x 320
    text_width, line = 470, 18
    font = ImageFont.load_default(size=14)
    height = max(tile[1], line * (captions + 3 + 2 * (predictions is not None))) + 8
    sheet = Image.new("RGB", (3 * (tile[0] + 4) + text_width, height * len(pairs)), "white")
    draw = ImageDraw.Draw(sheet)
    for row, pair in enumerate(pairs):
        top = row * height
        for column, path in enumerate((pair.before, pair.after, pair.distractor)):
            if path is not None:
                image = Image.fromarray(data.preprocess_uint8(path, data.IMAGE_SIZE)) if model_view \
                    else data.load_image(path).convert("RGB").resize(tile, Image.Resampling.BICUBIC)
                sheet.paste(image, (column * (tile[0] + 4), top))
        lines = [f"{pair.id}  {pair.change_type or ''}"]
        if predictions is not None:
            lines.append(f"predicted: {predictions.get(pair.id, '(none)')}")
        lines += [f"reference: {c}" if predictions is not None else c for c in pair.captions[:captions]]
        if predictions is not None and pair.id + data.NO_CHANGE_SUFFIX in predictions:
            lines.append(f"distractor predicted: {predictions[pair.id + data.NO_CHANGE_SUFFIX]}")
        lines += [f"distractor{' reference' if predictions is not None else ''}: {c}"
                  for c in pair.no_change_captions[:1]]
        for k, text in enumerate(lines):
            draw.text((3 * (tile[0] + 4) + 6, top + 4 + k * line), text, fill="black", font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


# -----------------------------------------------------------------------------
# Pictures: the two images with a heat map, the caption, one small map per word

TILE = (240, 160)  # half of CLEVR's 480 x 320
WORD_TILE = (96, 64)
FONT_SIZE = 14


def stretch(values: np.ndarray, axis=None) -> np.ndarray:
    """values scaled to [0, 1], lowest to highest (along axis): the pictures show where, not how much."""
    low, high = values.min(axis=axis, keepdims=True), values.max(axis=axis, keepdims=True)
    return (values - low) / np.maximum(high - low, 1e-12)


def heat(image: Image.Image, patch_map: np.ndarray, size: tuple[int, int], box=None) -> Image.Image:
    """image resized to size, with a map (N,) in [0, 1] over its patches laid on it: red to yellow, clear at 0."""
    grid = math.isqrt(len(patch_map))
    level = np.asarray(Image.fromarray(np.uint8(255 * patch_map.reshape(grid, grid))).resize(
        size, Image.Resampling.NEAREST), np.float32)[..., None] / 255  # (h, w, 1), one block per patch
    colour = np.concatenate([np.full_like(level, 255), 255 * level, np.zeros_like(level)], axis=-1)  # red -> yellow
    pixels = np.asarray(image.convert("RGB").resize(size, Image.Resampling.BICUBIC), np.float32)
    tinted = Image.fromarray(np.uint8(pixels * (1 - 0.7 * level) + colour * 0.7 * level))
    if box:
        scale_x, scale_y = size[0] / image.width, size[1] / image.height
        x, y, w, h = box
        ImageDraw.Draw(tinted).rectangle([x * scale_x, y * scale_y, (x + w) * scale_x, (y + h) * scale_y],
                                         outline=(0, 220, 0), width=2)
    return tinted


def pair_panel(before: Image.Image, after: Image.Image, maps: dict[str, np.ndarray], words: list[str],
               word_maps: np.ndarray, title: str, boxes: dict | None = None) -> Image.Image:
    """One pair: each view's map on the before and after image, the title lines, then a map per word.

    maps: {view: (2N,)} over [before patches; after patches]; word_maps (S, 2N), one per word.
    """
    font = ImageFont.load_default(size=FONT_SIZE)
    boxes = boxes or {}
    line = FONT_SIZE + 4
    views = [v for v in VIEWS if v in maps]
    per_row = max(1, (len(views) * (2 * TILE[0] + 12)) // (2 * WORD_TILE[0] + 10))
    word_rows = math.ceil(len(words) / per_row)
    title_lines = title.split("\n")
    width = max(len(views) * (2 * TILE[0] + 12), 2 * TILE[0] + 12)
    height = line * len(title_lines) + line + TILE[1] + 8 + word_rows * (WORD_TILE[1] + line + 4) + 8
    panel = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(panel)
    for k, text in enumerate(title_lines):
        draw.text((4, 2 + k * line), text, fill="black", font=font)
    top = line * len(title_lines) + 2
    n = len(next(iter(maps.values()))) // 2
    for column, view in enumerate(views):
        left = column * (2 * TILE[0] + 12)
        draw.text((left + 4, top), VIEW_NAMES[view], fill=(60, 60, 60), font=ImageFont.load_default(size=11))
        # the intra map holds two distributions, one per image, each stretched alone; the others one over both
        halves = stretch(maps[view].reshape(2, n), axis=1 if view == "intra" else None)  # (2, N): before, after
        for side, (image, name) in enumerate(((before, "before"), (after, "after"))):
            panel.paste(heat(image, halves[side], TILE, boxes.get(name)), (left + side * (TILE[0] + 4), top + line))
    top += line + TILE[1] + 8
    for k, word in enumerate(words):
        left = (k % per_row) * (2 * WORD_TILE[0] + 10)
        row_top = top + (k // per_row) * (WORD_TILE[1] + line + 4)
        draw.text((left + 4, row_top), f"{k + 1}. {word}", fill="black", font=font)
        halves = stretch(word_maps[k].reshape(2, n))  # (2, N)
        for side, (image, name) in enumerate(((before, "before"), (after, "after"))):
            panel.paste(heat(image, halves[side], WORD_TILE, boxes.get(name)),
                        (left + side * (WORD_TILE[0] + 2), row_top + line))
    return panel


def explain_pairs(encoder: PairEncoder, decoder: CaptionDecoder, pairs: list[data.ImagePair], images, tokenizer,
                  max_len: int, out: Path, device, ctx, visual: torch.Tensor | None = None,
                  references: bool = True) -> list[str]:
    """Write one PNG with a panel per pair (stacked); return the captions written.

    visual (B, M, E): the pair tokens to decode from (the cached features, so the captions are the scored
    ones); None: the encoder's own tokens.
    """
    before = clip.normalize(torch.stack([images(p.before) for p in pairs]).to(device))  # (B, 3, R, R)
    after = clip.normalize(torch.stack([images(p.after) for p in pairs]).to(device))  # (B, 3, R, R)
    with ctx:
        attention = encoder_attention(encoder.eval(), before, after)
        tokens, cross = decode_with_attention(decoder.eval(), (attention["pair_tokens"] if visual is None
                                                               else visual).float(),
                                              tokenizer.sot_id, tokenizer.eot_id, max_len)
    ids = [row[:row.index(tokenizer.eot_id)] if tokenizer.eot_id in row else row for row in tokens.tolist()]
    maps = {k: v.float().cpu().numpy() for k, v in
            patch_maps(attention, cross, [len(row) for row in ids], encoder.n_patches).items()}
    per_word = cross.mean(dim=2).float().cpu().numpy()  # (B, S, M)
    n = encoder.n_patches
    word_maps = np.concatenate([per_word[..., 1:n + 1], per_word[..., n + 2:]], axis=-1)  # (B, S, 2N)
    panels, captions = [], []
    for b, pair in enumerate(pairs):
        words = [tokenizer.decode([i]).strip() for i in ids[b]]
        caption = " ".join(words)
        captions.append(caption)
        title = f"{pair.id}  {pair.change_type or ''}\npredicted: {caption}"
        if references and pair.captions:
            title += f"\nreference: {pair.captions[0]}"
        target = change_patches(pair, n)
        if target is not None:
            title += "\npointing game (green box: the changed object): " + ", ".join(
                f"{view} {'hit' if pointing_hit(maps[view][b], target) else 'miss'}" for view in VIEWS if view in maps)
        panels.append(pair_panel(data.load_image(pair.before), data.load_image(pair.after),
                                 {view: m[b] for view, m in maps.items()}, words, word_maps[b, :len(words)],
                                 title, pair.change_boxes))
    sheet = Image.new("RGB", (max(p.width for p in panels), sum(p.height + 6 for p in panels)), (200, 200, 200))
    top = 0
    for panel in panels:
        sheet.paste(panel, (0, top))
        top += panel.height + 6
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return captions


def localisation(encoder: PairEncoder, decoder: CaptionDecoder, pairs: list[data.ImagePair], features, images,
                 tokenizer, max_len: int, batch_size: int, device, ctx, kept: dict | None = None) -> dict | None:
    """The pointing game over the change pairs that have boxes (features row i = pairs[i]); None if none has.

    Returns localisation_table's dict: per change type, pairs, chance and each view's hit rate in percent. kept, a
    dict, receives each scored pair's maps, {id: {view: (2N,)}}, for the results page.
    """
    rows = [i for i, p in enumerate(pairs) if p.change_boxes and change_patches(p, encoder.n_patches) is not None]
    if not rows:
        return None
    n = encoder.n_patches
    hits = {view: {} for view in VIEWS}
    chance = {}
    progress, batches = Progress(math.ceil(len(rows) / batch_size)), 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        before = clip.normalize(torch.stack([images(pairs[i].before) for i in chunk]).to(device))  # (B, 3, R, R)
        after = clip.normalize(torch.stack([images(pairs[i].after) for i in chunk]).to(device))  # (B, 3, R, R)
        visual = torch.from_numpy(np.asarray(features[chunk], dtype=np.float32)).to(device)  # (B, M, E)
        with ctx:
            attention = encoder_attention(encoder.eval(), before, after)
            tokens, cross = decode_with_attention(decoder.eval(), visual, tokenizer.sot_id, tokenizer.eot_id, max_len)
        lengths = [row.index(tokenizer.eot_id) if tokenizer.eot_id in row else len(row) for row in tokens.tolist()]
        maps = {k: v.float().cpu().numpy() for k, v in patch_maps(attention, cross, lengths, n).items()}
        for b, i in enumerate(chunk):
            kind = pairs[i].change_type or "change"
            target = change_patches(pairs[i], n)
            chance.setdefault(kind, []).append(float(target.mean()))
            for view in maps:
                hits[view].setdefault(kind, []).append(pointing_hit(maps[view][b], target))
            if kept is not None:
                kept[pairs[i].id] = {view: m[b] for view, m in maps.items()}
        batches += 1
        if batches % 20 == 0 or start + batch_size >= len(rows):
            print(f"attention of {len(rows)} change pairs: " + progress.line(batches), flush=True)
    return localisation_table({view: h for view, h in hits.items() if h}, chance)


if __name__ == "__main__":
    # explain.py reads attention out of trained models, so it runs through caption.py; on its own, the pointing
    # game on a hand-made map: the changed object covers the patches of a box, and the map peaks on one of them
    print("usage: python caption.py --data synth --pair BEFORE AFTER --explain OUT.png   (or --eval: "
          "test_attention.png and the pointing game's table)")
    target = box_patches([100, 60, 40, 40], 224, 224, grid=7)  # (49,): the patches a 40-pixel box overlaps
    patch_map = np.zeros(2 * 49)  # (2N,): one value per patch of the before and the after image
    patch_map[49 + int(np.flatnonzero(target)[0])] = 1.0  # the peak on the after image, on the box
    print(f"a box [x 100, y 60, w 40, h 40] of a 224 x 224 image covers patches {np.flatnonzero(target).tolist()} "
          f"of 49 (chance {target.mean():.0%}); a map peaking on patch {49 + int(np.flatnonzero(target)[0])} of "
          f"the pair's 98 hits it: {pointing_hit(patch_map, target)}")
