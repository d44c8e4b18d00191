"""Stage 2 of CLIP4IDC, IDC finetuning: train a captioner that says what changed, evaluate it like the papers.

CLIP4IDC (Guo et al., 2022, section 3.3) puts a transformer caption decoder (decoder.py) on the adapted pair
encoder of stage 1 (adapt.py): the decoder reads the pair's 2(N+1) = 100 tokens and writes the change
caption, trained with token cross-entropy (losses.py) and decoded greedily.

By default the pair encoder stays as stage 1 left it, in the paper's words "a vanilla Transformer is
trained for IDC on the features extracted by the vision encoder": every pair is encoded once, its tokens
are kept on disk in float16 (keyed by the stage-1 checkpoint), and the decoder trains on them, so an epoch
costs the decoder alone. --finetune_encoder trains end to end with CLIP at lr x clip_lr_scale, as the
reference does, keeping stage 1's frozen set: when stage 1 froze the intra-image blocks (the synth preset),
they stay frozen and each training image's intra tokens are computed once. On CLEVR-Change-style data
(use_no_change_pair) every item is two captions: the change pair with a change caption and the distractor
pair (before, view-shifted before) with a no-change caption, their two losses summed, as the reference.

The best epoch is chosen by CIDEr-D on the validation split, with patience; the test split is decoded and
scored once at the end, and again by --eval: overall, semantic changes only, and per change type
(color, material, add, drop, move, distractor), each subset re-scored on its own as the papers' toolkit
does (metrics.py), then, where the pairs carry CLEVR-Change's change types (the synthetic set, CLEVR-Change),
the kind of change each caption says, by keywords, right per true kind (metrics.change_kinds); plus a grid PNG of
test pairs with their predicted and reference captions. Where the
data knows where the changed object is (the synthetic set; CLEVR-Change with RCC's boxes file), it also scores
localisation, a pointing game on the encoder's and the decoder's attention (explain.py), and writes
test_attention.png: the attention maps of the first pairs of the grid, word by word.

The file reads top-down: the Config and presets; the captioner (the stage-1 encoder, the decoder, the optimizer
and one training step); the run: main, job (stage 1, the tokenizer, the captioner; then --pair, --eval or
training), train (the loop); then how an epoch is scored: validate, predict (greedy ids, then text), CIDEr-D.
What the jobs and the loop call follows the lesson: captioning one pair, the test split, the training set,
checkpoints, the test split's score table. The process set-up (DDP, autocast,
GradScaler) is stage 1's, processes.setup; the loop's step boundary is loop.StepBoundary; the stage-1 checkpoint a
captioner builds on is checkpoints.load_stage1's, and the pair features cached on disk are caches.py's.

Differs from the reference implementation (github.com/sushizixin/CLIP4IDC at commit ca49461, its
main_task_caption.py and modules/; "the reference" below):
  - the best epoch is chosen on the validation split (the reference uses the test split);
  - by default the decoder trains on cached encoder features (--finetune_encoder, the synth preset's, for the
    reference's way);
  - greedy decoding stops once every caption of the batch has written EOT (the reference always runs 32 steps;
    the text, cut at EOT, is the same); it writes at most max_len = 32 tokens as the reference, 22 in the synth
    preset, whose captions are shorter;
  - the output layer runs only at caption positions that are not padding, and batches are cut to their
    longest caption: the same loss, less work;
  - float32 weights with optional autocast, torch's AdamW instead of BertAdam, LayerNorms not decayed;
  - the unused CLIP text tower is frozen when finetuning (the reference runs it on a dummy caption).

Run:  python caption.py --data synth                  train on the synthetic set (after adapt.py --data synth)
      python caption.py --data synth --eval           decode and score the test split with the best checkpoint
      python caption.py --data synth --pair A.png B.png   caption one pair of your own images
      python caption.py --data synth --pair A.png B.png --explain OUT.png   ... and show where the models looked
      python caption.py --data clevr                  the paper's run; torchrun works as for adapt.py
      python caption.py --data clevr --eval --checkpoint trained/pytorch_model.bin.clevr
                                                      the reference's released captioner on the test split
      python caption.py --data clevr --encoder_ckpt pretrained/pytorch_model.bin.clevr
                                                      stage 2 on the reference's released stage-1 weights

Shape letters: B pairs in a batch, M visual tokens per pair (100), E width (512), T caption tokens, V vocabulary.
"""
import dataclasses
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

import clip
import data
import explain
import metrics
import synth
from batches import batch_plan, epoch_batches, training_loader
from caches import FeatureItems, IntraTokens, feature_paths, image_reader, split_features
from check import contact_sheet
from checkpoints import (Stage1, check_resume, checkpoint_tokenizer, load_checkpoint, load_stage1, load_trained,
                         rng_state, seed_everything, split_fingerprint, start_or_resume,
                         vocabulary_hint, vocabulary_tensor)
from decoder import CaptionDecoder, DecoderConfig, ids_to_text
from encoder import FROZEN_IN_REFERENCE, PairEncoder, no_decay_names
from files import OutDirLock, check_out_dir, save_json
from flags import ConfigError, check_image_path, check_length, check_settings, flag, parse_config
from loop import Run, StepBoundary
from losses import caption_loss
from processes import keep_freed_memory, loader_workers, one_download_per_machine, setup
from progress import Progress
from release import release_decoder, release_stage
from stopping import check_finite_model, final_test_stopped, refuse_empty_splits, run_main

MODEL_KEYS = ("data", "max_words", "finetune_encoder", "use_no_change_pair", "train_word_embedding",
              "decoder_layers", "decoder_heads", "decoder_ffn")
# what --resume also refuses to change: what the training computes (its batch, schedule, rates, data order)
TRAINING_KEYS = ("epochs", "batch_size", "grad_accum", "lr", "clip_lr_scale", "weight_decay", "warmup", "beta2",
                 "eps", "grad_clip", "dropout", "max_len", "seed")
