"""Stage 0 for the synthetic world: CLIP's own pretraining, at small size, on single synthetic scenes.

CLIP4IDC starts from OpenAI's CLIP, pretrained on 400M web image-text pairs (CLIP paper, section 2.3), which the
synthetic world lacks. This script makes a CLIP for it the way OpenAI did: the same clip.CLIP class, from
scratch, on single synthetic scenes (synth.py) and sentences naming their objects, with CLIP's contrastive loss.
It is stage 1's loop one step earlier: adapt.py's Config, optimizer, training step, loop and retrieval, imported,
with CLIP itself (SceneCLIP) in place of the pair encoder and one image in place of a pair. It ends by checking
CLIP-style zero-shot classification of held-out objects and by writing the weights in OpenAI's names and
format: the file assets/synth-ViT-32.pt that clip.MODELS names "synth-ViT/32" and adapt.py's synth preset adapts.

Run:  python pretrain.py                      train a synthetic CLIP (draws data/synth_scenes on first use; about
                                              20 minutes of training on one core). The shipped file came from this
                                              loop's earlier home, adapt.py --data scenes; pretrain.py wrote the same
                                              file on a tiny preset, and has not been run at full size (BENCHMARKS 1)
      torchrun --standalone --nproc_per_node=2 pretrain.py
      python pretrain.py --resume             continue an interrupted run from out_dir/ckpt_last.pt

Shape letters: B scenes in a batch, R image side (224), T description tokens (32), E joint embedding width.
"""
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group

import adapt
import clip
import data
import synth
from checkpoints import save_checkpoint, seed_everything, start_or_resume
from encoder import PairEncoder
from files import OutDirLock, save_json
from flags import ConfigError, flag, parse_config
from processes import keep_freed_memory, loader_workers, setup
from stopping import run


@dataclass
class Config(adapt.Config):  # adapt.py's knobs; their defaults here are the scenes preset's
    data: str = flag("scenes", "stage 0's one dataset: single synthetic scenes (data/synth_scenes)")
    out_dir: str = flag("", 'checkpoints and logs ("" = runs/pretrain_scenes)')

    def check_split(self):
        """Stage 0 trains CLIP on single images: there is no pair encoder, so no split point to check."""


# The scenes preset: a CLIP of width 128 (6 vision blocks on 32-pixel patches, 2 text blocks), from scratch;
# everything trains, at one rate.
PRESETS = {
    "scenes": dict(clip_model="scratch", scratch_width=128, scratch_text_width=128,
                   scratch_text_layers=2, scratch_embed_dim=128, epochs=8, batch_size=128, lr=1e-3, clip_lr_scale=1.0,
                   weight_decay=0.1, freeze=False, num_workers=1, log_every=20, eval_batch_size=250),
}


# -----------------------------------------------------------------------------
# CLIP on one image and its description


