"""Stage 0 for the synthetic world: CLIP's own pretraining, at small size, on single synthetic scenes.

CLIP4IDC starts from OpenAI's CLIP, pretrained on 400M web image-text pairs (CLIP paper, section 2.3), which the
synthetic world lacks. This script makes a CLIP for it the way OpenAI did: the same clip.CLIP class, from
scratch, on single synthetic scenes (synth.py) and sentences naming their objects, with CLIP's contrastive loss.
It is stage 1 one step earlier, with CLIP itself (SceneCLIP) in place of the pair encoder and one image in place
of a pair, run through adapt.py's Config (and the sizes of a CLIP from scratch), optimizer, schedule, training step,
loop and retrieval scores. It ends by checking CLIP-style zero-shot classification of held-out objects and by
writing the weights in OpenAI's names and format: the file assets/synth-ViT-32.pt that plumbing/clip_files.py's
MODELS names "synth-ViT/32" and adapt.py's synth preset adapts.

Run:  python pretrain.py                      train a synthetic CLIP (draws data/synth_scenes on first use; about
                                              20 minutes of training on one core). The shipped file came from this
                                              loop's earlier home, adapt.py --data scenes; pretrain.py wrote the same
                                              file on a tiny preset, and has not been run at full size (BENCHMARKS 1)
      torchrun --standalone --nproc_per_node=2 pretrain.py
      python pretrain.py --resume             continue an interrupted run from out_dir/ckpt_last.pt

Shape letters: B scenes in a batch, R image side (224), T description tokens (32), E joint embedding width.
"""
import dataclasses
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import adapt
import clip
import data
import plumbing
import synth
from encoder import PairEncoder
from plumbing import ConfigError, flag

SCRATCH_SIZES = ("scratch_width", "scratch_layers", "scratch_patch", "scratch_text_width", "scratch_text_layers",
                 "scratch_embed_dim")
# what --resume refuses to change
MODEL_KEYS = ("data", "clip_model", "intra_layers", "freeze_intra", "max_words", *SCRATCH_SIZES, "synth_pairs")
INPUTS = ("image", "caption")  # what adapt.train_step feeds SceneCLIP: one scene and its description


@dataclass
class Config(adapt.Config):  # adapt.py's knobs and a CLIP's sizes from scratch; the scenes preset sets their values
    data: str = flag("scenes", "stage 0's one dataset: single synthetic scenes (data/synth_scenes)")
    clip_model: str = flag("ViT-B/32", '"scratch": a CLIP from scratch at the scratch_* sizes; or a model name '
                                       '(plumbing/clip_files.py\'s MODELS) or weights file, trained further')
    out_dir: str = flag("", 'checkpoints and logs ("" = runs/pretrain_scenes)')
    scratch_width: int = flag(256, "scratch model: vision width")
    scratch_layers: int = flag(6, "scratch model: vision blocks")
    scratch_patch: int = flag(32, "scratch model: patch side in pixels")
    scratch_text_width: int = flag(256, "scratch model: text width")
    scratch_text_layers: int = flag(3, "scratch model: text blocks")
    scratch_embed_dim: int = flag(256, "scratch model: joint embedding width")

    def __post_init__(self):  # adapt.py's checks (max_words at most 77, as OpenAI's CLIP), then the scratch sizes
        super().__post_init__()
        plumbing.check_settings(self, positive=SCRATCH_SIZES)


# The scenes preset: a CLIP of width 128 (6 vision blocks on 32-pixel patches, 2 text blocks), from scratch;
# everything trains, at one rate.
PRESETS = {
    "scenes": dict(clip_model="scratch", scratch_width=128, scratch_text_width=128,
                   scratch_text_layers=2, scratch_embed_dim=128, epochs=8, batch_size=128, lr=1e-3, clip_lr_scale=1.0,
                   weight_decay=0.1, freeze=False, num_workers=1, log_every=20, eval_batch_size=250),
}


# -----------------------------------------------------------------------------
# CLIP on one image and its description


