"""The CLIP4IDC pair encoder: one CLIP ViT that looks at a before image and an after image together.

CLIP4IDC (CLIP for Image Difference Captioning; Guo et al., 2022, section 3.2 and Fig. 2; the method of both
stages) splits the vision transformer (ViT) of CLIP (Contrastive Language-Image Pre-training, clip.py) in two.
The first `intra_layers` blocks (9 of 12) are *intra-image* layers: each image is encoded alone, exactly as CLIP
would. Then the two token sequences are joined: a learned "before" vector is added to every token of the before
image, an "after" vector to every token of the after image, the two are concatenated into one sequence of 2(N+1)
tokens, a new joint position table is added and `ln_mid` normalises them. The remaining blocks (3) are
*inter-image* layers that attend across both images. `ln_post` and CLIP's projection then map every token to the
joint space: the captioner (stage 2) reads all 2(N+1) tokens, and the pair embedding used for retrieval (stage 1)
is the mean of the two CLS (class) tokens, at 0 (before) and N+1 (after). The caption's embedding is CLIP's own
text embedding, the feature at the EOT (end-of-text) token.

The reference is github.com/sushizixin/CLIP4IDC at commit ca49461; this file follows its modules/module_clip.py
(`VisualTransformer.__init__` and `.forward`, `CLIP.encode_image`). Differs from reference:
- The four new parameters live on the PairEncoder as `before_embedding`, `after_embedding`,
  `joint_positional_embedding`, `ln_mid` (the reference: `clip.visual.bef_embedding`, ...); plumbing/release.py maps
  the reference's released files onto these names.
- Weights stay float32 (the training script chooses autocast); the reference casts CLIP to float16.
- The intra-image layers see the batch as [all before images; all after images] instead of the
  reference's interleaved (before, after) pairs; each image is encoded alone, so this changes nothing.
- The no-decay set also holds the LayerNorm weights (see `no_decay_names`).

The lesson runs from EncoderConfig to the end of block_at_rows: the config, the frozen parts and the no-decay
rule, then PairEncoder (its five steps in order, encode_pair, and beside it embed_pair, the same pair embedding
computed from the two CLS rows of the last inter-image block alone; forward, which chooses between the two by
PairEncoder.cls_rows_only (adapt.py sets it from adapt.CLS_ROWS_ONLY); what trains), then block_at_rows, the one
block computed at chosen rows. Then the demo.

Run `python encoder.py` to push a random image pair through a tiny random CLIP and print every shape.
The benchmark of one full-size training step is `python -m bench adapt`.

Shape letters: B pairs in the batch, R image side (224), N patches per image ((224/32)^2 = 49),
D vision width (768), E joint embedding width (512), T caption tokens, L = 2(N+1) joint tokens (100),
Q rows computed alone (the speed variant's block_at_rows: stage 1 reads the 2 CLS rows).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import clip


@dataclass(frozen=True)
class EncoderConfig:
    intra_layers: int = 9  # CLIP blocks that encode each image alone; the rest (12 - 9 = 3) see the pair


# The parts of CLIP (names as in the OpenAI checkpoint) that the reference freezes in both stages (its
# main_task_retrieval.py and main_task_caption.py, `main`, with freeze_layer_num=0): the vision tower's embedding,
# which also starts every intra-image token (intra_image_parts), and the text tower's. Everything else trains.
VISION_EMBEDDING = (
    "visual.conv1",                 # patch embedding
    "visual.class_embedding",       # the image's CLS token
    "visual.positional_embedding",  # CLIP's per-image position table (N+1 rows)
    "visual.ln_pre",
)
FROZEN_IN_REFERENCE = (
    *VISION_EMBEDDING,
    "token_embedding",              # word embeddings of the text tower
    "positional_embedding",         # the text tower's position table
)


def under(name: str, part: str) -> bool:
    """Whether the CLIP parameter `name` is the part itself or inside it ("visual.transformer.resblocks.3" holds
    "visual.transformer.resblocks.3.mlp.c_fc.weight", but not "...resblocks.30.mlp.c_fc.weight")."""
    return name == part or name.startswith(part + ".")


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameters trained without weight decay, in both stages: every bias and every LayerNorm parameter."""
    # differs from reference: its rule is by name ("bias", "LayerNorm.weight"), and CLIP's LayerNorms
    # are named ln_*, so it decays their weights (and ln_mid's). We exempt all LayerNorm parameters.
    names = {name for name, _ in model.named_parameters() if name.endswith("bias")}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            names.update(f"{module_name}.{name}" for name, _ in module.named_parameters())
    return names


