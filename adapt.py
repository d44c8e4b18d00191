"""Stage 1 of CLIP4IDC, IDC adaptation: teach CLIP's vision tower to see what changed between two images.

CLIP4IDC (Guo et al., 2022, section 3.2) first adapts CLIP to image pairs. encoder.py's pair encoder turns a
(before, after) pair into one embedding; CLIP's text tower turns the pair's change caption into another;
a symmetric contrastive loss (losses.py) pulls each pair towards its own caption and away from every other
caption of the global batch. Stage 2 (caption.py) then trains a captioner on the adapted pair encoder.

This is a plain nanoGPT-style script: a Config dataclass whose fields are the command-line flags, a dataset
preset applied before them, then one loop. The same file runs on one CPU or GPU (`python adapt.py`) and on
several (`torchrun --standalone --nproc_per_node=2 adapt.py`, or several machines with torchrun's
--nnodes/--rdzv flags): DDP is detected from the environment.

The file reads top-down: the Config (the flags) and the presets; stage 1's data; the model, optimizer, schedule
and one training step; the run: main, train_and_test (data, model, optimizer, resume, samples), train (the loop);
then how the loop scores an epoch: evaluate, retrieval, retrieval_metrics (every caption ranked against every
pair, R@K). After the lesson: the checkpoint, the test split and --eval, the DDP and torch.compile wrap. What keeps
a run safe and fast (the processes, the step boundary's saves and stops, the caches) is plumbing/'s: every call
to it says `plumbing.`, and can be skipped on a first reading.

Stage 0, which made the synthetic CLIP that the synth preset adapts, runs through this file's step and loop
(pretrain.py): CLIP itself on one image and its description, in place of the pair encoder on a pair.

Differs from the reference implementation (github.com/sushizixin/CLIP4IDC at commit ca49461, its
main_task_retrieval.py and modules/; "the reference" below):
  - the best epoch is chosen on the validation split; the reference selects on the test split;
  - float32 weights, with optional autocast (bf16, or fp16 with a GradScaler), instead of fp16 weights;
  - torch's AdamW (with bias correction) instead of BertAdam (without it); LayerNorm weights not decayed;
  - the global batch is divided by the number of processes (the reference divides by GPUs per machine);
  - checkpoints hold the optimizer and RNG states, so an interrupted run resumes where it stopped;
  - the synth preset freezes the intra-image blocks outright and computes their tokens once (see build_encoder);
  - ties in retrieval ranks count against the true match (retrieval_metrics).

Run:  python adapt.py --data synth            the synthetic CLIP adapted to pairs (README: how long, by CPU)
      python adapt.py --data clevr            the paper's run on CLEVR-Change, on one GPU; or spot, ier, levir
      torchrun --standalone --nproc_per_node=2 adapt.py --data clevr
      python adapt.py --data synth --resume   continue an interrupted run from out_dir/ckpt_last.pt
      python adapt.py --data clevr --eval --checkpoint pretrained/pytorch_model.bin.clevr
                                              the test retrieval of the reference's released stage-1 weights

Shape letters: B pairs in a batch, R image side (224), T caption tokens (32), E joint embedding width,
P pairs of a split, C captions of a split.
"""
import dataclasses
import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import clip
import data
import plumbing
from encoder import EncoderConfig, PairEncoder, from_checkpoint
from losses import contrastive_loss, ieee_float32
from plumbing import ConfigError, flag

CLS_ROWS_ONLY = True  # speed variant: PairEncoder.embed_pair, beside encode_pair (the last block at the CLS rows)
MAX_LOGIT_SCALE = math.log(100)  # logit_scale is clamped to ln(100): a temperature of at least 0.01, as CLIP
INPUTS = ("before", "after", "caption")  # what a step feeds the model: PairEncoder(before, after, text)
MODEL_KEYS = ("data", "clip_model", "intra_layers", "freeze_intra", "max_words", "synth_pairs")
# what --resume also refuses to change: what the training computes (its batch, schedule, rates, data order)
TRAINING_KEYS = ("freeze", "epochs", "batch_size", "grad_accum", "lr", "clip_lr_scale", "weight_decay", "warmup",
                 "beta2", "eps", "grad_clip", "seed")


