"""Tests of losses.py and encoder.py (to be merged into test_all.py by the lead).

Run them with:  python -m pytest test_part_encoder.py -q
The DDP test starts 2 CPU processes (gloo backend) and takes a few seconds.
"""
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import clip
from encoder import FROZEN_IN_REFERENCE, EncoderConfig, PairEncoder, rename_reference_keys
from losses import caption_loss, contrastive_loss, gather_with_grad
from test_all import shared

# --- losses.py ---


def test_contrastive_loss_matches_a_direct_computation():
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]])
    pair = torch.tensor([[2.0, 0.1], [1.0, 1.0], [-0.5, 1.0]])
    logit_scale = torch.tensor(math.log(10.0))
    # cosine similarities times exp(logit_scale), then cross-entropy with caption i <-> pair i
    cos = [[sum(a * b for a, b in zip(t, p)) / (math.hypot(*t) * math.hypot(*p)) for p in pair.tolist()]
           for t in text.tolist()]
    s = [[10.0 * c for c in row] for row in cos]
    n = len(s)
    text_to_pair = sum(-s[i][i] + math.log(sum(math.exp(s[i][j]) for j in range(n))) for i in range(n)) / n
    pair_to_text = sum(-s[i][i] + math.log(sum(math.exp(s[j][i]) for j in range(n))) for i in range(n)) / n
    expected = (text_to_pair + pair_to_text) / 2
    assert math.isclose(contrastive_loss(text, pair, logit_scale).item(), expected, rel_tol=1e-6)


def test_contrastive_loss_is_computed_in_float32_under_bf16_autocast():
    text, pair = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    logit_scale = torch.tensor(math.log(100.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = contrastive_loss(text, pair, logit_scale)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, contrastive_loss(text.float(), pair.float(), logit_scale), rtol=1e-6, atol=1e-6)


def test_gather_with_grad_is_the_identity_in_one_process():
    x = torch.randn(4, 3)
    assert gather_with_grad(x) is x


class _TwoTowers(nn.Module):
    """A stand-in for the pair encoder: one linear map per modality and CLIP's logit scale."""

    def __init__(self):
        super().__init__()
        self.text = nn.Linear(6, 4)
        self.pair = nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, text_in, pair_in):
        return {"text_embedding": self.text(text_in), "pair_embedding": self.pair(pair_in),
                "logit_scale": self.logit_scale}


def _full_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)


def _loss_and_gradients(model, text_in, pair_in):
    out = model(text_in, pair_in)
    loss = contrastive_loss(out["text_embedding"], out["pair_embedding"], out["logit_scale"])
    loss.backward()
    named = model.module.named_parameters() if isinstance(model, DDP) else model.named_parameters()
    return {"loss": loss.detach(), **{name: p.grad.clone() for name, p in named}}


