"""The timings BENCHMARKS.md quotes but those of sections 9, 10 and 12: one function per figure, one subcommand each.

A reader of the concept files should see the concept, not the stopwatch, so the timings live here, apart,
as nanoGPT keeps its bench.py apart from model.py and train.py. This file imports the concept files (clip,
decoder, encoder, adapt, caption and the plumbing files) and none of them imports it. BENCHMARKS.md quotes the figures
printed here, each section with the command that printed it.

Each figure that times a model builds it at full size, the shape of OpenAI's ViT-B/32 (vision width D = 768, 12 blocks)
and of the reference's caption decoder (E = 512, V = 49408, 3 + 3 layers), with random weights: how long a
step takes does not depend on what the weights are. Each sets its number of torch threads (2, the cores of
the machine BENCHMARKS.md was measured on) and, but for clip, its seed; it warms up, and reports the fastest of
a few timed repeats, the one least slowed by whatever else the machine was doing. The defaults are the settings of the
figures in BENCHMARKS.md; smaller values (see each subcommand's --help) make a smoke run of a few seconds.

  clip      the ViT-B/32 image tower (images/s) and the BPE tokenizer, cold and warm (captions/s)   section 5
  decoder   greedy decoding with the key/value cache against the reference's full recompute, and a
            decoder training step on cached pair features, three ways                               section 4
  adapt     one stage-1 training step of the ViT-B/32 pair encoder (adapt.train_step): pairs/s, and
            its GFLOP/s next to this machine's matrix-multiply rate; JSON                            section 3
  synth     the synth preset's two training steps: GFLOP per step, ms per step, the fraction of this
            machine's matmul rate; --profile N: the top operators by wall time, and the largest
            matrix products' rates in the step and alone                                            section 2
  caption   stage 2 through caption.py's captioner: encoding pairs, decoding (cached and recomputed),
            a training step on cached features, and what they make of CLEVR-Change's splits; JSON  section 4
  metrics   metrics.py on a CLEVR-Change-sized corpus, the whole process, next to the Java toolkit   section 6
  load      stage-1 training batches through DataLoader workers: from PNGs and from the uint8 cache  section 7
  draw      drawing the synthetic dataset: pairs/s and pairs per CPU second                          section 7
  kinds     the kind of change each test caption of a caption.py run says, by keywords, per true kind
            (--confusion: true kind -> said kind), and the run's pointing game                      section 1
  results   results.html at CLEVR-Change's size, from a synth run repeated: writing time, size, and
            Chromium's time to open it, filter, sort and turn a page; JSON                          section 13
  first     the README's first command from a clean clone, each line time-stamped: per script wall
            time and peak memory, the phases, the steps' ms, CPU flags, md5 of both outputs, kinds  section 1
  cost      each stage at the papers' sizes: FLOPs per training pair, activation memory per batch size,
            the datasets' disk caches, and the GPU hours that follow from them (estimates); JSON    section 8
  gpu       on one GPU: the dtype auto picks, each stage's step at the papers' sizes in bf16, fp16
            and TF32 (MFU, peak memory), the loader, decoding, torchrun, --resume, --compile; JSON  section 11
  residual  bf16 autocast against float32, the vision residual stream in bf16 or float32: the pair
            embeddings' error and the test retrieval of a synth stage-1 checkpoint; JSON            section 11

Run:  python -m bench clip [--bpe-path FILE]       (the vocabulary from --bpe-path, CLIP_BPE_PATH or the cache)
      python -m bench decoder [--dtype bfloat16]   (about 2 minutes at the defaults)
      python -m bench adapt [--compile]
      python -m bench caption
      python -m bench synth [--profile 3]
      python -m bench metrics [--runs 3] [--variants "paraphrase index"] [--no-toolkit]
      python -m bench load [--root DIR] [--workers 2]   (DIR: a synthetic set, drawn if missing)
      python -m bench draw DIR --pairs 2000 [--workers 2]   (DIR must not exist)
      python -m bench kinds runs/caption_synth [--confusion] [--data synth] [--data_root DIR]
      python -m bench results runs/caption_synth [--images DIR]   (after the first command; a minute or two)
      python -m bench first OUT_DIR [--commit C] [--avx2]   (10-20 minutes on 2 cores; logs and summary.json in OUT_DIR)
      python -m bench first OUT_DIR --extra "--synth_pairs 40 --epochs 1"   (flags for both scripts: a smoke run)
      python -m bench cost [--batch-sizes 1 2 4 8]   (about 12 minutes on 2 busy cores; --tiny: a smoke run)
      python -m bench gpu [--out bench_gpu]   (at most 6 minutes on one H100; --tiny: a tiny CLIP on the CPU)
      python -m bench residual runs/adapt_synth/ckpt_best.pt   (after the first command; about a minute)
      python -m bench decoder --batch-decode 2 --steps 2 --batch-train 2 --length 4 --repeats 1   (a smoke run)
      python -m bench FIGURE --help                (the flags of one figure)

On a shared machine the wall clock includes the time spent waiting for a core: `clip` therefore also reports
CPU seconds, and `decoder` says how many cores other processes kept busy while it measured.

Shape letters: B pairs (or images) in a batch, R image side (224), M visual tokens per pair (100), E decoder
width (512), T caption tokens, V vocabulary (49408).
"""
import argparse
import collections
import contextlib
import dataclasses
import gzip
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import queue as queue_module
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

# `python -m bench gpu` runs on a stock GPU image with no internet, which may lack ftfy (clip.py's tokenizer needs it): its
# pure-Python wheels, carried in assets/wheels, are importable as they are, put on the path (and on PYTHONPATH for
# the torchrun runs) only when ftfy is missing
REPO = Path(__file__).resolve().parents[1]  # the repository root: the scripts it runs
WHEELS = sorted((REPO / "assets" / "wheels").glob("*.whl"))
try:
    import ftfy  # noqa: F401
except ImportError:
    sys.path[:0] = [str(wheel) for wheel in WHEELS]

import adapt
import caption
import clip
import data
import explain
import metrics
import synth
from decoder import CaptionDecoder, DecoderConfig
from encoder import EncoderConfig, PairEncoder, from_checkpoint
from plumbing.batches import training_loader
from plumbing import clip_files
from plumbing.caches import ResidentPixels, image_reader
from plumbing.casts import cast_once
from plumbing.checkpoints import BackgroundWriter, read_encoder, save_checkpoint
from plumbing.files import save_json
from plumbing.processes import Distributed, keep_freed_memory, loader_workers, resolve_dtype, set_tf32
from bench import ops
from scoring import meteor

CLEVR_TEST_PAIRS = 7970    # CLEVR-Change's test split: 3,985 change pairs + 3,985 distractor pairs
CLEVR_TRAIN_PAIRS = 33830  # CLEVR-Change's training split, in pairs (each with a change and a no-change caption)


# ---------------------------------------------------------------------------------------------------------
# Timing helpers


def _timed(fn) -> float:
    """Wall-clock seconds of one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(repeats: int, fn) -> float:
    """The fastest of `repeats` timed calls of fn, in wall-clock seconds: the one least slowed by other processes."""
    return min(_timed(fn) for _ in range(repeats))


def best_wall_and_cpu(repeats: int, fn, setup=lambda: None) -> tuple[float, float]:
    """The fastest of `repeats` calls of fn in wall-clock seconds and, apart, in CPU seconds of this process
    (the CPU time leaves out the waiting for a core on a busy machine); setup runs untimed before each call."""
    wall, cpu = [], []
    for _ in range(repeats):
        setup()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


MATRIX_PRODUCTS = ("mm", "addmm", "bmm")  # the aten operators that are matrix products


class OperatorClock(TorchDispatchMode):
    """Wall time per aten operator, backward included: each operator is timed alone as it runs, synchronous on
    the CPU. Used instead of torch.profiler, which on these small steps made memory-bound operators look up to
    9 times slower than they are (GELU on (64, 100, 512): 9.4 ms in its table, 1.0 ms timed in the step) and
    the step 45% longer; under this clock a step takes 10-40% longer than without it."""

    def __init__(self):
        super().__init__()
        self.seconds, self.calls = collections.Counter(), collections.Counter()
        self.product_seconds, self.product_calls = collections.Counter(), collections.Counter()  # by operand shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds, name = time.perf_counter() - start, func.overloadpacket.__name__
        self.seconds[name] += seconds
        self.calls[name] += 1
        if name in MATRIX_PRODUCTS:  # the two factors (addmm's bias left out), each (shape, contiguous or not)
            key = (name,) + tuple((tuple(a.shape), a.is_contiguous()) for a in args[-2:])
            self.product_seconds[key] += seconds
            self.product_calls[key] += 1
        return out

    def table(self, rows: int = 15) -> str:
        total = sum(self.seconds.values())
        lines = [f"{'operator':<55} {'ms':>9} {'share':>6} {'calls':>6}"]
        for name, seconds in self.seconds.most_common(rows):
            lines.append(f"{name:<55} {seconds * 1e3:9.1f} {seconds / total:6.1%} {self.calls[name]:6d}")
        return "\n".join(lines + [f"{'all operators':<55} {total * 1e3:9.1f}"])


def product_rates(clock: OperatorClock, rows: int = 10) -> str:
    """The clock's largest matrix products by operand shapes: their rate in the step, and the same product's rate
    alone, repeated on fresh operands of the same shapes and layout (the step's operands come from other operators
    and are often out of the caches). ᵀ marks an operand that is not contiguous: in these steps, a transpose."""
    def factor(shape, contiguous):  # a random operand; a non-contiguous one as the transpose of a contiguous one
        return torch.randn(*shape) if contiguous else torch.randn(*reversed(shape)).transpose(-1, -2)

    lines = [f"{'product':<52} {'calls':>5} {'ms':>7} {'GFLOP/s in the step':>20} {'alone':>6}"]
    for key, seconds in clock.product_seconds.most_common(rows):
        name, (shape_a, contiguous_a), (shape_b, contiguous_b) = key
        gflop = math.prod(shape_a) * shape_b[-1] * 2 / 1e9  # (..., m, k) @ (..., k, n): 2 m k n per matrix
        a, b = factor(shape_a, contiguous_a), factor(shape_b, contiguous_b)
        product = torch.bmm if name == "bmm" else torch.mm
        product(a, b)
        alone = gflop / best_of(20, lambda: product(a, b))
        shapes = f"{name} {shape_a}{'' if contiguous_a else 'ᵀ'} x {shape_b}{'' if contiguous_b else 'ᵀ'}"
        calls = clock.product_calls[key]
        lines.append(f"{shapes:<52} {calls:5d} {seconds * 1e3:7.1f} {gflop * calls / seconds:20.1f} {alone:6.1f}")
    return "\n".join(lines)


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds of this process, busy CPU seconds of the whole machine from /proc/stat or NaN)."""
    try:
        with open("/proc/stat") as stat:
            jiffies = [int(value) for value in stat.readline().split()[1:9]]
        machine = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except OSError:
        machine = math.nan
    own = os.times()
    return time.perf_counter(), own.user + own.system, machine


