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
the kind of change each caption says, by keywords (metrics.change_kinds); plus a grid PNG of test pairs with their
predicted and reference captions. Where the data knows where the changed object is (the synthetic set;
CLEVR-Change with RCC's boxes file), it also scores localisation, a pointing game on the encoder's and the
decoder's attention (explain.py), and writes test_attention.png: the attention maps of the first pairs of the grid.

The file reads top-down: the Config and presets; the captioner (the decoder on the stage-1 encoder, the optimizer
and one training step); the run: main, job (stage 1's encoder handed over, the tokenizer, the captioner; then
--pair, --eval or training), train (the loop) and what it trains on; then how an epoch is scored (validate:
the pairs' tokens, greedy ids, their text, CIDEr-D) and how the test split is (evaluate_test, the score table).
After the lesson: captioning one pair, checkpoints, resuming, and the reference's released decoder. What keeps a
run safe and fast (the processes, the step boundary, the caches) is plumbing/'s: every call to it says
`plumbing.`, and can be skipped on a first reading.

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

Shape letters: B pairs in a batch, M visual tokens per pair (100), E width (512), T caption tokens, V vocabulary,
R image side (224), P pairs of a split.
"""
import dataclasses
import functools
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import data
import explain
import metrics
import plumbing
import results
from decoder import CaptionDecoder, DecoderConfig, ids_to_text
from encoder import FROZEN_IN_REFERENCE, PairEncoder, from_checkpoint, no_decay_names
from losses import caption_loss
from plumbing import ConfigError, flag

MODEL_KEYS = ("data", "max_words", "finetune_encoder", "use_no_change_pair", "train_word_embedding",
              "decoder_layers", "decoder_heads", "decoder_ffn")
# what --resume also refuses to change: what the training computes (its batch, schedule, rates, data order)
TRAINING_KEYS = ("epochs", "batch_size", "grad_accum", "lr", "clip_lr_scale", "weight_decay", "warmup", "beta2",
                 "eps", "grad_clip", "dropout", "max_len", "seed")
PROGRESS = ("step", "best_metric", "best_epoch", "bad_epochs", "history")  # what a checkpoint records of the loop
SEMANTIC = "semantic change"  # the papers' "SC" row: change pairs only, no distractors
ATTENTION_PAIRS = 4  # test pairs in test_attention.png, the first of the grid
TEST_OUTPUTS = ("test_predictions.json", "test_scores.json", "test_scores.txt", "test_grid.png", "test_attention.png",
                "results.html")
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
    cuda_graphs: bool = flag(False, "capture the whole training step as one CUDA graph and replay it (captions padded "
                                    "to max_words): one GPU, bf16 or float32 (plumbing/capture.py). Not yet run on a "
                                    "GPU")
    out_dir: str = flag("", 'checkpoints, features, predictions and scores ("" = runs/caption_<dataset>)')
    log_every: int = flag(50, "optimizer steps between progress lines; the check that the loss and gradient norm are "
                              "finite runs then too (and before every save), not every step: reading a number from a "
                              "GPU waits for it, so a diverged run stops at most this many steps late")
    save_every: int = flag(500, "optimizer steps between ckpt_last.pt saves (and at every epoch end)")
    eval_batch_size: int = flag(64, "pairs per batch when encoding and decoding")
    resume: bool | str = flag(False, "continue from out_dir/ckpt_last.pt; --resume auto: continue it when it is there, "
                                     "else start afresh (one command for a job's first start and its requeue)",
                              also=("auto",))
    eval: bool = flag(False, "decode and score the test split with --checkpoint, then exit")
    pair: tuple[str, str] = flag((), "BEFORE AFTER: caption these two images with --checkpoint, then exit")
    checkpoint: str = flag("", '--eval, --pair: ours ("" = out_dir/ckpt_best.pt) or a release, '
                               'trained/pytorch_model.bin.*')
    explain: str = flag("", "with --pair: also write this PNG of where the encoder and the decoder attend")

    def __post_init__(self):  # a bad value fails here, before any data is read
        plumbing.check_settings(self, positive=("max_words", "intra_layers", "decoder_layers", "decoder_heads",
                                       "decoder_ffn", "epochs", "batch_size", "grad_accum", "lr", "max_len",
                                       "log_every", "save_every", "eval_batch_size"),
                                non_negative=("patience", "clip_lr_scale", "weight_decay", "grad_clip", "dropout"),
                                fraction=("warmup",))
        if self.num_workers < -1:
            raise ConfigError(f"--num_workers {self.num_workers}: it must be >= 0, or -1 for auto")
        # at least one word before the end token; the upper bounds are the decoder's positions (load_stage1)
        plumbing.check_length("max_words", self.max_words, 2, DecoderConfig.max_positions,
                              "a word and the end token; CLIP's text positions, which the decoder uses, hold 77")
        if self.explain:  # its format is checked now, not found unwritable after the work
            plumbing.check_image_path("explain", self.explain)
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
# The captioner: the caption decoder on the stage-1 encoder


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
        losses = []  # the change and the no-change loss, each a mean over its own tokens, summed (as the reference)
        for k, name in enumerate(names):
            targets = batch[f"{name}_targets"]  # (n,): where the targets are not padding, found by the collate
            chosen = states[k * B:(k + 1) * B].flatten(0, 1).index_select(0, targets)  # (n, E)
            # the output layer runs only where the loss looks
            losses.append(caption_loss(self.decoder.to_logits(chosen),
                                       batch[f"{name}_out"].flatten().index_select(0, targets), self.pad_id))
        return sum(losses)


def build_captioner(config: Config, encoder: PairEncoder, clip_config: dict, pad_id: int,
                    freeze_intra: bool = False) -> Captioner:
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
        return Captioner(decoder, encoder, pad_id)
    # differs from reference: the encoder is not part of the model; the embeddings are copies of CLIP's
    decoder = CaptionDecoder(decoder_config, nn.Parameter(token_embedding.detach().clone()),
                             nn.Parameter(positions.detach().clone(), requires_grad=False))
    decoder.word_embedding.requires_grad_(config.train_word_embedding)
    return Captioner(decoder, None, pad_id)


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
# The run: main, job (stage 1's encoder, the tokenizer, the captioner; --pair, --eval or training), train (the loop)


def main(argv=None):
    config = plumbing.parse_config(Config, PRESETS, argv, description=__doc__.split("\n")[0])
    if config.explain and not config.pair:
        raise ConfigError("--explain writes the attention maps of one pair: use it with --pair BEFORE AFTER "
                          "(--eval writes test_attention.png by itself)")
    out_dir = Path(config.out_dir or f"runs/caption_{config.data}")
    if not config.pair:  # a file there is refused before any work (--pair writes nothing there)
        plumbing.check_out_dir(out_dir)
    trained = None
    if config.eval or config.pair:  # the trained captioner decides the model settings and holds stage 1's
        trained = plumbing.load_trained(Path(config.checkpoint or out_dir / "ckpt_best.pt"), MODEL_KEYS)
        config = dataclasses.replace(config, **trained.settings)
        if trained.release and config.dtype == "auto":  # the reference decodes in float32 (its CLIP in fp16):
            # bf16 autocast or TF32 on a GPU would flip its near-ties (BENCHMARKS.md section 12): IEEE float32
            config = dataclasses.replace(config, dtype="float32", tf32=False)
    # DDP from torchrun's environment, the device, autocast and GradScaler, the seed; one run at a time in out_dir
    # (--pair writes nothing there, and reads ckpt_best.pt, which a run there replaces atomically)
    with plumbing.started(config, out_dir, lock=not config.pair) as run:
        job(run, trained)


def job(run: plumbing.Run, trained) -> None:
    """--pair, --eval or training, once the process is set up: stage 1's encoder, the tokenizer, the captioner.
    trained: --eval's or --pair's captioner (plumbing.load_trained), None when training."""
    config, dist_ = run.config, run.dist_
    root = data.dataset_root(config.data, config.data_root or None)
    if not config.pair:  # --data synth: drawn first (the tokenizer reads its vocabulary file), or checked
        plumbing.draw_synthetic(config, root, dist_)
    stage1 = load_stage1(config, None if trained is None or trained.release else trained)
    positions = stage1.encoder.clip.positional_embedding.shape[0]  # the decoder's, tied to CLIP's
    for name in ("max_words", "max_len"):
        plumbing.check_length(name, getattr(config, name), 2 if name == "max_words" else 1, positions,
                              f"the decoder has {positions} positions, CLIP's")
    # --pair reads no data: the vocabulary is the one the checkpoint keeps (else the dataset's, else OpenAI's)
    tokenizer = (plumbing.checkpoint_tokenizer(stage1.state, data.bpe_path(config.data, root)) if config.pair
                 else plumbing.dataset_tokenizer(data.bpe_path(config.data, root), dist_))
    if tokenizer.vocab_size != stage1.encoder.clip.config.vocab_size:
        raise ConfigError(f"the tokenizer of {config.data} has {tokenizer.vocab_size} tokens but the stage-1 "
                          f"model {stage1.path} has {stage1.encoder.clip.config.vocab_size}: it was trained "
                          f"on another dataset" + plumbing.vocabulary_hint(tokenizer))
    if trained is not None and trained.release:  # the reference's decoder, sized from its tensors, loaded strictly
        captioner = Captioner(release_decoder(trained.state, 2 * (stage1.encoder.n_patches + 1)), None,
                              tokenizer.pad_id)
    else:
        captioner = build_captioner(config, stage1.encoder, stage1.state["clip_config"], tokenizer.pad_id,
                                    stage1.freeze_intra)
        if trained is not None:
            captioner.load_state_dict(trained.state["model"])
    captioner.to(dist_.device)
    stage1.encoder.to(dist_.device)
    if config.pair:
        caption_pair(config, stage1, captioner, tokenizer, dist_.device, run.ctx)
    elif config.eval:
        evaluate(run, root, stage1, captioner, tokenizer)
    else:
        train(run, root, stage1, captioner, tokenizer)


@dataclasses.dataclass
class Stage1:
    """Stage 1's product, which stage 2 builds on: the adapted pair encoder and what its checkpoint says."""
    path: Path
    sha256: str           # the captioner records it, and refuses to run on another encoder
    encoder: PairEncoder  # in eval mode
    state: dict           # the checkpoint's other entries: config, clip_config, vocabulary (or bpe_path)
    freeze_intra: bool    # stage 1 froze the intra-image blocks (the synth preset): stage 2 keeps them frozen


def load_stage1(config: Config, trained=None) -> Stage1:
    """The stage-1 encoder: the file adapt.py wrote (runs/adapt_<data>/ckpt_best.pt, its ckpt_best.pt: the weights,
    the sizes to rebuild it with, its config) or a CLIP4IDC release (--encoder_ckpt). --eval and --pair (trained)
    take the copy of stage 1 their captioner holds (ours), so that a captioner's checkpoint travels alone; a flag
    wins; a release's captioner names its own file as --encoder_ckpt (plumbing.load_trained).
    stage 1's frozen intra-image blocks (--freeze_intra, the synth preset) are carried over: stage 2 keeps them
    frozen (build_captioner), and reads their tokens computed once (training_set)."""
    if trained is not None and not config.encoder_ckpt and "stage1" in trained.state:
        record = trained.state["stage1"]  # finetuned: no weights here, the captioner's encoder.* replace them
        return Stage1(trained.path, trained.state["encoder_sha256"], from_checkpoint(record), record,
                      record["config"].get("freeze_intra", False))
    hint = None if trained is None else trained.state.get("encoder_ckpt")  # where stage 1 was (a hint only)
    path = Path(config.encoder_ckpt or (hint if hint and Path(hint).is_file() else
                                        f"runs/adapt_{config.data}/ckpt_best.pt"))
    state = plumbing.read_encoder(path, config.intra_layers)  # ours or a release (--intra_layers: its split point)
    encoder = from_checkpoint(state)  # CLIP of the recorded sizes, split as recorded, holding the adapted weights
    sha256 = plumbing.sha256_of(path)
    if trained is not None and trained.state["encoder_sha256"] != sha256:
        raise ConfigError(f"{path} is not the stage-1 checkpoint the captioner was trained on (its sha256 "
                          f"differs); pass that one with --encoder_ckpt, or train stage 2 again")
    return Stage1(path, sha256, encoder, state, state.get("config", {}).get("freeze_intra", False))


def train(run: plumbing.Run, root: Path, stage1: Stage1, captioner: Captioner, tokenizer) -> None:
    """Train the captioner: validation CIDEr-D after every epoch, with patience; then the best epoch on the test
    split."""
    config, dist_, device, master = run.config, run.dist_, run.dist_.device, run.dist_.master
    if config.resume:  # what it resumes on, before any work
        plumbing.check_resume(run.out_dir, stage1)
    splits, images, eval_pairs = read_splits(config, dist_, root, stage1.encoder.clip.visual.input_resolution)
    plumbing.refuse_empty_splits(splits, data.SPLITS, config)
    # every pair's tokens, encoded once by the frozen encoder and kept on disk (not when the encoder trains)
    feature_path = feature_files(run, stage1, eval_pairs, images, () if config.finetune_encoder else data.SPLITS)
    train_set = training_set(run, stage1, splits["train"], images, tokenizer, feature_path)
    optimizer = build_optimizer(captioner, config)
    train_split = plumbing.split_fingerprint(splits["train"])  # what a resumed run checks it trains on
    state = resume(run, stage1, captioner, optimizer, train_split)
    step, best_cider, best_epoch, bad_epochs, history = (state[k] for k in PROGRESS)
    model = plumbing.cast_once(captioner, run.dtype)  # bf16 or fp16: the matrix weights cast once a step
    model = DDP(model, device_ids=[dist_.local_rank] if device.type == "cuda" else None,
                gradient_as_bucket_view=True) if dist_.ddp else model  # gradients in the all-reduce buckets
    # the global batch as micro-batches per process and accumulation step; the sampler deals the pairs out
    micro, sampler, steps_per_epoch = plumbing.batch_plan(train_set, config.batch_size, config.grad_accum, dist_,
                                                          config.seed, what="training pairs")
    total_steps = config.epochs * steps_per_epoch
    plumbing.announce(run, describe(run, len(train_set), micro, steps_per_epoch, captioner))

    def state(path):  # the checkpoint at the step the loop has reached
        return checkpoint(captioner, optimizer, run, stage1, tokenizer, stage1_weights=path.name == "ckpt_best.pt",
                          step=step, best_metric=best_cider, best_epoch=best_epoch, bad_epochs=bad_epochs,
                          history=history, train_split=train_split)

    loader = plumbing.training_loader(train_set, sampler, micro, config.num_workers, device,
                                      functools.partial(data.collate_captions, static=config.cuda_graphs))
    step_once = functools.partial(train_step, model, optimizer, run.scaler, ctx=run.ctx, config=config, ddp=dist_.ddp)
    if config.cuda_graphs:  # the step captured once as a CUDA graph, then replayed (plumbing/capture.py)
        plumbing.check_capture(config, dist_, run.dtype)
        step_once = plumbing.CapturedStep(step_once, optimizer)
    # Ctrl-C and SIGTERM end the step in progress, save ckpt_last.pt at that step and stop (plumbing.StepBoundary)
    with plumbing.StepBoundary(run, steps_per_epoch, total_steps, step, state) as boundary:
        model.train()
        while (step < total_steps or boundary.pending_validation) and bad_epochs <= config.patience:
            epoch, done_in_epoch = boundary.position(step)  # done_in_epoch > 0 when resuming part-way through it
            batches = boundary.epoch_batches(loader, epoch, done_in_epoch, config.grad_accum)  # the sampler's epoch
            for _ in range(done_in_epoch, steps_per_epoch):
                lr = get_lr(step, total_steps, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr * group["lr_scale"]
                try:
                    micro_batches = [data.to_device(next(batches), device) for _ in range(config.grad_accum)]
                except data.DataError as error:  # a damaged image: ckpt_last.pt at the last step, then one line
                    raise boundary.damaged(error, step) from None
                loss, grad_norm = step_once(micro_batches)  # train_step: forward, backward, clipping, AdamW
                step += 1
                if boundary.after_step(step, lr, loss, grad_norm):  # the master's log steps: .item() waits, here only
                    value = loss.item()
                    print(boundary.line(step, epoch=f"{epoch + 1}/{config.epochs}", loss=value,
                                        lr=get_lr(step, total_steps, config)), flush=True)
                    boundary.log.write(step=step, epoch=epoch, loss=value, lr=get_lr(step, total_steps, config))
                boundary.save_or_stop()  # ckpt_last.pt every save_every steps; for Ctrl-C or SIGTERM, then stops
            boundary.end_epoch(captioner)  # its last steps and weights checked finite, then saved (ckpt_last.pt)
            if master:  # end of epoch: validation CIDEr-D, decoded by the master alone while the others wait
                cider, predictions = validate(run, captioner, feature_path, eval_pairs["val"], images, tokenizer)
                improved = cider >= best_cider  # a tie keeps the later epoch, as the reference
                best_cider, best_epoch = (cider, epoch) if improved else (best_cider, best_epoch)
                bad_epochs = 0 if improved else bad_epochs + 1
                history.append({"epoch": epoch, "step": step, "val_CIDEr": cider})
                boundary.log.write(step=step, epoch=epoch, split="val", CIDEr=cider)
                best_file = [run.out_dir / "ckpt_best.pt"] if improved else []  # saved first: no line printed
                boundary.save(*best_file, run.out_dir / "ckpt_last.pt")  # can lose a checkpoint (the writer's thread)
                example = eval_pairs["val"][0].id
                print(f"epoch {epoch + 1} validation CIDEr-D {cider:.4f}" + (" (best so far)" if improved else "")
                      + f"; {example}: {predictions[example]!r}")
            bad_epochs = plumbing.from_master(bad_epochs, dist_)  # everyone follows the master's patience
            boundary.stop_if_signalled()  # Ctrl-C or SIGTERM in any process; under DDP also the epoch's barrier
    if bad_epochs > config.patience:
        plumbing.say(run, f"stopped early: {bad_epochs} epochs without a better validation CIDEr-D")
    test(run, stage1, captioner, tokenizer, (splits, images, eval_pairs), feature_path)


def training_set(run: plumbing.Run, stage1: Stage1, pairs, images, tokenizer, feature_path: dict) -> Dataset:
    """What a step reads per pair, besides its captions (data.CaptionItems: a change caption and, for CLEVR-Change,
    a no-change caption): with the encoder frozen (the default), the pair tokens cached by feature_files (M, E);
    finetuning it, the images' pixels (R, R, 3) uint8, or, when stage 1 froze the intra-image blocks (the synth
    preset), each image's intra-image tokens (N+1, D), computed once now, from which the step starts at the join."""
    config = run.config
    if not config.finetune_encoder:
        items = data.CaptionItems(pairs, tokenizer, config.use_no_change_pair, max_words=config.max_words)
        return plumbing.FeatureItems(items, feature_path["train"])  # items with "visual" (and "no_change_visual")
    if stage1.freeze_intra:
        images = plumbing.IntraTokens(stage1.encoder, pairs, images, config.eval_batch_size, run.dist_.device,
                                      run.ctx, images.cache_dir or run.out_dir, run.dist_)
        plumbing.say(run, f"intra-image tokens of {len(images.row)} training images {images.origin}: the "
                          f"intra-image blocks stay frozen, as in stage 1")
    return data.CaptionItems(pairs, tokenizer, config.use_no_change_pair, images=images, max_words=config.max_words)


def read_splits(config: Config, dist_, root: Path, resolution: int) -> tuple[dict, data.ImageReader, dict]:
    """The dataset's splits (data.py section 4's readers), the image reader (decoding, or the image cache with
    --image_cache) and each split's evaluation pairs (with CLEVR-Change's distractor pairs, data.evaluation_pairs)."""
    splits = {s: data.load_split(config.data, s, root) for s in data.SPLITS}
    images = plumbing.image_reader(splits, root, resolution, config.image_cache, dist_)
    return splits, images, {s: data.evaluation_pairs(splits[s], config.use_no_change_pair) for s in data.SPLITS}


# -----------------------------------------------------------------------------
# How an epoch is scored: each validation pair's tokens, its greedy token ids, their text, then CIDEr-D


@torch.no_grad()
def validate(run: plumbing.Run, captioner: Captioner, feature_path: dict, pairs, images,
             tokenizer) -> tuple[float, dict]:
    """Validation CIDEr-D, the metric that picks the best epoch, and the captions it scored."""
    features = split_features(run, captioner, feature_path, "val", pairs, images)
    predictions = predict(captioner.decoder, features, pairs, tokenizer, run.config, run.dist_.device, run.ctx)
    cider = metrics.score_captions(predictions, data.references(pairs), metrics=("CIDEr",),
                                   scorer=SCORER)["corpus"]["CIDEr"]
    return cider, predictions


def split_features(run: plumbing.Run, captioner: Captioner, feature_path: dict, split: str, pairs,
                   images) -> np.ndarray:
    """The pair tokens (P, M, E) of a split's evaluation pairs, float16: the cache (feature_files), or, when the
    encoder is finetuned, encoded now by its current weights, rounded to float16 all the same (encode_pairs)."""
    if captioner.encoder is None:
        return np.load(feature_path[split], mmap_mode="r")
    shape = (len(pairs), captioner.decoder.config.visual_tokens, captioner.decoder.config.hidden)
    return encode_pairs(run, captioner.encoder.eval(), pairs, images, np.empty(shape, np.float16), split)


def encode_pairs(run: plumbing.Run, encoder: PairEncoder, pairs, images, out: np.ndarray, what: str) -> np.ndarray:
    """Fill out (P, M, E) with every pair's tokens (row i = pairs[i]), --eval_batch_size pairs at a time.

    Rounded to float16 whatever the precision, for the validation and test captions as for the cache (half the disk
    and memory: CLEVR-Change's training split is 6.9 GB so); decoding widens them to float32 again (predict). Also
    when the encoder is finetuned (the synth preset), whose training steps read float32 tokens straight from the
    encoder: its evaluation decodes from the rounded ones."""
    config, device = run.config, run.dist_.device
    # a generator of its own: computing the cache (first run) or not (later runs) must not change the
    # global generator that training's random choices use
    loader = DataLoader(data.PairImages(pairs, images), batch_size=config.eval_batch_size,
                        num_workers=config.num_workers, generator=torch.Generator(), pin_memory=device.type == "cuda")
    progress, done = plumbing.Progress(len(loader)), 0
    for step, batch in enumerate(loader, 1):
        pixels = data.to_device(batch, device, ("before", "after"))  # (B, 3, R, R) each
        with torch.no_grad(), run.ctx:
            tokens = encoder.encode_pair(pixels["before"], pixels["after"])["pair_tokens"]  # (B, M, E)
        out[done:done + len(tokens)] = tokens.float().cpu().numpy().astype(np.float16)
        done += len(tokens)
        if run.dist_.master and (step % 20 == 0 or step == len(loader)):
            print(f"encoding {what}: " + progress.line(step), flush=True)
    return out


@torch.no_grad()
def predict(decoder: CaptionDecoder, features: np.ndarray, pairs, tokenizer, config: Config, device, ctx,
            what: str = "") -> dict[str, str]:
    """{evaluation id: greedy caption} for pairs, whose tokens are the rows of features (P, M, E)."""
    was_training = decoder.training
    decoder.eval()
    predictions, batches = {}, math.ceil(len(pairs) / config.eval_batch_size)
    progress = plumbing.Progress(batches)
    for b, start in enumerate(range(0, len(pairs), config.eval_batch_size), 1):
        visual = torch.from_numpy(np.asarray(features[start:start + config.eval_batch_size], dtype=np.float32))
        # --cuda_graphs: the same tokens at fixed shapes, a loop a GPU can replay as one graph (decoder.py)
        decode = decoder.greedy_decode_static if config.cuda_graphs else decoder.greedy_decode
        with ctx:
            ids = decode(visual.to(device), tokenizer.sot_id, tokenizer.eot_id, config.max_len)
        for pair, row in zip(pairs[start:start + config.eval_batch_size], ids.tolist()):
            predictions[pair.id] = ids_to_text(row, tokenizer.decode, tokenizer.eot_id)
        if what and (b % 20 == 0 or b == batches):
            print(f"decoding {what}: " + progress.line(b), flush=True)
    decoder.train(was_training)
    return predictions


def feature_files(run: plumbing.Run, stage1: Stage1, eval_pairs: dict, images, names) -> dict:
    """{split: the .npy file of its evaluation pairs' tokens, float16 (P, M, E)} for the splits `names`, encoded
    once per stage-1 checkpoint by encode_pairs (plumbing.feature_paths keeps them in out_dir/features)."""
    side = stage1.encoder.clip.visual.input_resolution // stage1.encoder.clip.visual.conv1.kernel_size[0]
    shape = (2 * (side * side + 1), stage1.encoder.clip.visual.proj.shape[1])  # (M, E)
    encoder = stage1.encoder.to(run.dist_.device)
    return plumbing.feature_paths(stage1.sha256, eval_pairs, names, shape, run.out_dir, run.dist_,
                                  lambda pairs, out, what: encode_pairs(run, encoder, pairs, images, out, what))


# -----------------------------------------------------------------------------
# The test split: decoded once, scored overall, per change type, by the kind of change said, and where it looked


def evaluate(run: plumbing.Run, root: Path, stage1: Stage1, captioner: Captioner, tokenizer, read=None,
             feature_path=None) -> None:
    """Decode and score the test split (evaluate_test): --eval, and the end of training (which passes what it
    has read already: read_splits's result and the feature files). The master alone: under torchrun the other
    processes wait for it."""
    if not run.dist_.master:
        return
    run = dataclasses.replace(run, dist_=dataclasses.replace(run.dist_, ddp=False))  # it waits for no other process
    config, dist_ = run.config, run.dist_
    splits, images, eval_pairs = read or read_splits(config, dist_, root, stage1.encoder.clip.visual.input_resolution)
    plumbing.refuse_empty_splits(splits, ("test",), config)
    if feature_path is None:
        feature_path = feature_files(run, stage1, eval_pairs, images, () if config.finetune_encoder else ("test",))
    features = split_features(run, captioner, feature_path, "test", eval_pairs["test"], images)
    field = data.SOURCES[config.data].field_scoring  # LEVIR-CC: also as its papers score, with their vocabulary
    vocabulary = metrics.field.field_vocabulary(c for s in data.SPLITS for p in splits[s] for c in p.captions) \
        if field else None
    evaluate_test(run, stage1.encoder, captioner.decoder, features, eval_pairs["test"], splits["test"], images,
                  tokenizer, vocabulary)


def evaluate_test(run: plumbing.Run, encoder: PairEncoder, decoder: CaptionDecoder, features: np.ndarray, pairs,
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
        table["field"] = metrics.field.score_both_ways(predictions, data.references(pairs), subsets, vocabulary, SCORER)
        text = metrics.field.format_both_ways(table["field"])
    if {pair.change_type for pair in pairs} <= {*data.CHANGE_TYPES, data.DISTRACTOR}:  # CLEVR-Change's types (synth)
        table["kinds"] = metrics.change_kinds([{"image_id": i, "caption": c} for i, c in predictions.items()],
                                              test_pairs)
        text += "\n\nkind of change said, by keywords (metrics.said_kind): " + metrics.format_kinds(table["kinds"])
    # the change pairs are the first rows of features, in the order of test_pairs (data.evaluation_pairs)
    maps = {}  # each change pair's attention maps, for the results page
    located = explain.localisation(encoder, decoder, test_pairs, features, images, tokenizer, config.max_len,
                                   config.eval_batch_size, device, ctx, maps)
    if located is not None:
        table["localisation"] = located
        text += "\n\n" + explain.format_localisation(located)
    for name in TEST_OUTPUTS:  # replaced together: a stopped evaluation leaves no earlier one's files beside its own
        (out_dir / name).unlink(missing_ok=True)
    plumbing.save_json([{"image_id": i, "caption": c} for i, c in predictions.items()],
                       out_dir / "test_predictions.json")
    plumbing.save_json(table, out_dir / "test_scores.json")
    (out_dir / "test_scores.txt").write_text(text + "\n")
    print(text)
    step = max(1, len(test_pairs) // 12)
    shown = test_pairs[::step][:12]
    grid = explain.contact_sheet(shown, out_dir / "test_grid.png", model_view=True, captions=1,
                                 predictions=predictions)
    rows = list(range(0, len(test_pairs), step))[:ATTENTION_PAIRS]  # the grid's first pairs
    attention = out_dir / "test_attention.png"
    explain.explain_pairs(encoder, decoder, [test_pairs[i] for i in rows], images, tokenizer, config.max_len,
                          attention, device, ctx, torch.from_numpy(np.asarray(features[rows], np.float32)).to(device))
    page = results.results_page(out_dir, predictions, table, pairs, SCORER, maps,
                                results.training_logs(config, out_dir))  # every pair, the curves
    print(f"predictions {out_dir / 'test_predictions.json'}, scores {out_dir / 'test_scores.json'}, grid {grid}, "
          f"attention maps {attention}, results page {page}")
    return table


def score_table(predictions: dict[str, str], pairs) -> dict:
    """Scores of the whole split, of its semantic changes alone, and of each change type, each scored alone (as the
    papers' toolkit re-scores a subset: CIDEr-D's document frequencies are the subset's; metrics.score_subsets)."""
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


# -----------------------------------------------------------------------------
# What the jobs and the loop call: caption one pair, the end of training, checkpoints, resuming


def caption_pair(config: Config, stage1: Stage1, captioner: Captioner, tokenizer, device, ctx) -> None:
    """Print the caption of the user's pair (--pair BEFORE AFTER); with --explain, write its attention maps."""
    images = data.ImageReader(stage1.encoder.clip.visual.input_resolution)
    for path in map(Path, config.pair):
        if not path.is_file():
            raise FileNotFoundError(f"--pair: image {path} is {data.absence(path)}")
    pixels = data.to_device({"before": images(Path(config.pair[0])).unsqueeze(0),
                             "after": images(Path(config.pair[1])).unsqueeze(0)}, device)  # (1, 3, R, R) each
    with torch.no_grad(), ctx:
        visual = stage1.encoder.eval().encode_pair(pixels["before"], pixels["after"])["pair_tokens"]  # (1, M, E)
    pair = data.ImagePair(" -> ".join(Path(p).name for p in config.pair), *map(Path, config.pair), captions=[])
    print(predict(captioner.decoder, visual.float().cpu().numpy(), [pair], tokenizer, config, device, ctx)[pair.id])
    if config.explain:
        explain.explain_pairs(stage1.encoder, captioner.decoder, [pair], images, tokenizer, config.max_len,
                              Path(config.explain), device, ctx)
        print(f"attention maps: {config.explain}")


def test(run: plumbing.Run, stage1: Stage1, captioner: Captioner, tokenizer, read: tuple, feature_path: dict) -> None:
    """The end of training: the test split decoded and scored once (evaluate), on the master, with the epoch
    chosen on validation (ckpt_best.pt); read and feature_path: what training has read already."""
    if not run.dist_.master:
        return
    best = plumbing.load_checkpoint(run.out_dir / "ckpt_best.pt")
    captioner.load_state_dict(best["model"])
    print(f"test scores of the best epoch ({best['best_epoch'] + 1}, validation CIDEr-D {best['best_metric']:.4f}):")
    try:
        evaluate(run, None, stage1, captioner, tokenizer, read, feature_path)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM: training is done, only the scores are not
        raise plumbing.final_test_stopped(interrupt, run.out_dir) from None


def describe(run: plumbing.Run, samples: int, micro: int, steps_per_epoch: int, captioner: Captioner) -> str:
    """The run in one line: what it trains, on how much, with which batch, where."""
    config, dist_ = run.config, run.dist_
    trainable = sum(p.numel() for p in captioner.parameters() if p.requires_grad)
    return (f"{samples} training pairs; global batch {config.batch_size} = {micro} x {dist_.world_size} processes "
            f"x {config.grad_accum} accumulation; {steps_per_epoch} steps per epoch, at most "
            f"{config.epochs * steps_per_epoch}; "
            f"{'finetuning the encoder' if config.finetune_encoder else 'cached encoder features'}; "
            f"{run.dtype} on {dist_.device}; {trainable / 1e6:.1f}M trainable parameters")


def checkpoint(captioner: Captioner, optimizer, run: plumbing.Run, stage1: Stage1, tokenizer,
               stage1_weights: bool = False, **progress) -> dict:
    """What ckpt_last.pt and ckpt_best.pt hold: enough to resume training, and to --eval and --pair without the
    flags or the stage-1 file: "stage1" holds its sizes, its configuration and its vocabulary, and (stage1_weights:
    ckpt_best.pt) its weights when the captioner does not hold them (the encoder not finetuned)."""
    record = {"clip_config": stage1.state["clip_config"], "encoder_config": dataclasses.asdict(stage1.encoder.config),
              "config": stage1.state.get("config", {}), "vocabulary": plumbing.vocabulary_tensor(tokenizer.bpe_path)}
    if stage1_weights and not run.config.finetune_encoder:
        record["model"] = stage1.encoder.state_dict()
    return {"model": captioner.state_dict(), "optimizer": optimizer.state_dict(), "scaler": run.scaler.state_dict(),
            "config": dataclasses.asdict(run.config), "stage1": record,
            "encoder_ckpt": str(stage1.path.resolve()),  # where stage 1 was: a hint for older checkpoints' readers
            "encoder_sha256": stage1.sha256, "decoder_config": dataclasses.asdict(captioner.decoder.config),
            **progress, "rng": plumbing.rng_state()}


def resume(run: plumbing.Run, stage1: Stage1, captioner: Captioner, optimizer, train_split: dict) -> dict:
    """Where training starts: step 0, or with --resume where ckpt_last.pt stopped, after restoring the captioner,
    the optimizer, the scaler and the random generators from it (plumbing.start_or_resume). A checkpoint trained on
    another stage-1 encoder is refused."""
    state = plumbing.start_or_resume(run, MODEL_KEYS + TRAINING_KEYS, captioner, optimizer, train_split)
    if state is None:
        return dict(zip(PROGRESS, (0, -1.0, -1, 0, [])))
    if state["encoder_sha256"] != stage1.sha256:
        raise ConfigError(f"{run.out_dir / 'ckpt_last.pt'} was trained on another stage-1 checkpoint than "
                          f"{stage1.path}")
    return state


def release_decoder(state_dict: dict[str, torch.Tensor], visual_tokens: int) -> CaptionDecoder:
    """The caption decoder of a CLIP4IDC release of the captioning stage (trained/pytorch_model.bin.*), in eval
    mode: its sizes read off its tensors, its names mapped to ours (plumbing/release.py), loaded with strict=True.
    visual_tokens: M from the pair encoder, 2(N+1)."""
    ours = plumbing.rename_reference_decoder_keys(state_dict)  # first: it says what is wrong with a damaged file
    decoder = CaptionDecoder(DecoderConfig(**plumbing.release_decoder_sizes(state_dict), visual_tokens=visual_tokens))
    decoder.load_state_dict(ours, strict=True)
    return decoder.eval()


if __name__ == "__main__":
    plumbing.run_main(main, "caption.py")
