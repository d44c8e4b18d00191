"""Casts: under bf16 or fp16 autocast, the matrix weights cast to that precision once per step, all in one operator.

Autocast casts a float32 weight to bf16 where a product uses it, one operator for each weight and each bias, and its
backward casts each gradient back, one more: 2 x 193 operators a stage-1 step of ViT-B/32 (of about 3,000). On a GPU
the host issues a step operator by operator (BENCHMARKS.md section 11), so these casts cost host time and kernels.
`CastWeights` wraps the model a step calls: before the forward it copies the matrix weights (nn.Linear and
nn.Conv2d weights and biases, CLIP's in_proj, CLIP's proj and text_projection) to the autocast precision in one
operator (torch._foreach_copy_), runs the model on the copies (torch.func.functional_call), and its backward casts
their gradients back to float32 in one more operator. The same numbers as autocast's casts (tested, bit for bit):
the same roundings of the same weights, the float32 weights stay the ones the optimizer updates; the products' inputs
are still cast by autocast. In float32 (no autocast) it is not used.

  cast_once(model, dtype)     what the scripts call: CastWeights under autocast, else the model
  CastWeights(model, dtype)   model(*args) with its matrix weights cast once; model.module is the model
  matrix_weights(model)       the names of the parameters it casts
"""
import torch
import torch.nn as nn
from torch.func import functional_call

PRODUCT_PARAMETERS = ("in_proj_weight", "in_proj_bias", "proj", "text_projection")  # clip.py's, used by products only


def matrix_weights(model: nn.Module) -> list[str]:
    """The names of the parameters that only matrix products read: what autocast casts at each use."""
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Linear, nn.Conv2d)) or name in PRODUCT_PARAMETERS:
                names.append(prefix + name)
    return names


class _CastOnce(torch.autograd.Function):
    """float32 weights -> their copies in `dtype`, written into `copies` by one operator; the backward casts the
    copies' gradients to float32 by one operator (adding them to float32 zeros that take no memory: expanded)."""

    @staticmethod
    def forward(ctx, copies: list, zeros: list, *weights):
        torch._foreach_copy_(copies, weights)
        ctx.zeros = zeros
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *torch._foreach_add(ctx.zeros, grads))


class CastWeights(nn.Module):
    """model(*args), its matrix weights (matrix_weights) cast to dtype once per call instead of at each use."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module, self.dtype = model, dtype
        parameters = dict(model.named_parameters())
        names = matrix_weights(model)
        self.trained = {n: parameters[n] for n in names if parameters[n].requires_grad}  # the Parameters themselves:
        self.frozen = {n: parameters[n] for n in names if not parameters[n].requires_grad}  # .to() and loads keep them
        self.copies = {}  # device -> (trained copies, frozen copies, float32 zeros): made at the first call there

    def forward(self, *args, **kwargs):
        trained, frozen = list(self.trained.values()), list(self.frozen.values())
        device = (trained or frozen)[0].device
        if device not in self.copies:
            self.copies[device] = ([torch.empty_like(p, dtype=self.dtype) for p in trained],
                                   [torch.empty_like(p, dtype=self.dtype) for p in frozen],
                                   [torch.zeros((), device=device).expand(p.shape) for p in trained])
        trained_copies, frozen_copies, zeros = self.copies[device]
        cast = dict(zip(self.trained, _CastOnce.apply(trained_copies, zeros, *trained)))
        if frozen:
            torch._foreach_copy_(frozen_copies, frozen)
            cast.update(zip(self.frozen, frozen_copies))
        return functional_call(self.module, cast, args, kwargs, tie_weights=False, strict=False)


def cast_once(model: nn.Module, dtype: str, compiled: bool = False) -> nn.Module:
    """The model a training step calls: CastWeights under bf16 or fp16 autocast (dtype, processes.setup's), the model
    itself in float32 and under --compile (which fuses the casts itself)."""
    if dtype == "float32" or compiled:
        return model
    return CastWeights(model, getattr(torch, dtype))