def others_load(since: tuple[float, float, float]) -> str:
    """How many cores other processes kept busy since `since`: they slow every figure down."""
    wall, own, machine = (now - then for now, then in zip(cpu_seconds(), since))
    return f"other processes used {max(machine - own, 0.0) / wall:.2f} cores meanwhile"


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """This machine's float32 matrix-multiply rate with the current thread count, in GFLOP/s (best of repeats)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n ** 3 / best_of(repeats, lambda: a @ b) / 1e9


# FlopCounterMode counts attention only for the GPU kernels; count the CPU flash-attention kernels the same
# way (the products QK^T and PV, and the backward's five products).
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_backward_flop_count(grad, q, k, v),
}


# ---------------------------------------------------------------------------------------------------------
# clip: the image tower and the tokenizer (BENCHMARKS.md section 5)


def clevr_style_captions(n: int) -> list[str]:
    """n distinct CLEVR-Change-like difference captions (for the tokenizer's figure)."""
    sizes = ["small", "large", "tiny", "big"]
    colors = ["gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow"]
    materials = ["metal", "rubber", "shiny", "matte"]
    shapes = ["cube", "sphere", "cylinder", "block", "ball", "thing"]
    templates = ["the {} {} {} {} changed to {}", "the {} {} {} {} that was behind the {} object has moved",
                 "someone added a {} {} {} {} next to the {} one", "the {} {} {} {} disappeared ; it was {}",
                 "a {} {} {} {} became {} ."]
    combos = itertools.product(sizes, colors, materials, shapes, colors, templates)  # templates vary fastest
    return [t.format(s, c, m, sh, c2) for s, c, m, sh, c2, t in itertools.islice(combos, n)]


def clip_throughput(bpe_path: str | None = None, threads: int = 2, batch: int = 32, repeats: int = 3,
                    n_captions: int = 5000):
    """Images/s of the ViT-B/32 image tower (float32) and captions/s of the tokenizer, with an empty encode
    cache (cold) and with every word cached (warm): the best of `repeats` runs, in wall-clock and in CPU time."""
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {repeats} runs")

    visual = clip.CLIP(clip.CLIPConfig()).visual.eval()  # ViT-B/32-shaped, random weights, float32
    images = torch.randn(batch, 3, visual.input_resolution, visual.input_resolution)  # (B, 3, R, R)
    with torch.inference_mode():
        visual(images)  # warm-up
        wall, cpu = best_wall_and_cpu(repeats, lambda: visual(images))
    print(f"ViT-B/32 image tower, batch {batch}, float32: {batch / wall:.1f} images/s "
          f"({wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU per batch; {batch / cpu:.1f} images per CPU-second)")

    captions = clevr_style_captions(n_captions)
    tokenizer = clip.SimpleTokenizer(bpe_path)

    def empty_cache():  # back to a fresh tokenizer's cache, which holds only the two special tokens
        tokenizer.cache = {clip.SOT: [tokenizer.sot_id], clip.EOT: [tokenizer.eot_id]}

    cold = best_wall_and_cpu(repeats, lambda: clip.tokenize(captions, tokenizer=tokenizer), setup=empty_cache)
    warm = best_wall_and_cpu(repeats, lambda: clip.tokenize(captions, tokenizer=tokenizer))
    for label, (wall, cpu) in (("cold (empty encode cache)", cold), ("warm (every word cached)", warm)):
        print(f"tokenizer, {len(captions)} CLEVR-style captions, {label}: {len(captions) / wall:,.0f} captions/s "
              f"({len(captions) / cpu:,.0f} per CPU-second)")


# ---------------------------------------------------------------------------------------------------------
# decoder: greedy decoding and a training step of the decoder alone (BENCHMARKS.md section 4)


def decoder_timings(threads: int = 2, batch_decode: int = 32, steps: int = 22, batch_train: int = 16,
                    length: int = 32, repeats: int = 3, dtype: str = "float32"):
    """Full-size timings: greedy decoding cached vs recomputed, and one training step on cached features.

    Weights stay float32; dtype "bfloat16" runs the same code under CPU autocast.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = DecoderConfig()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}, full-size decoder "
          f"(E={config.hidden}, V={config.vocab_size}, M={config.visual_tokens}, L={config.layers})")
    decoder = CaptionDecoder(config).eval()
    sot_id, eot_id = config.vocab_size - 2, config.vocab_size - 1
    with torch.no_grad():
        decoder.output_bias[eot_id] = -1e4  # random weights: never emit EOT, so every caption runs all steps
    visual = torch.randn(batch_decode, config.visual_tokens, config.hidden)  # (B, M, E)

    tokens = {}  # use_cache -> the tokens of the last timed run

    def decode(use_cache: bool):
        with autocast:
            tokens[use_cache] = decoder.greedy_decode(visual, sot_id, eot_id, max_len=steps, use_cache=use_cache)

    decoder.greedy_decode(visual[:2], sot_id, eot_id, max_len=2)  # warm-up
    since = cpu_seconds()
    cached_rate = batch_decode / best_of(repeats, lambda: decode(True))
    full_rate = batch_decode / best_of(repeats, lambda: decode(False))
    assert tokens[True].shape == (batch_decode, steps), tokens[True].shape
    print(f"greedy decoding, {batch_decode} pairs x {steps} steps: cached {cached_rate:.2f} captions/s, "
          f"full recompute (reference algorithm) {full_rate:.2f} captions/s, speed-up {cached_rate / full_rate:.1f}x, "
          f"same tokens: {torch.equal(tokens[True], tokens[False])}; {others_load(since)}")

    def pairs_per_second(freeze_embeddings: bool, loss_positions: int | None) -> float:
        model = CaptionDecoder(config).train()
        model.word_embedding.requires_grad_(not freeze_embeddings)
        model.position_embedding.requires_grad_(not freeze_embeddings)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
        features = torch.randn(batch_train, config.visual_tokens, config.hidden)  # (B, M, E), cached pair features
        caption_in = torch.randint(0, config.vocab_size - 2, (batch_train, length))  # (B, T)
        caption_out = torch.randint(0, config.vocab_size - 2, (batch_train, length))  # (B, T)
        real = torch.zeros(batch_train, length, dtype=torch.bool)
        real[:, :loss_positions or length] = True  # (B, T) positions the loss counts

        def step():
            with autocast:
                if loss_positions is None:
                    logits = model(features, caption_in)  # (B, T, V)
                    loss = F.cross_entropy(logits.flatten(0, 1), caption_out.flatten())
                else:
                    states = model.caption_states(features, caption_in)  # (B, T, E)
                    loss = F.cross_entropy(model.to_logits(states[real]), caption_out[real])  # head on loss positions
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up
        return batch_train / best_of(repeats, step)

    for freeze, positions, what in ((False, None, "all parameters trained (Spot-the-Diff: embeddings at a low lr)"),
                                    (True, None, "tied CLIP embeddings frozen (CLEVR-Change)"),
                                    (True, length // 2, f"embeddings frozen, head on {length // 2} of {length} "
                                                        "positions (loss positions only)")):
        since = cpu_seconds()
        print(f"training step, batch {batch_train}, T={length}, forward+backward+AdamW, {what}: "
              f"{pairs_per_second(freeze, positions):.1f} pairs/s; {others_load(since)}")


# ---------------------------------------------------------------------------------------------------------
# adapt: one full-size stage-1 training step, FLOPs counted, next to this machine's matmul rate (section 3)


def adapt_step(threads: int = 2, batch_size: int = 16, steps: int = 3, compile: bool = False) -> dict:
    """One stage-1 step of a ViT-B/32-sized encoder (random weights), float32 on the CPU, batch 16, T = 32.

    The same train_step and optimizer as training, with the reference's frozen set. The FLOPs are counted
    on a first, eager step (the counter cannot see into compiled code); the step time is the fastest of
    `steps` timed steps after it (and after compiling, with compile).
    """
    keep_freed_memory()  # as adapt.py does before training: steps reuse freed memory (BENCHMARKS.md 2)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = adapt.Config(batch_size=batch_size)
    encoder = PairEncoder(clip.CLIP(clip.CLIPConfig()), EncoderConfig(config.intra_layers)).train()
    encoder.cls_rows_only = adapt.CLS_ROWS_ONLY  # as adapt.build_encoder
    encoder.freeze()
    optimizer = adapt.build_optimizer(encoder, config)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    side, vocab = encoder.clip.visual.input_resolution, encoder.clip.config.vocab_size
    text = torch.randint(0, vocab - 2, (batch_size, config.max_words))  # (B, T)
    text[:, 0], text[:, -1] = vocab - 2, vocab - 1  # start and end tokens
    batch = {"before": torch.randn(batch_size, 3, side, side), "after": torch.randn(batch_size, 3, side, side),
             "caption": text}
    ctx = contextlib.nullcontext()  # float32: no autocast
    step = lambda model: adapt.train_step(model, optimizer, scaler, [batch], ctx, config, False,
                                          encoder.clip.logit_scale)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        step(encoder)
    model, result = encoder, {"threads": threads, "batch_size": batch_size, "compiled": compile}
    if compile:
        model = torch.compile(encoder)
        result["compile_s"] = _timed(lambda: step(model))
    matmul_before = matmul_gflops()
    step_s = best_of(steps, lambda: step(model))
    matmul = max(matmul_before, matmul_gflops())  # the better of two, so a busy moment cannot flatter the step
    gflop = counter.get_total_flops() / 1e9
    return {**result, "pairs_per_s": batch_size / step_s, "step_s": step_s, "gflop_per_step": gflop,
            "gflop_per_s": gflop / step_s, "matmul_gflop_per_s": matmul, "fraction_of_matmul": gflop / step_s / matmul}


# ---------------------------------------------------------------------------------------------------------
# synth: the synth preset's two training steps, FLOPs counted, next to the matmul rate, and their profile


def synth_batches(encoder: PairEncoder, batch1: int, batch2: int, caption_length: int) -> tuple[dict, dict]:
    """Random stand-ins of one training batch of each synth stage (batch1 and batch2 pairs), as the steps receive
    them: the intra-image tokens (B, N+1, D) of the frozen intra-image blocks instead of pixels, captions of
    `caption_length` words."""
    n, width, vocab = encoder.n_patches + 1, encoder.clip.visual.class_embedding.shape[0], encoder.clip.config.vocab_size
    sot, eot = vocab - 2, vocab - 1
    tokens = lambda b: torch.randn(b, n, width)  # (B, N+1, D)
    words = lambda b: torch.randint(1, vocab - 2, (b, caption_length))  # (B, T) word ids
    start, end = (lambda b: torch.full((b, 1), sot)), (lambda b: torch.full((b, 1), eot))  # (B, 1) each
    stage1 = {"before": tokens(batch1), "after": tokens(batch1),
              "caption": torch.cat([start(batch1), words(batch1), end(batch1)], 1)}  # (B, T+2)
    change, no_change = words(batch2), words(batch2)
    stage2 = {"before": tokens(batch2), "after": tokens(batch2), "distractor": tokens(batch2),
              "caption_in": torch.cat([start(batch2), change], 1), "caption_out": torch.cat([change, end(batch2)], 1),
              "no_change_caption_in": torch.cat([start(batch2), no_change], 1),  # (B, T+1)
              "no_change_caption_out": torch.cat([no_change, end(batch2)], 1)}
    return stage1, collated(stage2)


def collated(batch: dict) -> dict:
    """A stage-2 batch of stacked tensors as the training DataLoader hands it over (data.collate_captions: cut
    to its longest caption, with the positions the loss reads)."""
    size = len(next(iter(batch.values())))
    return data.collate_captions([{key: value[i] for key, value in batch.items()} for i in range(size)])


def synth_steps(threads: int = 2, steps: int = 5, caption_length: int = 14, profile: int = 0) -> dict:
    """One training step of each synth stage as the first README command runs it (stage 1: adapt.py's synth
    preset, batch 128; stage 2: caption.py's, batch 32 change + 32 distractor pairs, the pair encoder
    finetuned), on the synthetic CLIP (assets/synth-ViT-32.pt), float32. FLOPs from FlopCounterMode on an
    eager step, the fastest of `steps` timed steps, this run's 2048 x 2048 matmul rate before and after (the
    better one), and the fraction GFLOP/s / matmul GFLOP/s. With profile > 0, the operators' wall time over that
    many steps of each stage (OperatorClock)."""
    keep_freed_memory()  # as both scripts do before training
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    stage1_config = adapt.Config(**adapt.PRESETS["synth"], data="synth")
    stage2_config = caption.Config(**caption.PRESETS["synth"], data="synth")
    clip_model, _ = clip_files.load(stage1_config.clip_model)  # stage 2's CLIP; stage 1's is loaded by build_encoder
    encoder = adapt.build_encoder(stage1_config, clip_model.config.vocab_size)[0].train()  # the preset's frozen set
    batch1, batch2 = synth_batches(encoder, stage1_config.batch_size, stage2_config.batch_size, caption_length)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ctx = contextlib.nullcontext()  # float32: no autocast

    optimizer1 = adapt.build_optimizer(encoder, stage1_config)
    step1 = lambda: adapt.train_step(encoder, optimizer1, scaler, [batch1], ctx, stage1_config, False,
                                     encoder.clip.logit_scale)
    encoder2 = PairEncoder(clip_model, EncoderConfig(stage1_config.intra_layers))
    captioner = caption.build_captioner(stage2_config, encoder2, dataclasses.asdict(clip_model.config), clip.PAD_ID,
                                        freeze_intra=True).train()
    optimizer2 = caption.build_optimizer(captioner, stage2_config)
    step2 = lambda: caption.train_step(captioner, optimizer2, scaler, [batch2], ctx, stage2_config, False)

    result = {"threads": threads, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "caption_length": caption_length}
    matmul, product_gflop = matmul_gflops(), {}
    for name, step in (("stage1", step1), ("stage2", step2)):
        with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            step()
        step_s = best_of(steps, step)
        gflop = counter.get_total_flops() / 1e9
        by_op = {op.__name__: flops for op, flops in counter.get_flop_counts()["Global"].items()}
        product_gflop[name] = sum(by_op.get(op, 0) for op in MATRIX_PRODUCTS) / 1e9
        result[name] = {"step_ms": round(step_s * 1000, 1), "gflop_per_step": round(gflop, 2),
                        "gflop_per_s": round(gflop / step_s, 1)}
    matmul = max(matmul, matmul_gflops())  # the better of two, so a busy moment cannot flatter the steps
    result["matmul_gflop_per_s"] = round(matmul, 1)
    for name in ("stage1", "stage2"):
        result[name]["fraction_of_matmul"] = round(result[name]["gflop_per_s"] / matmul, 3)
    if profile:
        for name, step in (("stage1", step1), ("stage2", step2)):
            clock = OperatorClock()
            with clock:
                for _ in range(profile):
                    step()
            print(f"--- {name}: {profile} steps, operators by wall time\n{clock.table()}", file=sys.stderr)
            print(f"--- {name}: the largest matrix products\n{product_rates(clock)}", file=sys.stderr)
            # the matrix products alone: their FLOPs over their own time, against the same matmul rate
            product_s = sum(clock.product_seconds.values()) / profile  # per step
            result[name]["matrix_products"] = {
                "share_of_operator_time": round(product_s * profile / sum(clock.seconds.values()), 3),
                "gflop_per_s": round(product_gflop[name] / product_s, 1),
                "fraction_of_matmul": round(product_gflop[name] / product_s / matmul, 3)}
    return result


# ---------------------------------------------------------------------------------------------------------
# caption: stage 2's encoding, decoding and training, full-size, and CLEVR-Change's splits at those rates (section 4)


def caption_costs(threads: int = 2, pairs: int = 64, batch: int = 32, steps: int = 22, train_batch: int = 16) -> dict:
    """Encoding (ViT-B/32 pair encoder), greedy decoding with and without the cache (same weights, `steps`
    tokens per caption: EOT is forbidden so both run every step, as the reference always does), and one
    training step on cached features (batch 16 pairs, two captions each as on CLEVR-Change)."""
    keep_freed_memory()  # as caption.py does before training
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = caption.Config()
    encoder = PairEncoder(clip.CLIP(clip.CLIPConfig()), EncoderConfig()).eval()
    captioner = caption.build_captioner(config, encoder, dataclasses.asdict(encoder.clip.config), clip.PAD_ID)
    decoder = captioner.decoder.eval()
    vocab = decoder.config.vocab_size
    sot, eot = vocab - 2, vocab - 1
    with torch.no_grad():
        decoder.output_bias[eot] = -1e4  # random weights: never stop early, so every caption takes `steps` tokens
    side = encoder.clip.visual.input_resolution
    images = torch.randn(pairs, 3, side, side)  # (pairs, 3, R, R), each pair is (image, itself)
    with torch.no_grad():
        encoder.encode_pair(images[:2], images[:2])  # warm-up
        encode_s = sum(_timed(lambda: encoder.encode_pair(images[i:i + batch], images[i:i + batch]))
                       for i in range(0, pairs, batch))
        visual = encoder.encode_pair(images[:batch], images[:batch])["pair_tokens"]  # (B, M, E)
        decoder.greedy_decode(visual[:2], sot, eot, 2)  # warm-up
        cached_s = _timed(lambda: decoder.greedy_decode(visual, sot, eot, steps, use_cache=True))
        full_s = _timed(lambda: decoder.greedy_decode(visual, sot, eot, steps, use_cache=False))
    # training on cached features: captions of 8 to 16 tokens, as CLEVR-Change's, padded to max_words
    captioner.train()
    optimizer = caption.build_optimizer(captioner, config)
    lengths = torch.randint(8, 17, (2, train_batch))

    def caption_ids(n: int) -> torch.Tensor:  # (B, max_words): the n-th set of random captions, zero-padded
        ids = torch.zeros(train_batch, config.max_words, dtype=torch.long)
        for i, length in enumerate(lengths[n].tolist()):
            ids[i, :length] = torch.randint(1, vocab - 2, (length,))
        return ids

    features = collated({"visual": torch.randn(train_batch, *visual.shape[1:]), "caption_in": caption_ids(0),
                         "caption_out": caption_ids(0), "no_change_visual": torch.randn(train_batch, *visual.shape[1:]),
                         "no_change_caption_in": caption_ids(1), "no_change_caption_out": caption_ids(1)})

    def train_step():
        captioner(features).backward()
        torch.nn.utils.clip_grad_norm_(captioner.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # warm-up
    train_s = best_of(3, train_step)
    return {"threads": threads, "encode_pairs_per_s": pairs / encode_s,
            "decode_cached_captions_per_s": batch / cached_s, "decode_full_recompute_captions_per_s": batch / full_s,
            "decode_speedup": full_s / cached_s, "clevr_test_encode_min": CLEVR_TEST_PAIRS / (pairs / encode_s) / 60,
            "clevr_test_decode_cached_min": CLEVR_TEST_PAIRS / (batch / cached_s) / 60,
            "clevr_test_decode_full_recompute_min": CLEVR_TEST_PAIRS / (batch / full_s) / 60,
            "train_pairs_per_s_cached_features": train_batch / train_s,
            "clevr_train_epoch_min": CLEVR_TRAIN_PAIRS / (train_batch / train_s) / 60}


# ---------------------------------------------------------------------------------------------------------
# data.py and synth.py: loading stage-1 batches, drawing the synthetic dataset (section 7)


def loader_rate(samples, batch_size: int, workers: int, device: torch.device, seconds: float,
                resident: bool = False) -> dict:
    """Pairs per second that `workers` DataLoader processes deliver to this process, as training gets them: the
    DataLoader of batches.training_loader (persistent workers, pinned on CUDA), for about `seconds` after a
    warm-up batch; on a GPU each batch is also copied there and normalised (data.to_device), which on the CPU
    would be the training process's own work, not the loader's. resident: the samples' pixels held on the device
    (plumbing.ResidentPixels, made from their image cache first): the workers hand over rows and captions, and
    each batch's pixels are looked up and normalised there. Also the CPU milliseconds per pair of this process and
    of its workers (read from /proc)."""
    table = None
    if resident:
        samples.images = ResidentPixels(samples.images, samples.pairs, device)
        table = samples.images.table
    torch.manual_seed(0)
    sampler = torch.utils.data.RandomSampler(samples, replacement=True, num_samples=10 ** 9)
    loader = training_loader(samples, sampler, batch_size, workers, device, data.collate_text)
    batches = iter(loader)
    data.to_device(next(batches), device)  # warm-up: the workers start, and their first batches are queued
    start, cpu_start, pairs = time.perf_counter(), os.times(), 0
    workers_cpu_start = worker_cpu_seconds()
    while time.perf_counter() - start < seconds:
        batch = next(batches)
        if device.type == "cuda" or resident:
            batch = data.to_device(batch, device, ("before", "after", "caption"), table)
        pairs += batch["before"].shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - start, os.times()
    workers_cpu = worker_cpu_seconds() - workers_cpu_start
    del batches, loader  # the workers end
    return {"workers": workers, "batch_size": batch_size, "pairs_per_s": round(pairs / wall, 1),
            "main_cpu_ms_per_pair": round(1000 * (cpu.user + cpu.system - cpu_start.user - cpu_start.system) / pairs, 3),
            "worker_cpu_ms_per_pair": round(1000 * workers_cpu / pairs, 3) if workers else None}


def worker_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's living child processes (its DataLoader workers), read from
    /proc; 0 where there is none."""
    total = 0.0
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            except (OSError, IndexError, ValueError):  # a child that just ended
                pass
    return total