@dataclass
class Config:
    # data
    data: str = flag("clevr", "dataset preset: clevr, spot, ier, levir, pairs, synth")
    data_root: str = flag("", "the dataset's folder (\"\" = data/<dataset>, see data.py)")
    synth_pairs: int = flag(2000, "synth only: scenes drawn on first use")
    max_words: int = flag(32, "caption length in tokens, start and end tokens included")
    image_cache: bool = flag(False, "keep preprocessed 224x224 pixels in .npy files (skips PNG decoding)")
    resident_pixels: str = flag("auto", "hold the training images' cached pixels in the GPU's memory, no loader "
                                        "between them and the step: on, off, or auto (on a GPU, with --image_cache, "
                                        "when they take at most half its free memory)")
    num_workers: int = flag(-1, "DataLoader processes per training process that read the images and hand over their "
                                "uint8 pixels; 0: the training process reads them between steps. -1 (auto): on a GPU "
                                "every CPU this process may use but one (shared by torchrun's processes on a machine), "
                                "on the CPU 4. How many pairs a second a worker hands over, from PNGs or "
                                "--image_cache: BENCHMARKS.md section 7")
    # model
    clip_model: str = flag("ViT-B/32", "model name (plumbing/clip_files.py's MODELS) or weights file")
    intra_layers: int = flag(9, "vision blocks that see each image alone; the rest see the pair")
    freeze: bool = flag(True, "freeze the reference's set: patch, class and position embeddings, ln_pre, token "
                              "embedding")
    freeze_intra: bool = flag(False, "freeze the intra-image blocks too, and compute each image's intra tokens once")
    # optimisation
    epochs: int = flag(12, "passes over the training samples")
    batch_size: int = flag(128, "global batch: per-process batch x processes x grad_accum")
    grad_accum: int = flag(1, "micro-batches per optimizer step: the global batch runs in this many pieces, one after "
                              "another, when it does not fit in memory; the step averages their gradients. The "
                              "contrastive loss then sees only a micro-batch's captions as negatives, a different loss")
    lr: float = flag(1e-4, "learning rate of the new joint parameters")
    clip_lr_scale: float = flag(1e-3, "CLIP's parameters train at lr x clip_lr_scale")
    weight_decay: float = flag(0.2, "decoupled weight decay (not on biases and norms)")
    warmup: float = flag(0.1, "fraction of the steps spent warming up")
    beta2: float = flag(0.98, "AdamW's second-moment decay (beta1 is 0.9)")
    eps: float = flag(1e-6, "AdamW's epsilon")
    grad_clip: float = flag(1.0, "global gradient-norm clipping")
    # run
    seed: int = flag(42, "random seed (each process adds its rank)")
    device: str = flag("auto", "where to train: auto (cuda when torch sees a GPU, else cpu), cpu or cuda; under "
                               "torchrun each process takes the GPU of its LOCAL_RANK. Choose GPUs with "
                               "CUDA_VISIBLE_DEVICES")
    dtype: str = flag("auto", "precision of the products: auto is bfloat16 autocast on a GPU that computes it natively "
                              "(compute capability >= 8.0: A100, H100), float16 autocast with a loss scaler on an "
                              "older one (V100, T4), float32 on the CPU and when scoring a release; or float32, "
                              "bfloat16, float16. The weights stay float32")
    tf32: bool = flag(True, "float32 on a GPU (--dtype float32): matrix products and convolutions in TensorFloat-32 on "
                            "A100/H100, about 8x IEEE float32's rate; --no-tf32 for IEEE float32, to compare a run "
                            "with the CPU's numbers")
    compile: bool = flag(False, "torch.compile the model (after the DDP wrap): up to a minute of compiling, then fused "
                                "element-wise work; no faster on the CPU (BENCHMARKS.md section 11: the H200's step)")
    cuda_graphs: bool = flag(False, "capture the whole training step (forward, backward, clipping, AdamW) as one CUDA "
                                    "graph and replay it: one launch a step instead of thousands; one GPU, bf16 or "
                                    "float32 (plumbing/capture.py). Not yet run on a GPU")
    out_dir: str = flag("", 'checkpoints and logs ("" = runs/adapt_<dataset>)')
    log_every: int = flag(10, "optimizer steps between progress lines; the check that the loss and gradient norm are "
                              "finite runs then too (and before every save), not every step: reading a number from a "
                              "GPU waits for it, so a diverged run stops at most this many steps late")
    save_every: int = flag(200, "optimizer steps between ckpt_last.pt saves (and at every epoch end)")
    eval_batch_size: int = flag(128, "pairs per batch when encoding the evaluation split")
    resume: bool | str = flag(False, "continue from out_dir/ckpt_last.pt; --resume auto: continue it when it is there, "
                                     "else start afresh (one command for a job's first start and its requeue)",
                              also=("auto",))
    eval: bool = flag(False, "score the test split's retrieval with --checkpoint, then exit")
    checkpoint: str = flag("", '--eval: ours ("" = out_dir/ckpt_best.pt) or a release, pretrained/pytorch_model.bin.*')

    def __post_init__(self):  # a bad value fails here, before any data is read
        plumbing.check_settings(self, positive=("synth_pairs", "max_words", "intra_layers", "epochs", "batch_size",
                                                "grad_accum", "lr", "log_every", "save_every", "eval_batch_size"),
                                non_negative=("clip_lr_scale", "weight_decay", "grad_clip"), fraction=("warmup",))
        if self.num_workers < -1:
            raise ConfigError(f"--num_workers {self.num_workers}: it must be >= 0, or -1 for auto")
        if self.resume and self.checkpoint:
            raise ConfigError(f"--checkpoint {self.checkpoint} with --resume: --resume continues out_dir/ckpt_last.pt "
                              f"(pass that run's --out_dir); --checkpoint is for --eval")
        # at least one word between the start and end tokens; CLIP's text positions hold 77 (clip.CLIPConfig; a
        # loaded model's own are checked in build_clip)
        plumbing.check_length("max_words", self.max_words, 3, clip.CLIPConfig.context_length, "start token, at "
                              "least one word, end token; CLIP's text tower has 77 positions")