def _ddp_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(_TwoTowers())  # DDP averages the parameter gradients over the processes
    text_in, pair_in = _full_batch()
    b = text_in.shape[0] // world
    mine = slice(rank * b, (rank + 1) * b)  # this process's share of the global batch
    torch.save(_loss_and_gradients(model, text_in[mine], pair_in[mine]), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_with_b_pairs_each_train_like_one_process_with_2b_pairs(tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    one_process = _loss_and_gradients(_TwoTowers(), *_full_batch())
    for rank in range(2):
        two_processes = torch.load(tmp_path / f"rank{rank}.pt")
        assert two_processes.keys() == one_process.keys()
        for name, expected in one_process.items():
            torch.testing.assert_close(two_processes[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_caption_loss_ignores_padding_targets():
    pad_id = 0
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[3, 5, 1, pad_id], [2, pad_id, pad_id, pad_id]])
    log_probs = logits.log_softmax(-1)
    real = [(0, 0), (0, 1), (0, 2), (1, 0)]  # (caption, position) of the 4 targets that are not padding
    expected = -sum(log_probs[b, t, targets[b, t]] for b, t in real) / len(real)
    torch.testing.assert_close(caption_loss(logits, targets, pad_id), expected)
    changed_at_padding = logits.clone()
    changed_at_padding[1, 1:] = 100.0
    torch.testing.assert_close(caption_loss(changed_at_padding, targets, pad_id), expected)


# --- encoder.py ---

TINY = dict(embed_dim=32, image_resolution=64, vision_layers=4, vision_width=128, vision_patch_size=16,
            context_length=77, vocab_size=1000, transformer_width=64, transformer_heads=1, transformer_layers=2)
N = (64 // 16) ** 2  # 16 patches per image of the tiny CLIP
D, E = 128, 32  # its vision width and joint embedding width


def _tiny_encoder(intra_layers=3):
    torch.manual_seed(0)
    return PairEncoder(clip.CLIP(clip.CLIPConfig(**TINY)), EncoderConfig(intra_layers=intra_layers)).eval()


def _images(batch=2, seed=1):
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def test_with_every_block_intra_image_the_cls_output_is_clips_image_embedding():
    model = _tiny_encoder(intra_layers=4)  # split at the last block: no inter-image layers
    images = _images()
    with torch.no_grad():
        cls = model.project(model.intra_image(images))[:, 0]  # join (before/after, joint positions, ln_mid) bypassed
        torch.testing.assert_close(cls, model.clip.encode_image(images), rtol=1e-5, atol=1e-5)


def test_on_the_tiny_openai_checkpoint_the_intra_image_cls_output_is_openais_image_embedding():
    expected = torch.load(shared("clip_vectors", "tiny_expected.pt"))
    clip_model = clip.build_model(clip.load_state_dict(shared("clip_vectors", "tiny_openai_state_dict.pt")))
    model = PairEncoder(clip_model, EncoderConfig(intra_layers=len(clip_model.visual.transformer.resblocks)))
    with torch.no_grad():
        cls = model.project(model.intra_image(expected["images"]))[:, 0]
    torch.testing.assert_close(cls, expected["encode_image"], rtol=1e-5, atol=1e-5)


def test_every_step_of_the_pair_encoder_has_the_documented_shape():
    model = _tiny_encoder(intra_layers=3)
    before, after = _images(seed=1), _images(seed=2)
    text = torch.randint(0, 998, (2, 8))
    text[:, -1] = 999  # end-of-text, the largest id
    with torch.no_grad():
        intra = model.intra_image(before)
        joint = model.join(intra, model.intra_image(after))
        inter = model.inter_image(joint)
        tokens = model.project(inter)
        out = model(before, after, text)
    assert intra.shape == (2, N + 1, D)
    assert joint.shape == inter.shape == (2, 2 * (N + 1), D)
    assert tokens.shape == (2, 2 * (N + 1), E)
    assert model.pool(tokens).shape == (2, E)
    assert {key: tuple(value.shape) for key, value in out.items()} == {
        "pair_embedding": (2, E), "pair_tokens": (2, 2 * (N + 1), E), "text_embedding": (2, E), "logit_scale": ()}
    torch.testing.assert_close(out["pair_tokens"], tokens)


def test_the_pair_embedding_is_the_mean_of_the_before_and_after_cls_tokens():
    model = _tiny_encoder()
    with torch.no_grad():
        out = model.encode_pair(_images(seed=1), _images(seed=2))
    tokens = out["pair_tokens"]
    torch.testing.assert_close(out["pair_embedding"], (tokens[:, 0] + tokens[:, N + 1]) / 2)


def test_swapping_before_and_after_changes_the_pair_embedding():
    model = _tiny_encoder()
    before, after = _images(seed=1), _images(seed=2)
    with torch.no_grad():
        forward = model.encode_pair(before, after)["pair_embedding"]
        swapped = model.encode_pair(after, before)["pair_embedding"]
    assert (forward - swapped).abs().max() > 1e-3


def test_inter_image_layers_let_the_before_image_see_the_after_image():
    before, after, other_after = _images(seed=1), _images(seed=2), _images(seed=3)
    for intra_layers, sees_after in [(3, True), (4, False)]:
        model = _tiny_encoder(intra_layers)
        with torch.no_grad():
            cls_a = model.encode_pair(before, after)["pair_tokens"][:, 0]
            cls_b = model.encode_pair(before, other_after)["pair_tokens"][:, 0]
        assert ((cls_a - cls_b).abs().max() > 1e-3) == sees_after


def test_new_parameters_start_at_scale_width_to_the_minus_half():
    model = _tiny_encoder()
    assert model.joint_positional_embedding.shape == (2 * (N + 1), D)
    for p in (model.before_embedding, model.after_embedding, model.joint_positional_embedding):
        assert abs(p.std().item() - D ** -0.5) < 0.2 * D ** -0.5
    assert not torch.equal(model.joint_positional_embedding[:N + 1], model.clip.visual.positional_embedding)
    assert torch.equal(model.ln_mid.weight, torch.ones(D)) and torch.equal(model.ln_mid.bias, torch.zeros(D))


def test_a_split_point_beyond_the_vision_blocks_is_refused():
    with pytest.raises(ValueError, match="intra_layers=5"):
        _tiny_encoder(intra_layers=5)


def test_freeze_stops_exactly_the_references_frozen_clip_parts():
    model = _tiny_encoder()
    frozen = model.freeze()
    assert FROZEN_IN_REFERENCE == ("visual.conv1", "visual.class_embedding", "visual.positional_embedding",
                                   "visual.ln_pre", "token_embedding", "positional_embedding")
    assert sorted(frozen) == sorted([
        "clip.visual.conv1.weight", "clip.visual.class_embedding", "clip.visual.positional_embedding",
        "clip.visual.ln_pre.weight", "clip.visual.ln_pre.bias", "clip.token_embedding.weight",
        "clip.positional_embedding"])
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == set(frozen)


def test_optimizer_groups_put_new_parameters_at_lr_and_clip_at_the_scaled_lr_without_decay_for_norms():
    model = _tiny_encoder()
    model.freeze()
    groups = {g["name"]: g for g in model.optimizer_groups(lr=1e-4, clip_lr_scale=1e-3, weight_decay=0.2)}
    names = {id(p): name for name, p in model.named_parameters()}
    members = {key: {names[id(p)] for p in g["params"]} for key, g in groups.items()}
    assert members["joint"] == {"before_embedding", "after_embedding", "joint_positional_embedding"}
    assert members["joint_no_decay"] == {"ln_mid.weight", "ln_mid.bias"}
    assert {"clip.logit_scale", "clip.visual.proj", "clip.text_projection"} <= members["clip"]
    assert {"clip.visual.ln_post.weight", "clip.ln_final.weight", "clip.visual.transformer.resblocks.0.ln_1.weight",
            "clip.transformer.resblocks.0.attn.in_proj_bias"} <= members["clip_no_decay"]
    assert [(groups[k]["lr"], groups[k]["weight_decay"]) for k in ("joint", "joint_no_decay", "clip", "clip_no_decay")] \
        == [(1e-4, 0.2), (1e-4, 0.0), (1e-4 * 1e-3, 0.2), (1e-4 * 1e-3, 0.0)]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set().union(*members.values()) == trainable and sum(map(len, members.values())) == len(trainable)


def test_a_reference_checkpoint_loads_after_renaming_its_new_parameters():
    model = _tiny_encoder()
    ours_to_reference = {ours: reference for reference, ours in
                         [("clip.visual.bef_embedding", "before_embedding"), ("clip.visual.aft_embedding", "after_embedding"),
                          ("clip.visual.joint_positional_embedding", "joint_positional_embedding"),
                          ("clip.visual.ln_mid.weight", "ln_mid.weight"), ("clip.visual.ln_mid.bias", "ln_mid.bias")]}
    reference = {ours_to_reference.get(key, key): value.half() for key, value in model.state_dict().items()}
    reference["decoder.some_layer.weight"] = torch.zeros(3)
    fresh = _tiny_encoder()
    fresh.load_state_dict(rename_reference_keys(reference), strict=True)
    torch.testing.assert_close(fresh.before_embedding, model.before_embedding.half().float())