class PairEncoder(nn.Module):
    """CLIP with its vision tower split into intra-image and inter-image layers (the reference's
    modules/module_clip.py, `VisualTransformer`)."""

    # The one switch of the speed variant beside encode_pair: True makes forward compute the pair embedding from the
    # two CLS rows of the last inter-image block alone (embed_pair). adapt.py sets it from adapt.CLS_ROWS_ONLY.
    cls_rows_only = False

    def __init__(self, clip_model: clip.CLIP, config: EncoderConfig = EncoderConfig()):
        super().__init__()
        blocks = len(clip_model.visual.transformer.resblocks)
        if not 0 <= config.intra_layers <= blocks:
            raise ValueError(f"EncoderConfig.intra_layers={config.intra_layers}, but this CLIP has {blocks} "
                             f"vision blocks: choose a split point from 0 to {blocks} (the paper's is 9)")
        self.config = config
        # CLIP keeps its own parameter names (clip.visual.conv1, clip.visual.transformer.resblocks.*, ...)
        # so that the OpenAI checkpoint and the reference's parameter groups map one to one.
        self.clip = clip_model
        width = clip_model.visual.class_embedding.shape[0]  # D
        self.n_patches = clip_model.visual.positional_embedding.shape[0] - 1  # N
        tokens = 2 * (self.n_patches + 1)  # L: before CLS + N patches, then after CLS + N patches
        scale = width ** -0.5  # the reference's init scale, as CLIP's for class_embedding
        # differs from reference: named here, not clip.visual.bef_embedding etc. (plumbing/release.py maps them)
        self.before_embedding = nn.Parameter(scale * torch.randn(width))  # (D,) added to every before token
        self.after_embedding = nn.Parameter(scale * torch.randn(width))  # (D,) added to every after token
        # a new table, not a copy of CLIP's positional_embedding, as in the reference
        self.joint_positional_embedding = nn.Parameter(scale * torch.randn(tokens, width))  # (L, D)
        self.ln_mid = clip.LayerNorm(width)  # CLIP's float32 LayerNorm; torch's default init: weight 1, bias 0

    # --- the steps of the pair encoder, in order ---

    def intra_image(self, images: torch.Tensor) -> torch.Tensor:
        """CLIP's embedding and its first intra_layers blocks, each image alone: (B, 3, R, R) -> (B, N+1, D)."""
        x = self.clip.visual.embed(images)  # (B, N+1, D): patchify, prepend CLS, add positions, ln_pre
        for block in self.clip.visual.transformer.resblocks[:self.config.intra_layers]:
            x = block(x)  # (B, N+1, D)
        return x

    def join(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """Mark each image's tokens, concatenate them, add joint positions: 2 x (B, N+1, D) -> (B, L, D)."""
        dtype = before.dtype  # under autocast the blocks' output may be bf16/fp16; keep it
        x = torch.cat([before + self.before_embedding.to(dtype), after + self.after_embedding.to(dtype)], dim=1)  # (B, L, D)
        return self.ln_mid(x + self.joint_positional_embedding.to(dtype))  # (B, L, D)

    def inter_image(self, x: torch.Tensor) -> torch.Tensor:
        """CLIP's remaining blocks over the joint sequence, full attention: (B, L, D) -> (B, L, D)."""
        for block in self.clip.visual.transformer.resblocks[self.config.intra_layers:]:
            x = block(x)  # (B, L, D)
        return x

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """ln_post and CLIP's projection on every token, as the reference's encode_image: (B, L, D) -> (B, L, E)."""
        return self.clip.visual.ln_post(x) @ self.clip.visual.proj  # (B, L, E)

    @property
    def cls_rows(self) -> slice:
        """The positions of the before CLS (0) and the after CLS (N+1) in the joint sequence of L = 2(N+1): every
        (N+1)-th row, as a slice, so that tokens[:, cls_rows] is a view."""
        return slice(0, None, self.n_patches + 1)

    def pool(self, cls_tokens: torch.Tensor) -> torch.Tensor:
        """The pair embedding: the mean of the before and the after CLS token, not normalised: (B, 2, E) -> (B, E)."""
        return (cls_tokens[:, 0] + cls_tokens[:, 1]) / 2  # (B, E)

    # --- public entry points ---

    def intra_pair(self, before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The intra-image tokens of both images, (B, N+1, D) each, from images (B, 3, R, R) (normalised, as
        clip.pair_transform makes them), or the tokens themselves when given: adapt.py computes them once per
        image when the intra-image blocks are frozen (--freeze_intra, caches.IntraTokens), and then every step
        starts at the join."""
        if before.dim() == 3:
            return before, after
        side = self.clip.visual.input_resolution  # R
        assert before.shape == after.shape and before.shape[1:] == (3, side, side), (
            f"PairEncoder: before {tuple(before.shape)} and after {tuple(after.shape)} must both be "
            f"(B, 3, {side}, {side}); resize the images with clip.pair_transform({side})")
        # differs from reference: [before images; after images], not interleaved; each image is alone here
        x = self.intra_image(torch.cat([before, after]))  # (2B, N+1, D)
        return x[:before.shape[0]], x[before.shape[0]:]

    def encode_pair(self, before: torch.Tensor, after: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a batch of image pairs: before, after (B, 3, R, R) images or (B, N+1, D) intra-image tokens.

        Returns {"pair_embedding": (B, E) for retrieval, "pair_tokens": (B, L, E) for the captioner}.
        """
        tokens = self.project(self.inter_image(self.join(*self.intra_pair(before, after))))  # (B, L, E)
        return {"pair_embedding": self.pool(tokens[:, self.cls_rows]), "pair_tokens": tokens}

    # --- the same pair embedding, faster: the speed variant beside the plain computation (cls_rows_only) ---
    # Retrieval reads only the two CLS rows of the last inter-image block, so that block (through block_at_rows,
    # after this class), ln_post and the projection can run on those rows alone. What it buys: BENCHMARKS.md
    # section 2, "The CLS-rows speed variant, with and without". test_all.py checks that the two agree.

    def embed_pair(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """encode_pair's pair embedding alone, (B, E), as retrieval needs it (stage 1): only the two CLS tokens
        of the last block's output are read, so that block, ln_post and the projection run on them alone."""
        x = self.join(*self.intra_pair(before, after))  # (B, L, D)
        # differs from reference: it computes every token, then pools two; the same numbers up to float rounding
        blocks = self.clip.visual.transformer.resblocks[self.config.intra_layers:]
        if not blocks:  # no inter-image block to compute the rows: they are the join's
            x = x[:, self.cls_rows]  # (B, 2, D)
        else:
            for block in blocks[:-1]:
                x = block(x)  # (B, L, D)
            x = block_at_rows(blocks[-1], x, self.cls_rows)  # (B, 2, D)
        return self.pool(self.project(x))  # (B, 2, E) -> (B, E)

    # --- stage 1's view ---

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        """CLIP's caption embedding, the feature at the end-of-text token: (B, T) token ids -> (B, E)."""
        return self.clip.encode_text(text)

    def forward(self, before: torch.Tensor, after: torch.Tensor, text: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Stage 1's view, what the contrastive loss reads: {"pair_embedding": (B, E), "logit_scale": ()}, plus
        "text_embedding" (B, E) when captions are given. The captioner reads encode_pair's "pair_tokens".

        Everything the loss needs comes out of forward, so that under DDP (DistributedDataParallel) it is all
        computed inside the wrapped module: losses.contrastive_loss(out["text_embedding"], out["pair_embedding"],
        out["logit_scale"]).
        """
        if self.cls_rows_only:  # the speed variant (embed_pair, above): the same numbers up to float rounding
            pair_embedding = self.embed_pair(before, after)  # (B, E)
        else:
            pair_embedding = self.encode_pair(before, after)["pair_embedding"]  # (B, E)
        out = {"pair_embedding": pair_embedding,  # from images, or from the cached intra-image tokens
               "logit_scale": self.clip.logit_scale}  # log(1/temperature), learned, as in CLIP
        if text is not None:
            out["text_embedding"] = self.encode_text(text)  # (B, E)
        return out

    # --- what trains, and at which learning rate (the reference's main_task_retrieval.py and main_task_caption.py,
    # `prep_optimizer`) ---

    def freeze(self, parts: tuple[str, ...] = FROZEN_IN_REFERENCE) -> list[str]:
        """Stop gradients for these CLIP parts (names as in the OpenAI checkpoint); return the frozen names."""
        frozen = []
        for part in parts:
            matched = [(name, p) for name, p in self.clip.named_parameters() if under(name, part)]
            if not matched:
                raise ValueError(f"PairEncoder.freeze: CLIP has no parameter named {part!r} or under it; "
                                 f"use OpenAI's names such as {FROZEN_IN_REFERENCE}")
            for name, p in matched:
                p.requires_grad_(False)
                frozen.append("clip." + name)
        return frozen

    def intra_image_parts(self) -> tuple[str, ...]:
        """The names (OpenAI's) of everything that computes the intra-image tokens: the embedding and the
        intra-image blocks. Freezing them all makes each image's intra-image tokens a constant."""
        blocks = tuple(f"visual.transformer.resblocks.{i}" for i in range(self.config.intra_layers))
        return (*VISION_EMBEDDING, *blocks)

    def intra_image_weights(self) -> dict[str, torch.Tensor]:
        """CLIP's tensors that compute the intra-image tokens (intra_image_parts), by OpenAI's names, in
        state-dict order: what caches.IntraTokens keys its file on."""
        parts = self.intra_image_parts()
        return {name: tensor for name, tensor in self.clip.state_dict().items()
                if any(under(name, part) for part in parts)}

    def optimizer_groups(self, lr: float, clip_lr_scale: float, weight_decay: float,
                         joint_lr_scale: float = 1.0) -> list[dict]:
        """Parameter groups for a torch optimizer, frozen parameters left out.

        Stage 1 (the reference's main_task_retrieval.py, `prep_optimizer`): the new joint parameters train at lr,
        CLIP's at lr * clip_lr_scale (1e-4 and 1e-3 in the paper). Stage 2 (main_task_caption.py, `prep_optimizer`)
        puts the joint parameters at CLIP's rate: joint_lr_scale=clip_lr_scale. Each group carries "lr_scale" so a
        schedule can set group["lr"] = scheduled_lr * group["lr_scale"], and a "name" for logging.
        """
        no_decay = no_decay_names(self)
        groups = {(role, decay): [] for role in ("joint", "clip") for decay in (True, False)}
        for name, p in self.named_parameters():
            if p.requires_grad:
                role = "clip" if name.startswith("clip.") else "joint"
                groups[(role, name not in no_decay)].append(p)
        lr_scales = {"joint": joint_lr_scale, "clip": clip_lr_scale}
        return [{"name": role if decay else f"{role}_no_decay", "params": params,
                 "lr": lr * lr_scales[role], "lr_scale": lr_scales[role],
                 "weight_decay": weight_decay if decay else 0.0}
                for (role, decay), params in groups.items() if params]


def block_at_rows(block: clip.ResidualAttentionBlock, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """block(x)[:, rows], computed for those rows alone: (B, L, D) -> (B, len(rows), D), the same numbers up to
    float rounding. A position sees the others only through attention's keys and values, so every position
    still gives its key and value, while the rest of the block (the query, the residual, the MLP) runs on the
    rows that are read. Stage 1's speed variant reads the two CLS rows of the last inter-image block
    (PairEncoder.embed_pair). rows is a slice, so that picking them is a view: a list would be an index tensor
    copied to the GPU each call."""
    attn, D = block.attn, x.shape[-1]
    h = block.ln_1(x)                                                                      # (B, L, D)
    q = F.linear(h[:, rows], attn.in_proj_weight[:D], attn.in_proj_bias[:D])              # (B, Q, D): the rows ask
    k, v = F.linear(h, attn.in_proj_weight[D:], attn.in_proj_bias[D:]).chunk(2, dim=-1)  # 2 x (B, L, D): all answer
    x = x[:, rows] + attn.attend(q, k, v, x.shape[0]).view(q.shape)                       # (B, Q, D)
    x = x + block.mlp(block.ln_2(x))                                                      # (B, Q, D)
    return x


# --- a saved encoder rebuilt ---

def from_checkpoint(state: dict) -> PairEncoder:
    """The pair encoder a checkpoint describes, in eval mode: a CLIP of its "clip_config" sizes, split after its
    "encoder_config" intra-image blocks, holding its "model" weights (ours, or a release's renamed by
    plumbing/release.py), loaded strictly. A captioner's record of its stage 1 may hold no weights: the captioner's
    own copy then replaces the random ones."""
    model = PairEncoder(clip.CLIP(clip.CLIPConfig(**state["clip_config"])), EncoderConfig(**state["encoder_config"]))
    if state.get("model") is not None:
        model.load_state_dict(state["model"])
    return model.eval()


# --- the demo ---

def tiny_pair_encoder() -> PairEncoder:
    """A pair encoder on a tiny random CLIP (64 x 64 images of 16 patches, 4 vision blocks, 3 of them intra-image),
    seeded: what the demo below and plumbing/release.py's run."""
    torch.manual_seed(0)
    tiny = clip.CLIPConfig(embed_dim=32, image_resolution=64, vision_layers=4, vision_width=128, vision_patch_size=16,
                           context_length=77, vocab_size=1000, transformer_width=64, transformer_heads=1,
                           transformer_layers=2)
    return PairEncoder(clip.CLIP(tiny), EncoderConfig(intra_layers=3))


if __name__ == "__main__":
    model = tiny_pair_encoder().eval()
    tiny = model.clip.config
    B, R, T = 2, tiny.image_resolution, 8
    before, after = torch.randn(B, 3, R, R), torch.randn(B, 3, R, R)
    text = torch.randint(0, tiny.vocab_size - 2, (B, T))
    text[:, -1] = tiny.vocab_size - 1  # end-of-text
    print(f"tiny CLIP: {R}x{R} images, {model.n_patches} patches each, {tiny.vision_layers} vision blocks, "
          f"{model.config.intra_layers} intra-image + {tiny.vision_layers - model.config.intra_layers} inter-image")
    with torch.no_grad():
        print(f"before, after images        {tuple(before.shape)} each   (B, 3, R, R)")
        embedded = model.clip.visual.embed(before)
        print(f"per-image embedding         {tuple(embedded.shape)}       (B, N+1, D)")
        intra_before, intra_after = model.intra_pair(before, after)  # intra_image on [befores; afters]
        print(f"after intra-image layers    {tuple(intra_before.shape)} each  (B, N+1, D)")
        joint = model.join(intra_before, intra_after)
        print(f"joined, positions, ln_mid   {tuple(joint.shape)}       (B, L=2(N+1), D)")
        inter = model.inter_image(joint)
        print(f"after inter-image layers    {tuple(inter.shape)}       (B, L, D)")
        tokens = model.project(inter)
        print(f"ln_post and proj            {tuple(tokens.shape)}        (B, L, E)")
        cls = tokens[:, model.cls_rows]  # rows 0 (before CLS) and N+1 (after CLS)
        print(f"the two CLS rows, 0 and {model.n_patches + 1}  {tuple(cls.shape)}         (B, 2, E)")
        pair_embedding = model.pool(cls)
        print(f"pair embedding (their mean) {tuple(pair_embedding.shape)}            (B, E)")
        print(f"caption tokens              {tuple(text.shape)}             (B, T)")
        print(f"text embedding (EOT)        {tuple(model.encode_text(text).shape)}            (B, E)")
        out = model(before, after, text)
        print("forward returns            ", {key: tuple(value.shape) for key, value in out.items()})
        print(f"forward's pair embedding is the mean of the two CLS rows: "
              f"{torch.equal(out['pair_embedding'], pair_embedding)}")
        print(f"first pair's embedding, first 4 of {pair_embedding.shape[1]}: "
              f"{[round(v, 4) for v in pair_embedding[0, :4].tolist()]}")