PROGRESS = ("step", "best_metric", "best_epoch", "bad_epochs", "history")  # what a checkpoint records of the loop
SEMANTIC = "semantic change"  # the papers' "SC" row: change pairs only, no distractors
ATTENTION_PAIRS = 4  # test pairs in test_attention.png, the first of the grid
TEST_OUTPUTS = ("test_predictions.json", "test_scores.json", "test_scores.txt", "test_grid.png", "test_attention.png")
SCORER = metrics.FastCaptionScorer  # speed variant (metrics.py): the plain CaptionScorer's numbers, faster (tested)


@dataclass
class Config:
    # data
    data: str = flag("clevr", "dataset preset: clevr, spot, ier, levir, pairs or synth")
    data_root: str = flag("", "the dataset's folder (\"\" = data/<dataset>, see data.py)")
    synth_pairs: int = flag(2000, "synth only: scenes drawn on first use (must match adapt.py's)")
    max_words: int = flag(32, "caption length in tokens, start and end tokens included")
    use_no_change_pair: bool = flag(True, "also train on (before, distractor) with a no-change caption (CLEVR-Change)")
    image_cache: bool = flag(False, "keep preprocessed 224x224 pixels in .npy files (skips PNG decoding)")
    num_workers: int = flag(-1, "DataLoader processes per training process that read the cached pair tokens, or the "
                                "images (uint8) with --finetune_encoder and when encoding pairs; 0: the training "
                                "process reads them between steps. -1 (auto): on a GPU every CPU this process may use "
                                "but one (shared by torchrun's processes on a machine), on the CPU 4")
    # model
    encoder_ckpt: str = flag("", 'stage 1: ours ("" = runs/adapt_<dataset>/ckpt_best.pt) or a CLIP4IDC release file')
    intra_layers: int = flag(9, "a release's vision blocks that see each image alone (not in its file; ours record it)")
    finetune_encoder: bool = flag(False, "train the pair encoder too, end to end (the reference's way)")
    decoder_layers: int = flag(3, "visual self-attention layers, and as many decoder layers")
    decoder_heads: int = flag(8, "attention heads of the decoder")
    decoder_ffn: int = flag(2048, "feed-forward width of the decoder")
    dropout: float = flag(0.1, "dropout on the decoder's hidden states and attention probabilities")
    train_word_embedding: bool = flag(False, "the word embedding (tied to CLIP's) trains at lr x clip_lr_scale; else "
                                             "frozen")
    # optimisation
    epochs: int = flag(50, "at most this many passes over the training pairs")
    patience: int = flag(10, "stop after this many epochs more without a better validation CIDEr-D")
    batch_size: int = flag(16, "global batch of pairs: per-process batch x processes x grad_accum")
    grad_accum: int = flag(1, "micro-batches per optimizer step: the global batch runs in this many pieces, one after "
                              "another, when it does not fit in memory; the step averages their gradients (the same "
                              "step as one batch but for how the caption tokens fall into the pieces, and dropout)")
    lr: float = flag(1e-4, "learning rate of the decoder")
    clip_lr_scale: float = flag(1e-3, "the encoder (when finetuned) and the word embedding train at lr x clip_lr_scale")
    weight_decay: float = flag(0.01, "decoupled weight decay (not on biases and norms)")
    warmup: float = flag(0.1, "fraction of the steps spent warming up, then linear decay")
    beta2: float = flag(0.999, "AdamW's second-moment decay (beta1 is 0.9)")
    eps: float = flag(1e-6, "AdamW's epsilon")
    grad_clip: float = flag(1.0, "global gradient-norm clipping")
    max_len: int = flag(32, "greedy decoding writes at most this many tokens (the reference: always 32)")
    # run
    seed: int = flag(2021, "random seed (each process adds its rank)")
    device: str = flag("auto", "where to train: auto (cuda when torch sees a GPU, else cpu), cpu or cuda; under "
                               "torchrun each process takes the GPU of its LOCAL_RANK. Choose GPUs with "
                               "CUDA_VISIBLE_DEVICES")
    dtype: str = flag("auto", "precision of the products: auto is bfloat16 autocast on a GPU that computes it natively "
                              "(compute capability >= 8.0: A100, H100), float16 autocast with a loss scaler on an "
                              "older one (V100, T4), float32 on the CPU and when a release decodes; or float32, "
                              "bfloat16, float16. The weights stay float32")
    tf32: bool = flag(True, "float32 on a GPU (--dtype float32): matrix products and convolutions in TensorFloat-32 on "
                            "A100/H100, about 8x IEEE float32's rate; --no-tf32 for IEEE float32, to compare a run "
                            "with the CPU's numbers")
    out_dir: str = flag("", 'checkpoints, features, predictions and scores ("" = runs/caption_<dataset>)')
    log_every: int = flag(50, "optimizer steps between progress lines; the check that the loss and gradient norm are "
                              "finite runs then too (and before every save), not every step: reading a number from a "
                              "GPU waits for it, so a diverged run stops at most this many steps late")
    save_every: int = flag(500, "optimizer steps between ckpt_last.pt saves (and at every epoch end)")
    eval_batch_size: int = flag(64, "pairs per batch when encoding and decoding")
    resume: bool = flag(False, "continue from out_dir/ckpt_last.pt")
    eval: bool = flag(False, "decode and score the test split with --checkpoint, then exit")
    pair: tuple[str, str] = flag((), "BEFORE AFTER: caption these two images with --checkpoint, then exit")
    checkpoint: str = flag("", '--eval, --pair: ours ("" = out_dir/ckpt_best.pt) or a release, '
                               'trained/pytorch_model.bin.*')
    explain: str = flag("", "with --pair: also write this PNG of where the encoder and the decoder attend")

    def __post_init__(self):  # a bad value fails here, before any data is read
        check_settings(self, positive=("max_words", "intra_layers", "decoder_layers", "decoder_heads",
                                       "decoder_ffn", "epochs", "batch_size", "grad_accum", "lr", "max_len",
                                       "log_every", "save_every", "eval_batch_size"),
                       non_negative=("patience", "clip_lr_scale", "weight_decay", "grad_clip", "dropout"),
                       fraction=("warmup",))
        if self.num_workers < -1:
            raise ConfigError(f"--num_workers {self.num_workers}: it must be >= 0, or -1 for auto")
        # at least one word before the end token; the upper bounds are the decoder's positions (load_stage1)
        check_length("max_words", self.max_words, 2, clip.CLIPConfig.context_length,
                     "a word and the end token; CLIP's text positions, which the decoder uses, hold 77")
        if self.explain:  # its format is checked now, not found unwritable after the work
            check_image_path("explain", self.explain)
        for image in self.pair:
            if "://" in image:
                raise ConfigError(f"--pair {image}: a URL; --pair reads image files on this machine: download it "
                                  f"first (curl -L -o before.png URL), then pass the file")
        if self.resume and self.checkpoint:
            raise ConfigError(f"--checkpoint {self.checkpoint} with --resume: --resume continues out_dir/ckpt_last.pt "
                              f"(pass that run's --out_dir); --checkpoint is for --eval and --pair")