def loader_samples(root: Path, pairs: int, cached: bool) -> data.AdaptationSamples:
    """Stage-1 training samples of a small synthetic set drawn in root (480 x 320 PNGs, as CLEVR-Change's), read
    from the PNGs or from their uint8 image cache."""
    synth.ensure_synth(root, synth.SynthConfig(pairs=pairs))
    splits = {s: data.load_split("synth", s, root) for s in data.SPLITS}
    reader = image_reader(splits, root, data.IMAGE_SIZE, cached, Distributed(
        False, 0, 0, 1, torch.device("cpu"), True))
    return data.AdaptationSamples(splits["train"], clip_files.get_tokenizer(data.bpe_path("synth", root)), train=True,
                                  images=reader)


def loading(root: str | None = None, pairs: int = 200, workers: int = 1, batch_size: int = 128,
            seconds: float = 10.0) -> dict:
    """What `workers` DataLoader processes deliver to a training process, in pairs/s, from the uint8 image cache
    and from the PNGs (decoded and resized in the workers); printed as JSON."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(root) if root else Path(folder) / "synth"
        result = {"cpu_flags": cpu_flags(), "usable_cpus": data.usable_cpus()}
        for source, cached in (("image cache", True), ("PNG", False)):
            samples = loader_samples(root, pairs, cached)
            result[source] = loader_rate(samples, batch_size if cached else 32, workers, torch.device("cpu"),
                                         seconds)
    print(json.dumps(result, indent=2))
    return result


def drawing(folder: str, pairs: int, seed: int, workers: int = 1) -> None:
    """Drawing the synthetic dataset: wall time, pairs/s, and pairs per CPU second (of all the processes)."""
    cfg = synth.SynthConfig(pairs=pairs, seed=seed)
    start, cpu_start = time.perf_counter(), os.times()
    synth.make_synth(folder, cfg, workers)
    seconds, cpu = time.perf_counter() - start, os.times()
    cpu_seconds = sum(cpu[:4]) - sum(cpu_start[:4])  # user + system, this process and its finished workers
    print(f"{cfg.pairs} pairs in {folder} with {workers} process(es): {seconds:.1f} s, "
          f"{cfg.pairs / seconds:.1f} pairs/s; {cpu_seconds:.1f} CPU s, "
          f"{cfg.pairs / cpu_seconds:.1f} pairs per CPU second")


# ---------------------------------------------------------------------------------------------------------
# metrics.py: scoring a CLEVR-Change-sized corpus, the whole process as a user runs it (section 6)

# The coco-caption toolkit's whole process, as a caption paper runs it: PTB tokens (Java), then the four scorers
# (METEOR in a Java process). Its output goes nowhere; only its time is wanted.
TOOLKIT_SCRIPT = """
import json, sys
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.cider.cider import Cider
items = json.load(open(sys.argv[1]))["items"]
tokenizer = PTBTokenizer()
gts = tokenizer.tokenize({it["id"]: [{"caption": r} for r in it["references"]] for it in items})
res = tokenizer.tokenize({it["id"]: [{"caption": it["candidate"]}] for it in items})
for scorer in (Bleu(4), Meteor(), Rouge(), Cider()):
    scorer.compute_score(gts, res)
"""

# Each speed variant of metrics.py and scoring/meteor.py, and the line that puts the plain code back in its place, run in
# the scoring process before metrics.main (which, as the scripts do, asks for metrics.FastCaptionScorer).
METRICS_VARIANTS = {
    "none (all speed variants on)": "",
    "paraphrase index": "fast.FastMeteor.read_paraphrases = staticmethod(meteor.read_paraphrases)",
    "METEOR's pairs as arrays": "fast.FastMeteor.item_stats_many = meteor.Meteor.item_stats_many",
    "garbage collector paused": "import contextlib; metrics.collector_paused = contextlib.nullcontext",
    "PTB plain captions": "metrics.FastCaptionScorer.tokenizer = staticmethod(ptb.ptb_tokenize)",
    "METEOR's second process": "metrics.FastCaptionScorer.start_meteor = metrics.CaptionScorer.start_meteor",
    "normaliser's plain lines": "fast.FastMeteor.words = meteor.Meteor.words",
    "n-grams as arrays": "metrics.FastCaptionScorer._bleu_stats = metrics.CaptionScorer._bleu_stats; "
                         "metrics.FastCaptionScorer._cider_of = metrics.CaptionScorer._cider",
}


def _timed_run(command):
    """Wall seconds of one child process; its stdout."""
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.run(command, stdout=subprocess.PIPE, stderr=err)
        wall = time.perf_counter() - started
        if child.returncode != 0:
            err.seek(0)
            raise SystemExit(f"metrics bench: {' '.join(command[:3])} ... failed:\n{err.read().decode()[-3000:]}")
    return wall, child.stdout


TIMING_CORPUS = REPO / "tests" / "metrics_vectors" / "clevr_size_timing.json.gz"


def metrics_scoring(corpus: str | os.PathLike = TIMING_CORPUS, runs: int = 3, variants: str = "all",
                    toolkit: bool = True) -> dict:
    """Whole-process seconds of metrics.py on `corpus` with every speed variant, and without each one, and of the
    Java toolkit, run in turns (ABAB...) so that the machine's changing load falls on all of them alike. A
    gzipped corpus is unpacked into a temporary file first, outside the timing, since both programs read JSON."""
    if str(corpus).endswith(".gz"):
        unpacked = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        unpacked.write(gzip.decompress(Path(corpus).read_bytes()))
        unpacked.close()
        try:
            return metrics_scoring(unpacked.name, runs, variants, toolkit)
        finally:
            os.unlink(unpacked.name)
    if meteor.load_meteor_resources() is None:
        raise SystemExit("metrics bench: the METEOR 1.5 data is missing (pip install --no-deps pycocoevalcap==1.2)")
    names = list(METRICS_VARIANTS) if variants == "all" else \
        ["none (all speed variants on)", *(variants.split(",") if variants != "none" else [])]
    unknown = [n for n in names if n not in METRICS_VARIANTS]
    if unknown:
        raise SystemExit(f"metrics bench: unknown variants {unknown}; choose from {list(METRICS_VARIANTS)[1:]}")
    here = Path(metrics.__file__).resolve().parent
    walls, scores = {name: [] for name in names}, {}
    if toolkit:
        walls["Java toolkit"] = []
    for _ in range(runs):
        for name in names:
            code = (f"import sys; sys.path.insert(0, {str(here)!r}); import metrics\n"
                    f"from scoring import fast, meteor, ptb\n"
                    f"{METRICS_VARIANTS[name]}\nsys.exit(metrics.main(sys.argv[1:]))")
            wall, out = _timed_run([sys.executable, "-c", code, str(corpus), "--json"])
            walls[name].append(round(wall, 2))
            scores[name] = json.loads(out)["corpus"]
        if toolkit:
            wall, _ = _timed_run([sys.executable, "-c", TOOLKIT_SCRIPT, str(Path(corpus).resolve())])
            walls["Java toolkit"].append(round(wall, 2))
    same = all(s == scores[names[0]] for s in scores.values())
    median = {name: statistics.median(w) for name, w in walls.items()}
    base = walls[names[0]]
    # What a variant buys, run by run against the all-on run of the same turn (the load drifts between turns).
    bought = {name: statistics.median(1 - a / b for a, b in zip(base, w)) for name, w in walls.items()}
    table = [f"{'without':<30} {'median s':>9} {'all on, s':>9} {'bought':>7}  runs (s)"]
    for name in names[1:]:
        table.append(f"{name:<30} {median[name]:9.2f} {median[names[0]]:9.2f} {100 * bought[name]:6.1f}%  "
                     f"{walls[name]}")
    table.append(f"{'(all speed variants on)':<30} {median[names[0]]:9.2f} {'':9} {'':7}  {base}")
    if toolkit:
        ratio = statistics.median(t / a for a, t in zip(base, walls["Java toolkit"]))
        table.append(f"{'Java toolkit':<30} {median['Java toolkit']:9.2f} {'':9} {'':7}  {walls['Java toolkit']}"
                     f"  -> metrics.py is {ratio:.1f}x faster (median of the turns' ratios)")
    table.append(f"every variant gives the same corpus scores: {same}; load average {os.getloadavg()}")
    print("\n".join(table), file=sys.stderr)
    return {"walls": walls, "median_s": median, "same_scores": same, "cpus": os.cpu_count(),
            "ratio": round(ratio, 2) if toolkit else None}


# ---------------------------------------------------------------------------------------------------------
# The README's first command, whole: the command itself from a clean clone, its lines time-stamped, cut into phases,
# and the kind of change each test caption says (metrics.change_kinds) (section 1)

def run_kinds(run_dir: str | os.PathLike, name: str = "synth", root: str | None = None) -> tuple[dict, dict | None]:
    """change_kinds of a caption.py run folder against its dataset's test split; and the pointing game's table
    (explain.localisation) where the run's test_scores.json holds one, else None."""
    run_dir = Path(run_dir)
    path = run_dir / "test_predictions.json"
    if not path.is_file():
        raise SystemExit(f"kinds: no {path}; give the folder of a caption.py run (e.g. runs/caption_synth)")
    try:
        pairs = data.load_split(name, "test", root)
        kinds = metrics.change_kinds(json.loads(path.read_text()), pairs)
    except data.DataError as error:
        raise SystemExit(f"kinds: {error}")
    except metrics.CaptionInputError as error:  # a prediction that is not a pair of this test split
        raise SystemExit(str(error))
    scores = run_dir / "test_scores.json"
    located = json.loads(scores.read_text()).get("localisation") if scores.is_file() else None
    return kinds, located