# Dataset presets, applied before the command-line flags (the reference's scripts/retrieve_clevr.sh and
# retrieve_spot.sh). IER has no reference run: we use Spot-the-Diff's settings. synth is the reference's recipe
# scaled down to the synthetic CLIP (6 vision blocks: 4 intra-image, 2 inter-image; the same frozen set) and to 2 CPU
# cores: 1,572 steps on 5,600 training pairs. Its intra-image blocks are frozen, as the reference's 1e-7 all but
# freezes them, so that their tokens are computed once and a step costs a quarter. The reference's two rates, scaled:
# the new joint parameters at 1e-2, the rest of CLIP (inter-image blocks, text tower) at 1e-3. The before and after
# embeddings are the only thing that tells the two images apart, and at 1e-3 they grew too slowly: drops were
# retrieved, and captioned, as additions (README, "The synthetic run"). Every preset reads its pixels from the image
# cache, decoded once: decoding a CLEVR-Change batch's PNGs takes longer than a GPU's step (BENCHMARKS.md section 7).
PRESETS = {
    "clevr": dict(epochs=12, batch_size=128, lr=1e-4, clip_lr_scale=1e-3, image_cache=True),
    "spot": dict(epochs=20, batch_size=128, lr=1e-4, clip_lr_scale=1e-3, image_cache=True),
    "ier": dict(epochs=20, batch_size=128, lr=1e-4, clip_lr_scale=1e-3, image_cache=True),
    # LEVIR-CC has no reference run: Spot-the-Diff's recipe, for as many samples per epoch (RECIPES.md, "LEVIR-CC")
    "levir": dict(epochs=20, batch_size=128, lr=1e-4, clip_lr_scale=1e-3, image_cache=True),
    "pairs": dict(epochs=12, batch_size=64, lr=1e-4, clip_lr_scale=1e-3, image_cache=True),
    "synth": dict(clip_model="synth-ViT/32", intra_layers=4, freeze_intra=True, synth_pairs=6000, epochs=6,
                  batch_size=128, lr=1e-2, clip_lr_scale=0.1, num_workers=0, image_cache=True, log_every=20),
}


# -----------------------------------------------------------------------------
# Stage 1's data: image pairs and their change captions


class PairData(NamedTuple):
    """Stage 1's dataset as read: its splits of image pairs, its tokenizer and its image reader."""
    splits: dict                      # split name -> [data.ImagePair], the pairs that changed
    tokenizer: clip.SimpleTokenizer   # the dataset's vocabulary (the synthetic set has its own)
    images: data.ImageReader          # path -> uint8 pixels (R, R, 3): decoded, or from the image cache


def read_pairs(config: Config, dist_, resolution: int = data.IMAGE_SIZE) -> PairData:
    """The dataset's splits of image pairs, its tokenizer and image reader of resolution x resolution images."""
    root = data.dataset_root(config.data, config.data_root or None)
    plumbing.draw_synthetic(config, root, dist_)  # --data synth: the embedded dataset, drawn by synth.py on first use
    # data.load_split reads the dataset's own layout (data.py section 4) into ImagePairs: before, after, captions
    # and, for CLEVR-Change and the synthetic set, the distractor view; adaptation_pairs leaves out the pairs that
    # did not change (LEVIR-CC's), whose captions all say so and tell no pair apart
    splits = {s: data.adaptation_pairs(data.load_split(config.data, s, root)) for s in data.SPLITS}
    tokenizer = plumbing.dataset_tokenizer(data.bpe_path(config.data, root), dist_)  # OpenAI's: downloaded once
    # path -> uint8 pixels: each image decoded and resized to R x R, or with --image_cache read from a file of them
    images = plumbing.image_reader(splits, root, resolution, config.image_cache, dist_)
    return PairData(splits, tokenizer, images)


# -----------------------------------------------------------------------------
# Model, optimizer and schedule


def build_clip(config: Config, vocab_size: int) -> clip.CLIP:
    """A pretrained CLIP: OpenAI's ViT-B/32, the synthetic CLIP (pretrain.py's), or a weights file."""
    clip_model, _ = plumbing.load_clip(config.clip_model)  # the checksummed file, read as data, never run
    if clip_model.config.vocab_size != vocab_size:
        raise ConfigError(f"{config.clip_model} has a vocabulary of {clip_model.config.vocab_size} tokens "
                          f"but the {config.data} dataset's tokenizer has {vocab_size}; use the model's "
                          f"vocabulary file" + plumbing.vocabulary_hint())
    plumbing.check_length("max_words", config.max_words, 3, clip_model.config.context_length,
                          f"{config.clip_model}'s text tower has {clip_model.config.context_length} positions")
    return clip_model


