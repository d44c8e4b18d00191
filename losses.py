"""The two training losses of CLIP4IDC (CLIP for Image Difference Captioning).

Stage 1, IDC (image difference captioning) adaptation: the pair embeddings of a batch of image pairs and the
text embeddings of their change captions are pulled together with CLIP's symmetric contrastive loss
(InfoNCE, a cross-entropy that picks each caption's own pair among all pairs, and each pair's caption among
all captions). Each caption's positive is its own pair; every other pair in the *global* batch, over all
processes, is a negative, so under DistributedDataParallel (DDP) each process first all-gathers the
embeddings of the others. Stage 2, IDC finetuning (captioning): token cross-entropy of the decoder, ignoring padding.

The reference is github.com/sushizixin/CLIP4IDC at commit ca49461: stage 1's loss is its modules/modeling.py
`_loose_similarity` with modules/until_module.py `CrossEn` and `AllGather`; stage 2's is the
CrossEntropyLoss(ignore_index=0) of its modules/modeling.py `forward`. Differs from reference: the all-gather's
backward sums the gradient over processes (see `_GatherWithGrad`), so that 2 processes with b pairs each train
exactly like 1 process with 2b pairs. The reference's `AllGather` backward keeps only the local slice, which
divides its gradients by the world size.

The whole file is the lesson, top to bottom: the differentiable all-gather, stage 1's loss, stage 2's loss, and
a demo at the end.

Run `python losses.py` for a small demo on random embeddings.

Shape letters: B pairs (or captions) on this process, W processes (world size), E joint embedding
width (512 for ViT-B/32), T caption tokens, V vocabulary size.
"""
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F


# --- Differentiable all-gather ---

class _GatherWithGrad(torch.autograd.Function):
    """Concatenate every process's tensor along dim 0; send the gradient back to its owner."""

    @staticmethod
    def forward(ctx, x):
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        parts[rank] = x  # the local slice stays the autograd input itself
        ctx.rank, ctx.batch = rank, x.shape[0]
        return torch.cat(parts, dim=0)  # (W*B, ...)

    @staticmethod
    def backward(ctx, grad):
        # differs from reference: it keeps only this process's slice. Every process computes the same
        # global loss; summing the slices over processes makes DDP's gradient average equal 1 process's.
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place; keep autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.batch:(ctx.rank + 1) * ctx.batch]  # (B, ...)


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All-gather x from every process along dim 0, differentiably: (B, ...) -> (W*B, ...).

    The identity when torch.distributed is not initialised (one process). Every process must pass
    the same B (a DistributedSampler with drop_last=True guarantees it), and the rows come out in
    rank order, so row r*B + i is process r's row i.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


# --- Stage 1: symmetric contrastive loss ---

@contextmanager
def ieee_float32():
    """IEEE float32 matrix products inside the block, whatever --tf32 set (plumbing.processes.set_tf32): for the
    few products whose comments say float32 (the contrastive logits below, explain.py's attention maps); TF32's
    10-bit mantissa would round a logit of 100 by up to 0.05. The settings are restored after the block."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def contrastive_loss(text_emb: torch.Tensor, pair_emb: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric InfoNCE between captions and image pairs over the global batch (the reference's
    modules/modeling.py `_loose_similarity` and modules/until_module.py `CrossEn`).

    text_emb  (B, E): text embedding of caption i of this process (not normalised)
    pair_emb  (B, E): pair embedding of the image pair that caption i describes (not normalised)
    logit_scale:      log(1/temperature), learned, as in CLIP; the logits are scaled by its exp
    Returns the scalar loss, the same value on every process.
    """
    assert text_emb.ndim == 2 and text_emb.shape == pair_emb.shape, (
        f"contrastive_loss: text_emb {tuple(text_emb.shape)} and pair_emb {tuple(pair_emb.shape)} "
        "must both be (B, E), row i of one describing row i of the other")
    # float32 even under autocast and --tf32: logits reach exp(logit_scale) = 100, where bf16 would round them by
    # up to 0.5 and TF32 by up to 0.05; the (W*B, W*B) product is tiny next to the encoder (its gradient, computed
    # later by autograd, follows --tf32)
    with torch.autocast(text_emb.device.type, enabled=False), ieee_float32():
        text = gather_with_grad(F.normalize(text_emb.float(), dim=-1))  # (W*B, E)
        pair = gather_with_grad(F.normalize(pair_emb.float(), dim=-1))  # (W*B, E)
        logits = logit_scale.float().exp() * text @ pair.T  # (W*B, W*B): caption i against every pair
        positives = torch.arange(logits.shape[0], device=logits.device)  # caption i describes pair i
        text_to_pair = F.cross_entropy(logits, positives)  # each caption picks its pair among all pairs
        pair_to_text = F.cross_entropy(logits.T, positives)  # each pair picks its caption among all captions
    return (text_to_pair + pair_to_text) / 2


# --- Stage 2: caption loss ---

def caption_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Token cross-entropy, averaged over the target tokens that are not padding (no label smoothing).

    logits  (B, T, V): the decoder's scores for the next token at each position; or (N, V) for N positions
                       already picked out (caption.py runs the output layer only where a target is not padding)
    targets (B, T):    the next token ids (caption_out), padded with pad_id after the end token; or (N,)
    pad_id: the tokenizer's padding id. In CLIP's vocabulary it is also the token "!", so a real "!"
        is never learned either, as in the reference's CrossEntropyLoss(ignore_index=0).
    A batch whose targets are all padding gives NaN (0 tokens to average over).
    Under DDP each process averages over its own tokens and DDP averages the processes, as in the
    reference, so a token of a batch with short captions weighs slightly more than in one process.
    """
    assert logits.ndim in (2, 3) and targets.shape == logits.shape[:-1], (
        f"caption_loss: logits {tuple(logits.shape)} must be (B, T, V) or (N, V) and targets "
        f"{tuple(targets.shape)} (B, T) or (N,) to match")
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1).long(), ignore_index=pad_id)


if __name__ == "__main__":
    torch.manual_seed(0)
    B, E, T, V, PAD_ID = 8, 32, 6, 50, 0
    logit_scale = torch.tensor(math.log(1 / 0.07))  # CLIP's initial temperature 0.07
    text = torch.randn(B, E)
    print(f"contrastive loss, unrelated embeddings: {contrastive_loss(text, torch.randn(B, E), logit_scale):.3f} "
          f"(scoring every pair alike would give log(B) = {math.log(B):.3f})")
    print(f"contrastive loss, each pair embedding = its caption's: {contrastive_loss(text, text, logit_scale):.3f}")
    targets = torch.randint(1, V, (B, T))
    targets[:, T // 2:] = PAD_ID
    logits = torch.randn(B, T, V)
    print(f"caption loss on random logits: {caption_loss(logits, targets, PAD_ID):.3f} "
          f"(a uniform guess gives log(V) = {math.log(V):.3f}; {int((targets != PAD_ID).sum())} of {B * T} "
          "targets are not padding)")