def print_kinds(run_dir: str, name: str, root: str | None, confusion: bool) -> None:
    kinds, located = run_kinds(run_dir, name, root)
    print(metrics.format_kinds(kinds, confusion))
    if located:
        print(explain.format_localisation(located))


def results_page_at_scale(run_dir: str | os.PathLike, root: str | None = None, images: str | None = None,
                          pairs: int = CLEVR_TEST_PAIRS // 2, out: str | None = None, browse: bool = True) -> dict:
    """results.html at CLEVR-Change's size: a synth run's test pairs and captions repeated to `pairs` change pairs
    and as many distractor pairs, each image linked under a name of its own (so none is shared, as in CLEVR-Change),
    from the synthetic set or, with images, cycling through that folder's PNGs (e.g. CLEVR-Change's own renders).
    Times the writing (the scoring of every pair, the thumbnails), sizes the page by part and, where Chromium is
    installed, times its load and a filter, a sort and a page turn in it."""
    import results
    from bench.browser import CHROMIUM, Chromium
    run_dir = Path(run_dir)
    test = data.load_split("synth", "test", root)
    said = {p["image_id"]: p["caption"] for p in json.loads((run_dir / "test_predictions.json").read_text())}
    folder = Path(out or tempfile.mkdtemp(prefix="results_at_scale_"))
    (folder / "images").mkdir(parents=True, exist_ok=True)
    pool = sorted(Path(images).rglob("*.png")) if images else None
    made, predictions = [], {}
    for k in range(pairs):
        base = test[k % len(test)]
        links = []
        for n, path in enumerate((base.before, base.after, base.distractor)):
            link = folder / "images" / f"{k:06d}_{n}.png"
            link.unlink(missing_ok=True)
            link.symlink_to((pool[(3 * k + n) % len(pool)] if pool else path).resolve())
            links.append(link)
        made.append(dataclasses.replace(base, id=f"{k:06d}.png", before=links[0], after=links[1], distractor=links[2]))
        predictions[made[-1].id] = said[base.id]
        predictions[made[-1].id + data.NO_CHANGE_SUFFIX] = said[base.id + data.NO_CHANGE_SUFFIX]
    evaluated = data.evaluation_pairs(made, use_no_change_pair=True)
    predictions = {p.id: predictions[p.id] for p in evaluated}
    scored = metrics.score_captions(predictions, data.references(evaluated), scorer=metrics.FastCaptionScorer)
    table = {"scores": {"total": scored["corpus"]}, "sizes": {"total": len(evaluated)},
             "kinds": metrics.change_kinds([{"image_id": i, "caption": c} for i, c in predictions.items()], made)}
    generator = torch.Generator().manual_seed(0)
    maps = {p.id: {"inter": torch.rand(2 * 49, generator=generator).numpy()} for p in made}  # as many as --eval's
    started = time.perf_counter()
    page = results.results_page(folder, predictions, table, evaluated, metrics.FastCaptionScorer, maps, {})
    text = page.read_text()
    thumbs = re.search(r'<script type="application/json" id="thumbs">(.*?)</script>', text).group(1)
    seconds = round(time.perf_counter() - started, 1)
    figures = {"pairs": len(evaluated), "images": 3 * pairs, "seconds_to_write": seconds,
               "page_MB": round(page.stat().st_size / 1e6, 2), "images_MB": round(len(thumbs) / 1e6, 2),
               "images_from": images or "the synthetic set", "page": str(page)}
    if browse and CHROMIUM:
        browser = Chromium(folder / "profile", timeout=300)
        try:
            started = time.perf_counter()
            browser.open(page, 1280, 900)
            figures["chromium_load_s"] = round(time.perf_counter() - started, 2)
            for name, script in (("filter_move_ms", "f.type.value = 'move'"),
                                 ("sort_worst_ms", "f.sort.value = 'worst'"), ("search_ms", "f.query.value = 'cube'")):
                figures[name] = round(browser.run(
                    f"(() => {{ const f = document.getElementById('find'), t = performance.now(); {script}; "
                    "f.dispatchEvent(new Event('input')); return performance.now() - t; })()"), 1)
            figures["next_page_ms"] = round(browser.run(
                "(() => { const t = performance.now(); document.querySelector('.pager button[data-step=\"1\"]')"
                ".click(); return performance.now() - t; })()"), 1)
            figures["console_errors"] = browser.console_errors()
        finally:
            browser.close()
    return figures


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the instruction sets torch's CPU kernels choose among
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # torch's and oneDNN's AVX-512 kernels off
STAMP = re.compile(r"^\s*(\d+\.\d+) (.*)$")  # a stamped log line: seconds since the command's start, the line
STEP_LINE = re.compile(r"^step (\d+)/\d+ \|.* \| (\d+) ms/step \|")  # progress.Progress's line of a training step


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this machine's CPU has (Linux's /proc/cpuinfo; none elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in CPU_FLAGS if flag in flags]


def stamped_run(command: list[str], cwd: Path, env: dict, log_path: Path, t0: float) -> dict:
    """Runs command, its stdout and stderr as one stream, and writes (and prints) each line after the wall seconds
    since t0 (time.time()) at which it came. Returns the command's wall seconds, its peak resident memory and
    its children's (what /usr/bin/time -v reports), and its exit status."""
    started = time.time()
    child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
    with open(log_path, "w") as log:
        for line in child.stdout:
            stamped = f"{time.time() - t0:10.3f} {line.rstrip(chr(10))}"
            print(stamped, file=log, flush=True)
            print(stamped, flush=True)
    _, status, usage = os.wait4(child.pid, 0)  # this child's rusage: the largest RSS of it and its reaped children
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stdout.close()
    return {"wall_s": round(time.time() - started, 1), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2),
            "exit_status": child.returncode}


def read_stamped(log_path: Path) -> list[tuple[float, str]]:
    """A stamped log's lines: (seconds since the command's start, the line as the script printed it)."""
    return [(float(m[1]), m[2]) for m in map(STAMP.match, log_path.read_text().splitlines()) if m]


def step_ms(lines: list[tuple[float, str]]) -> dict:
    """A stage's training steps: the range of the ms/step its progress lines logged (each a mean since the
    first step, validations included), and the median time per step between two step lines with nothing
    printed between them (training alone)."""
    steps = [STEP_LINE.match(text) for _, text in lines]
    logged = [int(m[2]) for m in steps if m]
    between = [1000 * (lines[i + 1][0] - lines[i][0]) / (int(steps[i + 1][1]) - int(steps[i][1]))
               for i in range(len(lines) - 1) if steps[i] and steps[i + 1] and steps[i + 1][1] != steps[i][1]]
    return {"logged_ms_per_step": [min(logged), max(logged)] if logged else None,
            "ms_per_step_between_lines": round(statistics.median(between)) if between else None}


def phases(adapt_lines: list[tuple[float, str]], caption_lines: list[tuple[float, str]], adapt_end: float | None,
           caption_end: float | None, drawn_at: float | None = None) -> dict[str, float]:
    """Seconds of each phase of the first command, each ended by a line the scripts print (or, for the drawing,
    the time of the dataset's last file): a phase whose end is unknown is merged into the next, " + " joined."""
    at = lambda lines, marker: next((t for t, text in lines if marker in text), None)
    intra = next(((t, text) for t, text in adapt_lines if text.startswith("intra-image tokens of")), None)
    intra_s = re.search(r"\((\d+) s\)", intra[1]) if intra else None  # the tokens' own seconds, in the line
    marks = [("python start, drawing the pairs", drawn_at),
             ("image cache, loading the model", intra[0] - int(intra_s[1]) if intra_s else None),
             ("stage-1 intra-image tokens", intra[0] if intra else None),
             ("stage-1 training and validations", at(adapt_lines, "test retrieval of the best epoch")),
             ("stage-1 test retrieval, saving", adapt_end),
             ("stage-2 start: loading, the intra-image tokens", at(caption_lines, "global batch")),
             ("stage-2 training and validations", at(caption_lines, "test scores of the best epoch")),
             ("stage-2 test: decoding, scoring, pictures", caption_end)]
    spans, start, pending = {}, 0.0, []
    for name, end in marks:
        pending.append(name)
        if end is not None:
            spans[" + ".join(pending)] = round(end - start, 1)
            start, pending = end, []
    return spans


def md5_of(path: Path) -> str | None:
    return hashlib.md5(path.read_bytes()).hexdigest() if path.is_file() else None


def repository_of_this_file() -> str:
    """The git repository bench/ is in (a worktree's folder clones as its branch)."""
    here = Path(__file__).resolve().parent
    found = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"first: {here} is not in a git repository; give one with --repo")
    return found.stdout.strip()


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"first: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def first_command(folder: str | os.PathLike, commit: str | None = None, avx2: bool = False, extra: str = "",
                  repo: str | None = None) -> dict:
    """The README's first command (python adapt.py --data synth && python caption.py --data synth, no install)
    from a clean clone of repo (default: this file's) in folder/repo, at commit if given; extra: flags for
    both scripts (a smoke run). Writes folder/adapt.log and folder/caption.log (each line after the seconds
    since the start) and folder/summary.json, the dict returned: per script wall time and peak memory, the
    phases, the steps' ms, the CPU flags, the md5 of both outputs, and the kinds of the test captions."""
    folder = Path(folder).resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SystemExit(f"first: {folder} is not empty; give a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    clone = folder / "repo"
    git("clone", "-q", repo or repository_of_this_file(), str(clone))
    if commit:
        git("-C", str(clone), "checkout", "-q", commit)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(AVX2_ONLY if avx2 else {})}
    summary = {"commit": git("-C", str(clone), "rev-parse", "HEAD"), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(),
               "torch": torch.__version__, "env": AVX2_ONLY if avx2 else {}, "extra": extra, "scripts": {}}
    t0, ends = time.time(), {}
    for script in ("adapt", "caption"):
        command = [sys.executable, "-u", f"{script}.py", "--data", "synth", *extra.split()]
        summary["scripts"][script] = {"command": " ".join(command[1:]),
                                      **stamped_run(command, clone, env, folder / f"{script}.log", t0)}
        ends[script] = time.time() - t0
        if summary["scripts"][script]["exit_status"] != 0:
            break
    lines = {script: read_stamped(folder / f"{script}.log") for script in summary["scripts"]}
    adapt_lines, caption_lines = lines.get("adapt", []), lines.get("caption", [])
    root = clone / "data" / "synth"
    drawn = any("drawing the synthetic dataset" in text for _, text in adapt_lines) and root.is_dir()
    drawn_at = max(p.stat().st_mtime for p in root.iterdir() if p.is_file()) - t0 if drawn else None
    summary["total_s"] = round(time.time() - t0, 1)
    summary["phases_s"] = phases(adapt_lines, caption_lines, ends.get("adapt"), ends.get("caption"), drawn_at)
    summary["steps"] = {"stage1": step_ms(adapt_lines), "stage2": step_ms(caption_lines)}
    outputs = (clone / "runs/adapt_synth/test_retrieval.json", clone / "runs/caption_synth/test_predictions.json")
    summary["md5"] = {str(path.relative_to(clone)): md5_of(path) for path in outputs}
    summary["quality"] = first_quality(*outputs)  # what the README quotes of the run: retrieval, CIDEr-D
    if outputs[1].is_file():
        try:
            kinds, located = run_kinds(outputs[1].parent, "synth", root)
            summary.update(kinds=metrics.format_kinds(kinds), kinds_right=kinds["right"],
                           kinds_confusion=kinds["confusion"], localisation=located)
        except SystemExit as error:  # the summary keeps the timings of a run whose outputs are not the usual ones
            summary["kinds"] = str(error)
    save_json(summary, folder / "summary.json")
    return summary