def build_encoder(config: Config, vocab_size: int) -> tuple[PairEncoder, dict]:
    """The pair encoder, and the CLIP sizes a checkpoint needs to rebuild it."""
    clip_model = build_clip(config, vocab_size)
    blocks = clip_model.config.vision_layers
    if not 0 < config.intra_layers <= blocks:
        raise ConfigError(f"--intra_layers {config.intra_layers}: {config.clip_model} has {blocks} vision "
                          f"blocks, so it must be in [1, {blocks}]")
    model = PairEncoder(clip_model, EncoderConfig(config.intra_layers))
    model.cls_rows_only = CLS_ROWS_ONLY
    if config.freeze:
        model.freeze()
    if config.freeze_intra:
        # differs from reference: the intra-image blocks do not train at all (the reference trains every CLIP
        # block at lr x 1e-3), so each image's intra-image tokens are a constant, computed once (train_and_test)
        model.freeze(model.intra_image_parts())
    return model, dataclasses.asdict(clip_model.config)


def build_optimizer(model: nn.Module, config: Config) -> torch.optim.AdamW:
    # new joint parameters at lr, CLIP at lr x clip_lr_scale; no decay on biases and norms (encoder.py)
    groups = model.optimizer_groups(config.lr, config.clip_lr_scale, config.weight_decay)
    # differs from reference: AdamW with bias correction; the reference's BertAdam has none
    return torch.optim.AdamW(groups, betas=(0.9, config.beta2), eps=config.eps, fused=True)


def get_lr(step: int, total_steps: int, config: Config) -> float:
    """The reference's warmup_cosine (BertAdam): x/w during warmup, then 0.5(1 + cos(pi x)), x = step/total."""
    x = step / max(1, total_steps)
    if x < config.warmup:
        return config.lr * x / config.warmup
    return config.lr * 0.5 * (1 + math.cos(math.pi * x))


