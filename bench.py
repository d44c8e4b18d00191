"""Every timing that BENCHMARKS.md quotes, measured on the CPU: one function per figure, one subcommand each.

A reader of the concept files should see the concept, not the stopwatch, so the timings live here, apart,
as nanoGPT keeps its bench.py apart from model.py and train.py. This file imports the concept files (clip,
decoder, encoder, adapt, caption, runtime) and none of them imports it. BENCHMARKS.md quotes the figures
printed here, each section with the command that printed it.

Every figure builds its model at full size, the shape of OpenAI's ViT-B/32 (vision width D = 768, 12 blocks)
and of the reference's caption decoder (E = 512, V = 49408, 3 + 3 layers), with random weights: how long a
step takes does not depend on what the weights are. Each sets its number of torch threads (2, the cores of
the machine BENCHMARKS.md was measured on) and, but for clip, its seed; it warms up, and reports the fastest of
a few timed repeats, the one least slowed by whatever else the machine was doing. The defaults are the settings of the
figures in BENCHMARKS.md; smaller values (see each subcommand's --help) make a smoke run of a few seconds.

  clip      the ViT-B/32 image tower (images/s) and the BPE tokenizer, cold and warm (captions/s)   section 4
  decoder   greedy decoding with the key/value cache against the reference's full recompute, and a
            decoder training step on cached pair features, three ways                               section 3
  adapt     one stage-1 training step of the ViT-B/32 pair encoder (adapt.train_step): pairs/s, and
            its GFLOP/s next to this machine's matrix-multiply rate; JSON                            section 2
  synth     the synth preset's two training steps: GFLOP per step, ms per step, the fraction of this
            machine's matmul rate; --profile N: the top operators by wall time, and the largest
            matrix products' rates in the step and alone                                            section 1
  caption   stage 2 through caption.py's captioner: encoding pairs, decoding (cached and recomputed),
            a training step on cached features, and what they make of CLEVR-Change's splits; JSON  section 3
  metrics   metrics.py on a CLEVR-Change-sized corpus, the whole process, next to the Java toolkit   section 5
  load      stage-1 training batches: PNG decoding against the uint8 cache, 0 and 2 workers         section 6
  draw      drawing the synthetic dataset: pairs/s and pairs per CPU second                          section 6

Run:  python bench.py clip [--bpe-path FILE]       (the vocabulary from --bpe-path, CLIP_BPE_PATH or the cache)
      python bench.py decoder [--dtype bfloat16]   (about 2 minutes at the defaults)
      python bench.py adapt [--compile]
      python bench.py caption
      python bench.py synth [--profile 3]
      python bench.py metrics [--runs 3] [--variants "paraphrase index"] [--no-toolkit]
      python bench.py load --root /tmp/bench_synth --batches 40
      python bench.py draw /tmp/gen1 --pairs 2000 [--workers 2]
      python bench.py decoder --batch-decode 2 --steps 2 --batch-train 2 --length 4 --repeats 1   (a smoke run)
      python bench.py FIGURE --help                (the flags of one figure)

On a shared machine the wall clock includes the time spent waiting for a core: `clip` therefore also reports
CPU seconds, and `decoder` says how many cores other processes kept busy while it measured.

Shape letters: B pairs (or images) in a batch, R image side (224), M visual tokens per pair (100), E decoder
width (512), T caption tokens, V vocabulary (49408).
"""
import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import adapt
import caption
import clip
import data
import meteor
import metrics
import runtime
import synth
from decoder import CaptionDecoder, DecoderConfig
from encoder import EncoderConfig, PairEncoder

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
# clip: the image tower and the tokenizer (BENCHMARKS.md section 4)


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
# decoder: greedy decoding and a training step of the decoder alone (BENCHMARKS.md section 3)


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
# adapt: one full-size stage-1 training step, FLOPs counted, next to this machine's matmul rate (section 2)


def adapt_step(threads: int = 2, batch_size: int = 16, steps: int = 3, compile: bool = False) -> dict:
    """One stage-1 step of a ViT-B/32-sized encoder (random weights), float32 on the CPU, batch 16, T = 32.

    The same train_step and optimizer as training, with the reference's frozen set. The FLOPs are counted
    on a first, eager step (the counter cannot see into compiled code); the step time is the fastest of
    `steps` timed steps after it (and after compiling, with compile).
    """
    runtime.keep_freed_memory()  # as adapt.py does before training: steps reuse freed memory (BENCHMARKS.md 2)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = adapt.Config(batch_size=batch_size)
    encoder = PairEncoder(clip.CLIP(clip.CLIPConfig()), EncoderConfig(config.intra_layers)).train()
    encoder.freeze()
    optimizer = adapt.build_optimizer(encoder, config, torch.device("cpu"))
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
    return stage1, stage2