def first_quality(retrieval_file: Path, predictions_file: Path) -> dict:
    """The test figures of a first command's run: stage-1 R@1 (%), stage-2 CIDEr-D (total, semantic changes,
    distractors), from the files the scripts wrote."""
    quality = {}
    if retrieval_file.is_file():
        retrieval = json.loads(retrieval_file.read_text())
        quality["retrieval"] = {key: retrieval[key] for key in ("text_to_pair_R1", "pair_to_text_R1",
                                                                "text_to_pair_R5", "pair_to_text_R5") if key in retrieval}
    scores = predictions_file.parent / "test_scores.json"
    table = json.loads(scores.read_text()) if scores.is_file() else {}
    if "scores" in table:
        quality["cider"] = {name.replace(" ", "_"): round(value["CIDEr"], 4) for name, value in table["scores"].items()}
    if "semantic change" in table.get("localisation", {}):  # the pointing game over every change pair (%)
        quality["pointing_game"] = {view: table["localisation"]["semantic change"][view]
                                    for view in ("intra", "inter", "decoder", "chance")}
    page = predictions_file.parent / "results.html"
    if page.is_file():
        quality["results_page_bytes"] = page.stat().st_size
    return quality


def report_first(summary: dict, folder: str) -> None:
    """summary.json printed, but for the kinds' confusion, and the pointing game as its table."""
    print(json.dumps({k: v for k, v in summary.items() if k not in ("kinds_confusion", "localisation")}, indent=2))
    if summary.get("localisation"):
        print(explain.format_localisation(summary["localisation"]))
    failed = [f"{script}.py" for script, run in summary["scripts"].items() if run["exit_status"] != 0]
    if failed:
        raise SystemExit(f"first: {failed[0]} failed; its output is in {Path(folder) / failed[0].replace('.py', '.log')}")

# cost: what a full run costs, on paper, from two measurements per stage at the papers' sizes: the FLOPs of one
# training pair, and the memory of one training step at a few batch sizes (section 8)

COST_STAGES = {  # one training step of each stage, at the papers' sizes, as adapt.py and caption.py run it
    "stage1": "adapt.py's clevr preset: the ViT-B/32 pair encoder (9 intra-image + 3 inter-image blocks) and CLIP's "
              "text tower against each other (contrastive), the reference's frozen set",
    "stage2_cached": "caption.py's clevr preset: the caption decoder alone, on cached pair tokens",
    "stage2_finetune": "caption.py --finetune_encoder, the reference's way: the pair encoder and the decoder, end to "
                       "end (the text tower frozen, unused)",
}
GPU_PEAK_TFLOPS = {  # dense tensor-core peaks in the vendors' data sheets (no sparsity)
    "V100 (fp16)": 125, "A100 (bf16)": 312, "H100 SXM (bf16)": 989}
GPU_FRACTIONS = (0.3, 0.5)  # the fractions of that peak a step is assumed to reach
IMAGE_CACHE_BYTES = 224 * 224 * 3  # caches.image_cache: one uint8 (R, R, 3) image
# Each dataset's published counts (check.PUBLISHED), and what a run reads of them:
#   images: the unique files caches.image_cache keeps for every pair of every split (before, after, distractor):
#     CLEVR-Change: 3 per id (default, semantic, nonsemantic), 39,803 ids in its splits, none shared;
#     Spot-the-Diff: 2 per id (<id>.png, <id>_2.png), 11,329 ids, no split shares an id;
#     IER: the distinct img0/img1 names of its train/valid/test.json (github.com/airsplay/VisualRelationships at
#       9bee562): 4,516 + 684 + 848, 5,883 distinct (165 images are in two splits);
#   feature_rows: caption.py's cached pair tokens, one row per evaluation pair (data.evaluation_pairs):
#     CLEVR-Change also its distractor pair, (before, nonsemantic), so 2 rows per id;
#   stage1_samples: adapt.py trains on one sample per (train pair, change caption): Spot-the-Diff's 17,676 train
#     sentences, IER's 3,061 requests; CLEVR-Change's caption files were never read here: 6 change captions per
#     pair is an assumption (the RCC paper's 493,735 captions for 79,606 pairs), and stage 1's time scales with it;
#   stage2_pairs: caption.py trains on one item per train pair (CLEVR-Change: a change and a no-change caption).
#   LEVIR-CC: 2 images per annotated pair (10,077; the folders' unannotated images are never read), one feature
#     row per pair; stage 1 one sample per (changed train pair, caption): 3,407 x 5 (data.adaptation_pairs);
#     stage 2 every train pair, changed or not, one caption each.
DATASET_COSTS = {
    "clevr": {"images": 3 * (33_830 + 1_988 + 3_985), "feature_rows": 2 * (33_830 + 1_988 + 3_985),
              "stage1_samples": 6 * 33_830, "stage2_pairs": 33_830, "captions_per_pair": 2},
    "spot": {"images": 2 * (8_566 + 1_493 + 1_270), "feature_rows": 8_566 + 1_493 + 1_270,
             "stage1_samples": 17_676, "stage2_pairs": 8_566, "captions_per_pair": 1},
    "ier": {"images": 5_883, "feature_rows": 3_061 + 383 + 495,
            "stage1_samples": 3_061, "stage2_pairs": 3_061, "captions_per_pair": 1},
    "levir": {"images": 2 * (6_815 + 1_333 + 1_929), "feature_rows": 6_815 + 1_333 + 1_929,
              "stage1_samples": 5 * 3_407, "stage2_pairs": 6_815, "captions_per_pair": 1},
}


@dataclasses.dataclass
class CostSizes:
    """The sizes a cost is measured at: OpenAI's ViT-B/32 and the clevr preset's decoder, or a tiny stand-in."""
    clip_config: clip.CLIPConfig = dataclasses.field(default_factory=clip.CLIPConfig)  # ViT-B/32's sizes
    intra_layers: int = 9           # adapt.Config's default: 9 intra-image blocks, 3 inter-image
    decoder: dict = dataclasses.field(default_factory=dict)  # caption.Config fields over the clevr preset's
    caption_tokens: int = 32        # T: every caption max_words long, an upper bound (a batch is cut to its longest)


TINY_COST_SIZES = CostSizes(clip.CLIPConfig(embed_dim=32, image_resolution=64, vision_layers=3, vision_width=64,
                                            vocab_size=300, transformer_width=32, transformer_heads=1,
                                            transformer_layers=2),
                            intra_layers=2, decoder=dict(decoder_heads=2, decoder_ffn=64, decoder_layers=1),
                            caption_tokens=8)


def cost_step(stage: str, batch_size: int, sizes: CostSizes, captions_per_pair: int = 2,
              device: torch.device = torch.device("cpu"), dtype: str = "float32", cast_weights: bool = True):
    """(the model, a function running one training step of `stage` on one random batch of batch_size pairs).

    Random weights and inputs, on `device`, in `dtype` (float32, or autocast in bfloat16 or float16 with a
    GradScaler); the frozen sets, optimizers and steps of adapt.py and caption.py (train_step), the matrix weights
    cast once a step under autocast as the scripts cast them (plumbing.cast_once; cast_weights=False: at each use).
    captions_per_pair 2: CLEVR-Change's change and no-change caption (in stage 2 also the distractor pair); 1:
    Spot-the-Diff's and IER's one caption."""
    torch.manual_seed(0)
    encoder = PairEncoder(clip.CLIP(sizes.clip_config), EncoderConfig(sizes.intra_layers)).train()
    encoder.cls_rows_only = adapt.CLS_ROWS_ONLY  # as adapt.build_encoder
    side, vocab, length = sizes.clip_config.image_resolution, sizes.clip_config.vocab_size, sizes.caption_tokens
    sot, eot = vocab - 2, vocab - 1
    pixels = lambda: torch.randn(batch_size, 3, side, side)  # (B, 3, R, R), normalised
    words = lambda: torch.randint(1, vocab - 2, (batch_size, length - 1))  # (B, T-1), no padding
    column = lambda token: torch.full((batch_size, 1), token)  # (B, 1)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    ctx = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
    if stage == "stage1":
        config = adapt.Config(**adapt.PRESETS["clevr"])
        encoder.freeze()  # adapt.build_encoder with the preset's freeze=True
        optimizer = adapt.build_optimizer(encoder.to(device), config)
        batch = {"before": pixels(), "after": pixels(), "caption": torch.cat([column(sot), words()], 1)}  # (B, T)
        batch["caption"][:, -1] = eot  # every caption T tokens long: the collate cuts none
        batch = data.to_device(batch, device)
        stepped = cast_once(encoder, dtype if cast_weights else "float32")  # as adapt.wrap
        run = lambda: adapt.train_step(stepped, optimizer, scaler, [batch], ctx, config, False,  # noqa: E731
                                       encoder.clip.logit_scale)
        run.optimizer = optimizer
        return encoder, run
    config = caption.Config(**{**caption.PRESETS["clevr"], **sizes.decoder, "max_words": length,
                               "finetune_encoder": stage == "stage2_finetune",
                               "use_no_change_pair": captions_per_pair == 2})
    captioner = caption.build_captioner(config, encoder, dataclasses.asdict(sizes.clip_config), clip.PAD_ID)
    captioner = captioner.train().to(device)
    optimizer = caption.build_optimizer(captioner, config)
    batch = {}
    for name in ("caption", "no_change_caption")[:captions_per_pair]:
        text = words()
        batch[f"{name}_in"], batch[f"{name}_out"] = torch.cat([column(sot), text], 1), torch.cat([text, column(eot)], 1)
    if config.finetune_encoder:  # pixels: the change pair and the distractor pair are encoded in the step
        batch.update(before=pixels(), after=pixels(), **({"distractor": pixels()} if captions_per_pair == 2 else {}))
    else:  # the pair tokens caption.py cached, (B, M, E) per pair
        tokens = lambda: torch.randn(batch_size, 2 * (encoder.n_patches + 1), sizes.clip_config.embed_dim)
        batch.update(visual=tokens(), **({"no_change_visual": tokens()} if captions_per_pair == 2 else {}))
    batch = data.to_device(collated(batch), device)
    stepped = cast_once(captioner, dtype if cast_weights else "float32")  # as caption.train
    run = lambda: caption.train_step(stepped, optimizer, scaler, [batch], ctx, config, False)  # noqa: E731
    run.optimizer = optimizer
    return captioner, run