def train_step(model, optimizer, scaler, micro_batches, ctx, config: Config, ddp: bool,
               logit_scale: torch.nn.Parameter, inputs=INPUTS) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum micro-batches; returns the mean loss and the gradient norm before
    clipping (tensors, not synced). inputs: the batch entries the model reads (stage 0: an image and a caption)."""
    total = 0.0
    for i, batch in enumerate(micro_batches):
        # under DDP, the gradients are all-reduced only in the last micro-batch's backward
        with model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext():
            with ctx:
                # the captions come cut after the batch's last end-of-text token (data.collate_text; --compile: not cut)
                out = model(*(batch[k] for k in inputs))  # the pairs' and their captions' embeddings, (B, E) each
                # the all-gather inside the loss sees one micro-batch per process: accumulation shrinks the
                # set of contrastive negatives to micro-batch x processes, it does not grow it
                loss = contrastive_loss(out["text_embedding"], out["pair_embedding"], out["logit_scale"])
                loss = loss / len(micro_batches)
            scaler.scale(loss).backward()  # float16: the loss times the scale, so that small gradients do not underflow
        total = total + loss.detach()
    scaler.unscale_(optimizer)  # first: the norm is clipped on the true gradients, not on the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    scaler.step(optimizer)  # float16: skipped when a gradient is inf or NaN, and update() then halves the scale
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():  # a temperature below 0.01 makes the softmax too sharp to train, as CLIP found
        logit_scale.clamp_(max=MAX_LOGIT_SCALE)
    return total, grad_norm


# -----------------------------------------------------------------------------
# The run: the set-up (main), the data, the model and the optimizer (train_and_test), then the loop (train)


def main(argv=None):
    config = plumbing.parse_config(Config, PRESETS, argv, description=__doc__.split("\n")[0])
    # DDP from torchrun's environment, the device, autocast and GradScaler, the seed; one run at a time in out_dir
    with plumbing.started(config, Path(config.out_dir or f"runs/adapt_{config.data}")) as run:
        if run.config.eval:
            evaluate_checkpoint(run)
        else:
            train_and_test(run)


def train_and_test(run: plumbing.Run) -> None:
    """Stage 1: read the data, build the encoder, train it, then score the test split."""
    config, dist_ = run.config, run.dist_
    if config.resume:  # what it resumes on, before any work
        plumbing.check_resume(run.out_dir)
    pairs = read_pairs(config, dist_)
    plumbing.refuse_empty_splits(pairs.splits, data.SPLITS, config)
    with plumbing.one_download_per_machine(dist_):  # OpenAI's weights, downloaded on first use
        model, clip_config = build_encoder(config, pairs.tokenizer.vocab_size)
    model.to(dist_.device)
    optimizer = build_optimizer(model, config)
    train_split = plumbing.split_fingerprint(pairs.splits["train"])  # what a resumed run checks it trains on
    state = plumbing.start_or_resume(run, MODEL_KEYS + TRAINING_KEYS, model, optimizer, train_split)
    images = pairs.images  # (R, R, 3) uint8 pixels of an image file; with frozen intra-image blocks, its tokens:
    if config.freeze_intra:  # (N+1, D) each, computed once now (by the master, under DDP), read by every step
        images = plumbing.IntraTokens(model, pairs.splits["train"], pairs.images, config.eval_batch_size,
                                      dist_.device, run.ctx, pairs.images.cache_dir or run.out_dir, dist_)
        plumbing.say(run, f"intra-image tokens of {len(images.row)} training images {images.origin}: the "
                          f"intra-image blocks are frozen")
    elif plumbing.resident_pixels(config.resident_pixels, pairs.images, pairs.splits["train"], dist_.device):
        images = plumbing.ResidentPixels(pairs.images, pairs.splits["train"], dist_.device)
        plumbing.say(run, f"the pixels of {len(images.row)} training images in {dist_.device.type} memory "
                          f"({plumbing.size_text(images.bytes)}): no loader reads them")
    # one sample per (pair, change caption); half the time the before image is the distractor view (data.py)
    train_set = data.AdaptationSamples(pairs.splits["train"], pairs.tokenizer, train=True, images=images,
                                       max_words=config.max_words)
    checkpoint = functools.partial(stage1_checkpoint, model, optimizer, run, clip_config, pairs.tokenizer,
                                   train_split=train_split)
    step = train(run, model, optimizer, train_set, validate=lambda m: evaluate(
        m, pairs.splits["val"], pairs.tokenizer, pairs.images, config, dist_.device, run.ctx),
        checkpoint=checkpoint, state=state)
    if dist_.master:
        test(run, model, lambda m: evaluate(m, pairs.splits["test"], pairs.tokenizer, pairs.images, config,
                                            dist_.device, run.ctx), step)


def train(run: plumbing.Run, raw_model: nn.Module, optimizer, train_set, validate, checkpoint, state: dict | None,
          inputs=INPUTS) -> int:
    """The training loop; after every epoch, validate(model) on the master, whose text->pair R@1 picks the best
    epoch (kept in ckpt_best.pt). checkpoint(**progress) is the run's checkpoint at the step the loop has reached.
    Stage 0 (pretrain.py) trains CLIP itself through it. Returns the last step."""
    config, dist_, out_dir = run.config, run.dist_, run.out_dir
    device, master = dist_.device, dist_.master
    model = wrap(raw_model, config, dist_, run.dtype)  # what the step calls: DDP's under torchrun, compiled, ...
    step, best, best_epoch, history = 0, -1.0, -1, []
    if state is not None:
        step, best, best_epoch, history = state["step"], state["best_metric"], state["best_epoch"], state["history"]
    # the global batch as micro-batches per process and accumulation step; the sampler deals the samples out
    micro, sampler, steps_per_epoch = plumbing.batch_plan(train_set, config.batch_size, config.grad_accum, dist_,
                                                          config.seed)
    total_steps = config.epochs * steps_per_epoch
    plumbing.announce(run, describe(run, train_set, micro, steps_per_epoch, raw_model))

    def state(path):  # the checkpoint at the step and epoch the loop has reached
        return checkpoint(epoch=epoch, step=step, best_metric=best, best_epoch=best_epoch, history=history)

    loader = plumbing.training_loader(train_set, sampler, micro, config.num_workers, device,
                                      functools.partial(data.collate_text, cut=not (config.compile or
                                                                                    config.cuda_graphs)))
    pixels = getattr(train_set, "images", None)  # (stage 0's scenes draw theirs)
    resident = pixels.table if isinstance(pixels, plumbing.ResidentPixels) else None  # the training pixels on the device
    step_once = functools.partial(train_step, model, optimizer, run.scaler, ctx=run.ctx, config=config, ddp=dist_.ddp,
                                  logit_scale=raw_model.clip.logit_scale, inputs=inputs)
    if config.cuda_graphs:  # the step captured once as a CUDA graph, then replayed (plumbing/capture.py)
        plumbing.check_capture(config, dist_, run.dtype)
        step_once = plumbing.CapturedStep(step_once, optimizer)
    # Ctrl-C and SIGTERM end the step in progress, save ckpt_last.pt at that step and stop (plumbing.StepBoundary)
    with plumbing.StepBoundary(run, steps_per_epoch, total_steps, step, state) as boundary:
        model.train()
        while step < total_steps or boundary.pending_validation:  # (resumed before an epoch's validation)
            epoch, done_in_epoch = boundary.position(step)  # done_in_epoch > 0 when resuming part-way through it
            batches = boundary.epoch_batches(loader, epoch, done_in_epoch, config.grad_accum)  # the sampler's epoch
            for _ in range(done_in_epoch, steps_per_epoch):
                lr = get_lr(step, total_steps, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                try:
                    micro_batches = [data.to_device(next(batches), device, inputs, resident)
                                     for _ in range(config.grad_accum)]
                except data.DataError as error:  # a damaged image: ckpt_last.pt at the last step, then one line
                    raise boundary.damaged(error, step) from None
                loss, grad_norm = step_once(micro_batches)  # train_step: forward, backward, clipping, AdamW
                step += 1
                if boundary.after_step(step, lr, loss, grad_norm):  # the master's log steps: .item() waits, here only
                    loss_value, scale = loss.item(), raw_model.clip.logit_scale.exp().item()
                    print(boundary.line(step, epoch=f"{epoch + 1}/{config.epochs}", loss=loss_value,
                                        lr=get_lr(step, total_steps, config), temp=1 / scale if scale else math.inf),
                          flush=True)
                    boundary.log.write(step=step, epoch=epoch, loss=loss_value,
                                       lr=get_lr(step, total_steps, config), logit_scale=scale)
                boundary.save_or_stop()  # ckpt_last.pt every save_every steps; for Ctrl-C or SIGTERM, then stops
            boundary.end_epoch(raw_model)  # its last steps and weights checked finite, then saved (ckpt_last.pt)
            if master:  # end of epoch: validation retrieval on the master, the others wait
                scores = validate(raw_model)
                history.append({"epoch": epoch, "step": step, **scores})
                improved = scores["text_to_pair_R1"] >= best  # a tie keeps the later epoch, as the reference
                best, best_epoch = (scores["text_to_pair_R1"], epoch) if improved else (best, best_epoch)
                boundary.log.write(step=step, epoch=epoch, split="val", **scores)
                best_file = [out_dir / "ckpt_best.pt"] if improved else []  # saved first: no line printed
                boundary.save(*best_file, out_dir / "ckpt_last.pt")  # can lose a checkpoint (the writer's thread)
                print(f"epoch {epoch + 1} validation: {summary(scores)}" + (" (best so far)" if improved else ""))
            boundary.stop_if_signalled()  # Ctrl-C or SIGTERM in any process; under DDP also the epoch's barrier
    return step


# -----------------------------------------------------------------------------
# Evaluation: rank every caption of a split against every pair (the reference's main_task_retrieval.py, `eval_epoch`)


@torch.no_grad()
def evaluate(model: PairEncoder, split, tokenizer, images, config: Config, device, ctx) -> dict:
    """Retrieval on a split of pairs: each change caption ranked against every pair, each pair against the
    captions (retrieval)."""
    was_training = model.training
    model.eval()
    texts, text_to_pair = data.retrieval_texts(split)  # every caption of the split, and its pair's row
    # a generator of its own: evaluating must not draw from the global one that training's random choices use
    loader = DataLoader(data.PairImages(split, images), batch_size=config.eval_batch_size,
                        num_workers=config.num_workers, generator=torch.Generator(), pin_memory=device.type == "cuda")
    pair_embeddings = []
    for batch in loader:
        pixels = data.to_device(batch, device, ("before", "after"))  # (B, 3, R, R) each
        with ctx:
            pair_embeddings.append(model(pixels["before"], pixels["after"])["pair_embedding"].float())  # (B, E)
    scores = retrieval(model, torch.cat(pair_embeddings), texts, text_to_pair, tokenizer, config, device, ctx)
    model.train(was_training)
    return scores


@torch.no_grad()
def retrieval(model: nn.Module, visual: torch.Tensor, texts: list[str], text_to_row: list[int], tokenizer,
              config: Config, device, ctx) -> dict:
    """Recall at 1, 5, 10 and the median and mean rank, both ways (retrieval_metrics), of texts against the visual
    embeddings (P, E) by cosine similarity; text i describes row text_to_row[i]."""
    text_embeddings = []
    for start in range(0, len(texts), config.eval_batch_size):
        tokens = torch.stack([data.text_tokens(tokenizer, t, config.max_words)
                              for t in texts[start:start + config.eval_batch_size]]).to(device)  # (B, T)
        with ctx:
            text_embeddings.append(model.encode_text(tokens).float())  # (B, E)
    visual_e = torch.nn.functional.normalize(visual, dim=-1)  # (P, E)
    text_e = torch.nn.functional.normalize(torch.cat(text_embeddings), dim=-1)  # (C, E)
    scores = retrieval_metrics((text_e @ visual_e.T).cpu().numpy(), text_to_row)  # (C, P) cosine similarities
    return {f"{direction}_{name}": value for direction, by_name in scores.items() for name, value in by_name.items()}


def retrieval_metrics(sim, text_to_pair, ties="pessimistic") -> dict:
    """R@1/5/10 (%), median and mean rank (1 = best), text->pair and pair->text (the reference's metrics.py, from
    CLIP4Clip: `tensor_text_to_video_metrics`, `tensor_video_to_text_sim`, `compute_metrics`).

    sim: (C, P) similarities of every caption with every pair; text_to_pair[c] is caption c's pair, and a pair may
    have several captions. text->pair ranks each caption against all pairs. pair->text scores a pair against a
    pair's caption group by the group's best caption, then ranks the true group among the P groups. Medians as in
    the reference: torch.median (the lower middle value) for text->pair, np.median (the mean of the two middle
    values) for pair->text.
    # differs from reference: torch.argsort leaves the order of tied similarities unspecified (and CLIP4Clip's
    # compute_metrics counts a tied row several times); here a tie counts against the true match ("pessimistic",
    # so a constant matrix scores R@1 = 0), or for it with ties="optimistic".
    """
    sim, text_to_pair = np.asarray(sim, dtype=np.float64), np.asarray(text_to_pair)
    n_texts, n_pairs = sim.shape                                            # (C, P)
    assert text_to_pair.shape == (n_texts,), f"text_to_pair must have {n_texts} entries, got {text_to_pair.shape}"
    assert ties in ("pessimistic", "optimistic"), f"ties must be 'pessimistic' or 'optimistic', got {ties!r}"
    if n_texts and (text_to_pair.min() < 0 or text_to_pair.max() >= n_pairs):
        raise ValueError(f"text_to_pair values must be pair indices in [0, {n_pairs})")
    if not np.isfinite(sim).all():
        raise ValueError("sim holds NaN or infinite values; drop padded rows before ranking")
    captioned = np.bincount(text_to_pair, minlength=n_pairs) > 0
    if not captioned.all():
        raise ValueError(f"pairs {np.flatnonzero(~captioned)[:5].tolist()} have no caption: every pair needs at "
                         f"least one for pair->text ranking")

    def ranks(scores, true_scores):  # 0-based: how many entries score higher (a tie, if pessimistic, too)
        higher = (scores > true_scores[:, None]).sum(axis=1)
        return higher + (scores == true_scores[:, None]).sum(axis=1) - 1 if ties == "pessimistic" else higher

    def summary(r, median):
        return {"R1": 100.0 * float(np.mean(r < 1)), "R5": 100.0 * float(np.mean(r < 5)),
                "R10": 100.0 * float(np.mean(r < 10)), "MedianR": median(r + 1), "MeanR": float(np.mean(r + 1))}

    text_ranks = ranks(sim, sim[np.arange(n_texts), text_to_pair])         # (C,)
    group_best = np.full((n_pairs, n_pairs), -np.inf)                       # (P groups, P pairs)
    np.maximum.at(group_best, text_to_pair, sim)
    pair_scores = group_best.T                                              # (P pairs, P groups): truth on diagonal
    pair_ranks = ranks(pair_scores, np.diag(pair_scores))                   # (P,)
    return {"text_to_pair": summary(text_ranks, lambda r: float(np.sort(r)[(len(r) - 1) // 2])),
            "pair_to_text": summary(pair_ranks, lambda r: float(np.median(r)))}


def retrieval_table(scores: dict) -> str:
    return "\n".join(f"  {k:<18} {v:8.2f}" for k, v in scores.items())


def summary(scores: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in scores.items() if k.endswith(("R1", "R5")))


# -----------------------------------------------------------------------------
# What the run calls: its checkpoint, the test split; --eval


def stage1_checkpoint(model: PairEncoder, optimizer, run: plumbing.Run, clip_config: dict, tokenizer,
                      **progress) -> dict:
    """What ckpt_last.pt and ckpt_best.pt hold: enough to resume, and to rebuild the encoder in stage 2."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "config": dataclasses.asdict(run.config), "clip_config": clip_config,
            "encoder_config": dataclasses.asdict(model.config) if isinstance(model, PairEncoder) else None,
            # the vocabulary itself, so that the file travels alone; its path only as a hint of where it came from
            "vocabulary": plumbing.vocabulary_tensor(tokenizer.bpe_path), "bpe_path": str(tokenizer.bpe_path),
            **progress, "rng": plumbing.rng_state()}


