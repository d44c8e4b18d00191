"""How many operations a training step issues: the count that decides a GPU step's host time.

On a GPU each aten operation the step calls costs the host a launch (about 22 µs each on the H200's machine,
BENCHMARKS.md section 11), whatever the tensors' sizes: a ViT-B/32 step of a few thousand operations is host-bound until it is
captured whole. The count depends on the model's structure (depth, which blocks train, the step's code) and on the
precision (autocast adds casts), not on its width or batch, so it is counted here on the CPU on models of the full
depth at a narrow width: the stage-1 pair encoder with ViT-B/32's 12 vision and 12 text blocks (9 intra-image), and
the stage-2 captioner of 3 + 3 layers on cached pair tokens, each step as adapt.py and caption.py run it (the clevr
presets' frozen sets, fused AdamW, clipping). A test holds each count under a ceiling.

    python -m bench ops          the four counts: both stages, float32 and bfloat16
"""
import json
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adapt
import caption
import clip
import data
import plumbing
from decoder import CaptionDecoder, DecoderConfig
from encoder import EncoderConfig, PairEncoder

NARROW = dict(embed_dim=64, image_resolution=224, vision_layers=12, vision_width=64, vision_patch_size=32,
              context_length=77, vocab_size=1000, transformer_width=64, transformer_heads=1, transformer_layers=12)


class OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def precision(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)


def stage1_step(dtype: str, pairs: int = 2):
    """adapt.py's step on the narrow full-depth pair encoder: the clevr preset's settings and frozen set."""
    torch.manual_seed(0)
    model = PairEncoder(clip.CLIP(clip.CLIPConfig(**NARROW)), EncoderConfig(intra_layers=9)).train()
    model.cls_rows_only = adapt.CLS_ROWS_ONLY
    model.freeze()
    config = adapt.Config()
    optimizer = adapt.build_optimizer(model, config)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    text = torch.zeros(pairs, 16, dtype=torch.long)
    text[:, :4] = torch.tensor([NARROW["vocab_size"] - 2, 5, 7, NARROW["vocab_size"] - 1])  # SOT, words, EOT
    batch = {"before": torch.randn(pairs, 3, 224, 224), "after": torch.randn(pairs, 3, 224, 224), "caption": text}
    ctx, stepped = precision(dtype), plumbing.cast_once(model, dtype)  # as adapt.wrap
    return lambda: adapt.train_step(stepped, optimizer, scaler, [batch], ctx, config, False, model.clip.logit_scale)


def stage2_step(dtype: str, pairs: int = 2):
    """caption.py's step on cached pair tokens (the clevr preset: a change and a no-change caption per pair)."""
    torch.manual_seed(0)
    decoder = CaptionDecoder(DecoderConfig(hidden=64, heads=1, ffn=128, layers=3, vocab_size=1000,
                                           visual_tokens=100))
    captioner = caption.Captioner(decoder.train(), None, clip.PAD_ID)
    config = caption.Config()
    optimizer = caption.build_optimizer(captioner, config)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    words = torch.tensor([[5, 7, 9, 11], [4, 3, 0, 0]])[:pairs]  # 0: padding
    caption_in = torch.cat([torch.full((pairs, 1), 998), words], dim=1)
    caption_out = torch.cat([words, torch.zeros(pairs, 1, dtype=torch.long)], dim=1)
    caption_out[torch.arange(pairs), (words != 0).sum(1)] = 999
    items = [{"visual": torch.randn(100, 64).half(), "no_change_visual": torch.randn(100, 64).half(),
              "caption_in": i, "caption_out": o, "no_change_caption_in": i, "no_change_caption_out": o}
             for i, o in zip(caption_in, caption_out)]
    batch = data.to_device(data.collate_captions(items), torch.device("cpu"))
    ctx, stepped = precision(dtype), plumbing.cast_once(captioner, dtype)  # as caption.train
    return lambda: caption.train_step(stepped, optimizer, scaler, [batch], ctx, config, False)


def step_operations(stage: str, dtype: str) -> Counter:
    """The aten operations of the third step (the first two make the optimizer's state and warm the caches)."""
    step = (stage1_step if stage == "stage1" else stage2_step)(dtype)
    step()
    step()
    with OperationCount() as counted:
        step()
    return counted.counts


def main(argv=None) -> None:
    counts = {f"{stage} {dtype}": sum(step_operations(stage, dtype).values())
              for stage in ("stage1", "stage2") for dtype in ("float32", "bfloat16")}
    print(json.dumps(counts, indent=1))