class SavedForBackward(torch.autograd.graph.saved_tensors_hooks):
    """The bytes autograd keeps from the forward for the backward, the parameters left out: the activations.

    Counted once per storage, so that views of one tensor are not counted twice."""

    def __init__(self, model: torch.nn.Module):
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def cost_of_step(stage: str, batch_size: int, sizes: CostSizes, captions_per_pair: int, threads: int) -> dict:
    """One fresh process's measurements of one stage at one batch size (run it in a process of its own: the
    peak resident memory is the process's). Two steps first, untimed: the second holds the optimizer's state
    beside the activations, as every later step does; then a third with the FLOPs and the saved bytes counted."""
    keep_freed_memory()  # as adapt.py and caption.py do before training
    torch.set_num_threads(threads)
    model, step = cost_step(stage, batch_size, sizes, captions_per_pair)
    step()
    step()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    saved = SavedForBackward(model)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter, saved:
        step()
    return {"batch_size": batch_size, "flops": counter.get_total_flops(), "saved_bytes": saved.bytes,
            "peak_rss_bytes": peak_rss, "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _cost_child(queue, *args):
    queue.put(cost_of_step(*args))


def in_fresh_process(*args) -> dict:
    """cost_of_step in a new Python process (spawned: nothing inherited, so its peak memory is its own)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_cost_child, args=(queue, *args))
    child.start()
    while True:  # read before join: a child cannot exit while its queue is full
        try:
            result = queue.get(timeout=1)
            break
        except queue_module.Empty:
            if not child.is_alive():
                raise SystemExit(f"bench cost: the measuring process failed (exit code {child.exitcode}), see above")
    child.join()
    return result


def significant(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits, for a JSON that a reader reads."""
    return float(f"{x:.{digits}g}")


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (x, y)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


def step_flops(stage: str, sizes: CostSizes, captions_per_pair: int) -> float:
    """The FLOPs of one training step of `stage` on one pair, counted in this process."""
    model, step = cost_step(stage, 1, sizes, captions_per_pair)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        step()
    return counter.get_total_flops()


def encode_flops_per_pair(sizes: CostSizes) -> float:
    """The FLOPs of encoding one pair, forward only: caching stage 2's pair tokens, and every evaluation."""
    torch.manual_seed(0)
    encoder = PairEncoder(clip.CLIP(sizes.clip_config), EncoderConfig(sizes.intra_layers)).eval()
    images = torch.randn(2, 3, sizes.clip_config.image_resolution, sizes.clip_config.image_resolution)  # (2, 3, R, R)
    with torch.no_grad(), flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        encoder.encode_pair(images, images)
    return counter.get_total_flops() / 2


def disk_sizes(sizes: CostSizes) -> dict:
    """Each dataset's image cache (uint8 pixels) and stage-2 feature cache (float16 pair tokens), in GB; and the
    intra-image tokens of --freeze_intra (float32 (N+1, D) per training image, also held in memory)."""
    patches = (sizes.clip_config.image_resolution // sizes.clip_config.vision_patch_size) ** 2  # N
    row = 2 * (patches + 1) * sizes.clip_config.embed_dim * 2  # (M, E) float16
    intra = (patches + 1) * sizes.clip_config.vision_width * 4  # (N+1, D) float32
    train_images = {"clevr": 3 * 33_830, "spot": 2 * 8_566, "ier": 4_516, "levir": 2 * 6_815}
    return {name: {"images": d["images"], "image_cache_gb": round(d["images"] * IMAGE_CACHE_BYTES / 1e9, 2),
                   "feature_rows": d["feature_rows"], "feature_cache_gb": round(d["feature_rows"] * row / 1e9, 2),
                   "freeze_intra_tokens_gb": round(train_images[name] * intra / 1e9, 2)}
            for name, d in DATASET_COSTS.items()}


def run_hours(flops: dict) -> dict:
    """Hours of a full run's training steps per dataset, stage and GPU, at each fraction of the GPU's peak:
    arithmetic, FLOPs per pair x pairs x epochs / rate. Evaluation and data loading are left out."""
    stage1_epochs = {name: adapt.PRESETS[name]["epochs"] for name in DATASET_COSTS}
    stage2_epochs = {name: caption.PRESETS[name]["epochs"] for name in DATASET_COSTS}
    hours = {}
    for name, d in DATASET_COSTS.items():
        k = d["captions_per_pair"]
        work = {  # FLOPs of the whole stage
            "stage1": flops["stage1"] * d["stage1_samples"] * stage1_epochs[name],
            "stage2_cached": (flops[f"stage2_cached_{k}"] * d["stage2_pairs"] * stage2_epochs[name]
                              + flops["encode"] * d["feature_rows"]),  # + encoding every pair once
            "stage2_finetune": flops[f"stage2_finetune_{k}"] * d["stage2_pairs"] * stage2_epochs[name]}
        hours[name] = {stage: {"pflop": round(total / 1e15, 1),
                               **{f"{gpu} at {f:.0%}": round(total / (f * peak * 1e12) / 3600, 2)
                                  for gpu, peak in GPU_PEAK_TFLOPS.items() for f in GPU_FRACTIONS}}
                       for stage, total in work.items()}
    return {"epochs": {"stage1": stage1_epochs, "stage2 (at most; early stopping may end sooner)": stage2_epochs},
            "hours": hours}


def run_costs(batch_sizes=(1, 2, 4, 8), stages=tuple(COST_STAGES), sizes: CostSizes | None = None,
              threads: int = 2) -> dict:
    """FLOPs per training pair and memory per batch size of each stage, each step in a fresh process; the
    disk caches; and, from these, the hours of a full run on one GPU (estimates)."""
    sizes = sizes or CostSizes()
    result = {"sizes": dataclasses.asdict(sizes), "threads": threads, "stages": {}}
    flops = {"encode": encode_flops_per_pair(sizes)}
    for stage in stages:
        rows = [in_fresh_process(stage, b, sizes, 2, threads) for b in batch_sizes]
        per_pair = [row["flops"] / row["batch_size"] for row in rows]
        rss_slope, rss_intercept = line_fit(batch_sizes, [row["peak_rss_bytes"] for row in rows])
        saved_slope, saved_intercept = line_fit(batch_sizes, [row["saved_bytes"] for row in rows])
        trainable, parameters = rows[0]["trainable"], rows[0]["parameters"]
        result["stages"][stage] = {
            "what": COST_STAGES[stage],
            "gflop_per_pair": [significant(f / 1e9) for f in per_pair],
            "peak_rss_gb": [significant(row["peak_rss_bytes"] / 1e9) for row in rows],
            "saved_for_backward_gb": [significant(row["saved_bytes"] / 1e9) for row in rows],
            "rss_mb_per_pair": round(rss_slope / 1e6, 1), "rss_fixed_gb": round(rss_intercept / 1e9, 2),
            "saved_mb_per_pair": round(saved_slope / 1e6, 2), "saved_fixed_mb": round(saved_intercept / 1e6, 2),
            "parameters_m": round(parameters / 1e6, 2), "trainable_m": round(trainable / 1e6, 2),
            # float32 weights, their gradients and AdamW's two moments: what a GPU holds besides the activations
            "weights_grads_adam_gb": significant((4 * parameters + 12 * trainable) / 1e9)}
        flops[stage if stage == "stage1" else f"{stage}_2"] = per_pair[-1]
        if stage != "stage1":  # Spot-the-Diff and IER: one caption per pair, no distractor pair
            flops[f"{stage}_1"] = step_flops(stage, sizes, captions_per_pair=1)
    result["gflop_per_pair"] = {k: significant(v / 1e9) for k, v in flops.items()}
    result["disk"] = disk_sizes(sizes)
    if set(COST_STAGES) <= set(stages):
        result["estimate"] = run_hours(flops)
    return result


# ---------------------------------------------------------------------------------------------------------
# residual: the vision tower's residual stream under autocast, bfloat16 or float32 (section 11)


def embed_with_residual(dtype: torch.dtype | None):
    """clip.VisionTransformer.embed with its output, the start of the residual stream, in `dtype` (None: in the
    dtype of conv1's output, which autocast makes bfloat16; clip.py's own embed makes it float32). Every block
    adds to the stream in its dtype: x + f(x) of a float32 x and a bfloat16 f(x) is float32."""
    def embed(self, images):
        x = self.conv1(images)                                               # (B, D, G, G)
        x = x.flatten(2).transpose(1, 2).to(dtype or x.dtype)                # (B, N, D)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)     # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # (B, N+1, D)
        return self.ln_pre(x)
    return embed


def residual_precision(checkpoint: str, data_root: str | None = None, threads: int = 2) -> dict:
    """A stage-1 checkpoint of the synth preset on the synthetic test split in float32, and under bfloat16 autocast
    with the vision residual stream in bfloat16 or in float32: each variant's pair embeddings against float32's
    (relative error of the difference, 1 - cosine) and its test retrieval (adapt.evaluate)."""
    torch.set_num_threads(threads)
    model = from_checkpoint(read_encoder(checkpoint))
    config = adapt.Config(**{**adapt.PRESETS["synth"], "data": "synth", "data_root": data_root or "", "num_workers": 0})
    one = Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    splits, tokenizer, images = adapt.read_pairs(config, one)
    pixels = data.PairImages(splits["test"], images)
    batch = next(iter(DataLoader(pixels, batch_size=len(pixels))))
    before, after = clip.normalize(batch["before"]), clip.normalize(batch["after"])  # (B, 3, R, R) each
    variants = {"float32": (contextlib.nullcontext, None),
                "bfloat16, residual in bfloat16": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16),
                "bfloat16, residual in float32": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.float32)}
    original, result, reference = clip.VisionTransformer.embed, {"test pairs": len(pixels)}, None
    try:
        for name, (ctx, residual) in variants.items():
            clip.VisionTransformer.embed = embed_with_residual(residual)
            with torch.no_grad(), ctx():
                embedding = model.embed_pair(before, after).float()  # (B, E)
            reference = embedding if reference is None else reference
            error = (embedding - reference).norm(dim=-1) / reference.norm(dim=-1)  # (B,)
            cosine = F.cosine_similarity(embedding, reference, dim=-1)  # (B,)
            scores = adapt.evaluate(model, splits["test"], tokenizer, images, config, torch.device("cpu"), ctx())
            result[name] = {"relative_error_median": float(error.median()), "relative_error_max": float(error.max()),
                            "one_minus_cosine_max": float((1 - cosine).max()),
                            **{k: round(v, 2) for k, v in scores.items() if k.endswith(("R1", "R5"))}}
    finally:
        clip.VisionTransformer.embed = original
    print(json.dumps(result, indent=2))
    return result


# ---------------------------------------------------------------------------------------------------------
# gpu: the prepared GPU measurement (BENCHMARKS.md section 11)

GPU_PEAKS = {  # dense tensor-core TFLOPS in the vendors' data sheets (no sparsity): (bf16, fp16, tf32); None: not native.
    # The first key whose words are all in torch.cuda.get_device_name() wins: the longer names come first
    "H200": (989, 989, 495), "H100 PCIe": (756, 756, 378), "H100 NVL": (835, 835, 418),
    "H100": (989, 989, 495),  # H100 without another word: the SXM part (HBM3)
    "A100": (312, 312, 156), "A10": (125, 125, 62.5), "L40S": (362, 362, 183), "L40": (181, 181, 90.5),
    "L4": (121, 121, 60), "V100": (None, 125, None), "T4": (None, 65, None)}
GPU_STEP_BATCH = {"stage1": 128, "stage2_cached": 16, "stage2_finetune": 16}  # the clevr presets' global batches
STAGE1_PER_GPU = (16, 32, 64, 128)  # stage 1's pairs per GPU: 128 on 8, 4, 2 and 1 GPUs
# `python -m bench cost`'s float32 estimate at those batches (BENCHMARKS.md section 8): activations, weights, gradients, AdamW
COST_ESTIMATE_GB = {"stage1": 10.9, "stage2_cached": 1.4, "stage2_finetune": 5.0}
# Each script run's time limit, in seconds: the runs in turn, then the in-process parts (about 2 minutes on one H100,
# the compiled step the longest), fit in GPU_RUN_BUDGET_S, this command's estimate of its own length on one H100
SCRIPT_TIMEOUT_S = 45
GPU_RUN_BUDGET_S = 360


def gpu_peak(name: str) -> tuple:
    """(bf16, fp16, tf32) peak TFLOPS of the GPU named `name` (torch.cuda.get_device_name), Nones if unknown."""
    for key, peaks in GPU_PEAKS.items():
        if all(word in name for word in key.split()):
            return peaks
    return None, None, None


def device_steps(stage: str, batch_size: int, sizes: CostSizes, device: torch.device, dtype: str, steps: int,
                 peak: float | None) -> dict:
    """One stage's training step (cost_step: adapt.py's and caption.py's train_step) on the device in `dtype`
    (autocast, or TF32 float32): ms per step (the mean of `steps` after two warm-up steps), the FLOPs of a step
    and the fraction of the GPU's peak they reach (MFU), the peak memory allocated."""
    model, run = cost_step(stage, batch_size, sizes, device=device, dtype=dtype)
    with flop_counter.FlopCounterMode(display=False) as counter:
        run()
    run()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        run()
    synchronize(device)
    step_s = (time.perf_counter() - start) / steps
    flops = counter.get_total_flops()
    with ops.OperationCount() as counted:
        run()
    result = {"batch_size": batch_size, "dtype": dtype, "ms_per_step": round(step_s * 1000, 2),
              "ops_per_step": sum(counted.counts.values()), **host_and_gpu_ms(run, device),
              "pairs_per_s": round(batch_size / step_s, 1), "flops_per_step": flops,
              "tflop_per_s": round(flops / step_s / 1e12, 2),
              "mfu": round(flops / step_s / (peak * 1e12), 3) if peak else None}
    if device.type == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    return result


def host_and_gpu_ms(run, device: torch.device, repeats: int = 5) -> dict:
    """A step's two clocks apart (the medians of `repeats` steps): the host's issue time, from the call to its
    return, and the GPU's time for the step's kernels (CUDA events). The GPU is first kept busy (a sleep kernel) so
    that the host issues the whole step before its kernels start: the events then time the kernels alone. On the
    CPU: the host's time only. host_bound: the host takes longer to issue the step than the GPU to compute it."""
    host, gpu = [], []
    for _ in range(repeats):
        synchronize(device)
        if device.type == "cuda":
            torch.cuda._sleep(int(5e8))  # about a quarter of a second: longer than any step's issue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        run()
        host.append((time.perf_counter() - began) * 1000)
        if device.type == "cuda":
            end.record()
            synchronize(device)
            gpu.append(start.elapsed_time(end))
    result = {"host_issue_ms": round(statistics.median(host), 2)}
    if gpu:
        result.update(gpu_ms=round(statistics.median(gpu), 2), host_bound=statistics.median(host) > statistics.median(gpu))
    return result


