"""Remake bpe_tiny.txt.gz, tiny_openai_state_dict.pt and tiny_expected.pt by running OpenAI's own CLIP code.

Run by hand, never by the tests (see README.md beside this file):

    git clone https://github.com/openai/CLIP /tmp/openai-clip
    git -C /tmp/openai-clip checkout d05afc436d78f1c48dc0dbf8e5980a9d471f35f6
    python tests/clip_vectors/make_tiny_clip.py /tmp/openai-clip

The reference code is imported from that checkout, outside the repository. Its clip/clip.py imports
torchvision and tqdm at the top for its image transform and download bar; neither is used here, so
when they are not installed they are replaced by empty stand-ins (tokenize, build_model and the model
do not touch them).
"""
import gzip
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
N_MERGES = 1000         # the first 1,000 of OpenAI's 48,894 merges: 512 byte symbols + 1,000 + 2 specials = 1,514 ids
SEED_WEIGHTS, SEED_IMAGES = 20240601, 20240603
TEXTS = ["the small red metal cube changed to blue",
         "",                                                                   # EOT at position 1
         "There's a man in a red shirt; he's walking &amp; the car is gone!",  # contractions, HTML entity
         " ".join(["the large gray rubber sphere behind the cyan cylinder moved"] * 9)]  # > 77 tokens: truncated


def import_openai_clip(checkout: Path):
    for missing in ("torchvision", "torchvision.transforms", "tqdm"):
        try:
            __import__(missing)
        except ImportError:
            stub = types.ModuleType(missing)
            stub.Compose = stub.Resize = stub.CenterCrop = stub.ToTensor = stub.Normalize = stub.tqdm = None
            sys.modules[missing] = stub
    sys.path.insert(0, str(checkout))
    import clip.clip as openai_clip  # noqa: E402  (OpenAI's package, from the checkout)
    from clip import model as openai_model
    from clip.simple_tokenizer import SimpleTokenizer
    return openai_clip, openai_model, SimpleTokenizer


def write_tiny_merges(checkout: Path) -> Path:
    lines = gzip.open(checkout / "clip" / "bpe_simple_vocab_16e6.txt.gz").read().decode("utf-8").split("\n")
    text = "\n".join(lines[:1 + N_MERGES])  # the #version line and the first merges; no trailing newline, so that
    path = HERE / "bpe_tiny.txt.gz"           # OpenAI's reader (split on "\n") sees no empty merge
    path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    return path


def make_weights(openai_model, vocab_size: int) -> dict:
    torch.manual_seed(SEED_WEIGHTS)
    model = openai_model.CLIP(embed_dim=32, image_resolution=32, vision_layers=1, vision_width=128,
                              vision_patch_size=8, context_length=77, vocab_size=vocab_size,
                              transformer_width=64, transformer_heads=1, transformer_layers=2)
    g = torch.Generator().manual_seed(SEED_WEIGHTS + 1)
    with torch.no_grad():  # OpenAI's init leaves LayerNorms at (1, 0) and biases at 0: make every tensor non-trivial
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif name == "positional_embedding":
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        model.logit_scale.fill_(3.7)  # exp = 40.447: neither ln 100 nor ln(1/0.07)
    openai_model.convert_weights(model)  # fp16 where OpenAI's released checkpoints are fp16
    state_dict = dict(model.state_dict())
    state_dict |= {"input_resolution": torch.tensor(32), "context_length": torch.tensor(77),
                   "vocab_size": torch.tensor(vocab_size)}  # the metadata keys of OpenAI's archives
    return state_dict


def expected_outputs(openai_clip, openai_model, state_dict: dict) -> dict:
    model = openai_model.build_model(dict(state_dict)).float()  # what clip.load(..., device="cpu", jit=False) does
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(SEED_IMAGES))
    tokens = openai_clip.tokenize(TEXTS, truncate=True)
    captured = {}

    def keep(name):
        return lambda module, inputs, output: captured.setdefault(name, []).append(output.detach().clone())

    visual = model.visual
    hooks = [visual.conv1.register_forward_hook(keep("visual_patch_embed")),
             visual.ln_pre.register_forward_hook(keep("visual_ln_pre")),
             model.ln_final.register_forward_hook(keep("text_ln_final"))]
    hooks += [b.register_forward_hook(keep("visual_blocks")) for b in visual.transformer.resblocks]
    hooks += [b.register_forward_hook(keep("text_blocks")) for b in model.transformer.resblocks]
    with torch.no_grad():
        encode_image = model.encode_image(images)
        encode_text = model.encode_text(tokens)
        for hook in hooks:
            hook.remove()
        logits_per_image, logits_per_text = model(images, tokens)
        ln_post_all = visual.ln_post(captured["visual_blocks"][-1].permute(1, 0, 2))  # every token, batch-first
        text_input = model.token_embedding(tokens) + model.positional_embedding
    return {
        "images": images, "texts": TEXTS, "text_tokens": tokens,
        "encode_image": encode_image, "encode_text": encode_text,
        "logits_per_image": logits_per_image, "logits_per_text": logits_per_text,
        "logit_scale_exp": model.logit_scale.exp().detach(),
        "visual_patch_embed": captured["visual_patch_embed"][0],
        "visual_ln_pre": captured["visual_ln_pre"][0],  # OpenAI's ln_pre runs batch-first, before its permute
        "visual_blocks": torch.stack([x.permute(1, 0, 2) for x in captured["visual_blocks"]]),  # LND -> NLD
        "visual_ln_post_all_tokens": ln_post_all,
        "text_input_embeddings": text_input,
        "text_blocks": torch.stack([x.permute(1, 0, 2) for x in captured["text_blocks"]]),
        "text_ln_final": captured["text_ln_final"][0],
        "text_eot_index": tokens.argmax(-1),
    }


def main(checkout: Path):
    openai_clip, openai_model, SimpleTokenizer = import_openai_clip(checkout)
    tiny_bpe = write_tiny_merges(checkout)
    openai_clip._tokenizer = SimpleTokenizer(str(tiny_bpe))  # OpenAI's tokenize() reads this module global
    vocab_size = len(openai_clip._tokenizer.encoder)
    state_dict = make_weights(openai_model, vocab_size)
    torch.save(state_dict, HERE / "tiny_openai_state_dict.pt")
    torch.save(expected_outputs(openai_clip, openai_model, state_dict), HERE / "tiny_expected.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