class SceneCLIP(nn.Module):
    """Stage 0: CLIP itself on one image and its description, as OpenAI pretrained it (CLIP paper, 2.3).

    forward returns what train_step and evaluate read, as PairEncoder's does for a pair; the parameter
    groups follow PairEncoder's rule (here every parameter is CLIP's; no decay on biases and norms).
    """

    def __init__(self, clip_model: clip.CLIP):
        super().__init__()
        self.clip = clip_model

    def forward(self, image: torch.Tensor, text: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = {"image_embedding": self.clip.encode_image(image), "logit_scale": self.clip.logit_scale}  # (B, E)
        if text is not None:
            out["text_embedding"] = self.clip.encode_text(text)  # (B, E)
        return out

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        return self.clip.encode_text(text)  # (B, T) -> (B, E)

    optimizer_groups = PairEncoder.optimizer_groups


class Scenes(synth.SceneSamples):
    """A split of single scenes, which adapt.evaluate ranks as it ranks pairs: each scene's description against
    every scene."""

    def retrieval_texts(self) -> tuple[list[str], list[int]]:
        """(texts, text -> scene): one description per scene, in order."""
        return [self.description(i) for i in range(len(self))], list(range(len(self)))


def read_scenes(config: Config, dist_) -> tuple[dict, clip.SimpleTokenizer]:
    """Stage 0's splits of single scenes and their tokenizer; the scenes are drawn once, by the master, while the
    others wait."""
    root = Path(config.data_root or synth.SCENES_ROOT)
    if dist_.master:
        synth.ensure_scenes(root)
    if dist_.ddp:
        dist.barrier()
    tokenizer = clip.get_tokenizer(root / data.SYNTH_BPE_FILE)
    splits = {s: Scenes(root, s, tokenizer, train=s == "train", max_words=config.max_words) for s in data.SPLITS}
    return splits, tokenizer


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
        image_e = F.normalize(model(images)["image_embedding"].float(), dim=-1)  # (S, E)
        text_e = F.normalize(model.encode_text(prompts).float(), dim=-1)  # (96, E)
    model.train(was_training)
    predicted = [classes[j] for j in (image_e @ text_e.T).argmax(dim=1).tolist()]
    right = {a: [p[a] == t[a] for p, t in zip(predicted, truth)] for a in synth.ATTRIBUTE_ORDER}
    right = {"object": [all(r) for r in zip(*right.values())], **right}
    return {name: 100 * sum(r) / len(r) for name, r in right.items()}


def export_clip(model: clip.CLIP, path: Path) -> Path:
    """CLIP's weights as OpenAI ships them: OpenAI's parameter names, float16; written atomically."""
    save_checkpoint({k: v.detach().to("cpu", torch.float16) for k, v in model.state_dict().items()}, path)
    return path


def finish_stage0(model: SceneCLIP, tokenizer, config: Config, device, ctx, out_dir: Path, say) -> None:
    """Stage 0's product: the zero-shot check, and the best epoch's CLIP as a weights file in OpenAI's names."""
    accuracy = zero_shot_attributes(model, tokenizer, config, device, ctx)
    save_json(accuracy, out_dir / "zero_shot.json")
    say("zero-shot attributes of held-out single-object scenes, CLIP-style (prompts of all 96 objects): "
        + ", ".join(f"{k} {v:.1f}%" for k, v in accuracy.items()))
    path = export_clip(model.clip, out_dir / SYNTH_CLIP_FILE)
    say(f"wrote {path}, sha256 {clip.sha256_of(path)}")


# -----------------------------------------------------------------------------
# The run


def pretrain_and_test(config: Config, dist_, dtype: str, ctx, scaler, out_dir: Path) -> None:
    """Stage 0: read the scenes, build CLIP, train it with adapt.py's loop, score the test split, write the weights;
    then the processes of a torchrun leave their group together."""
    device, master = dist_.device, dist_.master
    splits, tokenizer = read_scenes(config, dist_)
    model = SceneCLIP(adapt.build_clip(config, tokenizer.vocab_size))
    clip_config = dataclasses.asdict(model.clip.config)
    model.to(device)
    optimizer = adapt.build_optimizer(model, config, device)
    ckpt_path = out_dir / "ckpt_last.pt"
    state = start_or_resume(ckpt_path, config, adapt.MODEL_KEYS, dist_, model, optimizer, scaler)
    if state is not None and master:
        print(f"resumed {ckpt_path} at step {state['step']}")
    step = adapt.train(config, dist_, ctx, scaler, dtype, adapt.wrap(model, config, dist_), model, optimizer,
                       splits["train"], splits, tokenizer, None, clip_config, state, out_dir)
    if master:
        adapt.test(model, splits, tokenizer, None, config, device, ctx, step, out_dir)
        finish_stage0(model, tokenizer, config, device, ctx, out_dir, print)
    if dist_.ddp:
        dist.barrier()  # every process done before any tears the group down (a gloo peer may abort otherwise)
        destroy_process_group()


def main(argv=None):
    config = parse_config(Config, PRESETS, argv, description=__doc__.split("\n")[0])
    if config.eval:
        raise ConfigError("--eval scores a pair encoder (adapt.py); stage 0 prints its test retrieval when "
                          "it ends")
    keep_freed_memory()  # the steps reuse freed memory instead of page-faulting on fresh pages
    dist_, dtype, ctx, scaler = setup(config)
    config = dataclasses.replace(config, num_workers=loader_workers(config.num_workers, dist_.device))
    seed_everything(config.seed + dist_.rank)
    out_dir = Path(config.out_dir or "runs/pretrain_scenes")
    with OutDirLock(out_dir, dist_.master):  # one run at a time writes there; a second is refused
        pretrain_and_test(config, dist_, dtype, ctx, scaler, out_dir)


if __name__ == "__main__":
    run(main, "pretrain.py")