def captured_step(stage: str, batch_size: int, sizes: "CostSizes", device: torch.device, dtype: str,
                  steps: int = 20) -> dict:
    """The step captured as one CUDA graph (as plumbing.CapturedStep captures it) against the same step eager, from
    the same weights over `steps` steps: how far their losses and weights are apart (0: bitwise equal), and the
    captured step's ms, host and GPU apart. On the CPU nothing is captured: it says so."""
    if device.type != "cuda":
        return {"not_run": "a CUDA graph needs a GPU"}
    losses, weights = {}, {}
    for mode in ("eager", "captured"):
        model, run = cost_step(stage, batch_size, sizes, device=device, dtype=dtype)
        if mode == "captured":
            run = graphed(run)
        losses[mode] = torch.stack([run()[0].float() for _ in range(steps)]).cpu()
        weights[mode] = [p.detach().float().cpu() for p in model.parameters()]
    timing = host_and_gpu_ms(run, device)
    return {"steps": steps, "loss_max_diff": float((losses["eager"] - losses["captured"]).abs().max()),
            "weight_max_diff": max(float((a - b).abs().max()) for a, b in zip(weights["eager"], weights["captured"])),
            **timing}


def graphed(run):
    """run() captured as a CUDA graph: three warm-up steps on a side stream, then one captured; each call replays it
    (the rate is a tensor and AdamW capturable, as plumbing.CapturedStep sets them)."""
    for group in run.optimizer.param_groups:
        group["lr"], group["capturable"] = torch.tensor(float(group["lr"]), device="cuda"), True
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()

    def replay():
        graph.replay()
        return tuple(tensor.clone() for tensor in outputs)
    return replay


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decoding_rate(sizes: CostSizes, device: torch.device, dtype: str, batch: int, max_len: int,
                  static: bool = False) -> dict:
    """Greedy decoding with the key/value cache, the reference's decoder sizes, random weights (which never write
    EOT early: every caption max_len tokens, the worst case), in captions per second. static: the fixed-shape
    decoding (decoder.greedy_decode_static), on a GPU compiled to CUDA graphs (mode reduce-overhead)."""
    config = caption.Config(**{**caption.PRESETS["clevr"], **sizes.decoder})
    encoder = PairEncoder(clip.CLIP(sizes.clip_config), EncoderConfig(sizes.intra_layers))
    captioner = caption.build_captioner(config, encoder, dataclasses.asdict(sizes.clip_config), clip.PAD_ID)
    decoder = captioner.decoder.eval().to(device)
    visual = torch.randn(batch, decoder.config.visual_tokens, decoder.config.hidden, device=device)  # (B, M, E)
    ctx = contextlib.nullcontext() if dtype == "float32" else torch.autocast(device.type, dtype=getattr(torch, dtype))
    vocab = sizes.clip_config.vocab_size
    decode = decoder.greedy_decode
    if static:
        decode = torch.compile(decoder.greedy_decode_static, mode="reduce-overhead") if device.type == "cuda" \
            else decoder.greedy_decode_static
    with torch.no_grad(), ctx:
        for _ in range(3 if static else 1):  # warm-up (and, static on a GPU, compiling and capturing)
            decode(visual, vocab - 2, vocab - 1, max_len if static else 2)
        synchronize(device)
        start = time.perf_counter()
        tokens = decode(visual, vocab - 2, vocab - 1, max_len)
        synchronize(device)
    seconds = time.perf_counter() - start
    return {"batch": batch, "tokens_per_caption": tokens.shape[1], "captions_per_s": round(batch / seconds, 1)}


class ScriptRuns:
    """The project's scripts run as a user types them, each in a subprocess under a time limit, in `folder` (their
    working directory: the default data/ and runs/ folders land there). A run that fails or outlasts its limit
    writes its whole output to `failures` (a text file), and its figure says so."""

    def __init__(self, folder: Path, failures: Path, timeout_s: float):
        self.folder, self.failures, self.timeout_s = folder, failures, timeout_s
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, WHEELS), os.environ.get("PYTHONPATH", "")]),
                    "PYTHONUNBUFFERED": "1"}
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, command: list[str]) -> dict:
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=self.folder, env=self.env, capture_output=True, text=True,
                                  timeout=self.timeout_s)
            status, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as late:  # the child is killed; what it printed is kept
            status = f"timed out after {self.timeout_s:.0f} s"
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (late.stdout, late.stderr))
        seconds = round(time.perf_counter() - start, 1)
        lines = (out if status == 0 else err or out).strip().splitlines()
        if status != 0:
            with open(self.failures, "a") as log:
                log.write(f"===== {name}: {shlex.join(command)}\n(in {self.folder}, {status}, {seconds} s)\n"
                          f"----- stdout\n{out}\n----- stderr\n{err}\n")
        return {"exit_status": status, "seconds": seconds, "last_line": lines[-1] if lines else "",
                "resumed": any(line.startswith("resumed ") for line in out.splitlines())}


TINY_RUN_FLAGS = ["--data", "synth", "--synth_pairs", "40", "--epochs", "1", "--batch_size", "8"]


def card_commands(runs: ScriptRuns) -> dict:
    """The card's two commands as a one-GPU user types them, `python adapt.py --data synth` then `python caption.py
    --data synth` (no torchrun, --device auto, the default folders), on a tiny synthetic set: each to its end."""
    python = [sys.executable, str(REPO / "adapt.py")]
    result = {"adapt": runs("python adapt.py", [*python, *TINY_RUN_FLAGS])}
    result["caption"] = runs("python caption.py", [sys.executable, str(REPO / "caption.py"), *TINY_RUN_FLAGS,
                                                   "--eval_batch_size", "16"])
    result["files"] = sorted(str(p.relative_to(runs.folder)) for p in runs.folder.glob("runs/*/*")
                             if p.suffix in (".pt", ".json"))
    return result


