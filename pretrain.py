"""Stage 0 for the synthetic world: CLIP's own pretraining, at small size, on single synthetic scenes.

CLIP4IDC starts from OpenAI's CLIP, pretrained on 400M web image-text pairs (CLIP paper, section 2.3), which the
synthetic world lacks. This script makes a CLIP for it the way OpenAI did: the same clip.CLIP class, from
scratch, on single synthetic scenes (synth.py) and sentences naming their objects, with CLIP's contrastive loss.
It is stage 1's loop one step earlier, with CLIP itself (SceneCLIP) in place of the pair encoder and one image in
place of a pair: adapt.py's Config (and the sizes of a CLIP from scratch), optimizer, schedule and retrieval
scores, and a loop of its own written as adapt.py's, with the same step boundary (StepBoundary). It ends
by checking CLIP-style zero-shot classification of held-out objects and by writing the weights in OpenAI's names
and format: the file assets/synth-ViT-32.pt that clip_files.MODELS names "synth-ViT/32" and adapt.py's synth preset
adapts.

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
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group
from torch.utils.data import DataLoader

import adapt
import clip
import clip_files
import data
import synth
from batches import batch_plan, epoch_batches, training_loader
from checkpoints import load_checkpoint, rng_state, save_checkpoint, seed_everything, start_or_resume, vocabulary_tensor
from encoder import PairEncoder
from files import OutDirLock, save_json
from flags import ConfigError, check_settings, flag, parse_config
from loop import Run, StepBoundary
from losses import contrastive_loss
from processes import keep_freed_memory, loader_workers, setup
from stopping import check_finite_model, run_main

SCRATCH_SIZES = ("scratch_width", "scratch_layers", "scratch_patch", "scratch_text_width", "scratch_text_layers",
                 "scratch_embed_dim")
# what --resume refuses to change
MODEL_KEYS = ("data", "clip_model", "intra_layers", "freeze_intra", "max_words", *SCRATCH_SIZES, "synth_pairs")


@dataclass
class Config(adapt.Config):  # adapt.py's knobs and a CLIP's sizes from scratch; the scenes preset sets their values
    data: str = flag("scenes", "stage 0's one dataset: single synthetic scenes (data/synth_scenes)")
    clip_model: str = flag("ViT-B/32", '"scratch": a CLIP from scratch at the scratch_* sizes; or a model name '
                                       '(clip_files.MODELS) or weights file, trained further')
    out_dir: str = flag("", 'checkpoints and logs ("" = runs/pretrain_scenes)')
    scratch_width: int = flag(256, "scratch model: vision width")
    scratch_layers: int = flag(6, "scratch model: vision blocks")
    scratch_patch: int = flag(32, "scratch model: patch side in pixels")
    scratch_text_width: int = flag(256, "scratch model: text width")
    scratch_text_layers: int = flag(3, "scratch model: text blocks")
    scratch_embed_dim: int = flag(256, "scratch model: joint embedding width")

    def __post_init__(self):  # adapt.py's checks (max_words at most 77, as OpenAI's CLIP), then the scratch sizes
        super().__post_init__()
        check_settings(self, positive=SCRATCH_SIZES)


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
    """A split of single scenes, which evaluate ranks as adapt.evaluate ranks pairs: each scene's description
    against every scene."""

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


# -----------------------------------------------------------------------------
# One training step, and the retrieval scores: stage 1's, on single images


def train_step(model: nn.Module, optimizer, scaler, micro_batches, ctx, config: Config, ddp: bool,
               logit_scale: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """adapt.train_step with a scene in place of a pair: one optimizer step over grad_accum micro-batches; returns
    the mean loss and the gradient norm before clipping (tensors, not synced)."""
    total = 0.0
    for i, batch in enumerate(micro_batches):
        # under DDP, the gradients are all-reduced only in the last micro-batch's backward
        with model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext():
            with ctx:
                out = model(batch["image"], batch["caption"])
                # CLIP's loss: each scene against every description of the batch, and each description against
                # every scene
                loss = contrastive_loss(out["text_embedding"], out["image_embedding"], out["logit_scale"])
                loss = loss / len(micro_batches)
            scaler.scale(loss).backward()
        total = total + loss.detach()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():  # a temperature below 0.01 makes the softmax too sharp to train, as CLIP found
        logit_scale.clamp_(max=adapt.MAX_LOGIT_SCALE)
    return total, grad_norm


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
            image_embeddings.append(model(image)["image_embedding"].float())  # (B, E)
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
    say(f"wrote {path}, sha256 {clip_files.sha256_of(path)}")


# -----------------------------------------------------------------------------
# The run


def checkpoint(model: SceneCLIP, optimizer, run: Run, tokenizer, **progress) -> dict:
    """What ckpt_last.pt and ckpt_best.pt hold: enough to resume (adapt.checkpoint's entries; no pair encoder)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "config": dataclasses.asdict(run.config), "clip_config": dataclasses.asdict(model.clip.config),
            "encoder_config": None,
            # the vocabulary itself, so that the file travels alone; its path only as a hint of where it came from
            "vocabulary": vocabulary_tensor(tokenizer.bpe_path), "bpe_path": str(tokenizer.bpe_path),
            **progress, "rng": rng_state()}


