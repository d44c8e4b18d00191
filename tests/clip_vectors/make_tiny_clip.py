"""Remake the tiny model's files here (merges, weights, outputs, TorchScript archive) by running OpenAI's code.

The four files: bpe_tiny.txt.gz, tiny_openai_state_dict.pt, tiny_expected.pt and tiny_openai_traced.pt.
Run by hand, never by the tests (see README.md beside this file). It needs openai/CLIP at commit
d05afc436d78f1c48dc0dbf8e5980a9d471f35f6, in a checkout outside the repository (CLIP_DIR is a placeholder
for a folder of your choice):

    git clone https://github.com/openai/CLIP CLIP_DIR
    git -C CLIP_DIR checkout d05afc436d78f1c48dc0dbf8e5980a9d471f35f6
    python tests/clip_vectors/make_tiny_clip.py CLIP_DIR            # writes the four files
    python tests/clip_vectors/make_tiny_clip.py CLIP_DIR --check    # compares with the files here, writes nothing

The reference code is imported from that checkout. Its clip/clip.py imports torchvision and tqdm at the
top for its image transform and download bar; neither is used here, so when they are not installed they
are replaced by empty stand-ins (tokenize, build_model, the model and clip.load's reading do not touch
them; clip.load then returns None for the transform).

tiny_openai_traced.pt is the tiny model as OpenAI publishes its weights, a TorchScript archive: OpenAI's
build_model on tiny_openai_state_dict.pt (fp16 where the released files are), the three metadata keys
as buffers, torch.jit.trace_module of forward, encode_image and encode_text, torch.jit.save. The archive
is then written again without its *.debug_pkl records, which hold the tracer's source ranges: the file
paths of the checkout, of torch and of this script, with line numbers. Before it is kept, OpenAI's own
clip.load reads it back (jit=False and jit=True) and must give tiny_expected.pt's outputs exactly.

Running the script again gives byte-identical files, except one record of the archive: torch.jit.save
makes `.data/serialization_id` from a checksum of every record it wrote, the *.debug_pkl ones included,
so it changes with those paths and line numbers. --check compares every other record of the archive
byte for byte, and a run that would change that record alone leaves the archive here as it is.
"""
import argparse
import gzip
import io
import sys
import tempfile
import types
import warnings
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ARCHIVE = "tiny_openai_traced.pt"
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
            nothing = lambda *args, **kwargs: None  # noqa: E731  (clip.load builds its transform from these)
            stub.Compose = stub.Resize = stub.CenterCrop = stub.ToTensor = stub.Normalize = stub.tqdm = nothing
            sys.modules[missing] = stub
    sys.path.insert(0, str(checkout))
    import clip.clip as openai_clip  # noqa: E402  (OpenAI's package, from the checkout)
    from clip import model as openai_model
    from clip.simple_tokenizer import SimpleTokenizer
    return openai_clip, openai_model, SimpleTokenizer


def tiny_merges(checkout: Path) -> bytes:
    lines = gzip.open(checkout / "clip" / "bpe_simple_vocab_16e6.txt.gz").read().decode("utf-8").split("\n")
    text = "\n".join(lines[:1 + N_MERGES])  # the #version line and the first merges; no trailing newline, so that
    return gzip.compress(text.encode("utf-8"), mtime=0)  # OpenAI's reader (split on "\n") sees no empty merge


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