def torchrun_tiny(runs: ScriptRuns, device: torch.device) -> dict:
    """adapt.py and caption.py under a 1-process torchrun (nccl on a GPU, gloo on the CPU) on a tiny synthetic set,
    each to its end (checkpoint and test files written), then adapt.py again with --resume: it continues from its
    last checkpoint (there, the end: it tests again). Returns each command's exit status, seconds and last line."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    tiny = [*TINY_RUN_FLAGS, "--device", device.type, "--num_workers", "2"]
    result = {"adapt": runs("torchrun adapt.py", [*torchrun, str(REPO / "adapt.py"), *tiny])}
    result["adapt --resume"] = runs("torchrun adapt.py --resume", [*torchrun, str(REPO / "adapt.py"), *tiny,
                                                                     "--resume"])
    result["caption"] = runs("torchrun caption.py", [*torchrun, str(REPO / "caption.py"), *tiny,
                                                      "--eval_batch_size", "16"])
    return result


def gpu_figures(out: str, tiny: bool = False, steps: int = 10) -> dict:
    """Everything BENCHMARKS.md section 11 needs from one GPU, in one command (GPU_RUN_BUDGET_S at most, by its own
    estimate, on one H100): the GPU, its peaks and the dtype --dtype auto picks; the card's commands as a one-GPU
    user types them, then under a 1-process torchrun with --resume (tiny synthetic sets); the seconds a stage-1
    checkpoint takes to write; the loader's pairs/s with
    this machine's cores; greedy decoding; each stage's step at the papers' sizes (random weights: the speed and
    memory do not depend on them) in bfloat16, float16 and TF32 float32 with MFU and peak memory against bench/
    cost's estimate, stage 1 also at 16, 32, 64 and 128 pairs per GPU; --compile's step last (the biggest parts
    last). Each part works in its own folder under out/parts; out/gpu.json is rewritten as each figure is measured,
    so a part that fails loses no other, and a failed script run's whole output goes to out/failures.log.
    tiny: a tiny CLIP on the CPU, every part in the same order and folders: the suite's check of this code."""
    begun = time.perf_counter()
    device = torch.device("cpu" if tiny else "cuda")
    sizes = TINY_COST_SIZES if tiny else CostSizes()
    out_dir = Path(out)
    parts, path, failures = out_dir / "parts", out_dir / "gpu.json", out_dir / "failures.log"
    parts.mkdir(parents=True, exist_ok=True)
    failures.unlink(missing_ok=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "python": sys.version.split()[0], "usable_cpus": data.usable_cpus(), "started": time.strftime("%F %T"),
              "commit": head_commit()}

    def record(name, measure):
        started = time.perf_counter()
        try:
            result[name] = measure()
        except Exception as error:  # one failed part: said in the file, the others still measured
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            with open(failures, "a") as log:
                log.write(f"===== {name}\n{traceback.format_exc()}\n")
        print(f"{name} ({time.perf_counter() - started:.0f} s): {json.dumps(result[name])}", flush=True)
        save_json(result, path)

    peaks = gpu_peak(result["device"]) if device.type == "cuda" else (None, None, None)
    result["peak_tflops"] = dict(zip(("bfloat16", "float16", "tf32"), peaks))
    peak_of = {"bfloat16": peaks[0], "float16": peaks[1], "float32": peaks[2]}  # float32 runs in TF32 here
    if device.type == "cuda":
        result["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        set_tf32(True)
    result["dtype_auto"] = auto = resolve_dtype("auto", device)
    timeout = SCRIPT_TIMEOUT_S * (4 if tiny else 1)  # the CPU's tiny runs step slower than a GPU's
    record("card commands", lambda: card_commands(ScriptRuns(parts / "card", failures, timeout)))
    record("torchrun", lambda: torchrun_tiny(ScriptRuns(parts / "torchrun", failures, timeout), device))
    record("checkpoint save", lambda: checkpoint_save(sizes, device, parts / "save"))
    workers = 1 if tiny else loader_workers(-1, device)
    for source, cached, resident in (("image cache", True, False), ("PNG", False, False), ("resident", True, True)):
        record(f"loader {source}", lambda: loader_rate(
            loader_samples(parts / "loader" / "synth", 40 if tiny else 200, cached), 8 if tiny else 128, workers,
            device, 1 if tiny else 10, resident))
    record("decoding", lambda: decoding_rate(sizes, device, auto, 4 if tiny else 256, 4 if tiny else 32))
    record("decoding static", lambda: decoding_rate(sizes, device, auto, 4 if tiny else 256, 4 if tiny else 32,
                                                    static=True))
    dtypes = ["bfloat16", "float16", "float32"] if auto != "float16" else ["float16", "float32"]
    for stage, batch in GPU_STEP_BATCH.items():
        for dtype in dtypes if stage != "stage1" else []:
            record(f"{stage} {dtype}", lambda: {
                **device_steps(stage, 2 if tiny else batch, sizes, device, dtype, 2 if tiny else steps, peak_of[dtype]),
                "estimate_float32_gb": None if tiny else COST_ESTIMATE_GB[stage]})
    for per_gpu in STAGE1_PER_GPU:  # where launches, not arithmetic, decide the step: how many GPUs pay
        record(f"stage1 {auto} {per_gpu} per GPU", lambda: device_steps(
            "stage1", 2 if tiny else per_gpu, sizes, device, auto, 2 if tiny else steps, peak_of[auto]))
    for dtype in dtypes[1:]:
        record(f"stage1 {dtype}", lambda: {
            **device_steps("stage1", 2 if tiny else GPU_STEP_BATCH["stage1"], sizes, device, dtype, 2 if tiny else steps,
                           peak_of[dtype]), "estimate_float32_gb": None if tiny else COST_ESTIMATE_GB["stage1"]})
    for stage, batch in GPU_STEP_BATCH.items():  # --cuda_graphs: the whole step one launch (plumbing/capture.py)
        if stage != "stage2_finetune":
            record(f"{stage} {auto} captured", lambda: captured_step(stage, 2 if tiny else batch, sizes, device, auto))
    record("stage1 compiled", lambda: compiled_step(sizes, device, auto, 2 if tiny else steps,
                                                    2 if tiny else GPU_STEP_BATCH["stage1"], "eager" if tiny else "inductor"))
    result["loaders over the step's demand"] = loader_margins(result, auto, 2 if tiny else GPU_STEP_BATCH["stage1"])
    result["seconds"] = round(time.perf_counter() - begun, 1)
    result["failed"] = sorted(name for name, value in result.items() if failed(value))
    save_json(result, path)
    return result


def loader_margins(result: dict, dtype: str, batch_size: int) -> dict:
    """Each pixel source's pairs/s over the pairs/s stage 1's captured step takes (else its eager step) at
    batch_size pairs: at least 1.5 and the step never waits for its pixels."""
    captured = result.get(f"stage1 {dtype} captured")
    eager = result.get(f"stage1 {dtype} {GPU_STEP_BATCH['stage1']} per GPU")  # (--tiny: batch_size 2 under that name)
    if isinstance(captured, dict) and captured.get("gpu_ms"):
        step_ms = max(captured["gpu_ms"], captured["host_issue_ms"])  # a replay: the longer of its two clocks
    elif isinstance(eager, dict) and eager.get("ms_per_step"):
        step_ms = eager["ms_per_step"]
    else:
        return {}
    demand = batch_size * 1000 / step_ms  # pairs/s the step takes
    return {source: round(result[f"loader {source}"]["pairs_per_s"] / demand, 2)
            for source in ("image cache", "PNG", "resident")
            if isinstance(result.get(f"loader {source}"), dict) and "pairs_per_s" in result[f"loader {source}"]}


def checkpoint_save(sizes: CostSizes, device: torch.device, folder: Path) -> dict:
    """Stage 1's whole training state at the papers' sizes (the model and AdamW's two moments of every trained
    parameter, random values) written as the loop writes ckpt_last.pt: its size; the seconds of the write itself
    (checkpoints.save_checkpoint: torch.save to a temporary file, fsync, rename), which a step waited for when the
    loop wrote in line; and the seconds a step waits now (BackgroundWriter.write: the copy to the host)."""
    encoder = PairEncoder(clip.CLIP(sizes.clip_config), EncoderConfig(sizes.intra_layers)).to(device)
    config = adapt.Config(**adapt.PRESETS["clevr"])
    encoder.freeze()
    optimizer = adapt.build_optimizer(encoder, config)
    for p in encoder.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()  # the moments exist, as after any step
    state = lambda: {"model": encoder.state_dict(), "optimizer": optimizer.state_dict()}
    folder.mkdir(parents=True, exist_ok=True)
    path, writer, in_line, waited = folder / "ckpt_last.pt", BackgroundWriter(), [], []
    for _ in range(2):
        synchronize(device)
        start = time.perf_counter()
        save_checkpoint(state(), path)
        in_line.append(time.perf_counter() - start)
        synchronize(device)
        start = time.perf_counter()
        writer.write([(state(), path)])
        waited.append(time.perf_counter() - start)
        writer.wait()
    size = path.stat().st_size
    path.unlink()
    return {"gb": round(size / 1e9, 3), "write_s": [round(x, 2) for x in in_line],
            "step_waits_s": [round(x, 3) for x in waited],
            "trained_parameters": sum(p.numel() for p in encoder.parameters() if p.requires_grad)}


def head_commit() -> str | None:
    """The commit measured, for BENCHMARKS.md: BENCH_COMMIT where the caller names it (a working tree copied to a
    lent GPU machine may carry another commit's .git), else the commit this checkout is at, else None."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def failed(figure) -> bool:
    """A figure that records a failure: an error, or a script run that did not end with exit status 0."""
    if not isinstance(figure, dict):
        return False
    return "error" in figure or figure.get("exit_status", 0) != 0 or any(failed(v) for v in figure.values())


def compiled_step(sizes: CostSizes, device: torch.device, dtype: str, steps: int, batch: int,
                  backend: str = "inductor") -> dict:
    """Stage 1's step with the encoder compiled (torch.compile, as --compile does), next to the eager step.
    backend "eager": torch.compile's graph capture alone, no code generated (the tiny check: no C++ compiler, seconds
    instead of minutes on 2 cores)."""
    eager = device_steps("stage1", batch, sizes, device, dtype, steps, None)
    model, run = cost_step("stage1", batch, sizes, device=device, dtype=dtype)
    model.forward = torch.compile(model.forward, backend=backend)  # what the step calls; the module stays as it was
    start = time.perf_counter()
    run()
    synchronize(device)
    compile_s = time.perf_counter() - start
    run()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        run()
    synchronize(device)
    step_s = (time.perf_counter() - start) / steps
    return {"dtype": dtype, "batch_size": batch, "backend": backend, "compile_s": round(compile_s, 1),
            "ms_per_step": round(step_s * 1000, 2), "eager_ms_per_step": eager["ms_per_step"]}


# ---------------------------------------------------------------------------------------------------------
# The command line: one subcommand per figure; its flags are the figure's arguments, its defaults BENCHMARKS.md's


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    figure = lambda name, what: sub.add_parser(name, help=what, description=what,
                                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    threads = dict(type=int, default=2, help="torch CPU threads")

    p = figure("clip", "ViT-B/32 image tower and tokenizer throughput")
    p.add_argument("--bpe-path", default=None, help="BPE vocabulary file (default: $CLIP_BPE_PATH or the cache)")
    p.add_argument("--threads", **threads)
    p.add_argument("--batch", type=int, default=32, help="images per image-tower batch")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each figure; the fastest is reported")
    p.add_argument("--captions", type=int, default=5000, help="CLEVR-style captions to tokenize")
    p.set_defaults(run=lambda a: clip_throughput(a.bpe_path, a.threads, a.batch, a.repeats, a.captions))

    p = figure("decoder", "greedy decoding (cached vs recomputed) and decoder training steps")
    p.add_argument("--threads", **threads)
    p.add_argument("--batch-decode", type=int, default=32, help="pairs per decoding batch")
    p.add_argument("--steps", type=int, default=22, help="decoding steps")
    p.add_argument("--batch-train", type=int, default=16, help="pairs per training step")
    p.add_argument("--length", type=int, default=32, help="caption tokens T per training pair")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each figure; the fastest is reported")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="arithmetic: float32, or bfloat16 under CPU autocast (weights stay float32)")
    p.set_defaults(run=lambda a: decoder_timings(a.threads, a.batch_decode, a.steps, a.batch_train, a.length,
                                                 a.repeats, a.dtype))

    p = figure("adapt", "one full-size stage-1 training step: pairs/s, GFLOP/s (JSON)")
    p.add_argument("--threads", **threads)
    p.add_argument("--batch-size", type=int, default=16, help="pairs per training step")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the counted one; the fastest is reported")
    p.add_argument("--compile", action="store_true", help="torch.compile the pair encoder first (about a minute)")
    p.set_defaults(run=lambda a: print(json.dumps(adapt_step(a.threads, a.batch_size, a.steps, a.compile), indent=2)))

    p = figure("synth", "the synth preset's two training steps: GFLOP per step, the step time, the fraction of this "
                        "machine's matmul rate (JSON); --profile N: the top operators and matrix products over N "
                        "steps (stderr)")
    p.add_argument("--threads", **threads)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the counted one; the fastest is reported")
    p.add_argument("--caption-length", type=int, default=14, help="caption words T per pair")
    p.add_argument("--profile", type=int, default=0, help="profile this many steps of each stage (0: no profile)")
    p.set_defaults(run=lambda a: print(json.dumps(synth_steps(a.threads, a.steps, a.caption_length, a.profile),
                                                  indent=2)))

    p = figure("caption", "stage-2 encoding, decoding and training on cached features (JSON)")
    p.add_argument("--threads", **threads)
    p.add_argument("--pairs", type=int, default=64, help="pairs encoded")
    p.add_argument("--batch", type=int, default=32, help="pairs per encoding and decoding batch")
    p.add_argument("--steps", type=int, default=22, help="decoding steps per caption")
    p.add_argument("--train-batch", type=int, default=16, help="pairs per training step (two captions each)")
    p.set_defaults(run=lambda a: print(json.dumps(caption_costs(a.threads, a.pairs, a.batch, a.steps, a.train_batch),
                                                  indent=2)))

    p = figure("load", "stage-1 training batches delivered to the training process by DataLoader workers, in "
                       "pairs/s: from the uint8 image cache and from PNGs (JSON)")
    p.add_argument("--root", default=None, help="a synthetic set's folder, drawn if missing (default: a temporary one)")
    p.add_argument("--pairs", type=int, default=200, help="pairs of the synthetic set drawn")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    p.add_argument("--batch-size", type=int, default=128, help="pairs per batch from the cache (32 from PNGs)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long each source is timed")
    p.set_defaults(run=lambda a: loading(a.root, a.pairs, a.workers, a.batch_size, a.seconds))

    p = figure("draw", "drawing the synthetic dataset into a new folder")
    p.add_argument("folder", help="where to draw (must not exist)")
    p.add_argument("--pairs", type=int, default=synth.SynthConfig.pairs, help="pairs to draw")
    p.add_argument("--seed", type=int, default=synth.SynthConfig.seed, help="the drawing's seed")
    p.add_argument("--workers", type=int, default=1, help="processes drawing pairs")
    p.set_defaults(run=lambda a: drawing(a.folder, a.pairs, a.seed, a.workers))

    p = figure("metrics", "scoring a CLEVR-Change-sized corpus with metrics.py, whole process, against the Java "
                          "toolkit's time (JSON)")
    p.add_argument("--corpus", default=TIMING_CORPUS, help="metrics.py input (JSON, or gzipped JSON)")
    p.add_argument("--runs", type=int, default=3, help="whole-process runs of each, in turns; the median is reported")
    p.add_argument("--variants", default="all", help=f"comma-separated, from {list(METRICS_VARIANTS)[1:]}; "
                                                      "none: all on, beside the toolkit")
    p.add_argument("--no-toolkit", dest="toolkit", action="store_false", help="leave the Java toolkit out")
    p.set_defaults(run=lambda a: print(json.dumps(metrics_scoring(a.corpus, a.runs, a.variants, a.toolkit), indent=2)))

    p = figure("kinds", "the kind of change each test caption of a caption.py run says (by keywords), per true kind; "
                        "and the pointing game where the run's test_scores.json holds it")
    p.add_argument("run_dir", help="a caption.py run folder, with test_predictions.json (e.g. runs/caption_synth)")
    p.add_argument("--data", default="synth", help="the dataset the run was tested on (data.py's SOURCES)")
    p.add_argument("--data_root", default=None, help="its folder (default: data/<name>)")
    p.add_argument("--confusion", action="store_true", help="also true kind -> said kind counts")
    p.set_defaults(run=lambda a: print_kinds(a.run_dir, a.data, a.data_root, a.confusion))

    p = figure("results", "results.html at CLEVR-Change's size (a synth run's test pairs repeated): the time to "
                          "write it, its size, and Chromium's time to open it, filter, sort and turn a page (JSON)")
    p.add_argument("run_dir", help="a caption.py run on the synthetic set (e.g. runs/caption_synth)")
    p.add_argument("--data_root", default=None, help="its dataset's folder (default: data/synth)")
    p.add_argument("--images", default=None, help="a folder of PNGs to cycle through instead of the synthetic "
                                                  "images (e.g. CLEVR-Change's images/)")
    p.add_argument("--pairs", type=int, default=CLEVR_TEST_PAIRS // 2, help="change pairs (each with a distractor)")
    p.add_argument("--out", default=None, help="where the page and its linked images go (default: a temporary folder)")
    p.add_argument("--no-browser", dest="browse", action="store_false", help="leave Chromium out")
    p.set_defaults(run=lambda a: print(json.dumps(results_page_at_scale(a.run_dir, a.data_root, a.images, a.pairs,
                                                                        a.out, a.browse), indent=2)))

    p = figure("first", "the README's first command from a clean clone: time-stamped logs, phases, peak memory, "
                        "md5 of the outputs, the kinds of change said (DIR/summary.json)")
    p.add_argument("folder", help="a new folder: the clone goes to folder/repo, the logs and summary.json beside it")
    p.add_argument("--commit", default=None, help="check this commit out in the clone (default: its HEAD)")
    p.add_argument("--avx2", action="store_true", help=f"torch's AVX-512 kernels off in both scripts: {AVX2_ONLY}")
    p.add_argument("--extra", default="", help="flags for both scripts, e.g. '--synth_pairs 40 --epochs 1' (a smoke run)")
    p.add_argument("--repo", default=None, help="the repository to clone (default: the one this file is in)")
    p.set_defaults(run=lambda a: report_first(first_command(a.folder, a.commit, a.avx2, a.extra, a.repo), a.folder))

    p = figure("residual", "bfloat16 autocast against float32 on the CPU, the vision residual stream in bfloat16 or "
                           "float32: pair-embedding error and test retrieval of a synth stage-1 checkpoint (JSON)")
    p.add_argument("checkpoint", help="a stage-1 checkpoint of the synth preset, e.g. runs/adapt_synth/ckpt_best.pt")
    p.add_argument("--data_root", default=None, help="the synthetic set's folder (default: data/synth)")
    p.add_argument("--threads", **threads)
    p.set_defaults(run=lambda a: residual_precision(a.checkpoint, a.data_root, a.threads))

    p = figure("gpu", f"the prepared GPU measurement, at most {GPU_RUN_BUDGET_S // 60} minutes on one H100 by its "
                      "own estimate: the GPU and the dtype auto picks, the card's commands as a one-GPU user types "
                      "them, a 1-process torchrun run and --resume, the loader, greedy decoding, each stage's step at "
                      "the papers' sizes in bf16, fp16 and TF32 (MFU, peak memory), stage 1 at 16 to 128 pairs per "
                      "GPU, --compile (JSON, printed as measured)")
    p.add_argument("--out", default="bench_gpu", help="the folder: gpu.json (rewritten after each figure), "
                                                      "failures.log (a failed part's whole output), parts/")
    p.add_argument("--steps", type=int, default=10, help="timed steps per figure, after two warm-up steps")
    p.add_argument("--tiny", action="store_true", help="a tiny CLIP on the CPU: the suite's check of this code")
    p.set_defaults(run=lambda a: gpu_figures(a.out, a.tiny, a.steps))

    p = figure("cost", "each stage at the papers' sizes: FLOPs per training pair, peak memory per batch size (each "
                       "step in a fresh process), the datasets' disk caches, and from these the hours of a full run on "
                       "one GPU, estimated (JSON)")
    p.add_argument("--threads", **threads)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="pairs per step, one process each")
    p.add_argument("--stages", nargs="+", choices=list(COST_STAGES), default=list(COST_STAGES),
                   help="the steps measured (the estimate needs all three)")
    p.add_argument("--tiny", action="store_true", help="a tiny CLIP and decoder instead of the papers' sizes (a test)")
    p.set_defaults(run=lambda a: print(json.dumps(run_costs(a.batch_sizes, a.stages,
                                                            TINY_COST_SIZES if a.tiny else None, a.threads),
                                                  indent=2)))

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