# Dataset presets (the reference's scripts/caption_clevr.sh and caption_spot.sh). Spot-the-Diff, IER and your own
# pairs have no distractor images, and on Spot-the-Diff the reference trains the tied word embedding (at
# lr x clip_lr_scale, its main_task_caption.py `main`); CLEVR freezes it.
# synth: a decoder of width 128 trained end to end with the inter-image blocks, as the reference (CLIP, the
# joint parameters and the word embedding at lr x 0.5 = 5e-4, the decoder at 1e-3; the intra-image blocks stay
# frozen as in stage 1), 5,600 pairs, 4 epochs = 700 steps, no dropout, which learnt faster in our runs. The
# scale is the best validation CIDEr-D of 0.1, 0.3, 0.5 and 0.7; at 1 the inter-image blocks lost what stage 1
# taught them. The decoder alone on cached features: test CIDEr-D 1.64 (README, "The synthetic run").
PRESETS = {
    "clevr": dict(epochs=50, batch_size=16, lr=1e-4, use_no_change_pair=True, train_word_embedding=False),
    "spot": dict(epochs=50, batch_size=16, lr=1e-4, use_no_change_pair=False, train_word_embedding=True),
    "ier": dict(epochs=50, batch_size=16, lr=1e-4, use_no_change_pair=False, train_word_embedding=True),
    # LEVIR-CC, no reference run: Spot-the-Diff's (real photographs, no distractor images); its unchanged pairs are
    # ordinary training pairs with their own captions, as its papers train them (RECIPES.md, "LEVIR-CC")
    "levir": dict(epochs=50, batch_size=16, lr=1e-4, use_no_change_pair=False, train_word_embedding=True),
    "pairs": dict(epochs=50, batch_size=16, lr=1e-4, use_no_change_pair=False, train_word_embedding=True),
    "synth": dict(synth_pairs=6000, finetune_encoder=True, epochs=4, patience=4, batch_size=32, lr=1e-3, max_len=22,
                  clip_lr_scale=0.5, train_word_embedding=True, decoder_heads=4, decoder_ffn=512, dropout=0.0,
                  num_workers=0, image_cache=True, log_every=10, eval_batch_size=128),
}


# -----------------------------------------------------------------------------
# The stage-1 encoder and the captioner


class Captioner(nn.Module):
    """What stage 2 trains: the caption decoder, and the pair encoder when it is finetuned.

    The decoder's word embedding (also its output weight) and position embedding are CLIP's token and text
    position embeddings: the same Parameters when the encoder is finetuned, copies of them otherwise.
    forward(batch) returns the loss, so that under DDP everything that needs gradients runs inside it.
    """

    def __init__(self, decoder: CaptionDecoder, encoder: PairEncoder | None, pad_id: int):
        super().__init__()
        self.encoder = encoder  # registered first, so the tied embeddings are named (and grouped) as CLIP's
        self.decoder = decoder
        self.pad_id = pad_id

    def forward(self, batch: dict) -> torch.Tensor:
        B = batch["caption_in"].shape[0]
        both = "no_change_caption_in" in batch  # CLEVR: also the distractor pair with a no-change caption
        if self.encoder is None:  # cached pair tokens
            visual = torch.cat([batch["visual"], batch["no_change_visual"]]) if both else batch["visual"]
        else:  # encode now, the change pairs and the distractor pairs in one batch
            before = torch.cat([batch["before"], batch["before"]]) if both else batch["before"]
            after = torch.cat([batch["after"], batch["distractor"]]) if both else batch["after"]
            visual = self.encoder.encode_pair(before, after)["pair_tokens"]  # (kB, M, E), pixels or intra tokens
        names = ("caption", "no_change_caption") if both else ("caption",)
        # the captions come cut to the batch's longest one (data.collate_captions)
        caption_in = torch.cat([batch[f"{n}_in"] for n in names])  # (kB, T)
        states = self.decoder.caption_states(visual, caption_in, caption_in == self.pad_id)  # (kB, T, E)
        losses = []  # the change loss and the no-change loss, each a mean over its own tokens, summed (as the reference)
        for k, name in enumerate(names):
            targets = batch[f"{name}_targets"]  # (n,): where the targets are not padding, found by the collate
            chosen = states[k * B:(k + 1) * B].flatten(0, 1).index_select(0, targets)  # (n, E)
            # the output layer runs only where the loss looks
            losses.append(caption_loss(self.decoder.to_logits(chosen),
                                       batch[f"{name}_out"].flatten().index_select(0, targets), self.pad_id))
        return sum(losses)