def describe(run: plumbing.Run, train_set, micro: int, steps_per_epoch: int, model: nn.Module) -> str:
    """The run in one line: how much it trains on, with which batch, where."""
    config, dist_ = run.config, run.dist_
    pairs = f" from {len(train_set.pairs)} pairs" if hasattr(train_set, "pairs") else ""  # stage 0: scenes
    return (f"{len(train_set)} training samples{pairs}; global batch {config.batch_size} = {micro} x "
            f"{dist_.world_size} processes x {config.grad_accum} accumulation; {steps_per_epoch} steps per epoch, "
            f"{config.epochs * steps_per_epoch} in all; {run.dtype} on {dist_.device}; "
            f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.1f}M trainable parameters")


def test(run: plumbing.Run, model: nn.Module, score, step: int) -> dict:
    """The test split's retrieval (score(model)), scored once, with the epoch chosen on validation, written to the
    log and test_retrieval.json; the best checkpoint (ckpt_best.pt) is returned."""
    best = plumbing.load_checkpoint(run.out_dir / "ckpt_best.pt")
    model.load_state_dict(best["model"])
    try:
        scores = score(model)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM: training is done, only the scores are not
        raise plumbing.final_test_stopped(interrupt, run.out_dir) from None
    best_epoch = best["best_epoch"]
    plumbing.JsonlLog(run.out_dir / plumbing.LOG_NAME).write(step=step, split="test", best_epoch=best_epoch, **scores)
    plumbing.save_json({"best_epoch": best_epoch, "val_text_to_pair_R1": best["best_metric"], **scores},
                       run.out_dir / "test_retrieval.json")
    print(f"test retrieval of the best epoch ({best_epoch + 1}, chosen on validation):\n{retrieval_table(scores)}")
    return best