def traced_archive(openai_clip, openai_model, state_dict: dict, expected: dict) -> bytes:
    """OpenAI's model holding state_dict, traced and saved as OpenAI's released .pt files are."""
    model = openai_model.build_model(dict(state_dict))  # fp16 where the released files are (convert_weights), eval
    del model.context_length, model.vocab_size  # int attributes of OpenAI's CLIP, tensors in its released archives
    for key in ("context_length", "vocab_size", "input_resolution"):  # in the order of the released archives
        model.register_buffer(key, state_dict[key].clone())
    images = torch.zeros(1, 3, 32, 32)
    tokens = openai_clip.tokenize([""])  # (1, 77) int32: SOT, EOT, padding
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        model(images, tokens)  # a warm-up: OpenAI's blocks cast their causal mask to fp16 on the first call, so the
        traced = torch.jit.trace_module(model, {"forward": (images, tokens), "encode_image": images,
                                                "encode_text": tokens})  # tracer's check sees the same mask
        path = Path(folder) / ARCHIVE
        torch.jit.save(traced, str(path))  # records under "tiny_openai_traced/", as ViT-B-32.pt's
        with zipfile.ZipFile(path) as saved:
            records = [(info.filename, saved.read(info)) for info in saved.infolist()
                       if not info.filename.endswith(".debug_pkl")]
        path.write_bytes(write_zip(records))
        for jit in (False, True):  # OpenAI's own clip.load reads it back and gives OpenAI's outputs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated in torch 2.13
                loaded, _ = openai_clip.load(str(path), device="cpu", jit=jit)
            for key, (method, *inputs) in {"encode_image": ("encode_image", "images"),
                                           "encode_text": ("encode_text", "text_tokens"),
                                           "logits_per_image": ("forward", "images", "text_tokens")}.items():
                out = getattr(loaded, method)(*(expected[name] for name in inputs))
                out = out[0] if method == "forward" else out
                assert torch.equal(out, expected[key]), f"clip.load(jit={jit}).{method}: not OpenAI's {key}"
    return write_zip(records)


def write_zip(records: list) -> bytes:
    """A stored (uncompressed) zip of (name, bytes) records with fixed dates: the same records, the same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def same_but_serialization_id(made: bytes, shipped: bytes) -> bool:
    """The same records with the same bytes in the same order, but .data/serialization_id (see the docstring)."""
    def records(data):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return [(i.filename, archive.read(i)) for i in archive.infolist()
                    if not i.filename.endswith("/.data/serialization_id")]
    return records(made) == records(shipped)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of openai/CLIP at d05afc4")
    parser.add_argument("--check", action="store_true", help="compare with the files here; write nothing")
    args = parser.parse_args(argv)
    openai_clip, openai_model, SimpleTokenizer = import_openai_clip(args.checkout)
    made = {"bpe_tiny.txt.gz": tiny_merges(args.checkout)}
    with tempfile.TemporaryDirectory() as folder:  # OpenAI's SimpleTokenizer reads its merges from a file
        tiny_bpe = Path(folder) / "bpe_tiny.txt.gz"
        tiny_bpe.write_bytes(made["bpe_tiny.txt.gz"])
        openai_clip._tokenizer = SimpleTokenizer(str(tiny_bpe))  # OpenAI's tokenize() reads this module global
    vocab_size = len(openai_clip._tokenizer.encoder)
    state_dict = make_weights(openai_model, vocab_size)
    expected = expected_outputs(openai_clip, openai_model, state_dict)
    made["tiny_openai_state_dict.pt"] = saved(state_dict, "tiny_openai_state_dict.pt")
    made["tiny_expected.pt"] = saved(expected, "tiny_expected.pt")
    made[ARCHIVE] = traced_archive(openai_clip, openai_model, state_dict, expected)
    for filename, data in made.items():
        shipped = (HERE / filename).read_bytes() if (HERE / filename).exists() else b""
        if data == shipped:
            print(f"{filename}: the same bytes")
        elif filename == ARCHIVE and shipped and same_but_serialization_id(data, shipped):
            print(f"{filename}: the same records but .data/serialization_id (kept as it is)")
        elif args.check:
            print(f"{filename}: DIFFERENT")
            return 1
        else:
            (HERE / filename).write_bytes(data)
            print(f"{filename}: written, {len(data):,} bytes")
    return 0


def saved(obj, filename: str) -> bytes:
    """torch.save's bytes for a file of that name (its records are named after the file)."""
    with tempfile.TemporaryDirectory() as folder:
        torch.save(obj, Path(folder) / filename)
        return (Path(folder) / filename).read_bytes()


if __name__ == "__main__":
    sys.exit(main())