def build_captioner(config: Config, encoder: PairEncoder, clip_config: dict, freeze_intra: bool = False) -> Captioner:
    """The decoder sized from CLIP (width E, vocabulary, positions), tied to CLIP's embeddings.

    freeze_intra: stage 1 froze the intra-image blocks (adapt.py --freeze_intra); finetuning keeps them frozen.
    """
    token_embedding, positions = encoder.clip.token_embedding.weight, encoder.clip.positional_embedding
    width, embed = token_embedding.shape[1], clip_config["embed_dim"]
    if width != embed:
        raise ConfigError(f"the decoder ties its word embedding to CLIP's token embedding of width {width}, "
                          f"so the pair tokens must have that width too, but CLIP's joint width is {embed}")
    decoder_config = DecoderConfig(hidden=embed, heads=config.decoder_heads, ffn=config.decoder_ffn,
                                   layers=config.decoder_layers, dropout=config.dropout,
                                   attention_dropout=config.dropout, vocab_size=token_embedding.shape[0],
                                   max_positions=positions.shape[0], visual_tokens=2 * (encoder.n_patches + 1))
    if config.finetune_encoder:
        # the very Parameters of CLIP (the reference's modules/modeling.py passes them to its decoder): they train
        # or stay frozen with CLIP's settings
        decoder = CaptionDecoder(decoder_config, token_embedding, positions)
        frozen = [p for p in FROZEN_IN_REFERENCE if not (p == "token_embedding" and config.train_word_embedding)]
        if freeze_intra:  # stage 1's frozen set (the reference's main_task_caption.py, `main`, freezes as stage 1)
            # differs from reference: frozen outright, as adapt.py --freeze_intra (the reference: lr 1e-7)
            frozen += encoder.intra_image_parts()
        # the text tower has no use in stage 2 (the reference runs it on a dummy caption and drops the output)
        encoder.freeze(tuple(frozen) + ("transformer", "ln_final", "text_projection", "logit_scale"))
        return Captioner(decoder, encoder, clip.PAD_ID)
    # differs from reference: the encoder is not part of the model; the embeddings are copies of CLIP's
    decoder = CaptionDecoder(decoder_config, nn.Parameter(token_embedding.detach().clone()),
                             nn.Parameter(positions.detach().clone(), requires_grad=False))
    decoder.word_embedding.requires_grad_(config.train_word_embedding)
    return Captioner(decoder, None, clip.PAD_ID)


def build_optimizer(captioner: Captioner, config: Config) -> torch.optim.AdamW:
    """The decoder at lr; the encoder and the word embedding (CLIP's) at lr x clip_lr_scale (the reference's
    main_task_caption.py, `prep_optimizer`).

    No weight decay on biases and LayerNorms (encoder.no_decay_names). named_parameters lists a tied Parameter
    once, under its first name: when finetuning, CLIP's (encoder.clip.token_embedding.weight), as in the reference.
    """
    no_decay = no_decay_names(captioner)
    groups = {}
    for name, p in captioner.named_parameters():
        if not p.requires_grad:
            continue
        role = "clip" if name.startswith("encoder.") or name == "decoder.word_embedding" else "decoder"
        groups.setdefault((role, name not in no_decay), []).append(p)
    scales = {"clip": config.clip_lr_scale, "decoder": 1.0}
    return torch.optim.AdamW([{"params": params, "lr": config.lr * scales[role], "lr_scale": scales[role],
                               "weight_decay": config.weight_decay if decay else 0.0}
                              for (role, decay), params in groups.items()],
                             betas=(0.9, config.beta2), eps=config.eps, fused=True)


def get_lr(step: int, total_steps: int, config: Config) -> float:
    """The reference's warmup_linear (BertAdam): x/w during warmup, then (1 - x)/(1 - w), x = step/total."""
    x = step / max(1, total_steps)
    if x < config.warmup:
        return config.lr * x / config.warmup
    return config.lr * max(0.0, (x - 1) / (config.warmup - 1))