def evaluate_checkpoint(run: plumbing.Run) -> None:
    """--eval: the test split's retrieval with a stage-1 checkpoint: adapt.py's (out_dir/ckpt_best.pt), or the
    adaptation stage of a CLIP4IDC release (--checkpoint pretrained/pytorch_model.bin.clevr), the paper's table."""
    config, dist_, ctx = run.config, run.dist_, run.ctx
    if not dist_.master:  # one process scores the test split; under torchrun the others wait for it
        return
    path = Path(config.checkpoint or run.out_dir / "ckpt_best.pt")
    state = plumbing.read_encoder(path, config.intra_layers, "adapt.py --eval --checkpoint")  # ours or a release
    model = from_checkpoint(state)
    model.cls_rows_only = CLS_ROWS_ONLY  # as the training's test: the same scores
    precision = nullcontext()
    if state.get("release") and config.dtype == "auto":  # scored in IEEE float32 (no autocast, TF32 off), as
        # caption.py scores a release: bf16 or TF32 on a GPU moves ranks that nearly tie (BENCHMARKS.md section 12)
        ctx, precision = nullcontext(), ieee_float32()
    splits, tokenizer, images = read_pairs(config, dataclasses.replace(dist_, ddp=False),
                                           model.clip.visual.input_resolution)
    if tokenizer.vocab_size != model.clip.config.vocab_size:
        raise ConfigError(f"{path} has a vocabulary of {model.clip.config.vocab_size} tokens but the "
                          f"{config.data} dataset's tokenizer has {tokenizer.vocab_size}"
                          + plumbing.vocabulary_hint(tokenizer))
    plumbing.refuse_empty_splits(splits, ("test",), config)
    with precision:
        scores = evaluate(model.to(dist_.device), splits["test"], tokenizer, images, config, dist_.device, ctx)
    plumbing.save_json({"checkpoint": str(path), **scores}, run.out_dir / "test_retrieval.json")
    print(f"test retrieval of {path}:\n{retrieval_table(scores)}")