def build_clip(config: Config, vocab_size: int) -> clip.CLIP:
    """CLIP from scratch at the scratch_* sizes (the scenes preset), or a pretrained one (adapt.build_clip)."""
    if config.clip_model != "scratch":
        return adapt.build_clip(config, vocab_size)
    clip_config = clip.CLIPConfig(
        embed_dim=config.scratch_embed_dim, image_resolution=data.IMAGE_SIZE,
        vision_layers=config.scratch_layers, vision_width=config.scratch_width,
        vision_patch_size=config.scratch_patch, context_length=config.max_words, vocab_size=vocab_size,
        transformer_width=config.scratch_text_width, transformer_heads=max(1, config.scratch_text_width // 64),
        transformer_layers=config.scratch_text_layers)
    return clip.CLIP(clip_config)


class SceneCLIP(nn.Module):
    """Stage 0: CLIP itself on one image and its description, as OpenAI pretrained it (CLIP paper, 2.3).

    forward returns what adapt.train_step and evaluate read, as PairEncoder's does for a pair, under the same names:
    "pair_embedding" is here the image's embedding. The parameter groups follow PairEncoder's rule (here every
    parameter is CLIP's; no decay on biases and norms).
    """

    def __init__(self, clip_model: clip.CLIP):
        super().__init__()
        self.clip = clip_model

    def forward(self, image: torch.Tensor, text: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = {"pair_embedding": self.clip.encode_image(image), "logit_scale": self.clip.logit_scale}  # (B, E)
        if text is not None:
            out["text_embedding"] = self.clip.encode_text(text)  # (B, E)
        return out

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        return self.clip.encode_text(text)  # (B, T) -> (B, E)

    optimizer_groups = PairEncoder.optimizer_groups


class Scenes(synth.SceneSamples):
    """A split of single scenes, which evaluate ranks as adapt.evaluate ranks pairs: each scene's description
    against every scene."""

    def retrieval_texts(self) -> tuple[list[str], list[int]]:
        """(texts, text -> scene): one description per scene, in order."""
        return [self.description(i) for i in range(len(self))], list(range(len(self)))


def read_scenes(config: Config, dist_) -> tuple[dict, clip.SimpleTokenizer]:
    """Stage 0's splits of single scenes and their tokenizer; the scenes are drawn once, by the master, while the
    others wait."""
    root = Path(config.data_root or synth.SCENES_ROOT)
    plumbing.by_master(dist_, synth.ensure_scenes, root)
    tokenizer = clip.get_tokenizer(root / data.SYNTH_BPE_FILE)
    splits = {s: Scenes(root, s, tokenizer, train=s == "train", max_words=config.max_words) for s in data.SPLITS}
    return splits, tokenizer


# -----------------------------------------------------------------------------
# The retrieval scores: stage 1's, on single images


@torch.no_grad()
def evaluate(model: SceneCLIP, split: Scenes, tokenizer, config: Config, device, ctx) -> dict:
    """Retrieval on a split of scenes: each scene's description ranked against every scene, each scene against the
    descriptions (adapt.retrieval)."""
    was_training = model.training
    model.eval()
    texts, text_to_scene = split.retrieval_texts()
    # a generator of its own: evaluating must not draw from the global one that training's random choices use
    loader = DataLoader(split, batch_size=config.eval_batch_size, num_workers=config.num_workers,
                        generator=torch.Generator(), pin_memory=device.type == "cuda")
    image_embeddings = []
    for batch in loader:
        image = data.to_device(batch, device, ("image",))["image"]  # (B, 3, R, R)
        with ctx:
            image_embeddings.append(model(image)["pair_embedding"].float())  # (B, E)
    scores = adapt.retrieval(model, torch.cat(image_embeddings), texts, text_to_scene, tokenizer, config, device, ctx)
    model.train(was_training)
    return scores


# -----------------------------------------------------------------------------
# Stage 0's product: the zero-shot check, and the weights in OpenAI's format


ZERO_SHOT_SCENES = 240        # stage 0's zero-shot check: held-out scenes of one object each
ZERO_SHOT_FIRST = 1_000_000   # their indices, after every scene of synth.SCENE_SPLITS
SYNTH_CLIP_FILE = "synth-ViT-32.pt"  # stage 0's product, shipped in assets/ as the model clip.load calls "synth-ViT/32"


@torch.no_grad()
def zero_shot_attributes(model: SceneCLIP, tokenizer, config: Config, device, ctx) -> dict:
    """CLIP's zero-shot classification, in the synthetic world: each held-out scene of one object against the
    descriptions of all 96 objects (2 sizes x 8 colours x 2 materials x 3 shapes). Accuracy in %, of the
    whole object and of each attribute (chance: 1.0, 50, 12.5, 50, 33.3)."""
    cfg = synth.SynthConfig()
    indices = list(range(ZERO_SHOT_FIRST, ZERO_SHOT_FIRST + ZERO_SHOT_SCENES))
    truth = [synth.pretrain_objects(i, cfg, n_objects=1)[0] for i in indices]
    images = clip.normalize(synth.scene_pixels([[obj] for obj in truth], cfg)).to(device)  # (S, 3, R, R)
    classes = [dict(zip(synth.ATTRIBUTE_ORDER, values))
               for values in itertools.product(synth.SIZES, synth.COLORS, synth.MATERIALS, synth.SHAPES)]
    prompts = torch.stack([data.text_tokens(tokenizer, synth.describe_scene([c]), config.max_words)
                           for c in classes]).to(device)  # (96, T)
    was_training = model.training
    model.eval()
    with ctx:
        image_e = F.normalize(model(images)["pair_embedding"].float(), dim=-1)  # (S, E)
        text_e = F.normalize(model.encode_text(prompts).float(), dim=-1)  # (96, E)
    model.train(was_training)
    predicted = [classes[j] for j in (image_e @ text_e.T).argmax(dim=1).tolist()]
    right = {a: [p[a] == t[a] for p, t in zip(predicted, truth)] for a in synth.ATTRIBUTE_ORDER}
    right = {"object": [all(r) for r in zip(*right.values())], **right}
    return {name: 100 * sum(r) / len(r) for name, r in right.items()}


def export_clip(model: clip.CLIP, path: Path) -> Path:
    """CLIP's weights as OpenAI ships them: OpenAI's parameter names, float16; written atomically."""
    plumbing.save_checkpoint({k: v.detach().to("cpu", torch.float16) for k, v in model.state_dict().items()}, path)
    return path


def finish_stage0(model: SceneCLIP, tokenizer, config: Config, device, ctx, out_dir: Path, say) -> None:
    """Stage 0's product: the zero-shot check, and the best epoch's CLIP as a weights file in OpenAI's names."""
    accuracy = zero_shot_attributes(model, tokenizer, config, device, ctx)
    plumbing.save_json(accuracy, out_dir / "zero_shot.json")
    say("zero-shot attributes of held-out single-object scenes, CLIP-style (prompts of all 96 objects): "
        + ", ".join(f"{k} {v:.1f}%" for k, v in accuracy.items()))
    path = export_clip(model.clip, out_dir / SYNTH_CLIP_FILE)
    say(f"wrote {path}, sha256 {plumbing.sha256_of(path)}")


# -----------------------------------------------------------------------------
# The run: stage 1's loop (adapt.train) on single scenes


def pretrain_and_test(run: plumbing.Run) -> None:
    """Stage 0: read the scenes, build CLIP, train it with adapt.py's step and loop, score the test split, write
    the weights."""
    config, dist_ = run.config, run.dist_
    splits, tokenizer = read_scenes(config, dist_)
    model = SceneCLIP(build_clip(config, tokenizer.vocab_size))
    model.to(dist_.device)
    optimizer = adapt.build_optimizer(model, config)
    state = plumbing.start_or_resume(run, MODEL_KEYS, model, optimizer)
    checkpoint = functools.partial(adapt.stage1_checkpoint, model, optimizer, run,
                                   dataclasses.asdict(model.clip.config), tokenizer)
    score = functools.partial(evaluate, tokenizer=tokenizer, config=config, device=dist_.device, ctx=run.ctx)
    step = adapt.train(run, model, optimizer, splits["train"], validate=lambda m: score(m, splits["val"]),
                       checkpoint=checkpoint, state=state, inputs=INPUTS)
    if dist_.master:  # the test split's retrieval, scored once, with the epoch chosen on validation
        adapt.test(run, model, lambda m: score(m, splits["test"]), step)
        finish_stage0(model, tokenizer, config, dist_.device, run.ctx, run.out_dir, print)


def main(argv=None):
    config = plumbing.parse_config(Config, PRESETS, argv, description=__doc__.split("\n")[0])
    if config.eval:
        raise ConfigError("--eval scores a pair encoder (adapt.py); stage 0 prints its test retrieval when "
                          "it ends")
    with plumbing.started(config, Path(config.out_dir or "runs/pretrain_scenes")) as run:
        pretrain_and_test(run)


if __name__ == "__main__":
    plumbing.run_main(main, "pretrain.py")