def train_step(model, optimizer, scaler, micro_batches, ctx, config: Config,
               ddp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum micro-batches; returns the mean loss and the gradient norm before
    clipping (tensors, not synced)."""
    total = 0.0
    for i, batch in enumerate(micro_batches):
        # under DDP, the gradients are all-reduced only in the last micro-batch's backward
        with model.no_sync() if ddp and i < len(micro_batches) - 1 else nullcontext():
            with ctx:
                loss = model(batch) / len(micro_batches)
            scaler.scale(loss).backward()  # float16: the loss times the scale, so that small gradients do not underflow
        total = total + loss.detach()
    scaler.unscale_(optimizer)  # first: the norm is clipped on the true gradients, not on the scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    scaler.step(optimizer)  # float16: skipped when a gradient is inf or NaN, and update() then halves the scale
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


# -----------------------------------------------------------------------------
# The run: main, then job (stage 1, the tokenizer, the captioner; --pair, --eval or training), then train (the
# loop)


def main(argv=None):
    config = parse_config(Config, PRESETS, argv, description=__doc__.split("\n")[0])
    if config.explain and not config.pair:
        raise ConfigError("--explain writes the attention maps of one pair: use it with --pair BEFORE AFTER "
                          "(--eval writes test_attention.png by itself)")
    keep_freed_memory()  # the steps reuse freed memory instead of page-faulting on fresh pages
    out_dir = Path(config.out_dir or f"runs/caption_{config.data}")
    if config.pair:  # writes nothing there, and reads ckpt_best.pt, which a run there replaces atomically
        return job(config, out_dir)
    check_out_dir(out_dir)  # a file there is refused before any work
    # one run at a time writes there (under torchrun its master holds the lock): a second is refused at once
    with OutDirLock(out_dir, master=int(os.environ.get("RANK", 0)) == 0):
        job(config, out_dir)


def job(config: Config, out_dir: Path) -> None:
    """--pair, --eval or training, once the command line is read: the processes, stage 1, the captioner."""
    best = best_path = None
    if config.eval or config.pair:  # the trained captioner decides the model settings and holds stage 1's
        best_path = Path(config.checkpoint or out_dir / "ckpt_best.pt")
        settings, best = load_trained(best_path, MODEL_KEYS)
        config = dataclasses.replace(config, **settings)
    release = best is not None and release_stage(best) == 2
    if release and config.dtype == "auto":  # the reference decodes in float32 (its CLIP in fp16): bf16 autocast
        # or TF32 on a GPU would flip its near-ties (BENCHMARKS.md section 12): IEEE float32
        config = dataclasses.replace(config, dtype="float32", tf32=False)
    dist_, dtype, ctx, scaler = setup(config)  # DDP from torchrun's environment, autocast, GradScaler
    config = dataclasses.replace(config, num_workers=loader_workers(config.num_workers, dist_.device))
    seed_everything(config.seed + dist_.rank)
    root = data.dataset_root(config.data, config.data_root or None)
    if config.data == "synth" and not config.pair:  # drawn first: the tokenizer reads its vocabulary file
        if dist_.master:
            synth.ensure_synth(root, synth.SynthConfig(pairs=config.synth_pairs))
        if dist_.ddp:
            dist.barrier()
    stage1 = load_stage1(config.encoder_ckpt, config.data, config.intra_layers,
                         None if best is None or release else best, best_path)
    positions = stage1.encoder.clip.positional_embedding.shape[0]  # the decoder's, tied to CLIP's
    for name in ("max_words", "max_len"):
        check_length(name, getattr(config, name), 2 if name == "max_words" else 1, positions,
                     f"the decoder has {positions} positions, CLIP's")
    # --pair reads no data: the vocabulary is the one the checkpoint keeps (else the dataset's, else OpenAI's)
    with one_download_per_machine(dist_):  # CLIP's vocabulary, downloaded on first use
        tokenizer = (checkpoint_tokenizer(stage1.state, data.bpe_path(config.data, root)) if config.pair
                     else clip.get_tokenizer(data.bpe_path(config.data, root)))
    if tokenizer.vocab_size != stage1.encoder.clip.config.vocab_size:
        raise ConfigError(f"the tokenizer of {config.data} has {tokenizer.vocab_size} tokens but the stage-1 "
                          f"model {stage1.path} has {stage1.encoder.clip.config.vocab_size}: it was trained "
                          f"on another dataset" + vocabulary_hint(tokenizer))
    if release:  # the reference's decoder, sized from its tensors and loaded strictly
        captioner = Captioner(release_decoder(best, 2 * (stage1.encoder.n_patches + 1)), None, clip.PAD_ID)
    else:
        captioner = build_captioner(config, stage1.encoder, stage1.state["clip_config"], stage1.freeze_intra)
        if best is not None:
            captioner.load_state_dict(best["model"])
    captioner.to(dist_.device)
    stage1.encoder.to(dist_.device)
    run = Run(config, dist_, dtype, ctx, scaler, out_dir)
    if config.pair:
        caption_pair(config, stage1, captioner, tokenizer, dist_.device, ctx)
    elif config.eval:
        evaluate(run, root, stage1, captioner, tokenizer)
    else:
        train(run, root, stage1, captioner, tokenizer)
    if dist_.ddp:
        dist.barrier()  # every process done before any tears the group down (a gloo peer may abort otherwise)
        destroy_process_group()


def train(run: Run, root: Path, stage1: Stage1, captioner: Captioner, tokenizer) -> None:
    """Train the captioner: validation CIDEr-D after every epoch, with patience; then the best epoch on the test split."""
    config, dist_, device, master = run.config, run.dist_, run.dist_.device, run.dist_.master
    say = print if master else (lambda *a, **k: None)
    if config.resume:  # what it resumes on, before any work
        check_resume(run.out_dir, stage1)
    splits, images, eval_pairs = read_splits(config, dist_, root, stage1.encoder.clip.visual.input_resolution)
    refuse_empty_splits(splits, data.SPLITS, config)
    feature_path = feature_paths(stage1, eval_pairs, images, () if config.finetune_encoder else data.SPLITS,
                                 run.out_dir, dist_, run.ctx, batch_size=config.eval_batch_size,
                                 num_workers=config.num_workers)
    train_set = training_set(run, stage1, splits["train"], images, tokenizer, feature_path, say)
    optimizer = build_optimizer(captioner, config)
    train_split = split_fingerprint(splits["train"])  # what a resumed run checks it trains on
    state = resume(run, stage1, captioner, optimizer, train_split)
    step, best_cider, best_epoch, bad_epochs, history = (state[k] for k in PROGRESS)
    model = DDP(captioner, device_ids=[dist_.local_rank] if device.type == "cuda" else None,
                gradient_as_bucket_view=True) if dist_.ddp else captioner  # gradients in the all-reduce buckets
    micro, sampler, steps_per_epoch = batch_plan(train_set, config.batch_size, config.grad_accum, dist_,
                                                 config.seed, what="training pairs")
    total_steps = config.epochs * steps_per_epoch
    if master:
        save_json(dataclasses.asdict(config), run.out_dir / "config.json")
        say(json.dumps(dataclasses.asdict(config)))
        say(describe(run, len(train_set), micro, steps_per_epoch, captioner))

    def state(path):  # the checkpoint at the step the loop has reached
        return checkpoint(captioner, optimizer, run, stage1, tokenizer, stage1_weights=path.name == "ckpt_best.pt",
                          step=step, best_metric=best_cider, best_epoch=best_epoch, bad_epochs=bad_epochs,
                          history=history, train_split=train_split)

    loader = training_loader(train_set, sampler, micro, config.num_workers, device, data.collate_captions)
    # Ctrl-C and SIGTERM end the step in progress, save ckpt_last.pt at that step and stop (StepBoundary)
    with StepBoundary(run, steps_per_epoch, total_steps, step, state) as boundary:
        model.train()
        while step < total_steps and bad_epochs <= config.patience:
            epoch = step // steps_per_epoch
            done_in_epoch = step - epoch * steps_per_epoch  # > 0 when resuming part-way through an epoch
            batches = epoch_batches(loader, epoch, done_in_epoch, config.grad_accum)  # the sampler's epoch
            for _ in range(done_in_epoch, steps_per_epoch):
                lr = get_lr(step, total_steps, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                try:
                    micro_batches = [data.to_device(next(batches), device) for _ in range(config.grad_accum)]
                except data.DataError as error:  # a damaged image: ckpt_last.pt at the last step, then one line
                    raise boundary.damaged(error, step) from None
                loss, grad_norm = train_step(model, optimizer, run.scaler, micro_batches, run.ctx, config, dist_.ddp)
                step += 1
                if boundary.after_step(step, lr, loss, grad_norm):  # the master's log steps: .item() waits, here only
                    value = loss.item()
                    say(boundary.line(step, epoch=f"{epoch + 1}/{config.epochs}", loss=value,
                                      lr=get_lr(step, total_steps, config)), flush=True)
                    boundary.log.write(step=step, epoch=epoch, loss=value, lr=get_lr(step, total_steps, config))
                boundary.save_or_stop()  # ckpt_last.pt every save_every steps; for Ctrl-C or SIGTERM, then stops
            boundary.end_epoch()  # the finiteness check of the epoch's last steps
            if master:  # end of epoch: validation CIDEr-D, decoded by the master alone while the others wait
                check_finite_model(captioner, step, lr)  # a non-finite model is never scored nor saved
                cider, predictions = validate(run, captioner, feature_path, eval_pairs["val"], images, tokenizer)
                improved = cider >= best_cider  # a tie keeps the later epoch, as the reference
                best_cider, best_epoch = (cider, epoch) if improved else (best_cider, best_epoch)
                bad_epochs = 0 if improved else bad_epochs + 1
                history.append({"epoch": epoch, "step": step, "val_CIDEr": cider})
                boundary.log.write(step=step, epoch=epoch, split="val", CIDEr=cider)
                best_file = [run.out_dir / "ckpt_best.pt"] if improved else []  # saved first: no line printed
                boundary.save(*best_file, run.out_dir / "ckpt_last.pt")  # can lose a checkpoint (the writer's thread)
                example = eval_pairs["val"][0].id
                say(f"epoch {epoch + 1} validation CIDEr-D {cider:.4f}" + (" (best so far)" if improved else "")
                    + f"; {example}: {predictions[example]!r}")
            bad_epochs = from_master(bad_epochs, dist_)  # everyone follows the master's patience
            boundary.stop_if_signalled()  # Ctrl-C or SIGTERM in any process; under DDP also the epoch's barrier
    if bad_epochs > config.patience:
        say(f"stopped early: {bad_epochs} epochs without a better validation CIDEr-D")
    test(run, stage1, captioner, tokenizer, (splits, images, eval_pairs), feature_path)


# -----------------------------------------------------------------------------
# How an epoch is scored: each validation pair's greedy token ids, then their text, then CIDEr-D


@torch.no_grad()
def validate(run: Run, captioner: Captioner, feature_path: dict, pairs, images,
             tokenizer) -> tuple[float, dict]:
    """Validation CIDEr-D, the metric that picks the best epoch, and the captions it scored."""
    config, device, ctx = run.config, run.dist_.device, run.ctx
    features = split_features(captioner, feature_path, "val", pairs, images, device, ctx,
                              batch_size=config.eval_batch_size, num_workers=config.num_workers)
    predictions = predict(captioner.decoder, features, pairs, tokenizer, config, device, ctx)
    cider = metrics.score_captions(predictions, data.references(pairs), metrics=("CIDEr",),
                                   scorer=SCORER)["corpus"]["CIDEr"]
    return cider, predictions


@torch.no_grad()
def predict(decoder: CaptionDecoder, features: np.ndarray, pairs, tokenizer, config: Config, device, ctx,
            what: str = "") -> dict[str, str]:
    """{evaluation id: greedy caption} for pairs, whose tokens are the rows of features (rows, M, E)."""
    was_training = decoder.training
    decoder.eval()
    predictions, batches = {}, math.ceil(len(pairs) / config.eval_batch_size)
    progress = Progress(batches)
    for b, start in enumerate(range(0, len(pairs), config.eval_batch_size), 1):
        visual = torch.from_numpy(np.asarray(features[start:start + config.eval_batch_size], dtype=np.float32))
        with ctx:
            ids = decoder.greedy_decode(visual.to(device), tokenizer.sot_id, tokenizer.eot_id, config.max_len)
        for pair, row in zip(pairs[start:start + config.eval_batch_size], ids.tolist()):
            predictions[pair.id] = ids_to_text(row, tokenizer.decode, tokenizer.eot_id)
        if what and (b % 20 == 0 or b == batches):
            print(f"decoding {what}: " + progress.line(b), flush=True)
    decoder.train(was_training)
    return predictions


# -----------------------------------------------------------------------------
# What the jobs and the loop call: caption one pair, evaluate the test split, the training set, checkpoints


def caption_pair(config: Config, stage1: Stage1, captioner: Captioner, tokenizer, device, ctx) -> None:
    """Print the caption of the user's pair (--pair BEFORE AFTER); with --explain, write its attention maps."""
    images = data.ImageReader(stage1.encoder.clip.visual.input_resolution)
    for path in map(Path, config.pair):
        if not path.is_file():
            raise FileNotFoundError(f"--pair: image {path} is {data.absence(path)}")
    before, after = (clip.normalize(images(Path(p)).unsqueeze(0).to(device)) for p in config.pair)  # (1, 3, R, R) each
    with torch.no_grad(), ctx:
        visual = stage1.encoder.eval().encode_pair(before, after)["pair_tokens"]  # (1, M, E)
    pair = data.ImagePair(" -> ".join(Path(p).name for p in config.pair), *map(Path, config.pair), captions=[])
    print(predict(captioner.decoder, visual.float().cpu().numpy(), [pair], tokenizer, config, device, ctx)[pair.id])
    if config.explain:
        explain.explain_pairs(stage1.encoder, captioner.decoder, [pair], images, tokenizer, config.max_len,
                              Path(config.explain), device, ctx)
        print(f"attention maps: {config.explain}")


def evaluate(run: Run, root: Path, stage1: Stage1, captioner: Captioner, tokenizer, read=None,
             feature_path=None) -> None:
    """Decode and score the test split (evaluate_test): --eval, and the end of training (which passes what it
    has read already: read_splits's result and the feature files). The master alone: under torchrun the other
    processes wait for it."""
    if not run.dist_.master:
        return
    run = dataclasses.replace(run, dist_=dataclasses.replace(run.dist_, ddp=False))  # it waits for no other process
    config, dist_, ctx = run.config, run.dist_, run.ctx
    splits, images, eval_pairs = read or read_splits(config, dist_, root, stage1.encoder.clip.visual.input_resolution)
    refuse_empty_splits(splits, ("test",), config)
    if feature_path is None:
        cached = () if config.finetune_encoder else ("test",)
        feature_path = feature_paths(stage1, eval_pairs, images, cached, run.out_dir, dist_, ctx,
                                     batch_size=config.eval_batch_size, num_workers=config.num_workers)
    features = split_features(captioner, feature_path, "test", eval_pairs["test"], images, dist_.device, ctx,
                              batch_size=config.eval_batch_size, num_workers=config.num_workers)
    field = data.SOURCES[config.data].field_scoring  # LEVIR-CC: also as its papers score, with their vocabulary
    vocabulary = metrics.field_vocabulary(c for s in data.SPLITS for p in splits[s] for c in p.captions) if field \
        else None
    evaluate_test(run, stage1.encoder, captioner.decoder, features, eval_pairs["test"], splits["test"], images,
                  tokenizer, vocabulary)


def training_set(run: Run, stage1: Stage1, pairs, images, tokenizer, feature_path: dict, say) -> Dataset:
    """The training items: pixels (finetuning), intra-image tokens computed once (finetuning on frozen intra-image
    blocks), or cached pair tokens (the decoder alone)."""
    config = run.config
    train_images = images if config.finetune_encoder else None
    if config.finetune_encoder and stage1.freeze_intra:  # training reads each image's intra tokens, computed now
        started = time.time()
        train_images = IntraTokens(stage1.encoder, pairs, images, config.eval_batch_size, run.dist_.device,
                                   run.ctx, images.cache_dir or run.out_dir, run.dist_)
        say(f"intra-image tokens of {len(train_images.row)} training images {train_images.origin} "
            f"({time.time() - started:.0f} s): the intra-image blocks stay frozen, as in stage 1")
    items = data.CaptionItems(pairs, tokenizer, config.use_no_change_pair, images=train_images,
                              max_words=config.max_words)
    return items if config.finetune_encoder else FeatureItems(items, feature_path["train"])


def describe(run: Run, samples: int, micro: int, steps_per_epoch: int, captioner: Captioner) -> str:
    """The run in one line: what it trains, on how much, with which batch, where."""
    config, dist_ = run.config, run.dist_
    trainable = sum(p.numel() for p in captioner.parameters() if p.requires_grad)
    return (f"{samples} training pairs; global batch {config.batch_size} = {micro} x {dist_.world_size} processes "
            f"x {config.grad_accum} accumulation; {steps_per_epoch} steps per epoch, at most "
            f"{config.epochs * steps_per_epoch}; "
            f"{'finetuning the encoder' if config.finetune_encoder else 'cached encoder features'}; "
            f"{run.dtype} on {dist_.device}; {trainable / 1e6:.1f}M trainable parameters")


def checkpoint(captioner: Captioner, optimizer, run: Run, stage1: Stage1, tokenizer,
               stage1_weights: bool = False, **progress) -> dict:
    """What ckpt_last.pt and ckpt_best.pt hold: enough to resume training, and to --eval and --pair without the
    flags or the stage-1 file: "stage1" holds its sizes, its configuration and its vocabulary, and (stage1_weights:
    ckpt_best.pt) its weights when the captioner does not hold them (the encoder not finetuned)."""
    record = {"clip_config": stage1.state["clip_config"], "encoder_config": dataclasses.asdict(stage1.encoder.config),
              "config": stage1.state.get("config", {}), "vocabulary": vocabulary_tensor(tokenizer.bpe_path)}
    if stage1_weights and not run.config.finetune_encoder:
        record["model"] = stage1.encoder.state_dict()
    return {"model": captioner.state_dict(), "optimizer": optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "config": dataclasses.asdict(run.config), "stage1": record,
            "encoder_ckpt": str(stage1.path.resolve()),  # where stage 1 was: a hint for older checkpoints' readers
            "encoder_sha256": stage1.sha256, "decoder_config": dataclasses.asdict(captioner.decoder.config),
            **progress, "rng": rng_state()}


def resume(run: Run, stage1: Stage1, captioner: Captioner, optimizer, train_split: dict) -> dict:
    """Where training starts: step 0, or with --resume where ckpt_last.pt stopped, after restoring the captioner,
    the optimizer, the scaler and the random generators from it (start_or_resume). A checkpoint trained on
    another stage-1 encoder is refused."""
    path = run.out_dir / "ckpt_last.pt"
    state = start_or_resume(path, run.config, MODEL_KEYS + TRAINING_KEYS, run.dist_, captioner, optimizer,
                            run.scaler, train_split)
    if state is None:
        return dict(zip(PROGRESS, (0, -1.0, -1, 0, [])))
    if state["encoder_sha256"] != stage1.sha256:
        raise ConfigError(f"{path} was trained on another stage-1 checkpoint than {stage1.path}")
    if run.dist_.master:
        print(f"resumed {path} at step {state['step']}")
    return state


def from_master(value: int, dist_) -> int:
    """The master's value, on every process of a torchrun (a broadcast); a process alone keeps its own."""
    if not dist_.ddp:
        return value
    flag = torch.tensor([value], device=dist_.device)
    dist.broadcast(flag, 0)
    return int(flag)


def test(run: Run, stage1: Stage1, captioner: Captioner, tokenizer, read: tuple, feature_path: dict) -> None:
    """The end of training: the test split decoded and scored once (evaluate), on the master, with the epoch
    chosen on validation (ckpt_best.pt); read and feature_path: what training has read already."""
    if not run.dist_.master:
        return
    best = load_checkpoint(run.out_dir / "ckpt_best.pt")
    captioner.load_state_dict(best["model"])
    print(f"test scores of the best epoch ({best['best_epoch'] + 1}, validation CIDEr-D {best['best_metric']:.4f}):")
    try:
        evaluate(run, None, stage1, captioner, tokenizer, read, feature_path)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM: training is done, only the scores are not
        raise final_test_stopped(interrupt, run.out_dir) from None


# -----------------------------------------------------------------------------
# What every job reads: the splits


def read_splits(config: Config, dist_, root: Path, resolution: int) -> tuple[dict, data.ImageReader, dict]:
    """The dataset's splits, the image reader (from the cache with --image_cache) and each split's evaluation
    pairs (with CLEVR-Change's distractor pairs, data.evaluation_pairs)."""
    splits = {s: data.load_split(config.data, s, root) for s in data.SPLITS}
    images = image_reader(splits, root, resolution, config.image_cache, dist_)
    return splits, images, {s: data.evaluation_pairs(splits[s], config.use_no_change_pair) for s in data.SPLITS}


# -----------------------------------------------------------------------------
# Scoring the test split: the score table


def score_table(predictions: dict[str, str], pairs) -> dict:
    """Scores of the whole split, of its semantic changes alone, and of each change type, each scored alone."""
    by_type = data.ids_by_type(pairs)
    subsets = {"total": [p.id for p in pairs]}
    if data.DISTRACTOR in by_type:
        subsets[SEMANTIC] = [p.id for p in pairs if p.change_type != data.DISTRACTOR]
    others = sorted(set(by_type) - {*data.CHANGE_TYPES, data.DISTRACTOR})  # a user's own types, after the known
    subsets.update({t: by_type[t] for t in (*data.CHANGE_TYPES, data.DISTRACTOR, *others)
                    if len(by_type.get(t, [])) > 1})
    started = time.perf_counter()
    results = metrics.score_subsets(predictions, data.references(pairs), subsets, scorer=SCORER)
    info = {**next(iter(results.values())).get("info", {}), "seconds": time.perf_counter() - started}
    return {"scores": {name: result["corpus"] for name, result in results.items()},
            "sizes": {name: len(ids) for name, ids in subsets.items()}, "info": info}


def format_table(table: dict) -> str:
    columns = ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr")
    label = {"material": "material (texture)", data.DISTRACTOR: "distractor (no change)"}
    lines = [f"{'':<26}{'pairs':>6} " + " ".join(f"{c:>8}" for c in columns)]
    for name, scores in table["scores"].items():
        lines.append(f"{label.get(name, name):<26}{table['sizes'][name]:>6} "
                     + " ".join(f"{scores[c]:8.4f}" for c in columns))
    info = table.get("info")
    if info:  # how it was scored: what a reader needs to compare these numbers with another toolkit's
        lines.append(f"({info.get('items')} captions against {info.get('references')} references; METEOR with "
                     f"{info.get('meteor_modules')}; scored in {info.get('seconds', 0.0):.1f} s)")
    return "\n".join(lines)


def evaluate_test(run: Run, encoder: PairEncoder, decoder: CaptionDecoder, features: np.ndarray, pairs,
                  test_pairs, images, tokenizer, vocabulary: dict | None = None) -> dict:
    """Decode the test split, write predictions (COCO results format), the score table, a grid PNG and the
    attention maps of the grid's first pairs; score localisation where the pairs have boxes (explain.py).

    pairs are the evaluation pairs (rows of features); test_pairs the split's pairs, for the grid. With the field's
    vocabulary (LEVIR-CC), the table is its papers' (whole test, change, no change, S*m), scored our way and theirs.
    """
    config, device, ctx, out_dir = run.config, run.dist_.device, run.ctx, run.out_dir
    predictions = predict(decoder, features, pairs, tokenizer, config, device, ctx, what="test")
    table = score_table(predictions, pairs)
    text = format_table(table)
    if vocabulary is not None:  # the papers' subsets: the whole split, its changed and its unchanged pairs
        by_type = data.ids_by_type(pairs)
        subsets = {"whole test": [p.id for p in pairs],
                   **{kind: by_type[kind] for kind in (data.CHANGED, data.UNCHANGED) if kind in by_type}}
        table["field"] = metrics.score_both_ways(predictions, data.references(pairs), subsets, vocabulary, SCORER)
        text = metrics.format_both_ways(table["field"])
    if {pair.change_type for pair in pairs} <= {*data.CHANGE_TYPES, data.DISTRACTOR}:  # CLEVR-Change's types (synth)
        table["kinds"] = metrics.change_kinds([{"image_id": i, "caption": c} for i, c in predictions.items()],
                                              test_pairs)
        text += "\n\nkind of change said, by keywords (metrics.said_kind): " + metrics.format_kinds(table["kinds"])
    # the change pairs are the first rows of features, in the order of test_pairs (data.evaluation_pairs)
    located = explain.localisation(encoder, decoder, test_pairs, features, images, tokenizer, config.max_len,
                                   config.eval_batch_size, device, ctx)
    if located is not None:
        table["localisation"] = located
        text += "\n\n" + explain.format_localisation(located)
    for name in TEST_OUTPUTS:  # replaced together: a stopped evaluation leaves no earlier one's files beside its own
        (out_dir / name).unlink(missing_ok=True)
    save_json([{"image_id": i, "caption": c} for i, c in predictions.items()],
              out_dir / "test_predictions.json")
    save_json(table, out_dir / "test_scores.json")
    (out_dir / "test_scores.txt").write_text(text + "\n")
    print(text)
    step = max(1, len(test_pairs) // 12)
    shown = test_pairs[::step][:12]
    grid = contact_sheet(shown, out_dir / "test_grid.png", model_view=True, captions=1, predictions=predictions)
    rows = list(range(0, len(test_pairs), step))[:ATTENTION_PAIRS]  # the grid's first pairs
    attention = out_dir / "test_attention.png"
    explain.explain_pairs(encoder, decoder, [test_pairs[i] for i in rows], images, tokenizer, config.max_len,
                          attention, device, ctx, torch.from_numpy(np.asarray(features[rows], np.float32)).to(device))
    print(f"predictions {out_dir / 'test_predictions.json'}, scores {out_dir / 'test_scores.json'}, grid {grid}, "
          f"attention maps {attention}")
    return table


if __name__ == "__main__":
    run_main(main, "caption.py")
