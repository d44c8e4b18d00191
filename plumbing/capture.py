"""A training step captured whole as one CUDA graph and replayed (--cuda_graphs): the host issues one launch a step.

A ViT-B/32 step issues a few thousand operations (bench/ops.py), each a kernel launch the host pays for while the
GPU waits: on an H200 a stage-1 step of 128 pairs took 87 ms of which the GPU computed for about 10 (BENCHMARKS.md
section 11). torch.cuda.CUDAGraph records every kernel of one step, forward, backward, clipping and AdamW, and
replays them with a single launch. What that asks of the step, and how the scripts give it:
  - fixed shapes: stage 1's captions are not cut to the batch's longest (data.collate_text, cut=False); stage 2's
    are padded to max_words, its loss read at every position with padding ignored (data.collate_captions,
    static=True: the same loss);
  - no host sync and no Python branch on data inside the step: the steps read nothing back (a test records
    every wait), the finiteness check runs outside, on log steps, as always;
  - the learning rate a tensor the captured optimizer reads, filled before each replay with the number the loop
    set, and AdamW capturable;
  - a side stream for the warm-up steps, then one step captured, then replays that copy each batch into the
    captured inputs.
Not captured: float16's loss scaler (its step reads whether a gradient overflowed back to the host), DDP (its
all-reduce buckets need their own capture set-up), gradient accumulation over several micro-batches with
different shapes. The capture itself runs only on a GPU and has not run on one yet: --cuda_graphs is off by
default until `python -m bench gpu` has measured it.
"""
import torch

from plumbing.flags import ConfigError

WARMUP_STEPS = 3  # eager steps on a side stream before the capture, as torch.cuda.graphs asks (they train, too)


def check_capture(config, dist_, dtype: str) -> None:
    """--cuda_graphs asks for one GPU, bf16 or float32, without --compile: else one line saying why."""
    why = ("it captures CUDA kernels: run on a GPU" if dist_.device.type != "cuda" else
           "float16's loss scaler reads back whether a gradient overflowed: use --dtype bfloat16 or float32"
           if dtype == "float16" else
           "DDP's all-reduce is not captured yet: run one process" if dist_.ddp else
           "it replaces --compile: pass one of them" if getattr(config, "compile", False) else None)
    if why:
        raise ConfigError(f"--cuda_graphs: {why}")


class CapturedStep:
    """step(micro_batches) -> (loss, grad_norm), a training step captured once as a CUDA graph and replayed.

    The first WARMUP_STEPS calls run `step` eagerly on a side stream; the next captures one call, whose input
    tensors are that call's batches, then replays it; every later call copies its batches into those tensors (the
    collates' fixed shapes) and replays. The learning rate the loop sets in each group (a number) is written into a
    tensor per group that the captured AdamW reads."""

    def __init__(self, step, optimizer):
        self.step, self.optimizer, self.calls, self.graph = step, optimizer, 0, None
        self.inputs = self.outputs = self.rates = None

    def __call__(self, micro_batches):
        self.calls += 1
        if self.graph is None and self.calls <= WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outputs = self.step(micro_batches)
            torch.cuda.current_stream().wait_stream(side)
            return outputs
        groups = self.optimizer.param_groups
        if self.graph is None:
            device = micro_batches[0][next(iter(micro_batches[0]))].device
            self.rates = [torch.tensor(float(group["lr"]), device=device) for group in groups]
            for group, rate in zip(groups, self.rates):
                group["lr"], group["capturable"] = rate, True  # AdamW reads its rate and step count on the GPU
            self.inputs = [{k: v.clone() for k, v in batch.items()} for batch in micro_batches]
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.step(self.inputs)
        else:
            for rate, group in zip(self.rates, groups):
                rate.fill_(float(group["lr"]))  # the loop's number for this step
                group["lr"] = rate
            for captured, batch in zip(self.inputs, micro_batches):
                for key, tensor in captured.items():
                    if batch[key].shape != tensor.shape:
                        raise RuntimeError(f"--cuda_graphs: batch entry {key} is {tuple(batch[key].shape)}, the "
                                           f"captured step's {tuple(tensor.shape)}: a captured step needs fixed shapes")
                    tensor.copy_(batch[key], non_blocking=True)
        self.graph.replay()
        return tuple(tensor.clone() for tensor in self.outputs)  # the next replay overwrites the captured ones