def synth_steps(threads: int = 2, steps: int = 5, caption_length: int = 14, profile: int = 0) -> dict:
    """One training step of each synth stage as the first README command runs it (stage 1: adapt.py's synth
    preset, batch 128; stage 2: caption.py's, batch 32 change + 32 distractor pairs, the pair encoder
    finetuned), on the synthetic CLIP (assets/synth-ViT-32.pt), float32. FLOPs from FlopCounterMode on an
    eager step, the fastest of `steps` timed steps, this run's 2048 x 2048 matmul rate before and after (the
    better one), and the fraction GFLOP/s / matmul GFLOP/s. With profile > 0, the operators' wall time over that
    many steps of each stage (OperatorClock)."""
    runtime.keep_freed_memory()  # as both scripts do before training
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    stage1_config = adapt.Config(**adapt.PRESETS["synth"], data="synth")
    stage2_config = caption.Config(**caption.PRESETS["synth"], data="synth")
    clip_model, _ = clip.load(stage1_config.clip_model)  # stage 2's CLIP; stage 1's is loaded by build_encoder
    encoder = adapt.build_encoder(stage1_config, clip_model.config.vocab_size)[0].train()  # the preset's frozen set
    batch1, batch2 = synth_batches(encoder, stage1_config.batch_size, stage2_config.batch_size, caption_length)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ctx = contextlib.nullcontext()  # float32: no autocast

    optimizer1 = adapt.build_optimizer(encoder, stage1_config, torch.device("cpu"))
    step1 = lambda: adapt.train_step(encoder, optimizer1, scaler, [batch1], ctx, stage1_config, False,
                                     encoder.clip.logit_scale)
    encoder2 = PairEncoder(clip_model, EncoderConfig(stage1_config.intra_layers))
    captioner = caption.build_captioner(stage2_config, encoder2, dataclasses.asdict(clip_model.config),
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
# caption: stage 2's encoding, decoding and training, full-size, and CLEVR-Change's splits at those rates (section 3)


def caption_costs(threads: int = 2, pairs: int = 64, batch: int = 32, steps: int = 22, train_batch: int = 16) -> dict:
    """Encoding (ViT-B/32 pair encoder), greedy decoding with and without the cache (same weights, `steps`
    tokens per caption: EOT is forbidden so both run every step, as the reference always does), and one
    training step on cached features (batch 16 pairs, two captions each as on CLEVR-Change)."""
    runtime.keep_freed_memory()  # as caption.py does before training
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = caption.Config()
    encoder = PairEncoder(clip.CLIP(clip.CLIPConfig()), EncoderConfig()).eval()
    captioner = caption.build_captioner(config, encoder, dataclasses.asdict(encoder.clip.config))
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

    features = {"visual": torch.randn(train_batch, *visual.shape[1:]), "caption_in": caption_ids(0),
                "caption_out": caption_ids(0), "no_change_visual": torch.randn(train_batch, *visual.shape[1:]),
                "no_change_caption_in": caption_ids(1), "no_change_caption_out": caption_ids(1)}

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
# data.py and synth.py: loading stage-1 batches (section 6), drawing the synthetic dataset (section 6)


def loading_rate(pairs: list[data.ImagePair], tokenizer: clip.SimpleTokenizer, batch_size: int, batches: int,
                 workers: int, images: data.ImageReader) -> dict[str, float]:
    """Stage-1 training batches (decode or cache, resize, normalise, tokenize, collate), in pairs per second.

    "wall": after one warm-up batch, pairs per second of wall time. "cpu": all pairs, warm-up included,
    per second of CPU time of this process and its DataLoader workers, which a busy machine does not change.
    """
    torch.manual_seed(0)
    samples = data.AdaptationSamples(pairs, tokenizer, train=True, images=images)
    loader = DataLoader(samples, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True)
    cpu_start = os.times()
    iterator = iter(loader)
    next(iterator)  # warm-up: worker start, first decode
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    del iterator  # joins the workers, so that their CPU time is counted below
    cpu = os.times()
    cpu_seconds = sum(cpu[:4]) - sum(cpu_start[:4])  # user + system, this process and its finished workers
    return {"wall": batches * batch_size / seconds, "cpu": (batches + 1) * batch_size / cpu_seconds}


def loading(name: str = "synth", root: str | None = None, batch_size: int = 16, batches: int = 20) -> None:
    """The stage-1 loading pipeline: PNG decoding against the uint8 cache, with 0 and 2 DataLoader workers."""
    torch.set_num_threads(1)
    root = data.dataset_root(name, root)
    if name == "synth":
        synth.ensure_synth(root)  # data.load_split reads the synthetic set; drawing it is synth.py's
    pairs = data.load_split(name, "train", root)
    tokenizer = clip.get_tokenizer(data.bpe_path(name, root))
    print(f"{name} train: {len(pairs)} pairs; batch {batch_size}, {batches} batches after one warm-up")
    start = time.perf_counter()
    cache = data.image_cache(pairs, root / "cache", "train", data.IMAGE_SIZE, workers=2)
    print(f"uint8 cache of {len(cache.row)} images ready in {time.perf_counter() - start:.1f} s: "
          f"{cache.array_path}")
    for name, images in (("decode PNG", data.ImageReader()), ("uint8 cache", data.ImageReader(cache=cache))):
        for workers in (0, 2):
            rate = loading_rate(pairs, tokenizer, batch_size, batches, workers, images)
            print(f"{name:12s} workers={workers}: {rate['wall']:7.1f} pairs/s, "
                  f"{rate['cpu']:7.1f} pairs per CPU second")


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
# metrics.py: scoring a CLEVR-Change-sized corpus, the whole process as a user runs it (section 5)

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

# Each speed variant of metrics.py and meteor.py, and the line that puts the plain code back in its place, run in
# the scoring process before metrics.main.
METRICS_VARIANTS = {
    "none (all speed variants on)": "",
    "paraphrase index": "meteor.FastMeteor.read_paraphrases = staticmethod(meteor.read_paraphrases)",
    "batched beam search": "meteor.FastMeteor.item_stats_many = meteor.Meteor.item_stats_many",
    "garbage collector paused": "import contextlib; metrics.collector_paused = contextlib.nullcontext",
    "PTB words-only captions": "metrics.FastCaptionScorer.tokenizer = staticmethod(metrics.ptb_tokenize)",
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


def metrics_scoring(corpus: str = "../shared/metrics_vectors/clevr_size_timing.json", runs: int = 3,
                    variants: str = "all", toolkit: bool = True) -> dict:
    """Whole-process seconds of metrics.py on `corpus` with every speed variant, and without each one, and of the
    Java toolkit, run in turns (ABAB...) so that the machine's changing load falls on all of them alike."""
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
            code = (f"import sys; sys.path.insert(0, {str(here)!r}); import metrics, meteor\n"
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
    print("\n".join(table))
    return {"walls": walls, "median_s": median, "same_scores": same, "cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------------------
# The command line: one subcommand per figure; its flags are the figure's arguments, its defaults BENCHMARKS.md's


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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

    p = figure("load", "loading stage-1 training batches: PNG decoding against the uint8 cache, 0 and 2 workers")
    p.add_argument("--data", default="synth", help="dataset name (data.py's SOURCES)")
    p.add_argument("--root", "--data_root", default=None, help="dataset folder (default: data/<name>)")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches after one warm-up")
    p.set_defaults(run=lambda a: loading(a.data, a.root, a.batch_size, a.batches))

    p = figure("draw", "drawing the synthetic dataset into a new folder")
    p.add_argument("folder", help="where to draw (must not exist)")
    p.add_argument("--pairs", type=int, default=synth.SynthConfig.pairs, help="pairs to draw")
    p.add_argument("--seed", type=int, default=synth.SynthConfig.seed, help="the drawing's seed")
    p.add_argument("--workers", type=int, default=1, help="processes drawing pairs")
    p.set_defaults(run=lambda a: drawing(a.folder, a.pairs, a.seed, a.workers))

    p = figure("metrics", "scoring a CLEVR-Change-sized corpus with metrics.py, whole process, against the Java "
                          "toolkit's time (JSON)")
    p.add_argument("--corpus", default="../shared/metrics_vectors/clevr_size_timing.json", help="metrics.py input")
    p.add_argument("--runs", type=int, default=3, help="whole-process runs of each, in turns; the median is reported")
    p.add_argument("--variants", default="all", help=f"comma-separated, from {list(METRICS_VARIANTS)[1:]}; "
                                                      "none: all on, beside the toolkit")
    p.add_argument("--no-toolkit", dest="toolkit", action="store_false", help="leave the Java toolkit out")
    p.set_defaults(run=lambda a: metrics_scoring(a.corpus, a.runs, a.variants, a.toolkit))

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