def train(run: Run, raw_model: SceneCLIP, optimizer, splits: dict, tokenizer, state: dict | None) -> int:
    """adapt.train's loop on single scenes; after every epoch, validation retrieval on the master, which keeps the
    best epoch in ckpt_best.pt. Returns the last step."""
    config, dist_, out_dir = run.config, run.dist_, run.out_dir
    device, master = dist_.device, dist_.master
    say = print if master else (lambda *a, **k: None)
    model = adapt.wrap(raw_model, config, dist_)  # what the step calls: under torchrun DDP's, with --compile compiled
    step, best, best_epoch, history = 0, -1.0, -1, []
    if state is not None:
        step, best, best_epoch, history = state["step"], state["best_metric"], state["best_epoch"], state["history"]
    micro, sampler, steps_per_epoch = batch_plan(splits["train"], config.batch_size, config.grad_accum, dist_,
                                                 config.seed)
    total_steps = config.epochs * steps_per_epoch
    if master:
        save_json(dataclasses.asdict(config), out_dir / "config.json")
        say(json.dumps(dataclasses.asdict(config)))
        say(adapt.describe(run, len(splits["train"]), len(splits["train"]), micro, steps_per_epoch, raw_model))

    def state(path):  # the checkpoint at the step and epoch the loop has reached
        return checkpoint(raw_model, optimizer, run, tokenizer, epoch=epoch, step=step, best_metric=best,
                          best_epoch=best_epoch, history=history)

    loader = training_loader(splits["train"], sampler, micro, config.num_workers, device,
                             functools.partial(data.collate_text, cut=not config.compile))
    # Ctrl-C and SIGTERM end the step in progress, save ckpt_last.pt at that step and stop (StepBoundary)
    with StepBoundary(run, steps_per_epoch, total_steps, step, state) as boundary:
        model.train()
        while step < total_steps:
            epoch = step // steps_per_epoch
            done_in_epoch = step - epoch * steps_per_epoch  # > 0 when resuming part-way through an epoch
            batches = epoch_batches(loader, epoch, done_in_epoch, config.grad_accum)  # the sampler's epoch
            for _ in range(done_in_epoch, steps_per_epoch):
                lr = adapt.get_lr(step, total_steps, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                try:
                    micro_batches = [data.to_device(next(batches), device, ("image", "caption"))
                                     for _ in range(config.grad_accum)]
                except data.DataError as error:  # a damaged file: ckpt_last.pt at the last step, then one line
                    raise boundary.damaged(error, step) from None
                loss, grad_norm = train_step(model, optimizer, run.scaler, micro_batches, run.ctx, config, dist_.ddp,
                                             raw_model.clip.logit_scale)
                step += 1
                if boundary.after_step(step, lr, loss, grad_norm):  # the master's log steps: .item() waits, here only
                    loss_value, scale = loss.item(), raw_model.clip.logit_scale.exp().item()
                    say(boundary.line(step, epoch=f"{epoch + 1}/{config.epochs}", loss=loss_value,
                                      lr=adapt.get_lr(step, total_steps, config),
                                      temp=1 / scale if scale else math.inf), flush=True)
                    boundary.log.write(step=step, epoch=epoch, loss=loss_value,
                                       lr=adapt.get_lr(step, total_steps, config), logit_scale=scale)
                boundary.save_or_stop()  # ckpt_last.pt every save_every steps; for Ctrl-C or SIGTERM, then stops
            boundary.end_epoch()  # the finiteness check of the epoch's last steps
            if master:  # end of epoch: validation retrieval on the master, the others wait
                check_finite_model(raw_model, step, lr)  # a non-finite model is never scored nor saved
                scores = evaluate(raw_model, splits["val"], tokenizer, config, device, run.ctx)
                history.append({"epoch": epoch, "step": step, **scores})
                improved = scores["text_to_pair_R1"] >= best  # a tie keeps the later epoch
                best, best_epoch = (scores["text_to_pair_R1"], epoch) if improved else (best, best_epoch)
                say(f"epoch {epoch + 1} validation: {adapt.summary(scores)}" + (" (best so far)" if improved else ""))
                boundary.log.write(step=step, epoch=epoch, split="val", **scores)
                best_file = [out_dir / "ckpt_best.pt"] if improved else []  # on the writer's thread
                boundary.save(*best_file, out_dir / "ckpt_last.pt")
            boundary.stop_if_signalled()  # Ctrl-C or SIGTERM in any process; under DDP also the epoch's barrier
    return step


def pretrain_and_test(run: Run) -> None:
    """Stage 0: read the scenes, build CLIP, train it, score the test split, write the weights; then the processes
    of a torchrun leave their group together."""
    config, dist_ = run.config, run.dist_
    device, master = dist_.device, dist_.master
    splits, tokenizer = read_scenes(config, dist_)
    model = SceneCLIP(build_clip(config, tokenizer.vocab_size))
    model.to(device)
    optimizer = adapt.build_optimizer(model, config, device)
    ckpt_path = run.out_dir / "ckpt_last.pt"
    state = start_or_resume(ckpt_path, config, MODEL_KEYS, dist_, model, optimizer, run.scaler)
    if state is not None and master:
        print(f"resumed {ckpt_path} at step {state['step']}")
    step = train(run, model, optimizer, splits, tokenizer, state)
    if master:  # the test split's retrieval, scored once, with the epoch chosen on validation
        best = load_checkpoint(run.out_dir / "ckpt_best.pt")
        model.load_state_dict(best["model"])
        adapt.save_test(run, best, evaluate(model, splits["test"], tokenizer, config, device, run.ctx), step)
        finish_stage0(model, tokenizer, config, device, run.ctx, run.out_dir, print)
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
        pretrain_and_test(Run(config, dist_, dtype, ctx, scaler, out_dir))


if __name__ == "__main__":
    run_main(main, "pretrain.py")