# -----------------------------------------------------------------------------
# The model a step calls: DDP, torch.compile


def wrap(model: nn.Module, config: Config, dist_, dtype: str = "float32") -> nn.Module:
    """The model the training step calls: under bf16 or fp16 autocast (dtype) its matrix weights cast once a step
    (plumbing.cast_once, the same numbers); under torchrun wrapped in DDP, which all-reduces the gradients in
    buckets while the backward runs; with --compile, compiled after the wrap, so that the compiled backward keeps
    DDP's overlap (compiled first, DDP would see one opaque backward and all-reduce after it). The unwrapped
    model is still the one saved, evaluated and whose logit_scale is clamped."""
    model = plumbing.cast_once(model, dtype, config.compile)
    if dist_.ddp:
        if config.compile and torch_version() < COMPILED_DDP_TORCH:
            raise ConfigError(f"--compile under torchrun needs torch {'.'.join(map(str, COMPILED_DDP_TORCH))} "
                              f"or newer (this is {torch.__version__}, whose compiled DDP fails its first "
                              f"step); train without --compile, or upgrade torch")
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, no copy in and out of them
        model = DDP(model, device_ids=[dist_.local_rank] if dist_.device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    return torch.compile(model) if config.compile else model


# torch 2.5.1's compiled DDP fails its first step (in either order, "Expected to have finished reduction in the prior
# iteration"); 2.11, 2.13 and 2.14 train (test_a_compiled_model_trains_under_two_process_ddp_...); 2.6-2.10 untested
COMPILED_DDP_TORCH = (2, 11)


def torch_version() -> tuple[int, int]:
    return tuple(int(part) for part in torch.__version__.split(".")[:2])


if __name__ == "__main__":
    plumbing.run_main(main, "adapt.py")
