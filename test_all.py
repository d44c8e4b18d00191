"""Tests for every file of the project, in the order of the README's file list.

Run them with:  python -m pytest test_all.py -q

Tests that compare against known answers (OpenAI's own CLIP outputs, the coco-caption toolkit's scores) read
them from tests/, where a README.md in each folder says how every file was made. "The reference" is the authors'
implementation of CLIP4IDC, github.com/sushizixin/CLIP4IDC at commit ca49461.
"""
import ast
import collections
import contextlib
import dataclasses
import errno
import functools
import gc
import gzip
import hashlib
import html
import html.parser
import http.server
import io
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import adapt
import caption
import check
import clip
import data
import explain
import metrics
import plumbing
import pretrain
import results
import synth
from bench import figures as bench
from bench import ops as bench_ops
from bench import records as bench_records
from bench.browser import CHROMIUM, Chromium
from plumbing import batches, caches, checkpoints, clip_files, files, flags, loop, processes, progress, stopping
from scoring import fast as scoring_fast
from scoring import field, meteor, ptb
from decoder import CaptionDecoder, DecoderConfig, ids_to_text
from encoder import FROZEN_IN_REFERENCE, EncoderConfig, PairEncoder, block_at_rows, from_checkpoint
from losses import caption_loss, contrastive_loss, gather_with_grad
from plumbing.release import (REFERENCE_OUTPUT_WEIGHT, read_release, release_checkpoint, rename_reference_decoder_keys,
                              rename_reference_keys, to_reference_decoder_keys, to_reference_keys)

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "tests"


def vectors(*parts) -> Path:
    """The path of a known-answer file in tests/ (tests/<folder>/README.md says how it was made)."""
    return VECTORS.joinpath(*parts)


# ======== clip.py ========


# tolerances from tests/clip_vectors/README.md, "Tolerances"
EMBEDDING_TOL = dict(rtol=1e-5, atol=1e-5)
LOGITS_TOL = dict(rtol=1e-5, atol=1e-4)
INTERMEDIATE_TOL = dict(rtol=1e-5, atol=2e-5)


@pytest.fixture(scope="module")
def openai_tokenizer():
    return clip.get_tokenizer(vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz"))


@pytest.fixture(scope="module")
def tokenizer_cases():
    return json.loads(vectors("clip_vectors", "tokenizer_public.json").read_text())["cases"]


@pytest.fixture(scope="module")
def expected():
    return torch.load(vectors("clip_vectors", "tiny_expected.pt"), weights_only=True)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return clip.get_tokenizer(vectors("clip_vectors", "bpe_tiny.txt.gz"))  # OpenAI's first 1,000 merges


# OpenAI's released checkpoints store these in fp16 (its convert_weights), everything else in fp32
OPENAI_FP16 = ("visual.conv1.", ".attn.in_proj_", ".attn.out_proj.", ".mlp.c_fc.", ".mlp.c_proj.", "visual.proj",
               "text_projection")


def save_as_openai_archive(state_dict: dict, path: Path) -> Path:
    """Our CLIP holding state_dict, traced and saved as a TorchScript archive laid out like OpenAI's ViT-B-32.pt:
    the model's parameters, the three metadata buffers, fp16 where OpenAI's are, and the tracer's code."""
    model = clip.build_model(state_dict)
    del model.context_length  # an int attribute in ours, a tensor in OpenAI's archives
    for key in ("context_length", "vocab_size", "input_resolution"):  # in the order of OpenAI's archives
        model.register_buffer(key, state_dict[key].clone())
    images = torch.zeros(1, 3, model.visual.input_resolution, model.visual.input_resolution)
    tokens = torch.zeros(1, model.context_length, dtype=torch.int32)
    tokens[0, :2] = torch.tensor([model.config.vocab_size - 2, model.config.vocab_size - 1])  # SOT, EOT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about our shape asserts; torch.jit's deprecation
        traced = torch.jit.trace_module(model, {"forward": (images, tokens), "encode_image": images,
                                                "encode_text": tokens})
        for name, parameter in traced.named_parameters():
            if any(part in name for part in OPENAI_FP16):
                parameter.data = parameter.data.half()
        torch.jit.save(traced, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_archive(tmp_path_factory):
    """tiny_openai_jit.pt: the tiny OpenAI checkpoint as a TorchScript archive, built from our own model."""
    state_dict = clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt"), dtype=None)
    return save_as_openai_archive(state_dict, tmp_path_factory.mktemp("archive") / "tiny_openai_jit.pt")


def tiny_checkpoint(filename, tiny_archive) -> Path:
    return tiny_archive if filename == tiny_archive.name else vectors("clip_vectors", filename)


def test_encode_gives_openais_ids_for_all_412_public_strings(openai_tokenizer, tokenizer_cases):
    assert len(tokenizer_cases) == 412
    wrong = [case["id"] for case in tokenizer_cases if openai_tokenizer.encode(case["text"]) != case["encode"]]
    assert wrong == []


def test_tokenize_gives_openais_int32_rows_for_all_412_public_strings(openai_tokenizer, tokenizer_cases):
    rows = clip.tokenize([case["text"] for case in tokenizer_cases], truncate=True, tokenizer=openai_tokenizer)
    assert rows.dtype == torch.int32 and rows.shape == (412, 77)
    expected_rows = [case["tokenize"] + [clip.PAD_ID] * (77 - len(case["tokenize"])) for case in tokenizer_cases]
    wrong = [case["id"] for case, row, want in zip(tokenizer_cases, rows.tolist(), expected_rows) if row != want]
    assert wrong == []


def test_decode_gives_openais_text_for_all_412_public_strings(openai_tokenizer, tokenizer_cases):
    wrong = [case["id"] for case in tokenizer_cases if openai_tokenizer.decode(case["encode"]) != case["decode"]]
    assert wrong == []


def test_openais_vocabulary_has_49408_ids_with_the_specials_last(openai_tokenizer):
    assert (openai_tokenizer.vocab_size, openai_tokenizer.sot_id, openai_tokenizer.eot_id) == (49408, 49406, 49407)
    assert openai_tokenizer.decode([clip.PAD_ID]) == "!"  # CLIP has no pad token: id 0 is "!"


def test_tokenize_refuses_a_caption_that_is_too_long_unless_truncating(openai_tokenizer, tokenizer_cases):
    long_text = next(case["text"] for case in tokenizer_cases if case["truncated"])
    with pytest.raises(RuntimeError, match="truncate=True"):
        clip.tokenize(long_text, tokenizer=openai_tokenizer)
    row = clip.tokenize(long_text, truncate=True, tokenizer=openai_tokenizer)[0]
    assert row[0] == 49406 and row[-1] == 49407  # cut to 77, the last token overwritten by EOT


def test_a_tiny_merges_file_gives_a_small_vocabulary_with_derived_special_ids(tmp_path):
    path = tmp_path / "bpe_tiny.txt.gz"
    path.write_bytes(gzip.compress("#version: 0.2\nc u\nb e</w>\ncu be</w>\n".encode("utf-8")))
    tokenizer = clip.SimpleTokenizer(path)
    assert (tokenizer.vocab_size, tokenizer.sot_id, tokenizer.eot_id) == (512 + 3 + 2, 515, 516)
    assert tokenizer.encode("Cube") == [514]              # c u b e</w> -> cu b e</w> -> cu be</w> -> cube</w>
    assert tokenizer.encode("cubes") == [512, 65, 68, 338]  # cu, then the byte symbols b, e and s</w>
    assert clip.tokenize("cube cube", context_length=6, tokenizer=tokenizer).tolist() == [[515, 514, 514, 516, 0, 0]]
    assert tokenizer.decode([514, 514]) == "cube cube "


def test_a_file_that_is_not_a_merges_file_is_refused_with_its_name(tmp_path):
    path = tmp_path / "vocab.txt.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n'))
    with pytest.raises(clip_files.FileError, match="vocab.txt.gz.*#version"):
        clip.SimpleTokenizer(path)


def test_the_vocabulary_is_found_through_clip_bpe_path(monkeypatch):
    vocabulary = vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz")
    monkeypatch.setenv("CLIP_BPE_PATH", str(vocabulary))
    assert clip_files.get_tokenizer() is clip.get_tokenizer(vocabulary)  # one tokenizer per vocabulary file
    assert clip.tokenize("a cube", clip_files.get_tokenizer())[0, :4].tolist() == [49406, 320, 11353, 49407]


def test_a_missing_vocabulary_offline_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CLIP_BPE_PATH", raising=False)
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path))
    monkeypatch.setattr(clip_files, "BPE_URL", (tmp_path / "offline" / "bpe_simple_vocab_16e6.txt.gz").as_uri())
    with pytest.raises(FileNotFoundError) as error:
        clip_files.get_tokenizer()
    assert "bpe_simple_vocab_16e6.txt.gz" in str(error.value) and str(tmp_path) in str(error.value)
    assert "curl" in str(error.value) and "CLIP_BPE_PATH" in str(error.value)
    assert list(tmp_path.iterdir()) == []  # no partial download left behind


def test_openai_preprocessing_matches_openais_on_every_test_image():
    folder = vectors("clip_vectors", "preprocess_vectors")
    images = json.loads((folder / "images.json").read_text())["images"]
    expected = np.load(folder / "expected.npz")
    preprocess = clip.transform(224)
    for name in images:
        image = Image.open(folder / f"{name}.png")
        pixels = clip.center_crop_to_uint8(image, 224)  # (224, 224, 3) after resize, crop and convert("RGB")
        np.testing.assert_array_equal(pixels, expected[f"{name}__rgb_uint8"], err_msg=name)
        np.testing.assert_allclose(preprocess(image).numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)
    assert len(images) == 6


def test_pair_preprocessing_resizes_straight_to_a_square_without_cropping():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (320, 480, 3), dtype=np.uint8))  # CLEVR size
    pixels = clip.resize_to_uint8(image, 224)
    np.testing.assert_array_equal(pixels, np.asarray(image.resize((224, 224), Image.Resampling.BICUBIC)))
    torch.testing.assert_close(clip.pair_transform(224)(image), clip.normalize(pixels))


def test_normalize_turns_a_batch_of_uint8_images_into_clip_inputs():
    white = np.full((2, 4, 4, 3), 255, dtype=np.uint8)  # (B, H, W, 3), as plumbing/caches.py caches them
    x = clip.normalize(white)
    assert x.shape == (2, 3, 4, 4) and x.dtype == torch.float32
    assert math.isclose(x[0, 0, 0, 0].item(), (1 - clip.CLIP_MEAN[0]) / clip.CLIP_STD[0], rel_tol=1e-6)


@pytest.mark.parametrize("filename", ["tiny_openai_jit.pt", "tiny_openai_state_dict.pt"])
def test_both_tiny_checkpoints_load_and_reproduce_openais_outputs(filename, expected, tiny_tokenizer, tiny_archive):
    model, preprocess = clip_files.load(tiny_checkpoint(filename, tiny_archive))
    assert model.config.image_resolution == 32 and model.visual.input_resolution == 32
    tokens = clip.tokenize(expected["texts"], truncate=True, tokenizer=tiny_tokenizer)
    assert torch.equal(tokens, expected["text_tokens"])
    assert_openais_outputs(model, tokens, expected)
    torch.testing.assert_close(model.logit_scale.exp().detach(), expected["logit_scale_exp"])


def assert_openais_outputs(model, tokens, expected):
    """The model's image and text embeddings and logits are OpenAI's (tiny_expected.pt), to the tolerances."""
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(expected["images"]), expected["encode_image"], **EMBEDDING_TOL)
        torch.testing.assert_close(model.encode_text(tokens), expected["encode_text"], **EMBEDDING_TOL)
        logits_per_image, logits_per_text = model(expected["images"], tokens)
    torch.testing.assert_close(logits_per_image, expected["logits_per_image"], **LOGITS_TOL)
    torch.testing.assert_close(logits_per_text, expected["logits_per_text"], **LOGITS_TOL)


def test_an_archive_traced_from_openais_own_model_loads_and_reproduces_openais_outputs(expected, tiny_tokenizer):
    path = vectors("clip_vectors", "tiny_openai_traced.pt")  # OpenAI's model, traced and saved by make_tiny_clip.py
    stored = clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt"), dtype=None)
    tensors = clip_files.load_state_dict(path, dtype=None)  # read without running the archive's code
    assert tensors.keys() == stored.keys()
    assert all(tensors[k].dtype == stored[k].dtype and torch.equal(tensors[k], stored[k]) for k in stored)
    model, _ = clip_files.load(path)
    assert_openais_outputs(model, clip.tokenize(expected["texts"], truncate=True, tokenizer=tiny_tokenizer), expected)


def test_every_intermediate_activation_matches_openais(expected, tiny_archive):
    model, _ = clip_files.load(tiny_archive)
    images, tokens = expected["images"], expected["text_tokens"]
    with torch.no_grad():
        visual = model.visual
        torch.testing.assert_close(visual.conv1(images), expected["visual_patch_embed"], **INTERMEDIATE_TOL)
        x = visual.embed(images)
        torch.testing.assert_close(x, expected["visual_ln_pre"], **INTERMEDIATE_TOL)
        for block, want in zip(visual.transformer.resblocks, expected["visual_blocks"], strict=True):
            x = block(x)
            torch.testing.assert_close(x, want, **INTERMEDIATE_TOL)
        torch.testing.assert_close(visual.ln_post(x), expected["visual_ln_post_all_tokens"], **INTERMEDIATE_TOL)

        x = model.token_embedding(tokens) + model.positional_embedding
        torch.testing.assert_close(x, expected["text_input_embeddings"], **INTERMEDIATE_TOL)
        for block, want in zip(model.transformer.resblocks, expected["text_blocks"], strict=True):
            x = block(x, causal=True)
            torch.testing.assert_close(x, want, **INTERMEDIATE_TOL)
        torch.testing.assert_close(model.ln_final(x), expected["text_ln_final"], **INTERMEDIATE_TOL)
    assert tokens.argmax(-1).tolist() == expected["text_eot_index"].tolist()
    assert expected["text_eot_index"][[1, 3]].tolist() == [1, 76]  # the empty caption; the one cut to 77 tokens


def test_reading_the_torchscript_archive_gives_exactly_its_jit_state_dict(tiny_archive):
    path = tiny_archive
    ours = clip_files.load_state_dict(path, dtype=None)  # stored dtypes, as torch.jit.load gives them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated in torch 2.13,
        warnings.simplefilter("ignore", FutureWarning)  # and said so as a FutureWarning in 2.14
        theirs = torch.jit.load(str(path), map_location="cpu").state_dict()
    assert list(ours) == list(theirs) and len(ours) == 17 + 12 * (1 + 2)  # 12 tensors per block, 1 + 2 blocks
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    stored = clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt"), dtype=None)
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in stored.items()}
    assert all(torch.equal(ours[k], stored[k]) for k in stored)


def test_load_state_dict_casts_weights_to_float32_and_keeps_the_metadata_ints():
    state_dict = clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt"))
    assert {v.dtype for k, v in state_dict.items() if k not in clip.METADATA_KEYS} == {torch.float32}
    assert [state_dict[k].item() for k in clip.METADATA_KEYS] == [32, 77, 1514]


def test_an_archive_that_asks_for_any_other_python_name_is_refused_not_run(tmp_path):
    path = tmp_path / "evil.pt"
    payload = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R."  # would call os.system("true")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil/data.pkl", payload)
        archive.writestr("evil/constants.pkl", b"\x80\x02).")
    with pytest.raises(RuntimeError, match="refusing to load os.system; .* not what it claims"):
        clip_files.load_state_dict(path)


def vit_b32_shaped_state_dict() -> dict:
    """Random tensors under every key of OpenAI's ViT-B-32.pt, with its shapes (and its fp16/fp32 layout)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"positional_embedding": (77, 512), "text_projection": (512, 512), "logit_scale": (),
              "visual.class_embedding": (768,), "visual.positional_embedding": (50, 768), "visual.proj": (768, 512),
              "visual.conv1.weight": (768, 3, 32, 32), "visual.ln_pre.weight": (768,), "visual.ln_pre.bias": (768,),
              "visual.ln_post.weight": (768,), "visual.ln_post.bias": (768,), "token_embedding.weight": (49408, 512),
              "ln_final.weight": (512,), "ln_final.bias": (512,)}
    for tower, width in (("visual.transformer", 768), ("transformer", 512)):
        for i in range(12):
            block = f"{tower}.resblocks.{i}."
            shapes |= {block + "attn.in_proj_weight": (3 * width, width), block + "attn.in_proj_bias": (3 * width,),
                       block + "attn.out_proj.weight": (width, width), block + "attn.out_proj.bias": (width,),
                       block + "ln_1.weight": (width,), block + "ln_1.bias": (width,),
                       block + "mlp.c_fc.weight": (4 * width, width), block + "mlp.c_fc.bias": (4 * width,),
                       block + "mlp.c_proj.weight": (width, 4 * width), block + "mlp.c_proj.bias": (width,),
                       block + "ln_2.weight": (width,), block + "ln_2.bias": (width,)}
    state_dict = {k: torch.randn(shape, generator=g).to(torch.float16 if len(shape) >= 2 else torch.float32)
                  for k, shape in shapes.items()}
    state_dict |= {"input_resolution": torch.tensor(224), "context_length": torch.tensor(77),
                   "vocab_size": torch.tensor(49408)}
    return state_dict


def test_a_vit_b32_shaped_state_dict_loads_strictly_and_is_recognised_as_vit_b32():
    model = clip.build_model(vit_b32_shaped_state_dict())
    assert model.config == clip.CLIPConfig(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768,
                                           vision_patch_size=32, context_length=77, vocab_size=49408,
                                           transformer_width=512, transformer_heads=8, transformer_layers=12)
    assert model.config.vision_heads == 12 and not model.training
    assert sum(p.numel() for p in model.parameters()) == 151_277_313  # ViT-B/32's published size
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("visual.ln_post.bias"), "Missing key.*visual.ln_post.bias"),
    (lambda sd: sd.update({"visual.extra": torch.zeros(1)}), "Unexpected key.*visual.extra"),
    (lambda sd: sd.pop("visual.conv1.weight"), "no 'visual.conv1.weight'"),
])
def test_a_state_dict_with_missing_or_extra_keys_is_refused_by_name(change, message):
    state_dict = clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt"))
    change(state_dict)
    with pytest.raises((RuntimeError, KeyError), match=message):
        clip.build_model(state_dict)


def test_a_missing_weights_file_is_reported_with_its_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        clip_files.load(tmp_path / "nowhere.pt")
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        clip_files.load_state_dict(tmp_path / "nowhere.pt")


def _truncated(data):
    return data[: len(data) // 2]


def _one_byte_flipped_in_the_first_tensor(data):
    position = data.index(b"tiny_openai_jit/data/0") + 200  # inside that record's bytes: its CRC no longer matches
    return data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1:]


@pytest.mark.parametrize("filename, damage", [
    ("tiny_openai_jit.pt", _truncated),
    ("tiny_openai_state_dict.pt", _truncated),
    ("tiny_openai_jit.pt", _one_byte_flipped_in_the_first_tensor),
    ("tiny_openai_jit.pt", lambda data: b"not a weights file at all"),
])
def test_a_truncated_or_corrupt_weights_file_gives_a_clear_error(filename, damage, tmp_path, tiny_archive):
    path = tmp_path / filename
    path.write_bytes(damage(tiny_checkpoint(filename, tiny_archive).read_bytes()))
    with pytest.raises(RuntimeError, match=f"{filename}.*(corrupt|truncated)"):
        clip_files.load(path)


def test_a_named_model_offline_fails_fast_naming_the_missing_file(tmp_path, monkeypatch):
    url = (tmp_path / "offline" / ("0" * 64) / "ViT-B-32.pt").as_uri()
    monkeypatch.setitem(clip_files.MODELS, "ViT-B/32", (url, "0" * 64))
    with pytest.raises(FileNotFoundError) as error:
        clip_files.load("ViT-B/32", download_root=tmp_path / "cache")
    assert str(tmp_path / "cache" / "ViT-B-32.pt") in str(error.value) and "curl" in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_load_downloads_a_named_model_into_the_cache_once_its_checksum_matches(tmp_path, monkeypatch, expected,
                                                                             tiny_archive):
    source = tiny_archive
    sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    (tmp_path / "server" / sha256).mkdir(parents=True)  # OpenAI's URLs embed the sha256 the same way
    shutil.copy(source, tmp_path / "server" / sha256 / "tiny.pt")
    monkeypatch.setitem(clip_files.MODELS, "tiny", ((tmp_path / "server" / sha256 / "tiny.pt").as_uri(), sha256))
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    model, _ = clip_files.load("tiny")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny.pt"]
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(expected["images"]), expected["encode_image"], **EMBEDDING_TOL)


@pytest.fixture
def http_folder(tmp_path):
    """A folder served by http.server on 127.0.0.1 in a thread; yields (folder, base URL)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_over_http_keeps_a_file_only_when_its_sha256_matches(http_folder, tmp_path):
    folder, base_url = http_folder
    data = b"weights " * 100_000
    (folder / "weights.bin").write_bytes(data)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="sha256.*deleted"):
        clip_files.download(f"{base_url}/weights.bin", cache, "0" * 64)
    assert list(cache.iterdir()) == []  # the bad download is gone, no temporary file left
    path = clip_files.download(f"{base_url}/weights.bin", cache, hashlib.sha256(data).hexdigest())
    assert path == cache / "weights.bin" and path.read_bytes() == data
    assert list(cache.iterdir()) == [path]


def test_download_from_a_file_url_deletes_a_bad_download_and_keeps_a_good_one(tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="sha256"):
        clip_files.download(source.as_uri(), cache, "0" * 64)
    assert list(cache.iterdir()) == []
    sha256 = hashlib.sha256(b"abc").hexdigest()
    assert clip_files.download(source.as_uri(), cache, sha256).read_bytes() == b"abc"
    assert list(cache.iterdir()) == [cache / "weights.bin"]


def test_download_replaces_a_cached_file_whose_checksum_is_wrong(tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"good")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "weights.bin").write_bytes(b"bad")
    with pytest.warns(UserWarning, match="downloading it again"):
        path = clip_files.download(source.as_uri(), cache, hashlib.sha256(b"good").hexdigest())
    assert path.read_bytes() == b"good" and list(cache.iterdir()) == [path]


def test_a_failed_download_raises_oserror_and_leaves_nothing_behind(http_folder, tmp_path):
    _, base_url = http_folder
    with pytest.raises(OSError, match="404"):
        clip_files.download(f"{base_url}/missing.bin", tmp_path / "cache", "0" * 64)
    assert list((tmp_path / "cache").iterdir()) == []


def tiny_config(**overrides) -> clip.CLIPConfig:
    sizes = dict(embed_dim=16, image_resolution=32, vision_layers=2, vision_width=64, vision_patch_size=16,
                 context_length=77, vocab_size=600, transformer_width=64, transformer_heads=2, transformer_layers=2)
    return clip.CLIPConfig(**(sizes | overrides))


def test_a_32_token_caption_embeds_exactly_like_its_77_token_row():
    torch.manual_seed(0)
    model = clip.CLIP(tiny_config()).eval()
    tokens = torch.zeros(2, 77, dtype=torch.int32)
    tokens[0, :4] = torch.tensor([598, 7, 9, 599])   # SOT, two words, EOT (SOT/EOT are the 2 largest ids)
    tokens[1, :3] = torch.tensor([598, 11, 599])
    with torch.no_grad():  # CLIP4IDC feeds 32 tokens: the causal mask makes the padding after EOT irrelevant
        torch.testing.assert_close(model.encode_text(tokens[:, :32]), model.encode_text(tokens), rtol=0, atol=1e-6)


def test_initialize_parameters_follows_openais_recipe():
    torch.manual_seed(0)
    model = clip.CLIP(tiny_config(vocab_size=5000, transformer_layers=8))
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))  # temperature 0.07
    assert model.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    proj_std = 64 ** -0.5 * (2 * 8) ** -0.5  # residual projections shrink with depth
    assert model.transformer.resblocks[0].mlp.c_proj.weight.std().item() == pytest.approx(proj_std, rel=0.05)


def test_quick_gelu_is_x_times_sigmoid_of_1_702_x_and_close_to_gelu():
    x = torch.tensor([-1.0, 0.0, 1.0, 3.0])
    # 1 / (1 + e^-1.702) = 0.845796...; QuickGELU(-x) = QuickGELU(x) - x, as GELU's
    assert clip.QuickGELU()(x).tolist() == pytest.approx([-0.154204, 0.0, 0.845796, 2.981929], abs=1e-6)
    x = torch.linspace(-6, 6, 1001)
    assert (clip.QuickGELU()(x) - torch.nn.functional.gelu(x)).abs().max().item() < 0.03  # an approximation of GELU, not GELU
def test_layer_norm_computes_in_float32_and_returns_the_input_dtype():
    norm = clip.LayerNorm(8)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 1000
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, norm(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)


# --- the synthetic CLIP, shipped in assets/ and loaded by name like OpenAI's ---

def test_the_synthetic_clip_loads_by_name_through_the_checksummed_download_path(tmp_path):
    url, sha256 = clip_files.MODELS["synth-ViT/32"]
    model, preprocess = clip_files.load("synth-ViT/32", download_root=tmp_path)  # "downloaded" from assets/ into the cache
    cached = tmp_path / "synth-ViT-32.pt"
    assert clip_files.sha256_of(cached) == sha256 == clip_files.sha256_of(HERE / "assets" / "synth-ViT-32.pt")
    assert url.startswith("file:") and model.visual.input_resolution == data.IMAGE_SIZE
    assert model.config.vocab_size == 2 * 256 + len(synth.synth_vocabulary()) + 2  # bytes, merges, SOT and EOT
    state = torch.load(HERE / "assets" / "synth-ViT-32.pt", weights_only=True)
    assert all(v.dtype == torch.float16 for v in state.values())  # stored as OpenAI stores its weights
    assert set(state) == set(model.state_dict())  # OpenAI's parameter names, loaded strictly


def test_a_corrupted_synthetic_clip_is_refused_and_a_corrupted_cached_copy_replaced(tmp_path, monkeypatch):
    shipped = HERE / "assets" / "synth-ViT-32.pt"
    damaged = tmp_path / "source" / "synth-ViT-32.pt"
    damaged.parent.mkdir()
    damaged.write_bytes(shipped.read_bytes()[:-100] + bytes(100))
    monkeypatch.setitem(clip_files.MODELS, "synth-ViT/32", (damaged.as_uri(), clip_files.MODELS["synth-ViT/32"][1]))
    with pytest.raises(RuntimeError, match="has sha256 .*, expected .*it was deleted"):
        clip_files.load("synth-ViT/32", download_root=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "cache" / "synth-ViT-32.pt").write_bytes(damaged.read_bytes())  # a damaged copy in the cache
    with pytest.warns(UserWarning, match="sha256 is not"):
        clip_files.load("synth-ViT/32", download_root=tmp_path / "cache")
    assert (tmp_path / "cache" / "synth-ViT-32.pt").read_bytes() == shipped.read_bytes()


# ======== encoder.py and losses.py ========

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


def _ddp_worker(rank, world, out_dir):
    torch.set_num_threads(1)
    # a file store, not TCP: with TCP, rank 0 hosts the store and may exit while rank 1 still tears down
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(_TwoTowers())  # DDP averages the parameter gradients over the processes
    text_in, pair_in = _full_batch()
    b = text_in.shape[0] // world
    mine = slice(rank * b, (rank + 1) * b)  # this process's share of the global batch
    torch.save(_loss_and_gradients(model, text_in[mine], pair_in[mine]), f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # both done before either tears its process group down
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_with_b_pairs_each_train_like_one_process_with_2b_pairs(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    one_process = _loss_and_gradients(_TwoTowers(), *_full_batch())
    for rank in range(2):
        two_processes = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert two_processes.keys() == one_process.keys()
        for name, expected in one_process.items():
            torch.testing.assert_close(two_processes[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def _download_worker(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    # two machines of two processes: global ranks 0-1 on the first, 2-3 on the second
    alone = processes.Distributed(True, rank, rank % 2, world, torch.device("cpu"), rank == 0)
    with processes.one_download_per_machine(alone):
        with open(f"{out_dir}/order", "a") as order:
            order.write(f"{rank} in\n")
        if rank % 2 == 0:
            time.sleep(1.0)  # the download
            with open(f"{out_dir}/order", "a") as order:
                order.write(f"{rank} downloaded\n")
    dist.barrier()
    dist.destroy_process_group()


def test_each_machines_first_process_downloads_while_the_others_wait_then_they_read_it(tmp_path):
    mp.spawn(_download_worker, args=(4, str(tmp_path)), nprocs=4)
    order = (tmp_path / "order").read_text().split("\n")[:-1]
    first, then = order[:4], order[4:]
    assert sorted(first) == ["0 downloaded", "0 in", "2 downloaded", "2 in"]  # the machines' first processes
    assert sorted(then) == ["1 in", "3 in"]  # the others enter once both downloads are done


@pytest.mark.parametrize("cut", [False, True])
def test_under_compile_captions_of_every_length_come_padded_to_one_and_compile_once(cut):
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PairEncoder(clip.CLIP(tiny_config(context_length=12)), EncoderConfig(1)).train()
    counter = CompileCounter()  # counts the graphs torch.compile makes: one per (re)compile
    compiled = torch.compile(model, backend=counter)

    def sample(words):  # a stage-1 sample as AdaptationSamples gives it: a caption of `words` words, zero-padded
        caption = torch.zeros(12, dtype=torch.long)
        caption[0], caption[1:words + 1], caption[words + 1] = 598, 5, 599  # SOT, words, EOT (the largest id)
        image = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8)
        return {"before": image, "after": image, "caption": caption}

    for words in (3, 7, 5, 9):  # four batches whose longest captions differ
        batch = data.collate_text([sample(words), sample(2)], cut=cut)
        assert batch["caption"].is_contiguous()
        batch = data.to_device(batch, torch.device("cpu"))
        compiled(batch["before"], batch["after"], batch["caption"])["pair_embedding"].sum().backward()
    assert counter.frame_count == 1 if not cut else counter.frame_count > 1  # cut: each new length recompiles
    torch._dynamo.reset()


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


def cached_pair_features(model, pairs, images, folder: Path, name: str = "test") -> Path:
    """caches.cached_features as caption.py fills it: the pair tokens of `pairs` by `model`, encoded two at a time
    by caption.encode_pairs in one process on the CPU (folder/<name>_<key>.npy)."""
    alone = processes.Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    run = loop.Run(caption.Config(eval_batch_size=2, num_workers=0), alone, "float32", contextlib.nullcontext(), None,
                   folder)
    shape = (len(pairs), 2 * (model.n_patches + 1), model.clip.visual.proj.shape[1])  # (P, M, E)
    return caches.cached_features("sha", pairs, shape, folder, name,
                                  lambda p, out, what: caption.encode_pairs(run, model, p, images, out, what))


def _images(batch=2, seed=1):
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def _pixels(batch=2, seed=1):
    """uint8 pixels (B, 64, 64, 3), as data.ImageReader hands them over."""
    return torch.randint(0, 256, (batch, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_with_every_block_intra_image_the_cls_output_is_clips_image_embedding():
    model = _tiny_encoder(intra_layers=4)  # split at the last block: no inter-image layers
    images = _images()
    with torch.no_grad():
        cls = model.project(model.intra_image(images))[:, 0]  # join (before/after, joint positions, ln_mid) bypassed
        torch.testing.assert_close(cls, model.clip.encode_image(images), rtol=1e-5, atol=1e-5)


def test_on_the_tiny_openai_checkpoint_the_intra_image_cls_output_is_openais_image_embedding():
    expected = torch.load(vectors("clip_vectors", "tiny_expected.pt"), weights_only=True)
    clip_model = clip.build_model(clip_files.load_state_dict(vectors("clip_vectors", "tiny_openai_state_dict.pt")))
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
    assert model.pool(tokens[:, model.cls_rows]).shape == (2, E)
    assert {key: tuple(value.shape) for key, value in out.items()} == {
        "pair_embedding": (2, E), "text_embedding": (2, E), "logit_scale": ()}
    torch.testing.assert_close(model.encode_pair(before, after)["pair_tokens"], tokens)


def test_the_pair_embedding_is_the_mean_of_the_before_and_after_cls_tokens():
    model = _tiny_encoder()
    with torch.no_grad():
        out = model.encode_pair(_images(seed=1), _images(seed=2))
    tokens = out["pair_tokens"]
    torch.testing.assert_close(out["pair_embedding"], (tokens[:, 0] + tokens[:, N + 1]) / 2)


def test_a_block_run_at_some_rows_equals_the_full_blocks_rows_values_and_gradients():
    # the speed variant of stage 1: the last inter-image block computes only the rows that are read
    torch.manual_seed(0)
    block = clip.ResidualAttentionBlock(D, 4)
    x = torch.randn(3, 2 * (N + 1), D, requires_grad=True)
    rows = [0, N + 1]
    grad_out = torch.randn(3, len(rows), D)
    full = block(x)[:, rows]
    (full * grad_out).sum().backward()
    full_grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    only = block_at_rows(block, x, rows)  # (3, 2, D)
    (only * grad_out).sum().backward()
    torch.testing.assert_close(only, full, rtol=1e-5, atol=1e-6)
    for got, expected in zip([x.grad] + [p.grad for p in block.parameters()], full_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_forward_without_the_speed_switch_gives_encode_pairs_pair_embedding_bit_for_bit():
    model = _tiny_encoder()
    assert not model.cls_rows_only  # off by default: forward runs the lesson's encode_pair
    before, after = _images(seed=1), _images(seed=2)
    with torch.no_grad():
        assert torch.equal(model(before, after)["pair_embedding"], model.encode_pair(before, after)["pair_embedding"])


def test_stage_1s_pair_embedding_from_the_cls_rows_alone_equals_encode_pairs_values_and_gradients():
    for intra_layers in (2, 4):  # two inter-image blocks; none (the rows are then cut after the intra blocks)
        model = _tiny_encoder(intra_layers)
        model.cls_rows_only = True  # the speed variant, as adapt.build_encoder switches it on
        before, after = _images(seed=1), _images(seed=2)
        full = model.encode_pair(before, after)["pair_embedding"]
        full.square().sum().backward()
        full_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        rows = []
        hook = model.clip.visual.ln_post.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
        fast = model(before, after)["pair_embedding"]  # forward: embed_pair, the last block at the CLS rows only
        hook.remove()
        assert rows == [2]  # ln_post (and the projection) saw the two CLS rows alone
        fast.square().sum().backward()
        torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-6)
        assert full_grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


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


def test_frozen_intra_image_blocks_train_from_their_tokens_computed_once_as_from_the_images(tmp_path):
    model = _tiny_encoder()
    model.freeze()
    model.freeze(model.intra_image_parts())  # what adapt.py --freeze_intra does
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(name.startswith(f"clip.visual.transformer.resblocks.{i}.") for i in range(3) for name in trainable)
    assert "clip.visual.transformer.resblocks.3.attn.in_proj_weight" in trainable  # the inter-image block trains
    names = ["b0", "a0", "d0", "b1", "a1", "d1"]
    for name in names:
        (tmp_path / name).write_bytes(b"")  # the tokens' file is keyed on each image file's size and time
    pixels = dict(zip([str(tmp_path / name) for name in names], _pixels(batch=6)))
    pairs = [data.ImagePair(id=str(i), before=str(tmp_path / f"b{i}"), after=str(tmp_path / f"a{i}"), captions=["x"],
                            distractor=str(tmp_path / f"d{i}")) for i in range(2)]
    cache = caches.IntraTokens(model, pairs, pixels.__getitem__, batch_size=4, device=torch.device("cpu"),
                               ctx=contextlib.nullcontext(), cache_dir=tmp_path)
    assert len(cache.row) == 6 and cache(str(tmp_path / "d1")).shape == (N + 1, D)
    text = torch.randint(1, 900, (2, 8))
    losses = []
    for read in (lambda path: clip.normalize(pixels[path]), cache):  # the same pairs: pixels, cached tokens
        source = lambda name: read(str(tmp_path / name))
        model.zero_grad()
        out = model(torch.stack([source("d0"), source("b1")]), torch.stack([source("a0"), source("a1")]), text)
        loss = contrastive_loss(out["text_embedding"], out["pair_embedding"], out["logit_scale"])
        loss.backward()
        losses.append((loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}))
    (loss_images, grads_images), (loss_cached, grads_cached) = losses
    torch.testing.assert_close(loss_cached, loss_images)
    for name, grad in grads_images.items():
        torch.testing.assert_close(grads_cached[name], grad, msg=name)


def test_intra_tokens_kept_in_a_file_are_read_back_and_a_changed_image_or_intra_weight_computes_them_again(tmp_path):
    model = _tiny_encoder()  # 3 intra-image blocks, 1 inter-image block
    pixels = {}
    for name, image in zip(["b0", "a0", "d0"], _pixels(batch=3)):
        (tmp_path / f"{name}.png").write_bytes(name.encode())  # the key reads each file's size and time
        pixels[tmp_path / f"{name}.png"] = image
    pairs = [data.ImagePair(id="0", before=tmp_path / "b0.png", after=tmp_path / "a0.png", captions=["x"],
                            distractor=tmp_path / "d0.png")]
    computed = []
    images = lambda path: computed.append(path) or pixels[path]

    def tokens():
        return caches.IntraTokens(model, pairs, images, 4, torch.device("cpu"), contextlib.nullcontext(), tmp_path / "cache")

    first = tokens()
    assert first.read_from is None and len(computed) == 3 and len(list((tmp_path / "cache").iterdir())) == 1
    second = tokens()  # stage 2 after stage 1: the same weights and images
    assert second.read_from is not None and len(computed) == 3 and torch.equal(second.tokens, first.tokens)
    with torch.no_grad():
        model.clip.visual.transformer.resblocks[3].ln_1.bias.add_(1.0)  # an inter-image block: no matter
    assert tokens().read_from is not None
    with torch.no_grad():
        model.clip.visual.transformer.resblocks[2].ln_1.bias.add_(1.0)  # an intra-image block: a new file
    third = tokens()
    assert third.read_from is None and len(computed) == 6 and not torch.equal(third.tokens, first.tokens)
    os.utime(tmp_path / "d0.png", ns=(1, 1))  # an image file changed
    assert tokens().read_from is None and len(computed) == 9


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


# ======== decoder.py ========

# A tiny decoder: 3 + 3 layers as the reference, narrow and with a 50-token vocabulary. Its init is wider than
# the reference's 0.02 so that a random model's greedy captions differ from pair to pair.
TINY_DECODER_CONFIG = DecoderConfig(hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=40, visual_tokens=6, init_std=0.1)
SOT_ID, EOT_ID = TINY_DECODER_CONFIG.vocab_size - 2, TINY_DECODER_CONFIG.vocab_size - 1


def tiny_decoder(seed=0, config=TINY_DECODER_CONFIG):
    torch.manual_seed(seed)
    return CaptionDecoder(config).eval()


def visual_tokens(batch, seed=1, config=TINY_DECODER_CONFIG):
    return torch.randn(batch, config.visual_tokens, config.hidden, generator=torch.Generator().manual_seed(seed))


def never_emit(decoder, token):
    with torch.no_grad():
        decoder.output_bias[token] = -1e4


# --- the model ---


def test_forward_returns_one_row_of_logits_per_caption_token():
    decoder = tiny_decoder()
    caption_in = torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (3, 7))
    assert decoder(visual_tokens(3), caption_in).shape == (3, 7, TINY_DECODER_CONFIG.vocab_size)


def test_the_full_size_decoder_has_the_reference_parameter_count():
    decoder = CaptionDecoder(DecoderConfig())
    embeddings = 49408 * 512 + 77 * 512 + 2 * 512  # word, position, their LayerNorm
    attention = 4 * (512 * 512 + 512) + 2 * 512  # query, key, value, out, LayerNorm
    feed_forward = 512 * 2048 + 2048 + 2048 * 512 + 512 + 2 * 512
    head = 512 * 512 + 512 + 2 * 512 + 49408  # dense, LayerNorm, output bias; the output weight is the word embedding
    expected = embeddings + 3 * (attention + feed_forward) + 3 * (2 * attention + feed_forward) + head
    assert expected == 47_719_680
    assert sum(p.numel() for p in decoder.parameters()) == expected


def test_a_fresh_decoder_starts_from_the_reference_init():
    torch.manual_seed(0)
    decoder = CaptionDecoder(DecoderConfig(hidden=64, heads=4, ffn=128, vocab_size=2000))
    assert torch.equal(decoder.output_bias, torch.zeros(2000))
    assert torch.equal(decoder.head_norm.weight, torch.ones(64)) and torch.equal(decoder.head_norm.bias, torch.zeros(64))
    assert torch.equal(decoder.caption_layers[2].feed_forward.down.bias, torch.zeros(64))
    assert abs(decoder.word_embedding.std().item() - 0.02) < 0.001
    assert abs(decoder.visual_layers[0].self_attention.query.weight.std().item() - 0.02) < 0.002


def test_decoder_layer_i_cross_attends_to_the_output_of_visual_layer_i():
    decoder = tiny_decoder()
    visual_outputs, cross_attention_sources = [], []
    for visual_layer, caption_layer in zip(decoder.visual_layers, decoder.caption_layers):
        visual_layer.register_forward_hook(lambda module, args, output: visual_outputs.append(output))
        caption_layer.cross_attention.key.register_forward_hook(
            lambda module, args, output: cross_attention_sources.append(args[0]))
    decoder(visual_tokens(2), torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (2, 4)))
    assert len(visual_outputs) == len(cross_attention_sources) == 3
    for visual_output, source in zip(visual_outputs, cross_attention_sources):  # its rows (B*M, E), the same memory
        assert source._base is visual_output and torch.equal(source, visual_output.flatten(0, 1))
    assert not torch.equal(visual_outputs[0], visual_outputs[2])


def test_a_later_caption_token_never_changes_an_earlier_logit():
    decoder = tiny_decoder()
    visual = visual_tokens(2)
    caption_in = torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (2, 10))
    changed = caption_in.clone()
    changed[:, 6:] = torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (2, 4))
    before, after = decoder(visual, caption_in), decoder(visual, changed)
    assert torch.equal(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_padding_after_the_caption_does_not_change_logits_at_real_positions():
    decoder = tiny_decoder()
    visual = visual_tokens(2)
    caption_in = torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (2, 5))
    padded = torch.cat([caption_in, torch.zeros(2, 4, dtype=torch.long)], dim=1)  # (2, 9), padded with id 0
    padding = torch.tensor([[False] * 5 + [True] * 4] * 2)
    logits = decoder(visual, padded, padding)
    assert logits.shape == (2, 9, TINY_DECODER_CONFIG.vocab_size)
    torch.testing.assert_close(logits[:, :5], decoder(visual, caption_in), rtol=0, atol=1e-5)


def test_visual_tokens_of_the_wrong_shape_are_refused_with_the_expected_shape():
    decoder = tiny_decoder()
    with pytest.raises(ValueError, match=r"\(B, 6, 32\)"):
        decoder(torch.randn(2, 32), torch.zeros(2, 3, dtype=torch.long))


def test_dropout_is_active_in_training_and_off_in_evaluation():
    decoder = tiny_decoder()
    visual, caption_in = visual_tokens(2), torch.randint(0, TINY_DECODER_CONFIG.vocab_size, (2, 6))
    assert torch.equal(decoder(visual, caption_in), decoder(visual, caption_in))
    decoder.train()
    assert not torch.equal(decoder(visual, caption_in), decoder(visual, caption_in))


# --- tied weights ---


def test_the_output_weight_is_the_word_embedding():
    decoder = tiny_decoder()
    caption_in = torch.tensor([[SOT_ID, 3, 4]])
    with torch.no_grad():
        decoder.word_embedding[7] = 0.0  # token 7 is not in the input, so only the output map reads this row
        decoder.output_bias[7] = 2.5
    logits = decoder(visual_tokens(1), caption_in)
    assert torch.equal(logits[..., 7], torch.full((1, 3), 2.5))


def test_clip_embeddings_passed_in_are_shared_not_copied():
    torch.manual_seed(0)
    token_embedding = nn.Embedding(TINY_DECODER_CONFIG.vocab_size, TINY_DECODER_CONFIG.hidden)  # stands in for CLIP's token_embedding
    positional_embedding = nn.Parameter(torch.randn(TINY_DECODER_CONFIG.max_positions, TINY_DECODER_CONFIG.hidden))  # and its positional_embedding
    word_values, position_values = token_embedding.weight.detach().clone(), positional_embedding.detach().clone()
    decoder = CaptionDecoder(TINY_DECODER_CONFIG, token_embedding.weight, positional_embedding)
    assert decoder.word_embedding is token_embedding.weight
    assert decoder.position_embedding is positional_embedding
    assert torch.equal(token_embedding.weight, word_values) and torch.equal(positional_embedding, position_values)
    both = nn.ModuleDict({"token_embedding": token_embedding, "decoder": decoder})
    assert sum(p.numel() for p in both.parameters()) == sum(p.numel() for p in decoder.parameters())
    decoder(visual_tokens(1), torch.tensor([[SOT_ID, 3]]))[0, -1, 9].backward()
    assert token_embedding.weight.grad[9].abs().sum() > 0  # token 9 was only an output: its gradient is the output map's


def test_embeddings_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="word_embedding has shape"):
        CaptionDecoder(TINY_DECODER_CONFIG, word_embedding=nn.Parameter(torch.zeros(TINY_DECODER_CONFIG.vocab_size + 1, TINY_DECODER_CONFIG.hidden)))


# --- greedy decoding ---


@pytest.mark.parametrize("batch, max_len, init_std", [(1, 1, 0.1), (1, 22, 0.1), (4, 7, 0.1), (9, 22, 0.1),
                                                      (9, 40, 0.1), (5, 22, 0.02)])
def test_decoding_with_the_cache_gives_the_same_tokens_as_full_recompute(batch, max_len, init_std):
    config = DecoderConfig(**{**TINY_DECODER_CONFIG.__dict__, "init_std": init_std})
    decoder = tiny_decoder(seed=batch, config=config)
    visual = visual_tokens(batch, seed=max_len, config=config)
    first = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=max_len)
    # Besides the real EOT, call "EOT" tokens that these captions do emit, so that rows stop at different steps.
    for eot_id in (EOT_ID, int(first[0, -1]), int(first[-1, 0])):
        cached = decoder.greedy_decode(visual, SOT_ID, eot_id, max_len=max_len, use_cache=True)
        recomputed = decoder.greedy_decode(visual, SOT_ID, eot_id, max_len=max_len, use_cache=False)
        assert cached.dtype == torch.long and cached.shape[0] == batch and cached.shape[1] <= max_len
        assert torch.equal(cached, recomputed)


def test_greedy_decoding_at_fixed_shapes_gives_the_cached_decodings_tokens_and_traces_as_one_graph():
    decoder, visual = tiny_decoder(seed=3), visual_tokens(6, seed=5)
    first = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=7)
    for eot_id in (EOT_ID, int(first[0, 2]), int(first[-1, 0])):  # rows that stop at different steps
        cached = decoder.greedy_decode(visual, SOT_ID, eot_id, max_len=7)
        static = decoder.greedy_decode_static(visual, SOT_ID, eot_id, max_len=7)
        assert static.shape == (6, 7) and torch.equal(static[:, :cached.shape[1]], cached)
        assert (static[:, cached.shape[1]:] == eot_id).all()  # ended rows keep emitting EOT to the last step
    # fullgraph=True raises at a graph break (a Python branch on data, a value read back): there is none
    traced = torch.compile(decoder.greedy_decode_static, fullgraph=True, backend="eager")
    assert torch.equal(traced(visual, SOT_ID, EOT_ID, 7), decoder.greedy_decode_static(visual, SOT_ID, EOT_ID, 7))


def test_greedy_tokens_are_the_argmax_of_the_teacher_forced_logits():
    decoder = tiny_decoder()
    never_emit(decoder, EOT_ID)
    visual = visual_tokens(6)
    tokens = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=15)
    assert tokens.shape == (6, 15)
    caption_in = torch.cat([torch.full((6, 1), SOT_ID), tokens[:, :-1]], dim=1)  # (6, 15)
    assert torch.equal(decoder(visual, caption_in).argmax(dim=-1), tokens)
    assert len({tuple(row) for row in tokens.tolist()}) > 1  # the pairs do steer the captions


def test_greedy_decoding_stops_at_eot():
    decoder = tiny_decoder()
    with torch.no_grad():
        decoder.output_bias[EOT_ID] = 1e4  # EOT wins at the first step
    tokens = decoder.greedy_decode(visual_tokens(3), SOT_ID, EOT_ID, max_len=22)
    assert tokens.tolist() == [[EOT_ID]] * 3


def test_each_caption_stops_at_its_own_eot_and_decoding_ends_when_all_have_stopped():
    decoder = tiny_decoder()
    never_emit(decoder, EOT_ID)
    visual = visual_tokens(6)
    free = decoder.greedy_decode(visual, SOT_ID, EOT_ID, max_len=22).tolist()  # never stops: 22 tokens each
    # Now call "EOT" the token found in the most captions but not in all of them.
    rows_with = {token: sum(token in row for row in free) for token in set(sum(free, []))}
    stop_token = max((rows, token) for token, rows in rows_with.items() if rows < len(free))[1]
    stops = [row.index(stop_token) + 1 if stop_token in row else 22 for row in free]  # tokens up to and with EOT
    assert min(stops) < 22 and max(stops) == 22
    tokens = decoder.greedy_decode(visual, SOT_ID, stop_token, max_len=22)
    assert tokens.shape == (6, 22)
    for row, free_row, stop in zip(tokens.tolist(), free, stops):
        assert row == free_row[:stop] + [stop_token] * (22 - stop)  # cut at its own EOT, then EOT to the end

    stopping = [i for i, stop in enumerate(stops) if stop < 22]
    assert len(stopping) >= 2
    early = decoder.greedy_decode(visual[stopping], SOT_ID, stop_token, max_len=22)
    assert early.shape == (len(stopping), max(stops[i] for i in stopping))  # ends with the last caption to stop


def test_greedy_decoding_refuses_training_mode():
    decoder = tiny_decoder().train()
    with pytest.raises(RuntimeError, match="eval"):
        decoder.greedy_decode(visual_tokens(1), SOT_ID, EOT_ID)


def test_max_len_must_fit_the_position_embedding():
    assert tiny_decoder().greedy_decode(visual_tokens(1), SOT_ID, EOT_ID, max_len=40).shape[1] <= 40
    with pytest.raises(ValueError, match="max_len=41"):
        tiny_decoder().greedy_decode(visual_tokens(1), SOT_ID, EOT_ID, max_len=41)


# --- ids to text ---


def test_ids_to_text_cuts_at_eot_then_at_the_pad_text():
    words = {1: "the", 2: "cube", 3: "moved", 0: "!", 9: "<|endoftext|>"}

    def decode(ids):
        return " ".join(words[i] for i in ids) + " "

    assert ids_to_text([1, 2, 3, 9, 1, 1], decode, eot_id=9) == "the cube moved"
    assert ids_to_text(torch.tensor([1, 2, 0, 3]), decode, eot_id=9) == "the cube"
    assert ids_to_text([9, 1], decode, eot_id=9) == ""


# ======== plumbing/release.py ========

# --- the pair encoder's names ---


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


# --- the reference's released weights ---

RELEASE_CLIP = {**TINY, "transformer_width": 32}  # the decoder ties CLIP's word embedding: text width = joint width E
RELEASE_DECODER = dict(layers=3, width=32, ffn=64, vocab=TINY["vocab_size"], positions=TINY["context_length"])


def reference_decoder_shapes(layers, width, ffn, vocab, positions):
    """The decoder.* keys and shapes of the reference's caption model, written out from its modules
    (github.com/sushizixin/CLIP4IDC at ca49461, modules/module_decoder.py, `DecoderModel`): BERT-style layers,
    the word embedding also saved as the output weight (classifier.cls.predictions.decoder.weight)."""
    def linear(name, n_in, n_out):
        return {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}

    def norm(name):
        return {f"{name}.weight": (width,), f"{name}.bias": (width,)}

    def attention(name):  # DecoderAttention: att (MultiHeadAttention) and output (BertSelfOutput)
        return {**linear(f"{name}.att.query", width, width), **linear(f"{name}.att.key", width, width),
                **linear(f"{name}.att.value", width, width), **linear(f"{name}.output.dense", width, width),
                **norm(f"{name}.output.LayerNorm")}

    shapes = {"decoder.embeddings.word_embeddings.weight": (vocab, width),
              "decoder.embeddings.position_embeddings.weight": (positions, width),
              **norm("decoder.embeddings.LayerNorm")}
    for i in range(layers):
        for stack, attentions in (("encoder", ("slf_attn",)), ("decoder", ("slf_attn", "enc_attn"))):
            layer = f"decoder.{stack}.layer.{i}"
            for name in attentions:
                shapes.update(attention(f"{layer}.{name}"))
            shapes.update({**linear(f"{layer}.intermediate.dense", width, ffn),
                           **linear(f"{layer}.output.dense", ffn, width), **norm(f"{layer}.output.LayerNorm")})
    head = "decoder.classifier.cls.predictions"
    shapes.update({**linear(f"{head}.transform.dense", width, width), **norm(f"{head}.transform.LayerNorm"),
                   f"{head}.decoder.weight": (vocab, width), f"{head}.bias": (vocab,)})
    return shapes


def reference_release(stage: int, seed: int = 0, vocab: int = TINY["vocab_size"]) -> dict:
    """A tiny state dict as the reference saves it (torch.save(model.state_dict())): CLIP under OpenAI's names
    (clip.py keeps them), the pair parameters under clip.visual.*, the weights its convert_weights halves in
    float16; stage 2 adds the decoder, the tied embeddings stored under each of their names."""
    generator = torch.Generator().manual_seed(seed)
    tiny_clip = clip.CLIP(clip.CLIPConfig(**{**RELEASE_CLIP, "vocab_size": vocab}))
    shapes = {f"clip.{key}": tuple(value.shape) for key, value in tiny_clip.state_dict().items()}
    shapes.update({"clip.visual.bef_embedding": (D,), "clip.visual.aft_embedding": (D,),
                   "clip.visual.joint_positional_embedding": (2 * (N + 1), D),
                   "clip.visual.ln_mid.weight": (D,), "clip.visual.ln_mid.bias": (D,)})
    if stage == 2:
        shapes.update(reference_decoder_shapes(**{**RELEASE_DECODER, "vocab": vocab}))
    state = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    halved = ("conv1.weight", "in_proj_weight", "in_proj_bias", "clip.visual.proj", "clip.text_projection")
    for key in state:  # Conv, Linear and attention weights and biases, and CLIP's two projections
        if key.startswith("clip.") and (key.endswith(halved) or any(linear in key for linear in (".out_proj.", ".c_"))):
            state[key] = state[key].half()
    if stage == 2:  # one Parameter in the reference, saved under every name
        for key in ("decoder.embeddings.word_embeddings.weight", "decoder.classifier.cls.predictions.decoder.weight"):
            state[key] = state["clip.token_embedding.weight"]
        state["decoder.embeddings.position_embeddings.weight"] = state["clip.positional_embedding"]
    return state


def test_a_reference_adaptation_file_is_stage_1_and_loads_strictly_with_every_tensor_in_place(tmp_path):
    release = reference_release(stage=1)
    torch.save(release, tmp_path / "pytorch_model.bin.clevr")
    stage, state = read_release(tmp_path / "pytorch_model.bin.clevr")
    assert stage == 1 and len(state) == len(release)
    model = from_checkpoint(release_checkpoint(state, intra_layers=3))  # strict: every parameter from the file
    assert model.clip.config == clip.CLIPConfig(**RELEASE_CLIP)  # sized from the tensors
    assert torch.equal(model.before_embedding, release["clip.visual.bef_embedding"])
    assert torch.equal(model.after_embedding, release["clip.visual.aft_embedding"])
    assert torch.equal(model.joint_positional_embedding, release["clip.visual.joint_positional_embedding"])
    assert torch.equal(model.ln_mid.bias, release["clip.visual.ln_mid.bias"])
    assert torch.equal(model.clip.visual.transformer.resblocks[3].mlp.c_fc.bias,
                       release["clip.visual.transformer.resblocks.3.mlp.c_fc.bias"].float())
    assert not model.training


def test_a_float16_release_loads_as_float32_with_the_same_values(tmp_path):
    release = reference_release(stage=1)
    assert release["clip.visual.proj"].dtype == torch.float16
    torch.save(release, tmp_path / "pytorch_model.bin.clevr")
    model = from_checkpoint(release_checkpoint(read_release(tmp_path / "pytorch_model.bin.clevr")[1], intra_layers=3))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.clip.visual.proj, release["clip.visual.proj"].float())


def test_the_pair_encoders_names_to_the_references_and_back_are_the_identity():
    ours = _tiny_encoder().state_dict()
    theirs = to_reference_keys(ours)
    assert "clip.visual.bef_embedding" in theirs and "before_embedding" not in theirs
    back = rename_reference_keys(theirs)
    assert back.keys() == ours.keys() and all(torch.equal(back[key], ours[key]) for key in ours)


@pytest.mark.parametrize("kind", ["a checkpoint of this project", "a plain CLIP", "text", "a pickled object"])
def test_a_file_of_another_kind_is_refused_in_one_line_saying_what_a_release_is(kind, tmp_path):
    path = tmp_path / "weights.bin"
    if kind == "a checkpoint of this project":
        torch.save({"model": _tiny_encoder().state_dict(), "config": {}}, path)
    elif kind == "a plain CLIP":
        torch.save(clip.CLIP(clip.CLIPConfig(**TINY)).state_dict(), path)
    elif kind == "text":
        path.write_text("not weights")
    else:
        torch.save(types.SimpleNamespace(model=1), path)  # weights_only refuses to build it
    with pytest.raises(clip_files.FileError) as error:
        read_release(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert "CLIP4IDC release file" in str(error.value) and "decoder.*" in str(error.value)


# --- the caption decoder's names ---


def test_the_decoders_names_to_the_references_and_back_are_the_identity():
    ours = tiny_decoder().state_dict()
    theirs = to_reference_decoder_keys(ours)
    config = TINY_DECODER_CONFIG
    assert {key: tuple(value.shape) for key, value in theirs.items()} == reference_decoder_shapes(
        config.layers, config.hidden, config.ffn, config.vocab_size, config.max_positions)
    back = rename_reference_decoder_keys(theirs)
    assert back.keys() == ours.keys() and all(torch.equal(back[key], ours[key]) for key in ours)


def test_the_reference_caption_model_saves_136_decoder_tensors():
    # measured on the reference's own model (modules/modeling.py, task_type caption): 443 tensors, 307 under clip.
    assert len(reference_decoder_shapes(layers=3, width=512, ffn=2048, vocab=49408, positions=77)) == 443 - 307


def test_a_reference_captioning_file_is_stage_2_and_its_decoder_loads_strictly_with_clips_embeddings(tmp_path):
    release = reference_release(stage=2)
    torch.save(release, tmp_path / "pytorch_model.bin.clevr")
    stage, state = read_release(tmp_path / "pytorch_model.bin.clevr")
    assert stage == 2
    pair_encoder = from_checkpoint(release_checkpoint(state, intra_layers=3))
    decoder = caption.release_decoder(state, 2 * (N + 1))
    assert decoder.config == DecoderConfig(hidden=32, heads=1, ffn=64, layers=3, vocab_size=TINY["vocab_size"],
                                           max_positions=77, visual_tokens=2 * (N + 1))
    assert torch.equal(decoder.word_embedding, pair_encoder.clip.token_embedding.weight) and not decoder.training
    ours = decoder.state_dict()
    for our_name, their_name in [
            ("embedding_norm.weight", "decoder.embeddings.LayerNorm.weight"),
            ("visual_layers.1.self_attention.out.weight", "decoder.encoder.layer.1.slf_attn.output.dense.weight"),
            ("visual_layers.2.self_attention.norm.bias", "decoder.encoder.layer.2.slf_attn.output.LayerNorm.bias"),
            ("caption_layers.2.cross_attention.query.bias", "decoder.decoder.layer.2.enc_attn.att.query.bias"),
            ("caption_layers.0.self_attention.value.weight", "decoder.decoder.layer.0.slf_attn.att.value.weight"),
            ("caption_layers.1.feed_forward.up.weight", "decoder.decoder.layer.1.intermediate.dense.weight"),
            ("caption_layers.0.feed_forward.norm.weight", "decoder.decoder.layer.0.output.LayerNorm.weight"),
            ("head_dense.bias", "decoder.classifier.cls.predictions.transform.dense.bias"),
            ("head_norm.weight", "decoder.classifier.cls.predictions.transform.LayerNorm.weight"),
            ("output_bias", "decoder.classifier.cls.predictions.bias"),
            ("word_embedding", "clip.token_embedding.weight"), ("position_embedding", "clip.positional_embedding")]:
        assert torch.equal(ours[our_name], release[their_name]), our_name
    visual = pair_encoder.encode_pair(_images(), _images(seed=2))["pair_tokens"]  # (2, 2(N+1), E)
    assert decoder.greedy_decode(visual, sot_id=998, eot_id=999, max_len=5).shape[0] == 2


def test_a_captioning_release_with_a_missing_or_untied_decoder_tensor_is_refused_by_name():
    missing = reference_release(stage=2)
    del missing["decoder.decoder.layer.1.enc_attn.att.key.bias"]
    with pytest.raises(ValueError, match=r"missing \['decoder.decoder.layer.1.enc_attn.att.key.bias'\]"):
        rename_reference_decoder_keys(missing)
    untied = reference_release(stage=2)
    untied[REFERENCE_OUTPUT_WEIGHT] = untied[REFERENCE_OUTPUT_WEIGHT] + 1
    with pytest.raises(ValueError, match="ties them"):
        rename_reference_decoder_keys(untied)


# ======== data.py ========

# Run:  python -m pytest test_all.py -q -k data
# The fixtures write each dataset's published layout in a temporary folder, awkward parts included;
# the synthetic dataset is drawn once per session, small.


SYNTH = synth.SynthConfig(pairs=40, seed=3)


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    return synth.make_synth(tmp_path_factory.mktemp("synth") / "synth", SYNTH)


@pytest.fixture(scope="module")
def synth_tokenizer(synth_root):
    return clip.get_tokenizer(synth_root / data.SYNTH_BPE_FILE)


def write_png(path, color=(120, 60, 30), size=(48, 32)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def write_json(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


@pytest.fixture
def clevr_root(tmp_path):
    """CLEVR-Change in miniature: id 4 is in no split and has no files; lists unsorted; dicts keyed by file name."""
    root = tmp_path / "clevr_change"
    ids = [0, 1, 2, 3, 5]
    for i in ids:
        write_png(root / "images" / f"CLEVR_default_{i:06d}.png", (i * 40, 0, 0))
        write_png(root / "sc_images" / f"CLEVR_semantic_{i:06d}.png", (0, i * 40, 0))
        write_png(root / "nsc_images" / f"CLEVR_nonsemantic_{i:06d}.png", (0, 0, i * 40))
    write_json(root / "splits.json", {"train": [3, 0, 1], "val": [2], "test": [5]})
    names = [f"CLEVR_default_{i:06d}.png" for i in ids]
    write_json(root / "change_captions.json",
               {name: [f"the small red cube {i} turned blue", "the red thing became blue"] for i, name in zip(ids, names)})
    write_json(root / "no_change_captions.json", {name: ["nothing has changed", "the scene remains the same"]
                                                  for name in names})
    write_json(root / "type_mapping.json", {"color": ["000000.png", "000005.png"], "material": ["000001.png"],
                                            "add": ["000002.png"], "drop": ["000003.png"], "move": []})
    return root


# --- readers of the published layouts ---

def test_clevr_change_reader_reads_only_split_ids_with_their_files_captions_and_types(clevr_root):
    train = data.read_clevr_change(clevr_root, "train")
    assert [p.id for p in train] == ["000003.png", "000000.png", "000001.png"]  # the split's order, no id 4
    first = train[0]
    assert first.before == clevr_root / "images" / "CLEVR_default_000003.png"
    assert first.after == clevr_root / "sc_images" / "CLEVR_semantic_000003.png"
    assert first.distractor == clevr_root / "nsc_images" / "CLEVR_nonsemantic_000003.png"
    assert first.captions == ["the small red cube 3 turned blue", "the red thing became blue"]
    assert first.no_change_captions == ["nothing has changed", "the scene remains the same"]
    assert [p.change_type for p in train] == ["drop", "color", "material"]


def test_clevr_change_evaluation_uses_the_toolkit_ids_and_reference_lists(clevr_root):
    pairs = data.evaluation_pairs(data.read_clevr_change(clevr_root, "train"), use_no_change_pair=True)
    assert [p.id for p in pairs] == ["000003.png", "000000.png", "000001.png",
                                     "000003.png_n", "000000.png_n", "000001.png_n"]
    assert pairs[3].after == clevr_root / "nsc_images" / "CLEVR_nonsemantic_000003.png"
    assert data.references(pairs)["000000.png_n"] == ["nothing has changed", "the scene remains the same"]
    assert data.ids_by_type(pairs) == {"drop": ["000003.png"], "color": ["000000.png"], "material": ["000001.png"],
                                       "distractor": ["000003.png_n", "000000.png_n", "000001.png_n"]}


def test_a_split_id_without_captions_is_an_error_naming_the_id(clevr_root):
    captions = json.loads((clevr_root / "change_captions.json").read_text())
    del captions["CLEVR_default_000005.png"]
    write_json(clevr_root / "change_captions.json", captions)
    with pytest.raises(data.DataError, match="split test id 5: CLEVR_default_000005.png has no entry"):
        data.read_clevr_change(clevr_root, "test")


def test_a_caption_that_is_not_text_is_an_error_naming_the_pair_and_the_file(clevr_root, tmp_path):
    captions = json.loads((clevr_root / "change_captions.json").read_text())
    captions["CLEVR_default_000005.png"] = ["the cube moved", 7]
    write_json(clevr_root / "change_captions.json", captions)
    with pytest.raises(data.DataError, match=r"pair 000005.png: caption 7 in .*change_captions.json is not text"):
        data.read_clevr_change(clevr_root, "test")
    write_json(tmp_path / "spot" / "annotations" / "val.json", [{"img_id": "3", "sentences": "the car is gone"}])
    with pytest.raises(data.DataError, match=r"val.json, item 0 \(img_id 3\): sentences should be a list"):
        data.read_spot_the_diff(tmp_path / "spot", "val")


def test_a_missing_image_is_an_error_naming_the_file(clevr_root):
    missing = clevr_root / "nsc_images" / "CLEVR_nonsemantic_000005.png"
    missing.unlink()
    with pytest.raises(data.DataError, match=f"image {missing} is missing"):
        data.load_split("clevr", "test", clevr_root)
    with pytest.raises(data.DataError, match=f"image {missing} is missing"):
        data.load_image(missing)


def test_a_corrupt_image_is_an_error_naming_the_file(clevr_root):
    corrupt = clevr_root / "images" / "CLEVR_default_000005.png"
    corrupt.write_bytes(corrupt.read_bytes()[:40])  # a truncated PNG
    pairs = data.read_clevr_change(clevr_root, "test")
    with pytest.raises(data.DataError, match=f"image {corrupt} is corrupt"):
        data.PairImages(pairs, data.ImageReader(32))[0]


def test_dataset_fields_of_the_wrong_type_are_one_line_naming_the_file_the_item_and_the_expected_type(clevr_root,
                                                                                                     tmp_path):
    write_json(clevr_root / "splits.json", {"train": [3, "0"], "val": [2], "test": [5]})
    with pytest.raises(data.DataError, match=r"splits.json, split 'train', item '0' should be a whole number"):
        data.read_clevr_change(clevr_root, "train")
    write_json(clevr_root / "type_mapping.json", {"color": "000000.png"})
    with pytest.raises(data.DataError, match=r"type_mapping.json, 'color' should be a list of file names"):
        data.read_clevr_change(clevr_root, "test")
    write_json(tmp_path / "ier" / "test.json", [{"img0": ["a.png"], "img1": "b.png", "sents": ["x"], "uid": "u"}])
    with pytest.raises(data.DataError, match=r"test.json, item 0 \(uid u\): img0 should be an image file name"):
        data.read_ier(tmp_path / "ier", "test")
    write_json(tmp_path / "mine" / "val.json", [{"before": 7, "after": "b.png", "captions": ["x"]}])
    with pytest.raises(data.DataError, match=r"val.json, item 0: 'before' should be an image path .*, got 7$"):
        data.read_user_pairs(tmp_path / "mine", "val")
    write_json(tmp_path / "mine" / "val.json", [{"before": "a.png", "after": "b.png", "captions": "the cup"}])
    with pytest.raises(data.DataError, match=r"pair 0: no captions in .*val.json.*non-empty list of strings"):
        data.read_user_pairs(tmp_path / "mine", "val")


def test_a_missing_image_of_your_own_pairs_says_to_put_it_there_or_remove_its_pair(tmp_path):
    write_png(tmp_path / "a.png")
    write_json(tmp_path / "train.json", [{"before": "a.png", "after": "gone.png", "captions": ["x"]}])
    with pytest.raises(data.DataError, match=r"gone.png is missing; put a readable copy there, or remove its pair from .*train.json"):
        data.load_split("pairs", "train", tmp_path)
    with pytest.raises(data.DataError, match=r"no folder .*nowhere.*or give its folder with --data_root"):
        data.load_split("pairs", "train", tmp_path / "nowhere")


def test_a_missing_dataset_folder_says_which_dataset_where_and_how_to_get_it(tmp_path):
    with pytest.raises(data.DataError, match=r"CLEVR-Change: no folder .*nowhere.*RobustChangeCaptioning"):
        data.load_split("clevr", "train", tmp_path / "nowhere")
    with pytest.raises(data.DataError, match=r"Spot-the-Diff: no folder .*harsh19/spot-the-diff"):
        data.load_split("spot", "train", tmp_path / "nowhere")
    with pytest.raises(data.DataError, match=r"Image-Editing-Request: no folder .*VisualRelationships"):
        data.load_split("ier", "train", tmp_path / "nowhere")


def test_spot_the_diff_raw_annotations_are_merged_by_img_id(tmp_path):
    root = tmp_path / "spot"
    for img_id in ("7", "12"):
        write_png(root / "images" / f"{img_id}.png")
        write_png(root / "images" / f"{img_id}_2.png")
    write_json(root / "annotations" / "test.json", [  # one item per annotator: img_id repeats
        {"img_id": "12", "sentences": ["the car is gone", "a man appeared"]},
        {"img_id": "7", "sentences": ["the door is open"]},
        {"img_id": "12", "sentences": ["the white car left"]}])
    pairs = data.load_split("spot", "test", root)
    assert [p.id for p in pairs] == ["12.png", "7.png"]
    assert pairs[0].captions == ["the car is gone", "a man appeared", "the white car left"]
    assert (pairs[0].before.name, pairs[0].after.name) == ("12.png", "12_2.png")
    assert pairs[0].distractor is None and pairs[0].change_type is None


def write_spot(root, split, items):
    """Spot-the-Diff's raw annotations/<split>.json and a small PNG for every image they name."""
    for img_id in {str(item["img_id"]) for item in items}:
        write_png(root / "images" / f"{img_id}.png")
        write_png(root / "images" / f"{img_id}_2.png", (30, 60, 120))
    write_json(root / "annotations" / f"{split}.json", items)


def test_spot_the_diff_empty_sentences_are_references_but_never_training_targets(tmp_path, synth_tokenizer, capsys):
    root = tmp_path / "spot"
    write_spot(root, "train", [  # as published: repeated ids, empty sentences, an id with nothing else ("3")
        {"img_id": "3", "sentences": [""]}, {"img_id": "12", "sentences": ["the car is gone", ""]},
        {"img_id": "3", "sentences": ["  "]}, {"img_id": "12", "sentences": ["a man appeared"]},
        {"img_id": "7", "sentences": ["the door is open"]}])
    pairs = data.load_split("spot", "train", root)
    assert capsys.readouterr().out == ("Spot-the-Diff train: 3 pairs, 6 sentences, 3 empty (1 pairs without any) "
                                       "left out of training; evaluation keeps them as references\n")
    assert data.references(pairs) == {"3.png": ["", "  "], "12.png": ["the car is gone", "", "a man appeared"],
                                      "7.png": ["the door is open"]}  # as the reference's ground truth holds them
    assert data.AdaptationSamples(pairs, synth_tokenizer, train=True).samples == [(1, 0), (1, 2), (2, 0)]
    items = data.CaptionItems(pairs, synth_tokenizer, use_no_change_pair=False)
    assert len(items) == 2 and [items[k]["row"] for k in range(2)] == [1, 2]  # rows of the pairs' features
    eot = synth_tokenizer.eot_id
    drawn = {synth_tokenizer.decode([t for t in items[0]["caption_out"].tolist() if t not in (eot, clip.PAD_ID)])
             .strip() for _ in range(30)}
    assert drawn == {"the car is gone", "a man appeared"}
    data.load_split("spot", "train", root)
    write_spot(root, "val", [{"img_id": "5", "sentences": ["a van left"]}])
    data.load_split("spot", "val", root)
    assert capsys.readouterr().out.count("\n") == 1  # one line for train again, none for a split without empties


def test_spot_the_diff_prefers_the_reformatted_file(tmp_path):
    root = tmp_path / "spot"
    write_png(root / "images" / "3.png")
    write_png(root / "images" / "3_2.png")
    write_json(root / "reformat_val.json", [{"img_id": "3", "sentences": ["from the reformatted file"]}])
    write_json(root / "annotations" / "val.json", [{"img_id": "3", "sentences": ["from the raw file"]}])
    assert data.load_split("spot", "val", root)[0].captions == ["from the reformatted file"]


def test_ier_reads_the_valid_file_for_val_and_keeps_mixed_case_requests(tmp_path):
    root = tmp_path / "ier"
    for name in ("Reddit.com_abc_abc.jpg", "Reddit.com_abc_xyz.jpg"):
        write_png(root / "images" / name)
    write_json(root / "valid.json", [{"img0": "Reddit.com_abc_abc.jpg", "img1": "Reddit.com_abc_xyz.jpg",
                                      "sents": ["Make It Brighter", "increase brightness", "Brighten the photo"],
                                      "uid": "Reddit_1"}])
    pairs = data.load_split("ier", "val", root)
    assert pairs[0].id == "Reddit_1"
    assert pairs[0].captions[0] == "Make It Brighter"
    assert data.references(pairs) == {"Reddit_1": ["Make It Brighter", "increase brightness", "Brighten the photo"]}


def test_ier_keeps_a_58_word_request_whole_as_a_reference_and_cuts_it_for_training(tmp_path, synth_tokenizer):
    root = tmp_path / "ier"
    for name in ("Zhopped.com_gc9hq_gc9hq.jpg", "Zhopped.com_gc9hq_cxyv8.jpg"):
        write_png(root / "images" / name)
    request = "Please " + " ".join(["remove the man on the left and"] * 8) + " Brighten"  # 58 words
    write_json(root / "test.json", [{"img0": "Zhopped.com_gc9hq_gc9hq.jpg", "img1": "Zhopped.com_gc9hq_cxyv8.jpg",
                                     "sents": [request, "brighten", "Remove the man"], "uid": "Zhopped_1004"}])
    pairs = data.load_split("ier", "test", root)
    assert len(request.split()) == 58 and data.references(pairs)["Zhopped_1004"][0] == request
    tokens = data.caption_tokens(synth_tokenizer, request, max_words=32)["caption_out"]
    assert tokens[31] == synth_tokenizer.eot_id and clip.PAD_ID not in tokens.tolist()


def check_command(monkeypatch, *args) -> int:
    """The exit status of `python check.py ...`, run in this process."""
    monkeypatch.setattr(sys, "argv", ["check.py", *args])
    with pytest.raises(SystemExit) as exit_:
        check.main()
    return exit_.value.code


def test_check_says_a_complete_download_is_complete(clevr_root, synth_root, monkeypatch, capsys):
    monkeypatch.setenv("CLIP_BPE_PATH", str(synth_root / data.SYNTH_BPE_FILE))  # no download in tests
    monkeypatch.setitem(check.PUBLISHED, "clevr", {"train": (3, None), "val": (1, None), "test": (1, None)})
    captions = json.loads((clevr_root / "change_captions.json").read_text())
    write_json(clevr_root / "change_captions.json", {**captions, "CLEVR_default_000004.png": ["in no split"]})
    assert check_command(monkeypatch, "--data", "clevr", "--data_root", str(clevr_root)) == 0
    out = capsys.readouterr().out
    assert "  train: 3 pairs (published: 3), 6 references" in out
    assert "    images: 9, 0 missing, 0 unreadable" in out
    assert "1 captioned ids are in no split and never used (the published files have 197)" in out
    assert out.endswith("complete: every split reads, every image opens, the published counts are met\n")


def test_check_names_a_missing_and_a_corrupt_image_and_fails(clevr_root, synth_root, monkeypatch, capsys):
    shutil.copy(synth_root / data.SYNTH_BPE_FILE, clevr_root)  # --data synth tokenizes with the folder's vocabulary
    missing = clevr_root / "sc_images" / "CLEVR_semantic_000001.png"
    missing.unlink()
    corrupt = clevr_root / "images" / "CLEVR_default_000005.png"
    corrupt.write_bytes(corrupt.read_bytes()[:60])  # a half-downloaded PNG: its header, not its pixels
    assert check_command(monkeypatch, "--data", "synth", "--data_root", str(clevr_root), "--max_words", "8") == 1
    out = capsys.readouterr().out
    assert f"      missing: {missing}\n" in out and f"      unreadable: {corrupt} (" in out
    assert "  train: 3 pairs, 6 references\n    images: 9, 1 missing, 0 unreadable" in out
    assert "longer than max_words 8" in out
    assert out.endswith("INCOMPLETE: train: 1 image(s) missing; test: 1 image(s) unreadable\n")


# --- LEVIR-CC: LevirCCcaptions.json and images/<split>/{A,B} ---

LEVIR_LONG = ("a long row of grey houses with small gardens and a narrow winding lane appears on the bareland at the "
              "lower-right while several tall trees beside the old road at the top of the scene are cut down and a "
              "new parking lot is built")  # 43 words: more than 32 CLIP tokens
LEVIR_CHANGES = ("several houses appear on the bareland at the bottom", "a road is built in the lower-right corner",
                 "some trees are removed beside the road", "a row of villas is constructed at the top")


def levir_record(split, number, changed, flag=True, tokens=True):
    """One record of LevirCCcaptions.json: Karpathy's form, five sentences, changeflag unless flag is False."""
    name = f"{split}_{number:06d}.png"
    said = ([LEVIR_CHANGES[(number + k) % len(LEVIR_CHANGES)] for k in range(5)] if changed
            else list(data.LEVIR_NO_CHANGE))
    sentences = [{"raw": f" {s} .", "imgid": number, "sentid": 5 * number + k, **({"tokens": s.split()} if tokens
                                                                                 else {})} for k, s in enumerate(said)]
    record = {"filepath": split, "filename": name, "imgid": number, "sentids": [5 * number + k for k in range(5)],
              "split": split, "sentences": sentences}
    return record | ({"changeflag": int(changed)} if flag else {})


LEVIR_SPLITS = {"train": 8, "val": 2, "test": 4}  # pairs per split, every other one changed


def write_levir(root, flag=True):
    """A LEVIR-CC-form folder: LevirCCcaptions.json (the first record of a split without changeflag, one record
    with raw sentences only, one caption of 43 words) and 256 x 256 PNGs, plus an image pair no record names.
    File numbers have gaps, as the published ones."""
    records = []
    for split, n in LEVIR_SPLITS.items():
        for k in range(n):
            number = 2 * k + 1
            records.append(levir_record(split, number, changed=k % 2 == 0, flag=flag and k > 0,
                                        tokens=(split, k) != ("val", 1)))
            stem = f"{split}_{number:06d}.png"
            write_png(root / "images" / split / "A" / stem, (90, 110 + 10 * k, 70), (256, 256))
            write_png(root / "images" / split / "B" / stem, (90 + 60 * (k % 2 == 0), 110 + 10 * k, 70), (256, 256))
        write_png(root / "images" / split / "A" / f"{split}_000100.png", size=(256, 256))  # in no record
        write_png(root / "images" / split / "B" / f"{split}_000100.png", size=(256, 256))
    records[0]["sentences"][2] |= {"tokens": LEVIR_LONG.split(), "raw": f" {LEVIR_LONG} ."}
    write_json(root / "LevirCCcaptions.json", {"images": records})
    return root


def test_levir_cc_reader_reads_the_records_of_a_split_not_the_image_folders(tmp_path):
    root = write_levir(tmp_path / "levir")
    train = data.load_split("levir", "train", root)
    assert [p.id for p in train] == ["train_000001.png", "train_000003.png", "train_000005.png", "train_000007.png",
                                     "train_000009.png", "train_000011.png", "train_000013.png", "train_000015.png"]
    assert train[0].before == root / "images" / "train" / "A" / "train_000001.png"
    assert train[0].after == root / "images" / "train" / "B" / "train_000001.png"
    assert [p.change_type for p in train[:2]] == ["change", "no change"] and train[0].distractor is None
    assert train[1].captions == list(data.LEVIR_NO_CHANGE) and train[0].captions[2] == LEVIR_LONG
    assert data.load_split("levir", "val", root)[1].captions == list(data.LEVIR_NO_CHANGE)  # from "raw", periods gone
    assert Image.open(train[0].before).size == (256, 256)
    assert tuple(data.ImageReader()(train[0].before).shape) == (224, 224, 3)  # resized to a square, as the reference


def test_levir_cc_without_changeflag_finds_unchanged_pairs_by_their_five_sentences(tmp_path):
    with_flag = {s: data.load_split("levir", s, write_levir(tmp_path / "a")) for s in data.SPLITS}
    without = {s: data.load_split("levir", s, write_levir(tmp_path / "b", flag=False)) for s in data.SPLITS}
    assert "changeflag" not in json.loads((tmp_path / "b" / "LevirCCcaptions.json").read_text())["images"][1]
    assert {s: [p.change_type for p in pairs] for s, pairs in without.items()} == \
        {s: [p.change_type for p in pairs] for s, pairs in with_flag.items()}


def test_levir_cc_stage_1_adapts_to_the_changed_pairs_and_stage_2_trains_on_all(tmp_path, synth_tokenizer):
    train = data.load_split("levir", "train", write_levir(tmp_path / "levir"))
    assert [p.change_type for p in data.adaptation_pairs(train)] == ["change"] * 4
    assert len(data.AdaptationSamples(data.adaptation_pairs(train), synth_tokenizer, train=True)) == 20
    assert len(data.CaptionItems(train, synth_tokenizer, use_no_change_pair=False)) == 8


def test_levir_cc_reader_says_where_the_file_is_missing_or_wrong(tmp_path):
    with pytest.raises(data.DataError, match="no LevirCCcaptions.json in .*Chen-Yang-Liu/LEVIR-CC-Dataset"):
        data.read_levir_cc(tmp_path, "train")
    write_json(tmp_path / "LevirCCcaptions.json", [levir_record("train", 1, True)])
    with pytest.raises(data.DataError, match=r'should be \{"images": \[...\]\}'):
        data.read_levir_cc(tmp_path, "train")
    write_json(tmp_path / "LevirCCcaptions.json", {"images": [levir_record("train", 1, True) | {"changeflag": "1"}]})
    with pytest.raises(data.DataError, match=r"record 0 \(train_000001.png\): changeflag should be 0"):
        data.read_levir_cc(tmp_path, "train")
    write_json(tmp_path / "LevirCCcaptions.json", {"images": [levir_record("train", 1, True) | {"changeflag": 2}]})
    with pytest.raises(data.DataError, match=r"changeflag should be 0 \(unchanged\) or 1 \(changed\), got 2"):
        data.read_levir_cc(tmp_path, "train")


def test_levir_cc_raw_only_sentences_are_tokenized_as_the_papers_preprocessing_tokenizes_them():
    sentence = {"raw": " a road is built, near 0.5km ; fine ?"}
    assert data.levir_caption(sentence, "here") == "a road is built , near 05km ; fine"  # RSCaMa's tokenize
    assert data.levir_caption(sentence, "here").split() == field.raw_tokens(sentence["raw"])[1:-1]


def test_levir_cc_is_found_in_the_folder_its_download_unpacks_to_or_the_error_names_that_folder(tmp_path):
    write_levir(tmp_path / "download" / "Levir-CC-dataset")
    test = data.load_split("levir", "test", tmp_path / "download")
    assert test[0].before == tmp_path / "download" / "Levir-CC-dataset" / "images" / "test" / "A" / "test_000001.png"
    with pytest.raises(data.DataError, match="no LevirCCcaptions.json in .* \\(nor in Levir-CC-dataset/ there"):
        data.read_levir_cc(tmp_path, "test")


def test_levir_cc_pair_whose_file_name_says_another_split_is_refused_naming_both(tmp_path):
    write_json(tmp_path / "LevirCCcaptions.json", {"images": [levir_record("val", 1, True) | {"split": "test"}]})
    with pytest.raises(data.DataError, match=r"\(val_000001.png\): its name says 'val' but its split is 'test'"):
        data.read_levir_cc(tmp_path, "test")


def test_check_levir_prints_pairs_references_and_kinds_beside_the_published_counts(tmp_path, synth_root,
                                                                                     monkeypatch, capsys):
    monkeypatch.setenv("CLIP_BPE_PATH", str(synth_root / data.SYNTH_BPE_FILE))  # no download in tests
    monkeypatch.setitem(check.PUBLISHED, "levir", {"train": (8, 40), "val": (2, 10), "test": (4, 20)})
    monkeypatch.setitem(check.PUBLISHED_KINDS, "levir", {"train": (4, 4), "val": (1, 1), "test": (2, 2)})
    outputs = []
    for flag in (True, False):  # the same counts from a file without changeflag
        root = write_levir(tmp_path / f"levir_{flag}", flag=flag)
        assert check_command(monkeypatch, "--data", "levir", "--data_root", str(root)) == 0
        outputs.append(capsys.readouterr().out.replace(str(root), "ROOT"))
    assert outputs[0] == outputs[1]
    out = outputs[0]
    assert "  train: 8 pairs (published: 8), 40 references (published: 40)\n" \
           "    4 change pairs (published: 4), 4 no-change pairs (published: 4)\n" \
           "    images: 16, 0 missing, 0 unreadable\n" in out
    assert "1 longer than max_words 32" in out and "note: change types" not in out  # LEVIR-CC's own two kinds
    assert out.endswith("complete: every split reads, every image opens, the published counts are met\n")


def test_check_levir_names_a_missing_and_a_damaged_image_and_the_published_counts_it_misses(tmp_path, synth_root,
                                                                                               monkeypatch, capsys):
    monkeypatch.setenv("CLIP_BPE_PATH", str(synth_root / data.SYNTH_BPE_FILE))
    root = write_levir(tmp_path / "levir")
    missing, damaged = root / "images" / "val" / "B" / "val_000003.png", root / "images" / "test" / "A" / "test_000001.png"
    missing.unlink()
    damaged.write_bytes(damaged.read_bytes()[:-30])  # cut short: its last pixels and end are gone
    assert check_command(monkeypatch, "--data", "levir", "--data_root", str(root)) == 1
    out = capsys.readouterr().out
    assert f"      missing: {missing}\n" in out and f"      unreadable: {damaged} (" in out
    assert "  test: 4 pairs (published: 1,929; DIFFERENT), 20 references (published: 9,645; DIFFERENT)\n" \
           "    2 change pairs (published: 964; DIFFERENT), 2 no-change pairs (published: 965; DIFFERENT)" in out
    assert "INCOMPLETE: " in out and "val: 1 image(s) missing" in out and "test: 1 image(s) unreadable" in out


# --- faults: full disks, damaged files, unwritable folders (BENCHMARKS.md section 9) ---

def _noisy_png(path, size=(480, 320), seed=0, **save):
    """A PNG that does not compress (random pixels): 8 KB overwritten in its middle land in its pixel data."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, **save)


def _overwrite_middle(path, size=8192):
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + size] = b"\xff" * size
    path.write_bytes(bytes(raw))


def test_check_decodes_every_image_whole_names_one_damaged_in_the_middle_and_notes_exif_orientation(
        clevr_root, synth_root, monkeypatch, capsys):
    shutil.copy(synth_root / data.SYNTH_BPE_FILE, clevr_root)
    damaged = clevr_root / "images" / "CLEVR_default_000005.png"
    _noisy_png(damaged)
    _overwrite_middle(damaged)  # its header and end marker intact: the old check passed it
    turned = clevr_root / "sc_images" / "CLEVR_semantic_000001.png"
    exif = Image.Exif()
    exif[check.EXIF_ORIENTATION] = 6  # "rotate 90 degrees to view"
    write_png(turned)
    Image.open(turned).save(turned, exif=exif)
    monkeypatch.setattr(check, "CHECK_PARALLEL_MIN", 4)  # 15 images: decoded by 2 processes, as a large dataset is
    monkeypatch.setattr(check, "usable_cpus", lambda: 2)
    assert check_command(monkeypatch, "--data", "synth", "--data_root", str(clevr_root)) == 1
    out = capsys.readouterr().out
    assert f"      unreadable: {damaged} (" in out and "1 missing" not in out
    assert f"  1 image(s) carry an EXIF orientation, which is ignored, as in the reference: the model sees them as " \
           f"stored, not turned as a viewer shows them ({turned})\n" in out
    assert out.endswith("INCOMPLETE: test: 1 image(s) unreadable\n")
    monkeypatch.setattr(check, "CHECK_PARALLEL_MIN", 10_000)  # one process: the same answers
    paths = sorted(clevr_root.glob("*/*.png"))
    assert check.image_checks(paths, progress.Progress(len(paths), what="images")) == [check.image_check(p) for p in paths]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("full", ["posix_fallocate", "disk_usage"])
def test_a_full_disk_while_the_image_cache_is_built_is_one_line_with_the_space_it_needs_and_leaves_no_file(
        clevr_root, tmp_path, monkeypatch, full):
    # a full disk simulated: os.posix_fallocate fails with ENOSPC, or shutil.disk_usage reports 1 KB free
    if full == "posix_fallocate":
        monkeypatch.setattr(os, "posix_fallocate", _no_space)
    else:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 ** 9, 10 ** 9, 1000))
    pairs = data.read_clevr_change(clevr_root, "train")
    with pytest.raises(files.DiskFull) as error:
        caches.image_cache(pairs, tmp_path / "cache", "all", image_size=32, workers=0)
    assert isinstance(error.value, stopping.USER_ERRORS)  # the scripts print it as one line
    assert str(error.value).startswith(f"not enough space for {tmp_path / 'cache' / 'all_32.npy'}: it needs 27.8 KB, "
                                       f"{tmp_path / 'cache'} has ")
    assert "--no-image_cache" in str(error.value) and list((tmp_path / "cache").iterdir()) == []


def test_a_read_only_data_folder_while_the_image_cache_is_built_is_one_line_suggesting_no_image_cache(
        clevr_root, tmp_path, monkeypatch):
    def read_only(*args, **kwargs):  # what a read-only mount answers (the tests run as root: chmod would not stop it)
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(np.lib.format, "open_memmap", read_only)
    with pytest.raises(data.DataError, match=f"cannot write the image cache in {tmp_path / 'cache'} \\(Read-only "
                                             f"file system\\); train with --no-image_cache .*writable folder"):
        caches.image_cache(data.read_clevr_change(clevr_root, "train"), tmp_path / "cache", "all", 32, workers=0)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_half_written_image_cache_index_or_a_truncated_array_is_built_again_with_the_same_pixels(
        clevr_root, tmp_path, capsys):
    pairs = data.read_clevr_change(clevr_root, "train")
    build = lambda: caches.image_cache(pairs, tmp_path / "cache", "all", image_size=32, workers=0)
    build()
    array, index = tmp_path / "cache" / "all_32.npy", tmp_path / "cache" / "all_32.json"
    whole, whole_index = array.read_bytes(), index.read_text()
    capsys.readouterr()
    index.write_text(whole_index[:len(whole_index) // 2])  # a run killed while writing the index
    build()
    assert "its index" in capsys.readouterr().err and index.read_text() == whole_index and array.read_bytes() == whole
    array.write_bytes(whole[:-3000])  # a copy cut short; its index still matches
    build()
    assert f"image cache {array}: it has {len(whole) - 3000:,} bytes, its header says {len(whole):,} (cut short?); " \
           f"building it again" in capsys.readouterr().err
    assert array.read_bytes() == whole and not list((tmp_path / "cache").glob("*partial*"))


class _FillingFile(io.RawIOBase):
    """A file on a disk that fills after `room` bytes: a write past them fails with ENOSPC, as the system's does."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def writable(self):
        return True

    def write(self, chunk):
        if len(chunk) > self.room:
            self.file.write(bytes(chunk[:self.room]))
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(chunk)
        return self.file.write(chunk)


@pytest.mark.parametrize("full", ["while writing", "before"])
def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, full):
    path = tmp_path / "run" / "ckpt_last.pt"
    checkpoints.save_checkpoint({"model": {"w": torch.zeros(1000)}, "step": 1}, path)
    last = path.read_bytes()
    if full == "while writing":  # torch.save's own error: a RuntimeError from inline_container.cc, the OSError before
        real_save = torch.save
        monkeypatch.setattr(torch, "save", lambda state, file: real_save(state, _FillingFile(file, 3000)))
    else:
        monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10 ** 9, 10 ** 9, 1000))
    with pytest.raises(files.DiskFull) as error:
        checkpoints.save_checkpoint({"model": {"w": torch.ones(25_000)}, "step": 2}, path)
    assert str(error.value).startswith(f"not enough space for {path}: it needs 100.0 KB, {path.parent} has ")
    assert str(error.value).endswith(f"free some space there, then continue with --resume ({path} keeps the "
                                     f"previous checkpoint)")
    assert isinstance(error.value, stopping.USER_ERRORS) and path.read_bytes() == last
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt_last.pt"]  # no temporary file left


def test_a_checkpoint_damaged_inside_a_tensor_is_refused_naming_the_file_and_the_member(tmp_path):
    path = tmp_path / "ckpt_best.pt"
    checkpoints.save_checkpoint({"model": {"w": torch.arange(40_000, dtype=torch.float32)}, "config": {}}, path)
    with zipfile.ZipFile(path) as archive:
        member = next(m for m in archive.infolist() if m.file_size == 160_000)  # the tensor's bytes
    raw = bytearray(path.read_bytes())
    start = member.header_offset + 30 + len(member.filename) + len(member.extra) + 64_000  # inside its data
    raw[start:start + 8192] = b"\xff" * 8192
    path.write_bytes(bytes(raw))
    assert torch.load(path, weights_only=True)["model"]["w"][16_000].isnan()  # torch.load alone takes it
    with pytest.raises(checkpoints.CheckpointError, match=f"^{path} is damaged: {member.filename} does not match its "
                                                      f"checksum .*delete it, or point to another checkpoint$"):
        checkpoints.load_checkpoint(path)


def test_an_unwritable_meteor_cache_still_gives_the_paraphrase_table_with_a_note_and_writes_nothing(
        tmp_path, monkeypatch, capsys):
    gz = tmp_path / "paraphrase-en.gz"  # METEOR's format: probability, phrase, paraphrase
    gz.write_bytes(gzip.compress(b"0.5\nred cube\nscarlet block\n0.25\nturned\nbecame\n0.1\nnot here\nelsewhere\n"))
    resources = types.SimpleNamespace(paraphrase_gz=gz)
    vocabulary = {"red", "cube", "scarlet", "block", "turned", "became"}
    monkeypatch.delenv(meteor.METEOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = scoring_fast.load_paraphrases(resources, vocabulary)
    assert kept == {("red", "cube"): [("scarlet", "block")], ("turned",): [("became",)]}
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))  # under a file: no folder can be made there
    capsys.readouterr()
    assert scoring_fast.load_paraphrases(resources, vocabulary) == kept
    err = capsys.readouterr().err
    assert f"metrics.py: note: cannot keep the METEOR paraphrase index in {tmp_path / 'a_file'}" in err
    assert "built for this run only" in err and (tmp_path / "a_file").read_text() == ""


def test_a_truncated_intra_tokens_file_is_said_and_computed_again(tmp_path, capsys):
    model = _tiny_encoder()
    pixels = dict(zip([tmp_path / "b.png", tmp_path / "a.png"], _pixels(batch=2)))
    for path in pixels:
        path.write_bytes(path.name.encode())
    pairs = [data.ImagePair(id="0", before=tmp_path / "b.png", after=tmp_path / "a.png", captions=["x"])]
    tokens = lambda: caches.IntraTokens(model, pairs, pixels.__getitem__, 4, torch.device("cpu"),
                                        contextlib.nullcontext(), tmp_path / "cache")
    first = tokens().tokens.clone()  # a copy: the file's memory map would fault once the file is cut short
    file = next((tmp_path / "cache").iterdir())
    file.write_bytes(file.read_bytes()[:5000])  # a copy cut short
    again = tokens()
    assert again.read_from is None and torch.equal(again.tokens, first)
    assert f"intra-image tokens {file} are damaged (" in capsys.readouterr().err
    assert tokens().read_from == file


def test_a_repeated_id_in_the_id_caption_format_is_refused_as_in_the_list_format(tmp_path, capsys):
    (tmp_path / "pred.json").write_text('{"1": "a cube moved", "2": "nothing changed", "1": "a cube turned red"}')
    write_json(tmp_path / "refs.json", {"1": ["a cube moved"], "2": ["nothing changed"]})
    assert metrics.main([str(tmp_path / "pred.json"), str(tmp_path / "refs.json")]) == 2
    assert capsys.readouterr().err == (f"metrics.py: error: {tmp_path / 'pred.json'}: duplicate key '1' in one JSON "
                                       f"object (JSON keeps only its last value); ids must be unique\n")


def test_a_stage_2_checkpoint_given_as_the_encoder_is_named_a_captioner_and_a_vocabulary_mismatch_names_clip_bpe_path(
        tmp_path, monkeypatch):
    path = tmp_path / "ckpt_best.pt"  # what caption.py saves: its model, config, the encoder's sha256 and sizes
    checkpoints.save_checkpoint({"model": {}, "config": {}, "encoder_sha256": "0" * 64, "stage1": {}}, path)
    with pytest.raises(flags.ConfigError, match=f"^{path} is a captioner \\(caption.py's stage-2 checkpoint\\), "
                                                  f"not a stage-1 encoder: --encoder_ckpt takes adapt.py's"):
        checkpoints.read_encoder(path)
    monkeypatch.setenv("CLIP_BPE_PATH", "/data/bpe.txt.gz")
    assert checkpoints.vocabulary_hint().endswith("reads CLIP_BPE_PATH's, now /data/bpe.txt.gz, else OpenAI's: point "
                                                  "CLIP_BPE_PATH at the model's)")


def test_check_calls_a_split_without_pairs_incomplete(clevr_root, synth_root, monkeypatch, capsys):
    shutil.copy(synth_root / data.SYNTH_BPE_FILE, clevr_root)
    write_json(clevr_root / "splits.json", {"train": [3, 0, 1], "val": [], "test": [5]})
    assert check_command(monkeypatch, "--data", "synth", "--data_root", str(clevr_root)) == 1
    out = capsys.readouterr().out
    assert "  val: 0 pairs, 0 references\n    no pairs:" in out and out.endswith("INCOMPLETE: val: 0 pairs\n")


def test_check_decodes_a_png_a_jpeg_and_others_whole_and_passes_a_png_that_lost_only_its_end_marker(tmp_path):
    for name, kind, lost in (("a.png", "PNG", 12), ("b.jpg", "JPEG", 30), ("c.bmp", "BMP", 30)):
        Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / name, kind)
        assert check.image_problem(tmp_path / name) is None
        (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-lost])  # the last bytes lost
    assert check.image_problem(tmp_path / "a.png") is None  # only the IEND chunk is gone: every pixel is there
    assert check.image_problem(tmp_path / "b.jpg") is not None and check.image_problem(tmp_path / "c.bmp") is not None
    assert check.image_problem(tmp_path / "d.png") == "missing"


# --- images of every mode ---

def test_a_16_bit_png_gives_the_same_pixels_as_its_8_bit_copy(tmp_path):
    grey = np.arange(48 * 32, dtype=np.uint8).reshape(32, 48)  # every value 0..255, and more
    Image.fromarray(grey, "L").save(tmp_path / "8.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "16.png")  # 255 -> 65535, as image tools do
    assert Image.open(tmp_path / "16.png").mode == "I;16"
    assert np.array_equal(np.asarray(data.load_image(tmp_path / "16.png")), np.asarray(data.load_image(tmp_path / "8.png")))
    assert np.array_equal(data.preprocess_uint8(tmp_path / "16.png", 32), data.preprocess_uint8(tmp_path / "8.png", 32))


def test_every_image_mode_is_read_as_its_8_bit_rgb_view():
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8))
    for mode in ("1", "L", "LA", "P", "PA", "RGBA", "CMYK", "RGB"):  # Pillow's own conversion, alpha dropped as CLIP's
        image = rgb.convert("P").convert("PA") if mode == "PA" else rgb.convert(mode)
        view = data.rgb_view(image)
        assert view.mode == "RGB" and np.array_equal(np.asarray(view), np.asarray(image.convert("RGB"))), mode
    grey = np.array([[0, 1, 128, 255]], np.uint8)
    for image in (Image.fromarray(grey.astype(np.uint16) * 257), Image.fromarray(grey.astype(np.int32) * 257, "I"),
                  Image.fromarray(grey / np.float32(255), "F")):
        view = np.asarray(data.rgb_view(image))  # (1, 4, 3): I;16 and I, a 16-bit value's high byte; F, 0..1
        assert np.array_equal(view, np.repeat(grey[..., None], 3, axis=2)), image.mode
    assert np.asarray(data.rgb_view(Image.fromarray(np.array([[-5.0, np.nan, 1.2]], np.float32)))).tolist() == \
        [[[0, 0, 0], [0, 0, 0], [255, 255, 255]]]  # out of range: clipped; not a number: black


def test_an_image_past_pillows_size_limit_is_one_line_naming_the_file(tmp_path, monkeypatch):
    write_png(tmp_path / "large.png", size=(48, 32))  # 1,536 pixels
    for limit in (1000, 700):  # Pillow warns past the limit and refuses past twice the limit: one line for both
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(data.DataError, match=f"image {tmp_path / 'large.png'} is too large .*shrink it below"):
            data.load_image(tmp_path / "large.png")
        assert "exceeds limit" in check.image_problem(tmp_path / "large.png")


def test_mixed_case_requests_tokenize_as_lower_case():
    tokenizer = clip.get_tokenizer(vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz"))
    assert torch.equal(data.text_tokens(tokenizer, "Make It Brighter"), data.text_tokens(tokenizer, "make it brighter"))


def test_user_pairs_json_reads_relative_paths_and_default_ids(tmp_path):
    root = tmp_path / "mine"
    for name in ("a.png", "b.png", "c.png", "d.png"):
        write_png(root / "img" / name)
    write_json(root / "train.json", [
        {"before": "img/a.png", "after": "img/b.png", "captions": ["the cup is gone"]},
        {"id": "kitchen", "before": "img/c.png", "after": "img/d.png", "captions": ["a plate appeared"],
         "type": "add", "distractor": "img/a.png", "no_change_captions": ["nothing changed"]}])
    pairs = data.load_split("pairs", "train", root)
    assert [p.id for p in pairs] == ["0", "kitchen"]
    assert pairs[0].before == root / "img" / "a.png"
    assert (pairs[1].change_type, pairs[1].distractor, pairs[1].no_change_captions) == \
        ("add", root / "img" / "a.png", ["nothing changed"])
    write_json(root / "val.json", [{"before": "img/a.png", "captions": ["x"]}])
    with pytest.raises(data.DataError, match=r"val.json, item 0: missing \['after'\]"):
        data.load_split("pairs", "val", root)


def test_clevr_change_pairs_carry_rcc_boxes_when_the_file_is_there(clevr_root):
    assert data.load_split("clevr", "test", clevr_root)[0].change_boxes is None  # the file is optional
    write_json(clevr_root / data.CHANGE_BOXES_FILE, {"5": {"bbox_before": [10, 20, 30, 40], "bbox_after": []}})
    assert data.load_split("clevr", "test", clevr_root)[0].change_boxes == {"before": [10, 20, 30, 40], "after": None}
    write_json(clevr_root / data.CHANGE_BOXES_FILE, {"5": {"bbox_before": [10, 20], "bbox_after": None}})
    with pytest.raises(data.DataError, match="id 5: bbox_before should be"):
        data.load_split("clevr", "test", clevr_root)


# --- tokens ---

def test_text_tokens_are_sot_ids_eot_then_pad(synth_tokenizer):
    tokens = data.text_tokens(synth_tokenizer, "nothing has changed", max_words=6)
    ids = synth_tokenizer.encode("nothing has changed")
    assert tokens.tolist() == [synth_tokenizer.sot_id, *ids, synth_tokenizer.eot_id, clip.PAD_ID]


def test_a_long_caption_is_cut_and_still_ends_with_eot(synth_tokenizer):
    tokens = data.text_tokens(synth_tokenizer, "the small red metal cube has been newly placed", max_words=5)
    assert tokens.tolist() == [synth_tokenizer.sot_id, *synth_tokenizer.encode("the small red")[:3],
                               synth_tokenizer.eot_id]


def test_caption_tokens_shift_the_target_by_one(synth_tokenizer):
    tokens = data.caption_tokens(synth_tokenizer, "nothing has changed", max_words=6)
    ids = synth_tokenizer.encode("nothing has changed")
    assert tokens["caption_in"].tolist() == [synth_tokenizer.sot_id, *ids, clip.PAD_ID, clip.PAD_ID]
    assert tokens["caption_out"].tolist() == [*ids, synth_tokenizer.eot_id, clip.PAD_ID, clip.PAD_ID]


# --- samples ---

def test_stage_1_has_one_sample_per_caption_and_swaps_the_before_image_only_in_training(clevr_root, synth_tokenizer):
    pairs = data.read_clevr_change(clevr_root, "train")
    images = data.ImageReader(32)
    train = data.AdaptationSamples(pairs, synth_tokenizer, train=True, images=images)
    assert len(train) == 6 and [train.samples[i] for i in (0, 1, 2)] == [(0, 0), (0, 1), (1, 0)]
    torch.manual_seed(0)
    swaps = [train[i % 6]["swapped"] for i in range(200)]
    assert 70 < sum(swaps) < 130
    swapped = next(sample for sample in (train[0] for _ in range(50)) if sample["swapped"])
    assert torch.equal(swapped["before"], images(pairs[0].distractor))
    evaluation = data.AdaptationSamples(pairs, synth_tokenizer, train=False, images=images)
    assert not any(evaluation[i % 6]["swapped"] for i in range(60))
    assert torch.equal(evaluation[0]["before"], images(pairs[0].before))


def test_stage_1_batches_are_dicts_of_stacked_tensors(clevr_root, synth_tokenizer):
    samples = data.AdaptationSamples(data.read_clevr_change(clevr_root, "train"), synth_tokenizer, train=True,
                                     images=data.ImageReader(32), max_words=12)
    batch = next(iter(torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=data.collate_text)))
    longest = max(int((c != clip.PAD_ID).sum()) for c in (samples[i]["caption"] for i in range(4)))
    assert (batch["before"].shape, batch["after"].shape, batch["caption"].shape) == \
        ((4, 32, 32, 3), (4, 32, 32, 3), (4, longest))  # uint8 pixels; captions cut after the last EOT
    assert batch["before"].dtype == torch.uint8 and batch["pair_index"].tolist() == [0, 0, 1, 1]
    on_device = data.to_device(batch, torch.device("cpu"), ("before", "after", "caption"))
    assert set(on_device) == {"before", "after", "caption"} and on_device["before"].shape == (4, 3, 32, 32)
    assert torch.equal(on_device["after"], clip.normalize(batch["after"]))


def test_stage_2_has_one_item_per_pair_with_its_no_change_pair(clevr_root, synth_tokenizer):
    pairs = data.read_clevr_change(clevr_root, "train")
    items = data.CaptionItems(pairs, synth_tokenizer, use_no_change_pair=True, images=data.ImageReader(32))
    assert len(items) == 3
    item = items[1]
    assert (item["row"], item["no_change_row"]) == (1, 4)
    assert data.evaluation_pairs(pairs, True)[item["no_change_row"]].id == "000000.png_n"
    assert item["caption_in"][0] == synth_tokenizer.sot_id and synth_tokenizer.eot_id in item["caption_out"]
    assert torch.equal(item["distractor"], data.ImageReader(32)(pairs[1].distractor))
    features_only = data.CaptionItems(pairs, synth_tokenizer, use_no_change_pair=False)[1]
    assert sorted(features_only) == ["caption_in", "caption_out", "row"]


def test_the_no_change_pair_needs_a_distractor(tmp_path, synth_tokenizer):
    pair = data.ImagePair(id="9.png", before=tmp_path / "9.png", after=tmp_path / "9_2.png", captions=["x"])
    with pytest.raises(data.DataError, match="pair 9.png has no distractor image"):
        data.CaptionItems([pair], synth_tokenizer, use_no_change_pair=True)


def test_pair_images_give_every_evaluation_pair_once_with_its_row(clevr_root):
    pairs = data.evaluation_pairs(data.read_clevr_change(clevr_root, "train"), use_no_change_pair=True)
    dataset = data.PairImages(pairs, data.ImageReader(32))
    assert len(dataset) == 6
    assert dataset[4]["row"] == 4 and torch.equal(dataset[4]["after"], data.ImageReader(32)(pairs[1].after))


def test_retrieval_texts_point_to_their_pairs(clevr_root):
    texts, text_to_pair = data.retrieval_texts(data.read_clevr_change(clevr_root, "train"))
    assert len(texts) == 6 and text_to_pair == [0, 0, 1, 1, 2, 2]


def test_the_image_cache_gives_the_decoded_pixels_and_is_rebuilt_when_a_file_changes(clevr_root, tmp_path):
    pairs = data.read_clevr_change(clevr_root, "train")
    cache = caches.image_cache(pairs, tmp_path / "cache", "train", image_size=32)
    assert len(cache.row) == 9
    assert np.array_equal(cache[pairs[2].after], data.preprocess_uint8(pairs[2].after, 32))
    write_png(pairs[2].after, (255, 255, 255))
    rebuilt = caches.image_cache(pairs, tmp_path / "cache", "train", image_size=32)
    assert rebuilt[pairs[2].after].min() == 255
    assert torch.equal(data.ImageReader(32, rebuilt)(pairs[0].before), data.ImageReader(32)(pairs[0].before))


def test_building_the_image_cache_draws_nothing_from_the_global_generator(synth_root, tmp_path):
    # a DataLoader draws a seed from the global generator when iterated; if the cache's did, a first run
    # (which builds the cache) and a second run (which finds it) would initialise and train differently
    pairs = data.load_split("synth", "test", synth_root)[:3]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    caches.image_cache(pairs, tmp_path / "cache", "test")
    assert torch.equal(torch.rand(3), expected)



def test_pixels_resident_on_the_device_give_the_batches_of_the_png_files_to_the_byte(clevr_root, synth_tokenizer,
                                                                                     tmp_path):
    pairs = data.read_clevr_change(clevr_root, "train")
    cache = caches.image_cache(pairs, tmp_path / "cache", "train", image_size=32)
    resident = caches.ResidentPixels(data.ImageReader(32, cache), pairs, torch.device("cpu"))
    assert len(resident.row) == len({str(p) for pair in pairs for p in caches.pair_paths(pair)})
    batches = []
    for images, table in ((data.ImageReader(32), None), (resident, resident.table)):
        samples = data.AdaptationSamples(pairs, synth_tokenizer, train=True, images=images)
        torch.manual_seed(0)  # the same distractor swaps
        collated = data.collate_text([samples[i % len(samples)] for i in range(24)])
        batches.append(data.to_device(collated, torch.device("cpu"), ("before", "after", "caption"), table))
    assert batches[1]["before"].shape == (24, 3, 32, 32) and batches[0].keys() == batches[1].keys()
    assert all(torch.equal(batches[0][k], batches[1][k]) for k in batches[0])
    assert collated["swapped"].any() and not collated["swapped"].all()  # distractor views among the rows


def test_resident_pixels_are_chosen_on_a_gpu_with_the_cache_and_refused_in_one_line_without_it(clevr_root, tmp_path):
    pairs = data.read_clevr_change(clevr_root, "train")
    cached = data.ImageReader(32, caches.image_cache(pairs, tmp_path / "cache", "train", image_size=32))
    cpu = torch.device("cpu")
    assert not caches.resident_pixels("auto", cached, pairs, cpu)  # auto: on a GPU only
    assert caches.resident_pixels("on", cached, pairs, cpu) and not caches.resident_pixels("off", cached, pairs, cpu)
    with pytest.raises(flags.ConfigError, match="add --image_cache"):
        caches.resident_pixels("on", data.ImageReader(32), pairs, cpu)
    with pytest.raises(flags.ConfigError, match="auto, on or off"):
        caches.resident_pixels("yes", cached, pairs, cpu)


def test_stage_1_from_resident_pixels_trains_as_from_the_loader(synth40_root, tiny_adapt, tmp_path):
    outputs = {}
    for choice in ("on", "off"):
        out = tmp_path / choice
        result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1",
                           "--no-freeze_intra", "--resident_pixels", choice)
        assert result.returncode == 0, result.stderr
        assert ("no loader reads them" in result.stdout) == (choice == "on")
        losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
        outputs[choice] = losses, (out / "test_retrieval.json").read_bytes()
    assert outputs["on"] == outputs["off"] and outputs["on"][0]


def ctrl_c_as_in_a_terminal():
    """A child's SIGINT handling as in a terminal: a shell's background job starts with SIGINT ignored, and Python
    then never raises KeyboardInterrupt, so a CI runner that starts the suite in the background would not test it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

def test_an_interrupt_during_the_image_cache_build_leaves_no_partial_file(tmp_path):
    for i in range(300):
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(tmp_path / f"{i}.png")
    script = ("import sys, time; from pathlib import Path; from plumbing import caches; import data\n"
              "root = Path(sys.argv[1])\n"
              "pairs = [data.ImagePair(str(i), root / f'{i}.png', root / f'{i}.png', ['x']) for i in range(300)]\n"
              "decode = caches.preprocess_uint8\n"
              "caches.preprocess_uint8 = lambda path, size: (time.sleep(0.02), decode(path, size))[1]  # 6 s in all\n"
              "caches.image_cache(pairs, root / 'cache', 'all', image_size=16, workers=0)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=HERE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_in_a_terminal)
    said = b""
    while b"image cache" not in said and process.poll() is None:  # the progress line: the build has begun
        said += process.stderr.read(1)
    assert list((tmp_path / "cache").glob("*.partial-*.npy"))  # ... and its partial file is there
    process.send_signal(signal.SIGINT)
    process.stderr.read()
    assert process.wait(timeout=60) != 0
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_partial_image_cache_of_a_dead_process_is_removed_at_the_next_build(clevr_root, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID runs no more
    living = tmp_path / "cache" / f"other_32.partial-{os.getppid()}.npy"  # a live process's build is left alone
    stale = tmp_path / "cache" / f"all_32.partial-{dead.pid}.npy"
    for path in (living, stale):
        write_json(path, [])
    caches.image_cache(data.read_clevr_change(clevr_root, "train"), tmp_path / "cache", "all", image_size=32)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["all_32.json", "all_32.npy", living.name]


def test_the_scripts_image_reader_reads_every_splits_images_from_one_cache_at_the_encoders_resolution(clevr_root):
    splits = {s: data.load_split("clevr", s, clevr_root) for s in data.SPLITS}
    alone = types.SimpleNamespace(master=True, ddp=False)  # one process: it builds the cache itself
    reader = caches.image_reader(splits, clevr_root, 32, cached=True, dist_=alone)
    assert reader.cache_dir == clevr_root / ".cache" and reader.cache.array_path.name == "all_32.npy"
    pair = splits["test"][0]
    assert torch.equal(reader(pair.after), caches.image_reader(splits, clevr_root, 32, False, alone)(pair.after))


# ======== synth.py ========

# synth_root (40 pairs, drawn once) and synth_tokenizer are the fixtures of data.py's tests above.


# --- the synthetic dataset ---

def test_an_incomplete_synthetic_folder_is_an_error_saying_it_will_be_drawn_again(tmp_path):
    (tmp_path / "synth").mkdir()
    with pytest.raises(data.DataError, match="not a complete synthetic dataset.*remove it and it will be drawn again"):
        synth.ensure_synth(tmp_path / "synth")


def test_drawing_fewer_than_one_synthetic_pair_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    for pairs in (0, -3):
        with pytest.raises(data.DataError, match=f"pairs {pairs}: the synthetic dataset needs .* at least 1 pair"):
            synth.make_synth(tmp_path / "synth", synth.SynthConfig(pairs=pairs))
        monkeypatch.setattr(sys, "argv", ["synth.py", "--make-synth", str(tmp_path / "synth"), "--pairs", str(pairs)])
        with pytest.raises(SystemExit) as exit_:
            synth.main()
        assert exit_.value.code == 2
        assert capsys.readouterr().err == f"synth.py: error: --pairs {pairs}: it must be at least 1\n"
    assert not (tmp_path / "synth").exists()


def test_synthetic_dataset_has_the_clevr_change_layout_and_balanced_splits(synth_root):
    splits = json.loads((synth_root / "splits.json").read_text())
    assert sorted(splits["train"] + splits["val"] + splits["test"]) == list(range(40))
    assert (len(splits["train"]), len(splits["val"]), len(splits["test"])) == (30, 5, 5)
    types = json.loads((synth_root / "type_mapping.json").read_text())
    assert types["move"][:2] == ["000004.png", "000009.png"]
    test = data.load_split("synth", "test", synth_root)
    assert sorted(p.change_type for p in test) == sorted(data.CHANGE_TYPES)  # one of each type
    assert Image.open(test[0].before).size == (480, 320)


def test_synthetic_dataset_is_the_same_bytes_for_the_same_seed_whatever_the_processes(synth_root, tmp_path):
    again = synth.make_synth(tmp_path / "again", SYNTH, workers=2)
    files = sorted(p.relative_to(synth_root) for p in synth_root.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((synth_root / f).read_bytes() == (again / f).read_bytes() for f in files)
    other = synth.make_synth(tmp_path / "other", synth.SynthConfig(pairs=5, seed=4))
    name = "images/CLEVR_default_000000.png"
    assert (other / name).read_bytes() != (synth_root / name).read_bytes()


WORD_ATTRIBUTE = {w: (attribute, value) for attribute, table in (
    ("size", synth.SIZE_WORDS), ("material", synth.MATERIAL_WORDS), ("shape", synth.SHAPE_WORDS))
    for value, words in table.items() for w in words} | {c: ("color", c) for c in synth.COLORS}


def named_objects(expression, scene):
    """The objects of scene that a referring expression like 'the tiny red shiny block' fits."""
    words = expression.split()
    assert words[0] == "the" and (words[-1] in synth.NOUN_WORDS or WORD_ATTRIBUTE[words[-1]][0] == "shape")
    wanted = dict(WORD_ATTRIBUTE[w] for w in words[1:] if w not in synth.NOUN_WORDS)
    return [i for i, obj in enumerate(scene) if all(obj[a] == v for a, v in wanted.items())]


def split_caption(caption, kind):
    """A change caption -> (referring expression, the verb phrase's new attribute value or None)."""
    for phrase in synth.VERB_PHRASES[kind]:
        head = phrase.split(" {new}")[0]
        if f" {head}" in caption:
            expression, rest = caption.split(f" {head}", 1)
            return expression, WORD_ATTRIBUTE[rest.split()[-1]][1] if "{new}" in phrase else None
    raise AssertionError(f"no {kind} verb phrase in {caption!r}")


def test_synthetic_captions_name_exactly_the_changed_object_of_the_drawn_scene(synth_root):
    scenes = json.loads((synth_root / synth.SYNTH_SCENES_FILE).read_text())["scenes"]
    captions = json.loads((synth_root / "change_captions.json").read_text())
    no_change = json.loads((synth_root / "no_change_captions.json").read_text())
    for name, scene in scenes.items():
        kind = scene["type"]
        assert len(set(captions[name])) == SYNTH.captions_per_pair
        assert set(no_change[name]) <= set(synth.NO_CHANGE_SENTENCES)
        named_in = "after" if kind == "add" else "before"
        for sentence in captions[name]:
            expression, new_value = split_caption(sentence, kind)
            assert named_objects(expression, scene[named_in]) == [scene["changed"][named_in]], sentence
            if kind in ("color", "material"):
                assert scene["after"][scene["changed"]["after"]][kind] == new_value != \
                    scene["before"][scene["changed"]["before"]][kind]
        count = {"add": 1, "drop": -1}.get(kind, 0)
        assert len(scene["after"]) == len(scene["before"]) + count


def test_synthetic_changes_stay_visible_after_the_224_resize(synth_root):
    scenes = json.loads((synth_root / synth.SYNTH_SCENES_FILE).read_text())["scenes"]
    for pair in data.load_split("synth", "test", synth_root):
        scene = scenes[f"CLEVR_default_{pair.id}"]
        before = data.preprocess_uint8(pair.before, 224).astype(int)
        after = data.preprocess_uint8(pair.after, 224).astype(int)
        changed = np.abs(before - after).max(-1)  # (224, 224)
        named_in = "after" if pair.change_type == "add" else "before"
        obj = scene[named_in][scene["changed"][named_in]]
        r = 0.8 * synth.SIZE_RADIUS[obj["size"]]  # the object's box, in the 224 x 224 image
        box = changed[round((obj["y"] - r) * 224 / 320):round((obj["y"] + r) * 224 / 320) + 1,
                      round((obj["x"] - r) * 224 / 480):round((obj["x"] + r) * 224 / 480) + 1]
        assert box.max() > 40, (pair.id, pair.change_type)
        assert (changed > 40).mean() < 0.15  # the rest of the scene is the same


def test_the_synthetic_vocabulary_makes_every_grammar_word_one_token(synth_tokenizer, synth_root):
    lines = gzip.open(synth_root / data.SYNTH_BPE_FILE, "rt").read().split("\n")
    assert lines[0] == "#version: 0.2" and synth_tokenizer.vocab_size == 512 + len(lines) - 1 + 2
    for word in sorted(synth.grammar_words()):
        assert len(synth_tokenizer.encode(word)) == 1, word
    for sentence in data.load_split("synth", "train", synth_root)[0].captions + list(synth.NO_CHANGE_SENTENCES):
        ids = synth_tokenizer.encode(sentence)
        assert len(ids) == len(sentence.split())
        assert synth_tokenizer.decode(ids).strip() == sentence


def test_learn_bpe_merges_the_most_frequent_pair_first_and_breaks_ties_by_order():
    assert synth.learn_bpe({"ab": 3, "cb": 1}) == [("a", "b</w>"), ("c", "b</w>")]
    assert synth.learn_bpe({"cb": 2, "ab": 2}) == [("a", "b</w>"), ("c", "b</w>")]


def test_synthetic_boxes_hold_the_changed_object_in_the_image_it_is_in(synth_root):
    boxes = json.loads((synth_root / data.CHANGE_BOXES_FILE).read_text())  # RCC's format, keyed "0", "1", ...
    pairs = {int(p.id[:6]): p for split in data.SPLITS for p in data.load_split("synth", split, synth_root)}
    for number, pair in pairs.items():
        entry = boxes[str(number)]
        assert pair.change_boxes == {"before": entry["bbox_before"], "after": entry["bbox_after"]}
        assert (entry["bbox_before"] is None) == (pair.change_type == "add")
        assert (entry["bbox_after"] is None) == (pair.change_type == "drop")
        if pair.change_type in ("color", "material"):  # only the object's pixels change, and it stays put
            assert entry["bbox_before"] == entry["bbox_after"]
            x, y, w, h = entry["bbox_before"]
            changed = np.argwhere(np.abs(np.asarray(Image.open(pair.before), int)
                                         - np.asarray(Image.open(pair.after), int)).max(-1) > 0)  # (k, 2): y, x
            assert changed.size and changed.min(0).tolist() >= [y - 1, x - 1]  # half-transparent edges: 1 pixel
            assert changed.max(0).tolist() <= [y + h, x + w]
        if pair.change_type == "move":
            assert entry["bbox_before"] != entry["bbox_after"]


def test_ensure_synth_adds_the_boxes_to_a_folder_drawn_without_them(synth_root, tmp_path):
    older = shutil.copytree(synth_root, tmp_path / "synth")
    (older / data.CHANGE_BOXES_FILE).unlink()
    synth.ensure_synth(older, SYNTH)
    assert (older / data.CHANGE_BOXES_FILE).read_bytes() == (synth_root / data.CHANGE_BOXES_FILE).read_bytes()


def test_ensure_synth_refuses_a_folder_drawn_with_other_settings_naming_the_synth_pairs_that_read_it(synth_root):
    assert synth.ensure_synth(synth_root, SYNTH) == synth_root
    # --eval --checkpoint of a model trained on --synth_pairs 40: the flag its checkpoint records, not "remove it"
    with pytest.raises(data.DataError, match=r"drawn with --synth_pairs 40, not 41: pass --synth_pairs 40 to read it "
                                             r"as drawn \(the value a checkpoint trained on it records in its config\)"):
        synth.ensure_synth(synth_root, synth.SynthConfig(pairs=41, seed=3))
    with pytest.raises(data.DataError, match=r"drawn with other settings .*'pairs': \(40, 41\), 'seed': \(3, 4\)"):
        synth.ensure_synth(synth_root, synth.SynthConfig(pairs=41, seed=4))


def test_ensure_synth_refuses_a_folder_whose_vocabulary_is_not_the_synthetic_clips(synth_root, tmp_path):
    old = tmp_path / "synth"
    shutil.copytree(synth_root, old)
    synth.write_bpe(old / data.SYNTH_BPE_FILE, synth.synth_vocabulary()[:-1])  # as an older data.py may have learnt it
    with pytest.raises(data.DataError, match="another vocabulary than the synthetic CLIP's .*remove the folder"):
        synth.ensure_synth(old)


# --- stage 0's single scenes ---

def test_stage_0_scenes_are_drawn_apart_from_every_idc_scene():
    cfg = synth.SynthConfig()
    for i in range(20):
        objects = synth.pretrain_objects(i, cfg)
        assert synth.SCENE_OBJECTS[0] <= len(objects) <= synth.SCENE_OBJECTS[1]
        assert objects != synth.synth_scene(i, cfg)["before"]  # another seed stream than the IDC pairs'
    assert synth.pretrain_objects(3, cfg) == synth.pretrain_objects(3, cfg)


def test_a_scene_description_names_every_object_and_fits_clips_32_tokens(synth_tokenizer):
    longest = {"size": "small", "color": "yellow", "material": "metal", "shape": "cylinder"}
    objects = [{**longest, "x": i} for i in range(synth.SCENE_OBJECTS[1])]
    description = synth.describe_scene(objects, lambda n: n - 1)  # the last order and the last synonyms
    assert description.count(" and ") == len(objects) - 1 and description.count("metallic cylinder") == 6
    assert len(synth_tokenizer.encode(description)) + 2 <= data.MAX_WORDS  # with SOT and EOT
    red = {"size": "large", "color": "red", "material": "rubber", "shape": "cube"}
    assert synth.describe_scene([red, longest]) == "large red rubber cube and small yellow metal cylinder"


def test_stage_0_samples_hold_the_scene_pixels_and_a_description_of_them(tmp_path, synth_tokenizer):
    root = synth.make_scenes(tmp_path / "scenes", splits={"train": 6, "val": 2, "test": 2})
    train = synth.SceneSamples(root, "train", synth_tokenizer, train=True)
    val = synth.SceneSamples(root, "val", synth_tokenizer, train=False)
    assert (len(train), len(val)) == (6, 2)
    sample = val[1]
    cfg = synth.SynthConfig()
    expected = synth.scene_pixels([synth.pretrain_objects(7, cfg)], cfg)[0]  # val: after 6
    assert torch.equal(sample["image"], torch.from_numpy(expected))  # uint8 (R, R, 3), normalised on the device
    assert synth_tokenizer.decode(sample["caption"][1:sample["caption"].argmax()].tolist()).strip() == \
        synth.describe_scene(synth.pretrain_objects(7, cfg))
    assert clip.read_merges(root / data.SYNTH_BPE_FILE) == synth.synth_vocabulary()


# ======== metrics.py ========

CORPORA = ["edge_cases", "clevr_style_public", "spot_public"]


def load_corpus(name):
    """(raw items, the toolkit's output) of one corpus in tests/metrics_vectors."""
    raw = json.loads(gzip.decompress(vectors("metrics_vectors", f"{name}.json.gz").read_bytes()))
    coco = json.loads(gzip.decompress(vectors("metrics_vectors", f"{name}.coco.json.gz").read_bytes()))
    return raw["items"], coco


def tokenized(coco):
    """Predictions and references exactly as every toolkit scorer saw them (after its PTB tokenizer)."""
    return ({item["id"]: item["candidate_tok"] for item in coco["items"]},
            {item["id"]: item["references_tok"] for item in coco["items"]})


def needs_meteor_data():
    if meteor.load_meteor_resources() is None:
        message = "the METEOR 1.5 data is missing: pip install --no-deps pycocoevalcap==1.2"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def scored():
    """Each corpus scored from the toolkit's tokens with BLEU, ROUGE-L and CIDEr, once for all tests."""
    cache = {}

    def get(name):
        if name not in cache:
            _, coco = load_corpus(name)
            cache[name] = (metrics.score_captions(*tokenized(coco), metrics=("BLEU", "ROUGE_L", "CIDEr"),
                                                  tokenize=False), coco)
        return cache[name]
    return get


# --- BLEU, ROUGE-L and CIDEr-D, from the toolkit's tokens ---

@pytest.mark.parametrize("name", CORPORA)
def test_bleu_rouge_and_cider_equal_the_toolkit_per_item_and_per_corpus(name, scored):
    result, coco = scored(name)
    for metric, value in result["corpus"].items():
        assert value == pytest.approx(coco["corpus"][metric], abs=1e-6), metric
    for expected in coco["items"]:
        mine = result["items"][expected["id"]]
        for metric, value in mine.items():
            assert value == pytest.approx(expected[metric], abs=1e-6), (expected["id"], metric)


def test_bleu_counts_equal_the_toolkits_summed_statistics():
    _, coco = load_corpus("clevr_style_public")
    scorer = metrics.CaptionScorer(*tokenized(coco), metrics=("BLEU",), tokenize=False)
    total = coco["corpus_bleu_stats"]
    assert sum(s["testlen"] for s in scorer.bleu_stats.values()) == total["testlen"]
    assert sum(s["reflen"] for s in scorer.bleu_stats.values()) == total["reflen"]
    assert [sum(s["correct"][k] for s in scorer.bleu_stats.values()) for k in range(4)] == total["correct"]
    assert [sum(s["guess"][k] for s in scorer.bleu_stats.values()) for k in range(4)] == total["guess"]


def test_bleu_of_an_exact_match_is_not_quite_one_because_of_the_toolkits_epsilons():
    result = metrics.score_captions({1: "the red cube moved", 2: "a blue ball"},
                                    {1: ["the red cube moved"], 2: ["a blue ball"]}, metrics=("BLEU",))
    assert result["items"][1]["BLEU_1"] == pytest.approx(0.9999999995, abs=1e-12)
    assert result["items"][2]["BLEU_4"] == pytest.approx(0.0316, abs=1e-4)     # three words: no 4-gram at all


def test_bleu_takes_the_closest_reference_length_and_the_shorter_on_a_tie():
    stats = metrics.bleu_item_stats(metrics._ngram_counts("a b c d e", 4), 5,
                                    [metrics._ngram_counts("a b c d", 4), metrics._ngram_counts("a b c d e f", 4)],
                                    [4, 6])
    assert stats["reflen"] == 4


def test_rouge_takes_best_precision_and_best_recall_from_different_references():
    # "a b" against ["a b c d" (P 1, R 0.5), "a" (P 0.5, R 1)]: P = 1 and R = 1 although no reference gives both.
    assert metrics.rouge_l("a b", ["a b c d", "a"]) == pytest.approx(1.0)
    assert metrics.rouge_l("", ["", "the cube moved"]) == 1.0       # split(" ") makes "" one empty token


def test_lcs_is_the_longest_common_subsequence():
    assert metrics.lcs_length("a b c d e".split(), "b x d e a".split()) == 3          # b d e
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = list(rng.integers(0, 5, rng.integers(0, 12)))
        b = list(rng.integers(0, 5, rng.integers(0, 12)))
        table = np.zeros((len(a) + 1, len(b) + 1), int)
        for i in range(len(a)):
            for j in range(len(b)):
                table[i + 1, j + 1] = table[i, j] + 1 if a[i] == b[j] else max(table[i, j + 1], table[i + 1, j])
        assert metrics.lcs_length(a, b) == table[-1, -1]


def test_bit_parallel_rouge_l_equals_the_plain_one():
    # scoring/fast.py's rouge_l (bit-parallel LCS), FastCaptionScorer's, against metrics.rouge_l, bit for bit.
    assert scoring_fast.rouge_l("a b", ["a b c d", "a"]) == metrics.rouge_l("a b", ["a b c d", "a"])
    assert scoring_fast.rouge_l("", ["", "the cube moved"]) == 1.0
    rng = np.random.default_rng(1)
    for _ in range(500):
        words = [" ".join(map(str, rng.integers(0, 6, rng.integers(0, 70)))) for _ in range(rng.integers(1, 4))]
        assert scoring_fast.rouge_l(words[0], words) == metrics.rouge_l(words[0], words)
        assert scoring_fast.rouge_l(words[-1], words[:1]) == metrics.rouge_l(words[-1], words[:1])


def test_ngram_arrays_give_the_plain_bleu_statistics_and_cider_of_every_corpus_and_subset():
    # scoring/fast.py's NgramTable, FastCaptionScorer's BLEU statistics and CIDEr-D, against the plain per-caption
    # dicts (CaptionScorer), bit for bit: the whole set, subsets (CIDEr's document frequencies change with them), one
    # item, repeated ids; the edge cases' empty and duplicate references and unicode; the field's id strings.
    corpora = [tokenized(load_corpus(name)[1]) for name in CORPORA]
    toolkit = levir_field_vectors()[1]["items"]
    corpora.append(({it["id"]: it["candidate_ids"] for it in toolkit},
                    {it["id"]: it["references_ids"] for it in toolkit}))
    for predictions, references in corpora:
        plain = metrics.CaptionScorer(predictions, references, ("BLEU", "CIDEr"), tokenize=False)
        fast = metrics.FastCaptionScorer(predictions, references, ("BLEU", "CIDEr"), tokenize=False)
        assert fast.bleu_stats == plain.bleu_stats and fast.items == plain.items
        ids = list(predictions)
        for subset in (None, ids[:100], ids[-1:], ids[::3], ids[:20] + ids[5:10]):
            assert fast.score(subset) == plain.score(subset)
        for config in (dataclasses.replace(plain.config, cider_log_n_of_one=1.0), metrics.MetricsConfig(bleu_n=2,
                       cider_n=3, cider_sigma=2.5)):          # as scoring/field.py sets it; other orders and width
            plain.config = fast.config = config
            assert fast.score(ids[-1:]) == plain.score(ids[-1:]) and fast.score(ids[::2]) == plain.score(ids[::2])


def test_ngram_arrays_give_the_plain_numbers_on_random_captions():
    # Few words, so that n-grams repeat within a caption and across references; any whitespace (str.split()), empty
    # captions and references, a reference equal to the candidate or repeated; 1- to 5-grams.
    rng = np.random.default_rng(2)
    words = ["a", "b", "c", "cube", "é", "日本", "x.y"]
    def caption():                                                                                  # noqa: E306
        picked = rng.choice(words[:rng.integers(1, len(words) + 1)], rng.integers(0, 16))
        return "".join(w + rng.choice([" ", " ", "  ", "\t", "\u3000"]) for w in picked)
    for trial in range(40):
        n_items = int(rng.integers(1, 30))
        predictions = {i: caption() for i in range(n_items)}
        references = {i: [caption() for _ in range(rng.integers(1, 6))] for i in range(n_items)}
        references[0] += [references[0][0], predictions[0]]
        config = metrics.MetricsConfig(bleu_n=int(rng.integers(1, 6)), cider_n=int(rng.integers(1, 6)),
                                       cider_log_n_of_one=[None, 1.0][trial % 2])
        plain = metrics.CaptionScorer(predictions, references, ("BLEU", "CIDEr"), tokenize=False, config=config)
        fast = metrics.FastCaptionScorer(predictions, references, ("BLEU", "CIDEr"), tokenize=False, config=config)
        assert fast.score() == plain.score()
        for _ in range(3):
            subset = rng.integers(0, n_items, rng.integers(1, n_items + 1)).tolist()
            assert fast.score(subset) == plain.score(subset)
    every_reference_empty = ({1: "a b", 2: "c"}, {1: [""], 2: ["", ""]}, ("BLEU", "CIDEr"), False)
    assert metrics.FastCaptionScorer(*every_reference_empty).score() == \
        metrics.CaptionScorer(*every_reference_empty).score()
    # The packed sort under the n-gram arrays is a stable argsort, also where keys are too large to pack.
    for high in (3, 1 << 20, 1 << 62):
        keys = rng.integers(0, high, 200)
        order, in_order = scoring_fast._stable_sort(keys)
        assert (order == np.argsort(keys, kind="stable")).all() and (in_order == np.sort(keys)).all()


def test_cider_is_ten_for_a_perfect_match_and_zero_for_a_one_item_corpus():
    result = metrics.score_captions({1: "the red cube moved", 2: "a ball appeared"},
                                    {1: ["the red cube moved"] * 3, 2: ["the blue sphere is gone"]}, metrics=("CIDEr",))
    assert result["items"][1]["CIDEr"] == pytest.approx(10.0)
    alone = metrics.score_captions({1: "the red cube moved"}, {1: ["the red cube moved"]}, metrics=("CIDEr",))
    assert alone["corpus"]["CIDEr"] == 0.0


def test_a_subset_is_rescored_on_its_own_so_its_cider_differs_from_its_items_inside_the_full_set():
    _, coco = load_corpus("clevr_style_public")
    predictions, references = tokenized(coco)
    first_100 = list(predictions)[:100]
    result = metrics.score_subsets(predictions, references, {"first 100": first_100, "all": list(predictions)},
                                   metrics=("CIDEr", "BLEU"), tokenize=False)
    assert result["first 100"]["corpus"]["CIDEr"] == pytest.approx(coco["first_100"]["CIDEr"], abs=1e-6)  # alone
    in_full_set = np.mean([item["CIDEr"] for item in coco["items"][:100]])
    assert np.mean([result["all"]["items"][i]["CIDEr"] for i in first_100]) == pytest.approx(in_full_set, abs=1e-6)
    # the subset scored alone, not inside the full set: the gap is a thousand times the tolerance of the checks above
    assert abs(coco["first_100"]["CIDEr"] - in_full_set) > 1e-3
    assert result["all"]["corpus"]["CIDEr"] == pytest.approx(coco["corpus"]["CIDEr"], abs=1e-6)


# --- retrieval metrics ---

def test_retrieval_ranks_each_caption_against_all_pairs_and_each_pair_against_caption_groups():
    # 3 pairs, 5 captions (2, 2 and 1 per pair). Text ranks: 0, 1, 2, 0, 1.
    sim = np.array([[0.9, 0.1, 0.2],
                    [0.3, 0.8, 0.1],
                    [0.5, 0.4, 0.6],
                    [0.1, 0.7, 0.2],
                    [0.2, 0.3, 0.25]])
    result = adapt.retrieval_metrics(sim, [0, 0, 1, 1, 2])
    assert result["text_to_pair"] == {"R1": 40.0, "R5": 100.0, "R10": 100.0, "MedianR": 2.0, "MeanR": 1.8}
    # A group scores by its best caption: pair 0 -> [0.9, 0.5, 0.2], pair 1 -> [0.8, 0.7, 0.3], pair 2 ->
    # [0.2, 0.6, 0.25]. Pair ranks: 0, 1, 1.
    assert result["pair_to_text"]["R1"] == pytest.approx(100 / 3)
    assert result["pair_to_text"]["MedianR"] == 2.0
    assert result["pair_to_text"]["MeanR"] == pytest.approx(5 / 3)


def test_retrieval_medians_are_torch_lower_median_for_texts_and_numpy_median_for_pairs():
    sim = np.array([[0.9, 0.1, 0.1, 0.1],         # symmetric: both directions have ranks 0, 1, 2, 3
                    [0.1, 0.5, 0.8, 0.2],
                    [0.1, 0.8, 0.3, 0.6],
                    [0.1, 0.2, 0.6, 0.05]])
    result = adapt.retrieval_metrics(sim, [0, 1, 2, 3])
    assert result["text_to_pair"]["MedianR"] == 2.0      # lower of 2 and 3
    assert result["pair_to_text"]["MedianR"] == 2.5      # mean of 2 and 3
    assert result["text_to_pair"]["MeanR"] == result["pair_to_text"]["MeanR"] == 2.5
    assert result["text_to_pair"]["R1"] == 25.0


def test_retrieval_ties_count_against_the_true_match_unless_asked_otherwise():
    constant = np.full((4, 4), 0.5)
    pessimistic = adapt.retrieval_metrics(constant, [0, 1, 2, 3])
    assert pessimistic["text_to_pair"] == {"R1": 0.0, "R5": 100.0, "R10": 100.0, "MedianR": 4.0, "MeanR": 4.0}
    optimistic = adapt.retrieval_metrics(constant, [0, 1, 2, 3], ties="optimistic")
    assert optimistic["text_to_pair"]["R1"] == 100.0 and optimistic["pair_to_text"]["MedianR"] == 1.0
    one_tie = adapt.retrieval_metrics(np.array([[0.5, 0.5, 0.2], [0.1, 0.9, 0.3], [0.0, 0.1, 0.7]]), [0, 1, 2])
    assert one_tie["text_to_pair"]["R1"] == pytest.approx(200 / 3)


def test_retrieval_refuses_a_pair_without_captions():
    with pytest.raises(ValueError, match="no caption"):
        adapt.retrieval_metrics(np.eye(3), [0, 1, 1])


# --- scoring a corpus: inputs, the command line, end to end ---

def write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def test_command_line_reads_coco_results_and_ground_truth(tmp_path, capsys):
    results = write(tmp_path / "res.json", [{"image_id": 7, "caption": "the red cube moved"},
                                            {"image_id": 8, "caption": "nothing changed"}])
    truth = write(tmp_path / "gt.json", {"images": [{"id": 7}, {"id": 8}], "annotations": [
        {"image_id": 7, "caption": "the red cube has moved", "id": 0},
        {"image_id": 8, "caption": "there is no change", "id": 1},
        {"image_id": 8, "caption": "nothing has changed", "id": 2}]})
    assert metrics.main([results, truth, "--json", "--meteor-modules", "exact,stem"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = metrics.score_captions({7: "the red cube moved", 8: "nothing changed"},
                                      {7: ["the red cube has moved"], 8: ["there is no change", "nothing has changed"]},
                                      meteor_modules=("exact", "stem"))
    assert printed["corpus"] == pytest.approx(expected["corpus"])
    assert set(printed["items"]) == {"7", "8"}


def test_command_line_reports_malformed_json_with_file_and_position(tmp_path, capsys):
    broken = write(tmp_path / "broken.json", '[{"image_id": 1, "caption": "a cube"},\n {"image_id": 2 "caption"}]')
    assert metrics.main([broken, broken]) == 2
    error = capsys.readouterr().err
    assert "broken.json" in error and "line 2, column 17" in error


def test_duplicate_prediction_ids_are_refused():
    with pytest.raises(metrics.CaptionInputError, match="duplicate prediction for image_id 3"):
        metrics.read_predictions([{"image_id": 3, "caption": "a"}, {"image_id": 3, "caption": "b"}], "res.json")


def test_a_prediction_without_references_is_refused_with_a_hint_about_id_types():
    with pytest.raises(metrics.CaptionInputError, match="have no references.*same type"):
        metrics.score_captions({5: "a cube"}, {"5": ["a cube"]})


def test_items_whose_only_reference_is_empty_score_as_the_toolkit_scores_them_in_a_corpus():
    # Spot-the-Diff-style items, four with empty references (two whose only reference is empty, one of them with an
    # empty candidate; one whose only reference is whitespace), and the coco-caption toolkit's scores of them
    # (pycocoevalcap 1.2, OpenJDK 17), made by tests/metrics_vectors/make_empty_references.py
    corpus = json.loads((vectors("metrics_vectors", "empty_references.json")).read_text(encoding="utf-8"))
    predictions = {item["id"]: item["candidate"] for item in corpus["items"]}
    references = {item["id"]: item["references"] for item in corpus["items"]}
    toolkit, toolkit_items = corpus["toolkit"]["corpus"], corpus["toolkit"]["items"]
    result = metrics.score_captions(predictions, references, metrics=("BLEU", "ROUGE_L", "CIDEr"))
    names = ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "ROUGE_L", "CIDEr")  # the empty items count in every mean
    assert {k: round(result["corpus"][k], 6) for k in names} == {k: round(toolkit[k], 6) for k in names}
    for i in predictions:
        assert {k: round(result["items"][i][k], 6) for k in ("ROUGE_L", "CIDEr")} == \
               {k: round(toolkit_items[i][k], 6) for k in ("ROUGE_L", "CIDEr")}, i
    assert result["items"]["9420.png"]["CIDEr"] == 0 and result["items"]["8069.png"]["ROUGE_L"] == 0
    assert result["items"]["3.png"]["ROUGE_L"] == 1.0  # an empty candidate matches an empty reference
    needs_meteor_data()   # the fast scorer: the plain one reads all of the paraphrase table, 8 s; they agree (below)
    meteor = metrics.score_captions(predictions, references, metrics=("METEOR",), scorer=metrics.FastCaptionScorer)
    assert abs(meteor["corpus"]["METEOR"] - toolkit["METEOR"]) < 1e-6
    assert [meteor["items"][i]["METEOR"] for i in ("9420.png", "3.png", "8069.png")] == [0, 0, 0]


def test_an_empty_reference_list_is_refused():
    with pytest.raises(metrics.CaptionInputError, match="empty list of references"):
        metrics.score_captions({"a": "a cube"}, {"a": []})


def test_end_to_end_from_raw_text_gives_the_toolkits_numbers():
    needs_meteor_data()
    items, coco = load_corpus("edge_cases")
    predictions = {it["id"]: it["candidate"] for it in items}
    references = {it["id"]: it["references"] for it in items}
    result = metrics.score_captions(predictions, references)                 # the plain scorer, all four modules
    for metric, value in coco["corpus"].items():
        assert result["corpus"][metric] == pytest.approx(value, abs=1e-6), metric
    assert metrics.score_captions(predictions, references, scorer=metrics.FastCaptionScorer) == result


# --- the kind of change a caption says, by keywords ---

@pytest.mark.parametrize("caption, kind", [
    ("the two scenes seem identical", "distractor"), ("there is no difference", "distractor"),
    ("nothing has moved", "distractor"),  # the no-change words come first
    ("a big metal sphere has been newly placed", "add"), ("the red cube is missing", "drop"),
    ("the red cube has disappeared", "drop"),  # "appeared" is inside it: drops are tried first
    ("the cube is no longer there", "drop"), ("the small cube changed its location", "move"),
    ("the gray sphere became red", "color"), ("the red sphere turned shiny", "material"),
    ("the rubber cube became metal", "material"), ("the red sphere became big", "?"), ("", "?")])
def test_the_kind_of_change_a_caption_says_is_the_first_keyword_rule_that_matches(caption, kind):
    assert metrics.said_kind(caption) == kind


def test_change_kinds_counts_each_true_kind_said_and_the_confusion():
    pairs = [data.ImagePair(f"{i}.png", Path("b.png"), Path("a.png"), captions=[], change_type=kind)
             for i, kind in enumerate(["color", "color", "drop", "move"])]
    said = {"0.png": "the cube became red", "1.png": "the cube is gone", "2.png": "the cube is gone",
            "3.png": "the scenes are the same", "0.png_n": "the scenes are the same", "1.png_n": "nothing changed",
            "2.png_n": "the cube moved"}
    kinds = metrics.change_kinds([{"image_id": i, "caption": c} for i, c in said.items()], pairs)
    assert metrics.format_kinds(kinds, confusion=True).splitlines() == [
        "color 1/2, drop 1/1, move 0/1, distractor 2/3",  # in data.CHANGE_TYPES's order; kinds not tested left out
        "  color -> color 1, drop 1", "  drop -> drop 1", "  move -> distractor 1", "  distractor -> distractor 2, move 1"]
    with pytest.raises(metrics.CaptionInputError, match="'9.png' is not a pair of the test split"):
        metrics.change_kinds([{"image_id": "9.png", "caption": "the cube moved"}], pairs)


def test_the_kind_of_change_scores_names_are_data_pys_and_synth_pys():
    assert metrics.CHANGE_KINDS == data.CHANGE_TYPES and metrics.NO_CHANGE_KIND == data.DISTRACTOR
    assert metrics.NO_CHANGE_ID_SUFFIX == data.NO_CHANGE_SUFFIX
    assert set(metrics.COLOR_WORDS) == set(synth.COLORS)
    assert set(metrics.MATERIAL_WORDS) == {w for words in synth.MATERIAL_WORDS.values() for w in words}


# --- the PTB tokenizer ---

@pytest.mark.parametrize("name", CORPORA)
def test_ptb_tokenizer_gives_the_toolkits_tokens_for_every_raw_caption(name):
    items, coco = load_corpus(name)
    for item, expected in zip(items, coco["items"]):
        assert ptb.ptb_tokenize_fast(item["candidate"]) == expected["candidate_tok"], item["id"]
        assert [ptb.ptb_tokenize_fast(r) for r in item["references"]] == expected["references_tok"], item["id"]


def test_ptb_tokenizer_splits_contractions_keeps_brackets_and_drops_punctuation():
    assert ptb.ptb_tokenize("It's the car's door, can't you see?") == "it 's the car 's door ca n't you see"
    assert ptb.ptb_tokenize("The cube cannot move!!!") == "the cube can not move !!!"
    assert ptb.ptb_tokenize("the (big) cube [red]") == "the -lrb- big -rrb- cube -lsb- red -rsb-"
    assert ptb.ptb_tokenize("10% of $5 costs #1 \u2014 a*b") == "10 % of $ 5 costs # 1 a * b"
    assert ptb.ptb_tokenize("the U.S. cube, e.g. the red one\u2026") == "the u.s. cube e.g. the red one"
    assert ptb.ptb_tokenize("the cube \U0001F642 moved") == "the cube moved"          # emoji are dropped
    assert ptb.ptb_tokenize("the small red cube\r\nmoved") == "the small red cube moved"
    assert ptb.ptb_tokenize("   \t ") == ""


def test_ptb_lexers_letters_are_javas_letters_of_the_basic_multilingual_plane():
    import unicodedata
    word = next(rx for rx, action in ptb._ptb_rules() if getattr(action, "__name__", "") == "unsoft"
                and "tok" not in rx.groupindex)
    marks = {0xad, *range(0x300, 0x370), *range(0x483, 0x488)}       # the soft hyphen and combining marks it takes
    for code in range(0x10000):
        is_letter = unicodedata.category(chr(code)).startswith("L") or code in marks
        assert (word.fullmatch(chr(code)) is not None) == is_letter, hex(code)
    assert word.fullmatch("a\u0660") and not word.fullmatch("a\u00b2") and not word.fullmatch("\U00010400")


def test_ptb_shortcut_gives_the_lexers_tokens_for_captions_of_words_spaces_and_lone_marks():
    captions = {"Cannot you see  the 3D cube gonna move", "No 5 St Mr US  ", "the cube 555 moved", "", "a, b; c! d?",
                "It moved etc. It is gone etc.", "see No. 5 and no. 6.", "the cube is a. The ball moved.", "Mr. Red",
                "U.S. cube.", "the cube ? . ! moved .", "red . . . cube", "cube.red moved", "moved?! Yes", "5. 6, 7."}
    for name in CORPORA:
        items, _ = load_corpus(name)
        captions.update(text for item in items for text in [item["candidate"], *item["references"]])
    plain = sorted(c for c in captions if ptb._PLAIN_CAPTION.fullmatch(c) and not ptb._DIGITS_SPACED.search(c))
    assert len(plain) > 8_000 and sum("." in c for c in plain) > 50
    plain = plain[::2] + [c for c in captions if len(c) < 40 and "." in c]     # 4,300 of them, for time
    assert [ptb.ptb_tokenize_fast(c) for c in plain] == [ptb.ptb_tokenize(c) for c in plain]


def test_scoring_runs_the_plain_scorer_unless_asked_for_the_fast_one_which_gives_the_same_numbers():
    import inspect
    for function in (metrics.score_captions, metrics.score_subsets):
        assert inspect.signature(function).parameters["scorer"].default is metrics.CaptionScorer
    items, _ = load_corpus("edge_cases")
    predictions = {it["id"]: it["candidate"] for it in items}
    references = {it["id"]: it["references"] for it in items}
    plain = metrics.score_captions(predictions, references, meteor_modules=("exact", "stem"))
    fast = metrics.score_captions(predictions, references, meteor_modules=("exact", "stem"),
                                  scorer=metrics.FastCaptionScorer)
    assert fast == plain
    # with all four METEOR modules: test_end_to_end_from_raw_text_gives_the_toolkits_numbers


def test_a_forked_meteor_worker_gives_the_same_numbers():
    needs_meteor_data()
    _, coco = load_corpus("clevr_style_public")                               # 1,200 items: above the threshold
    one = metrics.FastCaptionScorer(*tokenized(coco), tokenize=False, processes=1).score()
    two = metrics.FastCaptionScorer(*tokenized(coco), tokenize=False, processes=2).score()
    assert one == two
    predictions, references = tokenized(coco)                  # the worker is forked first, then the scorer fails
    with pytest.raises(metrics.CaptionInputError, match="unknown metrics"):
        metrics.FastCaptionScorer(predictions, references, ("METEOR", "SPICE"), processes=2)


def test_the_normalisers_shortcut_for_plain_lines_gives_its_words():
    lines = {"the 3d cube  moved ", "no 5 st mr us", "", "DOTMULTI moved", "the u.s. cube"}
    for name in CORPORA:
        _, coco = load_corpus(name)
        lines.update(text for item in coco["items"] for text in [item["candidate_tok"], *item["references_tok"]])
    fast = scoring_fast.FastMeteor(meteor.MeteorConfig(), ("exact",), None)
    assert sum(bool(scoring_fast._PLAIN_LINE.fullmatch(line)) for line in lines) > 5_000   # most take the shortcut
    assert [fast.words(line) for line in sorted(lines)] == [meteor.meteor_normalize(line) for line in sorted(lines)]


# --- the field's scoring: how the LEVIR-CC papers score, beside ours ---

def levir_field_vectors():
    """The LEVIR-CC-style corpus (words) and the Java toolkit's scores of it in the field's form (ids)."""
    read = lambda name: json.loads(gzip.decompress(vectors("metrics_vectors", name).read_bytes()))  # noqa: E731
    return read("levir_field.json.gz"), read("levir_field.coco.json.gz")


def test_field_scoring_of_vocabulary_ids_equals_the_java_toolkits_as_the_levir_cc_papers_run_it():
    corpus, toolkit = levir_field_vectors()
    items = corpus["items"]
    vocabulary = field.field_vocabulary(r for item in items for r in item["references"])
    assert vocabulary == toolkit["vocabulary"] and len(vocabulary) == 69
    assert [field.field_ids(item["candidate"], vocabulary) for item in items] == \
        [item["candidate_ids"] for item in toolkit["items"]]
    subsets = {"whole": [it["id"] for it in items],
               **{kind: [it["id"] for it in items if it["kind"] == kind] for kind in ("change", "no change")}}
    table = field.score_both_ways({it["id"]: it["candidate"] for it in items},
                                    {it["id"]: it["references"] for it in items}, subsets, vocabulary,
                                    metrics.FastCaptionScorer)
    for name, expected in toolkit["scores"].items():
        scored = table["field"][name]
        for metric in ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr"):
            assert scored[metric] == pytest.approx(100 * expected[metric], abs=1e-9), (name, metric)
        assert scored["S*m"] == pytest.approx(25 * (expected["BLEU_4"] + expected["METEOR"] + expected["ROUGE_L"]
                                                   + expected["CIDEr"]), abs=1e-9)
    assert table["sizes"] == {"whole": 240, "change": 130, "no change": 110}
    assert round(toolkit["scores"]["whole"]["METEOR"], 4) == 0.4311  # the table in tests/metrics_vectors/README.md


def test_field_meteor_on_ids_matches_exactly_but_for_the_paraphrase_tables_number_phrases():
    corpus, toolkit = levir_field_vectors()
    predictions = {it["id"]: it["candidate_ids"] for it in toolkit["items"]}
    references = {it["id"]: it["references_ids"] for it in toolkit["items"]}
    exact = metrics.score_captions(predictions, references, ("METEOR",), tokenize=False, meteor_modules=("exact",))
    assert exact["corpus"]["METEOR"] == pytest.approx(toolkit["scores"]["whole"]["METEOR_exact"], abs=1e-12)
    assert toolkit["scores"]["whole"]["METEOR"] - toolkit["scores"]["whole"]["METEOR_exact"] == \
        pytest.approx(0.0006, abs=1e-4)


def test_field_words_join_clip_decoded_hyphens_and_unknown_words_are_unk_in_references_too():
    assert field.field_words("a lane at the lower - right corner") == ["a", "lane", "at", "the", "lower-right",
                                                                         "corner"]
    vocabulary = field.field_vocabulary(["the road is widened"] * 5 + ["the quonset"] * 4)
    assert vocabulary == {"is": 4, "road": 5, "the": 6, "widened": 7}  # after <NULL> <UNK> <START> <END>
    assert field.field_ids("the quonset is widened", vocabulary) == "6 1 4 7"


# --- each LEVIR-CC paper's own evaluation (scoring/field.py), against its code run with the Java toolkit ---

def levir_papers():
    """Two LEVIR-CC-form corpora with predictions, and what RSICC's, RSCaMa's and Chg2Cap's code made of them."""
    return json.loads(gzip.decompress(vectors("metrics_vectors", "levir_papers.json.gz").read_bytes()))["corpora"]


TOOLKIT_NAMES = {"Bleu_1": "BLEU_1", "Bleu_2": "BLEU_2", "Bleu_3": "BLEU_3", "Bleu_4": "BLEU_4", "METEOR": "METEOR",
                 "ROUGE_L": "ROUGE_L", "CIDEr": "CIDEr"}


@pytest.mark.parametrize("corpus", ["main", "tiny"])
@pytest.mark.parametrize("paper", ["rsicc", "rscama", "chg2cap", "rscama shipped vocab"])
def test_each_levir_cc_papers_evaluation_gives_what_its_own_code_gave_every_subset_to_the_last_bit(corpus, paper):
    known = levir_papers()[corpus]
    answer = known["answers"][paper]
    rules = field.PAPERS[paper.split()[0]]
    own_file = answer["word_map"] if paper == "rscama shipped vocab" else None   # RSCaMa's vocab.json, as it ships
    if own_file is None:  # the vocabulary its preprocessing wrote: the same words, the same ids
        assert field.paper_vocabulary(known["records"], rules) == answer["word_map"]
    predictions = {p["image_id"]: p["caption"] for p in known["predictions"]}
    result = field.score_as(rules, predictions, known["records"], metrics.FastCaptionScorer, own_file)
    subsets = [n for n in ("no change", "change") if result["sizes"].get(n)] + ["whole"]  # the scripts' call order
    assert len(answer["calls"]) == len(subsets)
    for name, call in zip(subsets, answer["calls"]):
        assert result["sizes"][name] == len(call["hypotheses"])
        assert {TOOLKIT_NAMES[k]: v for k, v in call["scores"].items()} == \
            {m: result["subsets"][name][m] for m in field.METRICS}, name   # ==: every bit
    whole = answer["calls"][-1]
    assert [result["items"][i]["hypothesis"] for i in predictions] == [" ".join(map(str, h))
                                                                        for h in whole["hypotheses"]]
    printed = answer["printed"].splitlines()
    printed = printed[next(k for k, line in enumerate(printed) if line.startswith(("len(", "Testing:"))):]
    time_cut = lambda lines: [line.split("\t", 1)[1] if line.startswith("Time:") else line for line in lines]  # noqa
    assert time_cut(field.format_as(result).splitlines()[:-1]) == time_cut(printed)  # as its script prints


def test_the_papers_part_at_words_seen_5_and_6_times_and_number_them_by_first_appearance_or_sorted():
    known = levir_papers()["main"]
    words = {paper: field.paper_vocabulary(known["records"], field.PAPERS[paper]) for paper in field.PAPERS}
    assert ["greenhouse" in words[p] for p in ("rsicc", "rscama", "chg2cap")] == [False, False, True]  # 5 times
    assert all("stadium" in words[p] and "cul-de-sac" in words[p] for p in words)                      # 6 times
    assert all("pond" not in words[p] for p in words)                                                   # 4 times
    rsicc = [w for w in words["rsicc"] if not w.startswith("<")]
    assert rsicc != sorted(rsicc) and list(words["rsicc"].values())[:3] == [1, 2, 3]
    chg2cap = list(words["chg2cap"])
    assert chg2cap[:4] == ["<NULL>", "<UNK>", "<START>", "<END>"] and chg2cap[4:] == sorted(chg2cap[4:])


def test_the_raw_tokenizer_splits_off_commas_drops_periods_and_keeps_an_empty_word_as_the_papers_script_does():
    assert field.raw_tokens(" a road is built, near 0.5km .") == ["<START>", "a", "road", "is", "built", ",", "near",
                                                                 "05km", "<END>"]
    assert field.raw_tokens("a   b c") == ["<START>", "a", "", "b", "c", "<END>"]  # its remove-while-iterating
    assert field.prediction_words("at the lower - right .", field.PAPERS["chg2cap"]) == ["at", "the", "lower-right"]
    assert field.prediction_words("at the lower - right .", field.PAPERS["rsicc"]) == ["at", "the", "lower-right", "."]


def write_levir_papers_corpus(folder, corpus="tiny"):
    known = levir_papers()[corpus]
    references = write(folder / "LevirCCcaptions.json", {"images": known["records"]})
    predictions = write(folder / "test_predictions.json", [{"image_id": p["image_id"], "caption": p["caption"]}
                                                           for p in known["predictions"]])
    return predictions, references, known


def test_metrics_command_scores_levir_cc_as_a_paper_and_prints_its_scripts_lines_then_s_star_m(tmp_path, capsys):
    predictions, references, known = write_levir_papers_corpus(tmp_path)
    assert metrics.main([predictions, "--references", references, "--as", "chg2cap"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["len(nochange_references): 1", "len(change_references): 1", "nochange_metric:"]
    assert lines[-1].startswith("S*m ") and "ShizhenChang/Chg2Cap test.py" in lines[-1]
    assert metrics.main([predictions, "--references", references, "--as", "rsicc", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["subsets"]["whole"]["CIDEr"] == known["answers"]["rsicc"]["calls"][-1]["scores"]["CIDEr"]
    assert printed["sizes"] == {"whole": 2, "change": 1, "no change": 1} and printed["split"] == "test"
    vocab = write(tmp_path / "vocab.json", known["answers"]["rscama shipped vocab"]["word_map"])
    assert metrics.main([predictions, "--references", references, "--as", "rscama", "--vocab", vocab, "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["subsets"]["whole"]
    assert scores["CIDEr"] == known["answers"]["rscama shipped vocab"]["calls"][-1]["scores"]["CIDEr"]
    assert metrics.main([predictions, "--references", references]) == 0   # our way: words, PTB tokens
    assert capsys.readouterr().out.startswith("metric ")
    one = write(tmp_path / "one.json", [{"image_id": "test_000001", "caption": "a road is built"}])  # by its name
    assert metrics.main([one, "--references", references]) == 0 and "1 items, 5 references" in capsys.readouterr().out


def test_metrics_command_reads_clevr_change_spot_the_diff_and_ier_files_as_they_ship(tmp_path, capsys):
    said = {"000007.png": "the red cube moved", "000007.png_n": "nothing changed", "12.png": "a car is gone",
            "Reddit_1": "make it brighter"}
    predictions = write(tmp_path / "pred.json", [{"image_id": i, "caption": c} for i, c in said.items()])
    clevr = [write(tmp_path / "change_captions.json", {"CLEVR_default_000007.png": ["the red cube has moved"],
                                                       "CLEVR_default_000009.png": ["a ball is gone"]}),
             write(tmp_path / "no_change_captions.json", {"CLEVR_default_000007.png": ["nothing has changed"]})]
    spot = write(tmp_path / "test.json", [{"img_id": 12, "sentences": ["the car is gone"]},
                                          {"img_id": 12, "sentences": ["a car left"]}])  # merged by img_id
    ier = write(tmp_path / "ier_test.json", [{"img0": "a.jpg", "img1": "b.jpg", "uid": "Reddit_1",
                                              "sents": ["brighten the image", "make it lighter"]}])
    assert metrics.main([predictions, "--references", *clevr, spot, ier, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["info"]["references"] == 6
    expected = metrics.score_captions(said, {"000007.png": ["the red cube has moved"], "000007.png_n": [
        "nothing has changed"], "12.png": ["the car is gone", "a car left"], "Reddit_1": ["brighten the image",
                                                                                      "make it lighter"]})
    assert printed["corpus"] == expected["corpus"]


@pytest.mark.parametrize("case, error", [
    ("empty", "pred.json: no predictions in it"),
    ("unknown id", "1 prediction id(s) name no pair of the LevirCCcaptions.json, e.g. ['test_999999.png']"),
    ("a pair left out", "1 of the 2 test pairs have no prediction, e.g. ['test_000002.png']"),
    ("the same pair twice", "two predictions name the pair test_000001.png"),
    ("predictions as references", "this is a predictions file (COCO results [{image_id, caption}])"),
    ("a paper without LevirCCcaptions.json", "--as rsicc scores LEVIR-CC as its papers do"),
    ("the other paper's word map", "no ['<unk>', '<start>', '<end>', '<pad>'] in it"),
    ("references of no known kind", "not a references file; expected a COCO ground truth"),
])
def test_metrics_command_refuses_bad_predictions_and_references_in_one_line(tmp_path, capsys, case, error):
    predictions, references, known = write_levir_papers_corpus(tmp_path)
    said = [{"image_id": p["image_id"], "caption": p["caption"]} for p in known["predictions"]]
    args = {"empty": [write(tmp_path / "pred.json", []), "--references", references],
            "unknown id": [write(tmp_path / "p1.json", said + [{"image_id": "test_999999.png", "caption": "a"}]),
                           "--references", references, "--as", "rsicc"],
            "a pair left out": [write(tmp_path / "p2.json", said[:1]), "--references", references, "--as", "rsicc"],
            "the same pair twice": [write(tmp_path / "p3.json", said + [{"image_id": "test_000001", "caption": "a"}]),
                                    "--references", references, "--as", "chg2cap"],
            "predictions as references": [predictions, "--references", predictions],
            "a paper without LevirCCcaptions.json": [predictions, "--references", write(
                tmp_path / "gt.json", {"test_000001.png": ["a"], "test_000002.png": ["b"]}), "--as", "rsicc"],
            "the other paper's word map": [predictions, "--references", references, "--as", "rsicc", "--vocab",
                                           write(tmp_path / "v.json", known["answers"]["rscama"]["word_map"])],
            "references of no known kind": [predictions, "--references", write(tmp_path / "r.json", [1, 2])],
            }[case]
    assert metrics.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("metrics.py: error: ") and error in err and err.count("\n") == 1


def test_metrics_command_help_shows_an_example_per_dataset(capsys):
    with pytest.raises(SystemExit):
        metrics.main(["--help"])
    text = capsys.readouterr().out
    for dataset, reference in (("CLEVR-Change", "no_change_captions.json"), ("Spot-the-Diff", "annotations/test.json"),
                               ("IER", "data/ier/test.json"), ("LEVIR-CC", "LevirCCcaptions.json --as rsicc"),
                               ("any COCO set", "captions_val2014.json")):
        assert re.search(rf"{dataset} +python metrics.py .*{re.escape(reference)}", text, re.S), dataset


def test_both_ways_table_prints_whole_change_and_no_change_each_scored_ours_and_the_fields_with_s_star_m():
    references = {"a": ["several houses appear at the lower-right", "some houses are built"],
                  "b": list(data.LEVIR_NO_CHANGE), "c": ["a road is built in the forest", "a new road appears"]}
    predictions = {"a": "several houses appear at the lower - right", "b": "there is no difference",
                   "c": "a road is built"}
    vocabulary = field.field_vocabulary([r for refs in references.values() for r in refs] * 5)
    table = field.score_both_ways(predictions, references, {"whole test": ["a", "b", "c"], "change": ["a", "c"],
                                                            "no change": ["b"]}, vocabulary, metrics.CaptionScorer)
    for way in ("project", "field"):
        scores = table[way]["change"]
        assert scores["S*m"] == pytest.approx((scores["BLEU_4"] + scores["METEOR"] + scores["ROUGE_L"]
                                               + scores["CIDEr"]) / 4)
        assert table[way]["whole test"]["BLEU_4"] == pytest.approx(100.0)  # hyphens joined: every word matches
    text = field.format_both_ways(table)
    lines = text.splitlines()
    assert lines[0].split() == ["x100", "pairs", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L",
                                "CIDEr-D", "S*m"]
    assert [line.split(",")[0] for line in lines[1:7]] == ["whole test", "whole test", "change", "change",
                                                            "no change", "no change"]
    assert lines[2].startswith("whole test, field's        3") and lines[5].startswith("no change, ours            1")
    field_line = next(line for line in lines if line.startswith("field's:"))
    assert "vocabulary-id strings" in field_line and ">= 5 times" in field_line and "<unk>" in field_line \
        and "no PTB tokenizer" in field_line
    assert lines[-1] == "S*m = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4"


# ======== scoring/meteor.py ========

def test_meteor_counts_matches_by_stage_and_chunks_and_scores_them_with_its_formula():
    plain = meteor.Meteor(modules=("exact", "stem"))                     # exact weighs 1.0, stem 0.6
    stats = plain.item_stats("the red cubes moved", ["a red cube has moved"])
    assert (stats.hyp_len, stats.ref_len, stats.hyp_function_words, stats.ref_function_words) == (4, 5, 1, 2)
    assert stats.hyp_content_matches == stats.ref_content_matches == (2, 1)     # red, moved exact; cubes-cube stem
    assert stats.hyp_function_matches == stats.ref_function_matches == (0, 0)
    assert (stats.hyp_matched, stats.ref_matched, stats.chunks) == (3, 3, 2)    # "has" splits red cube | moved
    # content words weigh delta = 0.75, function words 0.25: P = 1.95 / 2.5, R = 1.95 / 2.75
    precision, recall = (2 * 1.0 + 0.6) * 0.75 / (3 * 0.75 + 0.25), (2 * 1.0 + 0.6) * 0.75 / (3 * 0.75 + 2 * 0.25)
    f_mean = precision * recall / (0.85 * precision + 0.15 * recall)
    assert plain.score(stats) == pytest.approx(f_mean * (1 - 0.6 * (2 / 3) ** 0.2), abs=1e-12)
    perfect = plain.item_stats("a cube", ["a cube"])                        # all matched in one chunk
    total = plain.add(plain.add(plain.zero_stats(), stats), perfect)
    assert (total.hyp_len, total.hyp_matched, total.chunks) == (6, 5, 2)   # a perfect item adds no chunk


def test_snowball_stemmer_gives_the_english_stems():
    # make_stemmer_normaliser_agreement.py in tests/metrics_vectors (run by hand, needs Java) checks this against
    # org.tartarus.snowball.ext.englishStemmer of meteor-1.5.jar: it agrees on all 173,767 words of METEOR's English
    # synonym, exception, function-word and paraphrase data (91,279 of them stemmed to something else).
    examples = {"generously": "generous", "running": "run", "skies": "sky", "cubes": "cube", "moved": "move",
                "dying": "die", "hopped": "hop", "hoping": "hope", "agreed": "agre", "feed": "feed", "bus": "bus",
                "gaps": "gap", "communication": "communic", "spheres": "sphere", "metallic": "metal",
                "shiny": "shini", "largest": "largest", "disappeared": "disappear"}
    assert {word: meteor.snowball_stem(word) for word in examples} == examples


def test_meteor_normaliser_joins_hyphens_splits_apostrophes_and_keeps_abbreviations():
    # make_stemmer_normaliser_agreement.py in tests/metrics_vectors (run by hand, needs Java) checks this against
    # edu.cmu.meteor.util.Normalizer of meteor-1.5.jar as -norm runs it: it agrees on all 48,425 distinct lines of
    # the edge-case, CLEVR-style and Spot corpora there, raw and PTB-tokenized (the jar changes 795 of them beyond
    # lower-casing and splitting).
    assert meteor.meteor_normalize("the café-coloured cube") == ["the", "café", "coloured", "cube"]
    assert meteor.meteor_normalize("it 's red") == ["it", "'", "s", "red"]
    assert meteor.meteor_normalize("the u.s. cube") == ["the", "us", "cube"]
    assert meteor.meteor_normalize("mr. smith moved") == ["mr.", "smith", "moved"]
    assert meteor.meteor_normalize("the end .") == ["the", "end", "."]


@pytest.mark.parametrize("name", CORPORA)
def test_meteor_with_its_data_equals_the_toolkit(name):
    needs_meteor_data()
    _, coco = load_corpus(name)
    # the fast scorer, which the scripts run; it gives the plain one's numbers (test_end_to_end_from_raw_text_...)
    result = metrics.score_captions(*tokenized(coco), metrics=("METEOR",), tokenize=False,
                                    scorer=metrics.FastCaptionScorer)
    assert result["info"]["meteor_modules"] == "exact+stem+synonym+paraphrase"
    assert result["corpus"]["METEOR"] == pytest.approx(coco["corpus"]["METEOR"], abs=1e-12)
    assert all(result["items"][e["id"]]["METEOR"] == pytest.approx(e["METEOR"], abs=1e-12) for e in coco["items"])


@pytest.mark.parametrize("name, modules", [
    ("clevr_style_public", ("exact",)), ("clevr_style_public", ("exact", "stem")),
    ("spot_public", ("exact",)), ("spot_public", ("exact", "stem"))])
def test_meteor_without_its_data_lands_on_the_toolkits_own_exact_and_stem_scores(name, modules):
    # the toolkit's corpus METEOR run with `-m exact` and `-m "exact stem"` (tests/metrics_vectors/README.md)
    _, coco = load_corpus(name)
    toolkit = coco["meteor_modules"]["+".join(modules)]
    result = metrics.score_captions(*tokenized(coco), metrics=("METEOR",), tokenize=False, meteor_modules=modules)
    assert result["corpus"]["METEOR"] == pytest.approx(toolkit, abs=1e-12)
    assert result["info"]["meteor_modules"] == "+".join(modules)
    assert "meteor_note" in result["info"]


@pytest.fixture
def no_meteor_data(monkeypatch, tmp_path):
    monkeypatch.setenv(meteor.METEOR_DATA_ENV, str(tmp_path))         # a folder without the jar
    meteor.load_meteor_resources.cache_clear()
    yield
    meteor.load_meteor_resources.cache_clear()


def test_without_the_meteor_data_scoring_falls_back_to_exact_and_stem_and_says_so(no_meteor_data):
    result = metrics.score_captions({1: "the cubes moved"}, {1: ["the cube has moved"]}, metrics=("METEOR",))
    assert result["info"]["meteor_modules"] == "exact+stem"
    assert "the METEOR 1.5 data was not found" in result["info"]["meteor_note"]
    with pytest.raises(metrics.CaptionInputError, match="pip install --no-deps pycocoevalcap"):
        metrics.score_captions({1: "a"}, {1: ["a"]}, metrics=("METEOR",), meteor_modules=meteor.METEOR_MODULES)


def test_meteor_builtin_word_lists_equal_the_jars_files():
    needs_meteor_data()
    jar = meteor._find_meteor_files()[0]
    with zipfile.ZipFile(jar) as archive:
        words = archive.read("function/english.words").decode("utf-8").split("\n")
        prefixes = archive.read("nonbreaking/english.prefixes").decode("utf-8").split("\n")
    assert meteor.METEOR_FUNCTION_WORDS == {w for w in words if w}
    table = {}
    for line in prefixes:
        parts = line.split()
        if parts and not parts[0].startswith("#"):
            table[parts[0]] = 2 if parts[1:2] == ["#NUMERIC_ONLY#"] else 1
    assert meteor.METEOR_NONBREAKING == table


# --- METEOR's speed variants give what the readable code gives ---

def test_many_items_at_once_give_the_statistics_of_one_item_at_a_time():
    needs_meteor_data()
    items = []
    for name in CORPORA:
        _, coco = load_corpus(name)
        items += [(e["candidate_tok"], e["references_tok"]) for e in coco["items"][:250]]
    fast = scoring_fast.FastMeteor(resources=meteor.load_meteor_resources())
    plain = meteor.Meteor(resources=meteor.load_meteor_resources())
    plain.read_paraphrases = scoring_fast.load_paraphrases     # the same table (a test below), read faster
    assert plain.item_stats_many(items) == fast.item_stats_many(items)


def test_many_items_at_once_give_the_same_statistics_with_any_stages_a_chunk_at_a_time_and_past_64_words():
    needs_meteor_data()
    _, coco = load_corpus("spot_public")
    items = [(e["candidate_tok"], e["references_tok"]) for e in coco["items"][:150]]
    long = " ".join(["the red cube and the blue ball"] * 12)     # 84 words: past the batched search's 64-bit masks
    items += [("", ["a cube"]), ("a cube", [""]), ("a  cube", ["a cube"]), ("the cube moved", []),   # the same words
              (long, [long + " moved", long.replace("red", "green")])]
    for modules in [("exact",), ("exact", "stem"), ("exact", "synonym"), ("exact", "paraphrase")]:
        plain = meteor.Meteor(modules=modules, resources=meteor.load_meteor_resources())
        plain.read_paraphrases = scoring_fast.load_paraphrases    # the same table (a test below), read faster
        fast = scoring_fast.FastMeteor(modules=modules, resources=meteor.load_meteor_resources())
        expected = plain.item_stats_many(items)
        assert [s for k in range(0, len(items), 40) for s in fast.item_stats_many(items[k:k + 40])] == expected
        assert fast.item_stats_many(items) == expected            # again: the alignments searched before, reused


def test_batched_beam_search_chooses_the_same_alignments_as_the_readable_one():
    needs_meteor_data()
    items, _ = load_corpus("clevr_style_public")
    fast = scoring_fast.FastMeteor(resources=meteor.load_meteor_resources())
    pairs = [(ptb.ptb_tokenize_fast(it["candidate"]), ptb.ptb_tokenize_fast(r)) for it in items[:300]
             for r in it["references"]]
    fast.prepare([text for pair in pairs for text in pair])
    problems, readable = [], []
    for hypothesis, reference in pairs:
        cands, cover1, cover2 = fast._candidates(fast.sentence(hypothesis), fast.sentence(reference))
        fixed, used1, used2, open_choice = meteor._fixed_matches(cands, cover1, cover2)
        if open_choice:
            problems.append((cands, fixed, used1, used2))
            readable.append(fast._resolve(cands, cover1, cover2, len(cands)))
            fast._structures.clear()
    assert len(problems) > 100
    assert fast._resolve_batch(problems) == readable


def test_batched_beam_search_matches_the_readable_one_on_made_up_problems():
    # Problems the corpora rarely hold: 64 words a side, many ties, phrases of several words, fixed matches amid
    # open ones, positions without candidates, more paths than the beam; several batches (batch_size).
    needs_meteor_data()
    rng = random.Random(54)
    fast = scoring_fast.FastMeteor(resources=meteor.load_meteor_resources())
    problems, readable = [], []
    while len(problems) < 400:
        n_ref, n_hyp = rng.choice([(64, 64), (64, 3), (2, 64)] + [(rng.randint(1, 30), rng.randint(1, 30))] * 5)
        cands = []
        for i in range(n_ref):
            options = set()
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 6])):
                length, m_length = rng.choice([(1, 1)] * 6 + [(1, 2), (2, 1), (2, 2), (3, 2)])
                if i + length <= n_ref and m_length <= n_hyp:
                    options.add((i, length, rng.randrange(n_hyp - m_length + 1), m_length, rng.randrange(4)))
            cands.append(sorted(options, key=lambda m: (m[4], m[2], m[1], m[3])))
        cover1, cover2 = [0] * n_hyp, [0] * n_ref
        for start, length, m_start, m_length, _ in itertools.chain.from_iterable(cands):
            for k in range(m_start, m_start + m_length):
                cover1[k] += 1
            for k in range(start, start + length):
                cover2[k] += 1
        fixed, used1, used2, open_choice = meteor._fixed_matches(cands, cover1, cover2)
        if open_choice:
            problems.append((cands, fixed, used1, used2))
            readable.append(fast._resolve(cands, cover1, cover2, n_ref))
            fast._structures.clear()
    assert sum(len(fixed) > 0 for _, fixed, _, _ in problems) > 50
    assert fast._resolve_batch(problems, batch_size=150) == readable


def test_paraphrase_index_is_built_once_and_keeps_the_tables_order(tmp_path, monkeypatch):
    table = tmp_path / "paraphrase-en.gz"
    triples = [("0.1", "the cube", "the block"), ("0.2", "cube", "block"), ("0.3", "cube", "dice"),
               ("0.4", "red", "crimson"), ("0.5", "the cube", "this cube")]
    table.write_bytes(gzip.compress("".join(f"{p}\n{a}\n{b}\n" for p, a, b in triples).encode()))
    monkeypatch.setenv(meteor.METEOR_CACHE_ENV, str(tmp_path / "cache"))
    resources = meteor.MeteorResources({}, {}, table, str(tmp_path))
    vocabulary = {"the", "cube", "block", "dice", "this"}
    expected = {("the", "cube"): [("the", "block"), ("this", "cube")], ("cube",): [("block",), ("dice",)]}
    assert scoring_fast.load_paraphrases(resources, vocabulary) == expected         # "red" -> "crimson" cannot match
    assert any((tmp_path / "cache").iterdir())
    assert scoring_fast.load_paraphrases(resources, vocabulary) == expected         # now read from the cache


def test_the_paraphrase_index_gives_what_reading_the_table_plainly_gives(tmp_path, monkeypatch):
    needs_meteor_data()
    with gzip.open(meteor.load_meteor_resources().paraphrase_gz, "rb") as f:
        lines = [f.readline() for _ in range(3 * 20_000)]            # the real table's first 20,000 pairs
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(b"".join(lines)))
    monkeypatch.setenv(meteor.METEOR_CACHE_ENV, str(tmp_path / "cache"))
    resources = meteor.MeteorResources({}, {}, table, str(tmp_path))
    words = sorted({w for line in lines[1::3] + lines[2::3] for w in line.decode().split()})
    rng = np.random.default_rng(0)
    for vocabulary in [set(words), set(rng.choice(words, len(words) // 2)), set(rng.choice(words, 500))]:
        expected = meteor.read_paraphrases(resources, vocabulary)
        assert len(expected) > 10
        assert scoring_fast.load_paraphrases(resources, vocabulary) == expected


def test_pausing_the_garbage_collector_changes_no_score_and_turns_it_back_on(monkeypatch):
    _, coco = load_corpus("edge_cases")
    paused = metrics.score_captions(*tokenized(coco), tokenize=False, scorer=metrics.FastCaptionScorer)
    assert gc.isenabled()
    monkeypatch.setattr(metrics, "collector_paused", contextlib.nullcontext)
    running = metrics.score_captions(*tokenized(coco), tokenize=False, scorer=metrics.FastCaptionScorer)
    assert paused["corpus"] == running["corpus"] and paused["items"] == running["items"]


# ======== plumbing/flags.py, plumbing/files.py, plumbing/progress.py, plumbing/checkpoints.py, plumbing/stopping.py, plumbing/processes.py, plumbing/batches.py ========

KEEP_FREED_MEMORY_PROBE = """
import ctypes, resource, torch
from plumbing import processes
def step():  # a training step's pattern: many large blocks alive at once, then all freed
    blocks = [torch.ones(5_000_000) for _ in range(12)]  # 12 x 20 MB
def faults_per_step():  # the fewest of steps 3 to 6: where the heap's history left a gap, one step maps afresh
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(faults[2:])
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(processes.M_MMAP_THRESHOLD, 128 * 1024)  # glibc's starting values, held fixed (its own threshold moves
libc.mallopt(processes.M_TRIM_THRESHOLD, 128 * 1024)  # with the history of frees, so the default is not repeatable)
held = faults_per_step()
kept = processes.keep_freed_memory()
print(kept, held, faults_per_step())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_keep_freed_memory_lets_a_repeated_step_reuse_its_pages():
    result = subprocess.run([sys.executable, "-c", KEEP_FREED_MEMORY_PROBE], cwd=HERE, capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0 and "libc.so.6" in result.stderr:
        pytest.skip("no glibc here")
    assert result.returncode == 0, result.stderr
    kept, before_call, after_call = result.stdout.split()
    assert kept == "True"
    assert int(before_call) > 30_000  # every 20 MB block mapped afresh: 12 x ~4,900 pages faulted in per step
    # the heap's pages reused: 0 on torch 2.13, one block's 4,883 when the heap cannot grow in place and glibc maps
    # it, a few blocks' where the allocator's history left the heap in pieces (14,649 seen in one step on torch
    # 2.5.1). What the call promises, on every torch: most of a repeated step's pages are reused, not faulted in.
    assert int(after_call) < int(before_call) / 3


def test_config_flags_follow_the_dataset_preset_then_the_command_line():
    config = flags.parse_config(adapt.Config, adapt.PRESETS, ["--data", "spot", "--lr", "3e-4"])
    assert (config.epochs, config.lr, config.clip_lr_scale) == (20, 3e-4, 1e-3)
    with pytest.raises(SystemExit):
        flags.parse_config(adapt.Config, adapt.PRESETS, ["--data", "spot", "--learning_rate", "3e-4"])


def test_a_flags_help_is_the_text_its_config_field_was_declared_with(capsys):
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(adapt.Config)}  # flags.flag(default, help)
    assert helps["lr"] == "learning rate of the new joint parameters"
    with pytest.raises(SystemExit):
        flags.parse_config(adapt.Config, adapt.PRESETS, ["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # as argparse wraps it
    assert "--lr LR learning rate of the new joint parameters (default: 0.0001)" in shown
    assert "the global batch runs in this many pieces, one after another, when it does not fit in memory" in shown
    for config in (adapt.Config, caption.Config, pretrain.Config):  # every flag says what it does
        assert all(f.metadata.get("help") for f in dataclasses.fields(config))
    for config in (adapt.Config, caption.Config):  # what a GPU user needs is explained, not only named
        helps = {f.name: f.metadata["help"] for f in dataclasses.fields(config)}
        assert all(len(helps[flag]) > 100 for flag in ("num_workers", "grad_accum", "device", "dtype"))


class FakeGPUs:
    """A machine with GPUs as torch sees it, with only what talks to the driver replaced: torch.cuda.is_available,
    device_count, get_device_capability, get_device_name, is_bf16_supported and current_device answer for `count`
    H100s; torch._C._cuda_setDevice (the
    driver call under torch.cuda.set_device) and init_process_group record their arguments, the store the processes
    meet in a stand-in. torch.cuda.set_device's own argument check (_get_device_index: an index, or a torch.device
    that names one) still runs."""

    def __init__(self, monkeypatch, count: int = 2):
        self.count, self.selected, self.groups = count, [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # autocast asks
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.selected[-1] if self.selected else 0)
        monkeypatch.setattr(torch._C, "_cuda_setDevice", self.selected.append, raising=False)  # absent from CPU builds
        monkeypatch.setattr(processes, "init_process_group", lambda backend, **kwargs: self.groups.append(
            {"backend": backend, **kwargs}))
        monkeypatch.setattr(processes, "process_store", lambda rank, world_size: ("store", rank, world_size))


class SetUpDone(Exception):
    """Raised where a script seeds its random numbers, right after its set-up: the test reads what it chose."""


# (environment, flags, the GPU index the process must take); the torchrun forms start an nccl group bound to it
TORCHRUN_STORE = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
LAUNCH_FORMS = {
    "python X.py": ({}, [], 0),
    "--device cuda": ({}, ["--device", "cuda"], 0),
    "--device cuda:1": ({}, ["--device", "cuda:1"], 1),
    "torchrun, process 1 of 2": ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                  **TORCHRUN_STORE}, [], 1),
    "torchrun, process 5 of 8, second machine": ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                                                  "LOCAL_WORLD_SIZE": "4", **TORCHRUN_STORE}, [], 1)}
SCRIPTS = {"adapt.py": (adapt, ["--data", "clevr"]), "caption.py": (caption, ["--data", "clevr"]),
           "caption.py --eval": (caption, ["--data", "clevr", "--eval"]),
           "caption.py --pair": (caption, ["--data", "clevr", "--pair", "BEFORE", "AFTER"]),
           "pretrain.py": (pretrain, ["--data", "scenes"])}


@pytest.mark.parametrize("form", LAUNCH_FORMS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_launch_form_of_every_script_starts_on_a_gpu_machine_and_takes_its_gpu(monkeypatch, tmp_path, form,
                                                                                      script):
    env, device_flags, index = LAUNCH_FORMS[form]
    module, script_flags = SCRIPTS[script]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", *TORCHRUN_STORE):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gpus = FakeGPUs(monkeypatch, count=2)
    chosen = {}
    real_setup = processes.setup

    def setup(config):  # the real set-up, its answer kept
        chosen["process"], chosen["dtype"], chosen["ctx"], chosen["scaler"] = answer = real_setup(config)
        return answer

    def seeded(seed):
        raise SetUpDone

    monkeypatch.setattr(loop, "setup", setup)  # plumbing.started, every script's set-up, calls them
    monkeypatch.setattr(loop, "seed_everything", seeded)
    monkeypatch.setattr(loop, "loader_workers", lambda n, device: chosen.setdefault(
        "workers", (n, processes.loader_workers(n, device)))[1])
    if module is caption:  # --eval and --pair read a trained captioner first: none here, the set-up is what is tested
        monkeypatch.setattr(plumbing, "load_trained", lambda path, keys: checkpoints.Trained(path, {}, {}, False))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        with pytest.raises(SetUpDone):
            module.main([*script_flags, "--out_dir", str(tmp_path / "run"), *device_flags])
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # --tf32, the default
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    process = chosen["process"]
    assert gpus.selected == [index] and process.device == torch.device("cuda", index)
    assert process.rank == int(env.get("RANK", 0)) and process.master == (process.rank == 0)
    if env:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        assert gpus.groups == [{"backend": "nccl", "store": ("store", rank, world_size), "rank": rank,
                                "world_size": world_size, "timeout": processes.GROUP_TIMEOUT,
                                "device_id": torch.device("cuda", index)}]
        assert process.ddp and process.world_size == int(env["WORLD_SIZE"])
    else:
        assert gpus.groups == [] and not process.ddp and process.world_size == 1
    # the README's GPU row: bf16 autocast on an H100 (no GradScaler), every usable CPU but one per process
    assert chosen["dtype"] == "bfloat16" and not chosen["scaler"].is_enabled()
    asked, workers = chosen["workers"]  # the preset's --num_workers, and what the set-up made of it
    assert workers == (asked if asked >= 0 else max(1, data.usable_cpus() // int(env.get("LOCAL_WORLD_SIZE", 1)) - 1))
    loader = batches.training_loader(list(range(8)), None, 2, 1, process.device, lambda items: items)
    assert loader.pin_memory and loader.num_workers == 1  # the batch is copied from pinned memory


class TF32Seen(TorchDispatchMode):
    """The --tf32 setting each matrix product would run under on a GPU (read at the product, as cuBLAS would)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.seen.append(torch.backends.cuda.matmul.allow_tf32)
        return func(*args, **(kwargs or {}))


def test_the_products_said_to_be_float32_run_in_ieee_float32_under_tf32_and_the_rest_keep_tf32(monkeypatch, tmp_path):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        processes.set_tf32(True)  # --tf32, the default
        text, pairs = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        with TF32Seen() as loss_products:
            contrastive_loss(text, pairs, torch.tensor(4.6))  # its backward runs later, outside: TF32 there
        query, keys = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
        with TF32Seen() as attention_products:
            explain.attention_weights(query, keys)
        with TF32Seen() as other_products:
            torch.nn.Linear(8, 8)(text)
        assert loss_products.seen and not any(loss_products.seen)  # the logits
        assert attention_products.seen and not any(attention_products.seen)
        assert other_products.seen == [True] and torch.backends.cuda.matmul.allow_tf32  # restored after
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    # released weights are scored in IEEE float32: --dtype auto gives float32 and TF32 off
    release = {"clip.visual.joint_positional_embedding": torch.zeros(1), "decoder.w": torch.zeros(1)}
    monkeypatch.setattr(plumbing, "load_trained", lambda path, keys: checkpoints.Trained(path, release, {}, True))
    asked = {}

    def setup(config):
        asked.update(dtype=config.dtype, tf32=config.tf32)
        raise SetUpDone

    monkeypatch.setattr(loop, "setup", setup)
    with pytest.raises(SetUpDone):
        caption.main(["--data", "clevr", "--eval", "--out_dir", str(tmp_path)])
    assert asked == {"dtype": "float32", "tf32": False}


@pytest.mark.parametrize("env, flag, message", [
    ({}, ["--device", "cuda:2"], "--device cuda:2, but torch sees 2 GPU"),
    ({"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", **TORCHRUN_STORE}, [],
     "LOCAL_RANK 2 on this machine, but torch sees 2 GPU")])
def test_a_gpu_that_is_not_there_is_refused_in_one_line(monkeypatch, env, flag, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gpus = FakeGPUs(monkeypatch, count=2)
    config = adapt.Config(device=flag[1] if flag else "auto")
    with pytest.raises(flags.ConfigError, match=re.escape(message)):
        processes.setup(config)
    assert gpus.selected == [] and gpus.groups == []


@pytest.mark.parametrize("capability, expected", [((7, 0), "float16"), ((7, 5), "float16"), ((8, 0), "bfloat16"),
                                                   ((9, 0), "bfloat16")])
def test_dtype_auto_on_a_gpu_is_bfloat16_only_where_it_is_native(monkeypatch, capsys, capability, expected):
    # torch.cuda.is_bf16_supported() says True on a V100 (7.0), where bfloat16 is emulated: the capability decides
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert processes.resolve_dtype("auto", torch.device("cuda")) == expected
    assert processes.resolve_dtype("bfloat16", torch.device("cuda")) == "bfloat16"  # asked for: given, with a note
    note = capsys.readouterr().err
    if expected == "float16":
        assert note.count("\n") == 1 and "no bfloat16 arithmetic" in note and "compute capability 7." in note
    else:
        assert note == ""


def test_dtype_auto_is_float32_on_the_cpu_and_an_unknown_dtype_is_refused_with_the_choices():
    assert processes.resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert processes.resolve_dtype("float16", torch.device("cpu")) == "float16"  # the GPU's fp16 path, emulated
    with pytest.raises(flags.ConfigError, match="--dtype 'fp16'.*auto, float32, bfloat16 or float16"):
        processes.resolve_dtype("fp16", torch.device("cpu"))


def test_a_bad_flag_value_is_refused_before_anything_is_read(capsys):
    with pytest.raises(SystemExit):
        flags.parse_config(adapt.Config, adapt.PRESETS, ["--data", "synth", "--batch_size", "0"])
    assert "--batch_size 0: it must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        flags.parse_config(caption.Config, caption.PRESETS, ["--warmup", "1"])
    assert "--warmup 1.0: it must be in [0, 1)" in capsys.readouterr().err


def test_a_user_error_is_one_line_and_any_other_error_keeps_its_traceback(capsys):
    def bad_setting():
        raise flags.ConfigError("--lr -1: it must be > 0")

    with pytest.raises(SystemExit) as exit_:
        stopping.run_main(bad_setting, "adapt.py")
    assert exit_.value.code == 1 and capsys.readouterr().err == "adapt.py: error: --lr -1: it must be > 0\n"

    def shape_bug():
        torch.zeros(2, 3) @ torch.zeros(2, 3)  # a RuntimeError from inside torch: a bug, not the user's input

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        stopping.run_main(shape_bug, "adapt.py")


def test_float_flags_accept_finite_values_only(capsys):
    for value in ("inf", "nan"):
        with pytest.raises(SystemExit):
            flags.parse_config(adapt.Config, adapt.PRESETS, ["--lr", value])
        assert f"--lr {value}: it must be a finite number, > 0" in capsys.readouterr().err


def test_caption_lengths_outside_what_the_model_holds_are_refused_before_any_work(capsys):
    for script, argv, expected in ((adapt, ["--max_words", "2"], "--max_words 2: it must be in [3, 77]"),
                                   (adapt, ["--max_words", "78"], "--max_words 78: it must be in [3, 77]"),
                                   (caption, ["--max_words", "1"], "--max_words 1: it must be in [2, 77]")):
        with pytest.raises(SystemExit):
            flags.parse_config(script.Config, script.PRESETS, argv)
        assert expected in capsys.readouterr().err


def test_more_intra_image_layers_than_the_model_has_are_refused_with_its_number_of_blocks():
    config = adapt.Config(data="synth", clip_model="synth-ViT/32", intra_layers=7)  # a model of 6 vision blocks
    with pytest.raises(flags.ConfigError, match=r"--intra_layers 7: synth-ViT/32 has 6 vision blocks.*\[1, 6\]"):
        adapt.build_encoder(config, clip_files.load("synth-ViT/32")[0].config.vocab_size)


def test_a_device_that_is_not_there_is_refused_in_one_line():
    assert flags.check_device("cpu") == "cpu"
    with pytest.raises(flags.ConfigError, match="--device 'gpu' is not a device"):
        flags.check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(flags.ConfigError, match="--device cuda: this torch .* use --device cpu"):
            processes.setup(adapt.Config(device="cuda"))


def test_an_explain_path_pil_cannot_write_is_refused_before_the_work(capsys):
    with pytest.raises(SystemExit):
        flags.parse_config(caption.Config, caption.PRESETS, ["--pair", "a.png", "b.png", "--explain", "why.txt"])
    assert "--explain why.txt: PIL cannot write an image *.txt; end the name with .png" in capsys.readouterr().err
    assert flags.parse_config(caption.Config, caption.PRESETS, ["--explain", "why.jpg"]).explain == "why.jpg"


def test_a_non_finite_loss_stops_training_at_the_next_check_naming_its_first_step_but_a_skipped_float16_step_does_not():
    finite, inf, nan = torch.tensor(2.0), torch.tensor(math.inf), torch.tensor(math.nan)
    float32, float16 = (torch.amp.GradScaler("cpu", enabled=e) for e in (False, True))
    watch = stopping.DivergenceWatch(float32, ddp=False)
    watch.add(6, 1e-3, finite, torch.tensor(3.0))
    watch.check()  # finite: nothing happens, and what was checked is forgotten
    assert watch.steps == []
    watch = stopping.DivergenceWatch(float16, ddp=False)
    watch.add(7, 1e-3, finite, inf)  # overflowed scaled gradients: expected in float16, GradScaler skips the step
    watch.check()
    for step, loss in ((7, finite), (8, nan), (9, nan)):  # the loss turns NaN at step 8; the check comes at step 9
        watch.add(step, 1e-3, loss, torch.tensor(3.0))
    with pytest.raises(stopping.Diverged, match=r"at step 8: loss nan, gradient norm 3, learning rate 0.001.*--lr"):
        watch.check()
    watch = stopping.DivergenceWatch(float32, ddp=False)
    watch.add(7, 1e-3, finite, inf)
    with pytest.raises(stopping.Diverged, match="at step 7: loss 2, gradient norm inf"):
        watch.check()


def test_the_step_boundary_reads_the_losses_on_log_and_save_steps_and_saves_between_epochs_or_for_a_signal(
        tmp_path, monkeypatch):
    alone = processes.Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    config = types.SimpleNamespace(log_every=4, save_every=3)
    run = loop.Run(config, alone, "float32", contextlib.nullcontext(), torch.amp.GradScaler("cpu", enabled=False),
                      tmp_path)
    saved, logged, checked = [], [], []
    monkeypatch.setattr(checkpoints, "save_checkpoint", lambda state, path: saved.append((state["step"], path.name)))
    with loop.StepBoundary(run, steps_per_epoch=6, total_steps=12, first_step=0,
                           state=lambda path: {"step": step}) as boundary:
        for step in range(1, 13):  # two epochs of 6 steps
            if boundary.after_step(step, 1e-3, torch.tensor(2.0), torch.tensor(1.0)):
                logged.append(step)
            if not boundary.watch.steps:  # read, the one wait for the device
                checked.append(step)
            boundary.save_or_stop()
    assert logged == [4, 8, 12] and checked == [3, 4, 8, 9, 12]  # step 6 ends an epoch: the epoch's end saves it
    assert saved == [(3, "ckpt_last.pt"), (9, "ckpt_last.pt")]
    with loop.StepBoundary(run, steps_per_epoch=6, total_steps=12, first_step=0,
                           state=lambda path: {"step": step}) as boundary:
        step = 1
        boundary.after_step(step, 1e-3, torch.tensor(2.0), torch.tensor(1.0))
        boundary.save_or_stop()
        boundary.stop.note(signal.SIGTERM, None)  # as the signal handler does, during step 2
        step = 2
        boundary.after_step(step, 1e-3, torch.tensor(2.0), torch.tensor(1.0))  # read at once, in one process
        with pytest.raises(stopping.Interrupted) as stopped:
            boundary.save_or_stop()
        assert saved[-1] == (2, "ckpt_last.pt")  # on disk before the run says it stopped
    assert stopped.value.status == 128 + signal.SIGTERM


def test_a_checkpoint_is_written_off_the_training_thread_from_a_copy_taken_at_the_step(tmp_path, monkeypatch):
    writer = checkpoints.BackgroundWriter()
    weights = torch.zeros(1000)
    started, release = threading.Event(), threading.Event()
    real_save = checkpoints.save_checkpoint

    def slow_disk(state, path):
        started.set()
        release.wait(30)
        real_save(state, path)

    monkeypatch.setattr(checkpoints, "save_checkpoint", slow_disk)
    writer.write([({"model": {"w": weights}, "history": [1]}, tmp_path / "ckpt_best.pt"),
                  ({"model": {"w": weights}, "step": 7}, tmp_path / "ckpt_last.pt")])
    assert started.wait(30)  # the write is under way, and write() has returned: the step goes on
    weights += 1  # the next step changes the weights in place
    release.set()
    writer.wait()
    assert torch.equal(checkpoints.load_checkpoint(tmp_path / "ckpt_best.pt", required=("model",))["model"]["w"],
                       torch.zeros(1000))
    assert checkpoints.load_checkpoint(tmp_path / "ckpt_last.pt", required=("model",))["step"] == 7
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10 ** 9, 10 ** 9, 1000))
    monkeypatch.setattr(checkpoints, "save_checkpoint", real_save)
    writer.write([({"model": {"w": torch.ones(25_000)}}, tmp_path / "ckpt_last.pt")])  # a full disk, on the thread
    with pytest.raises(files.DiskFull, match="not enough space for .*ckpt_last.pt"):
        writer.wait()  # the training thread hears of it at its next save, or when the loop ends
    writer.wait()  # said once


def test_partial_files_of_killed_processes_are_removed_and_those_of_a_running_one_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / f".ckpt_last.pt.tmp{dead.pid}"
    running = tmp_path / f".ckpt_best.pt.tmp{os.getppid()}"  # our parent process, alive
    finished = tmp_path / "ckpt_last.pt"
    for path in (killed, running, finished):
        path.write_bytes(b"x")
    files.remove_partial_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, finished.name])


def test_explain_py_alone_prints_its_usage_and_a_pointing_game():
    result = subprocess.run([sys.executable, str(HERE / "explain.py")], cwd=HERE, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: python caption.py")
    assert "hits it: True" in result.stdout


# ======== adapt.py ========

TINY_ADAPT = ["--data", "synth", "--synth_pairs", "40", "--intra_layers", "1", "--batch_size", "8",
              "--eval_batch_size", "16", "--log_every", "1"]


def write_tiny_clip(folder: Path, embed_dim: int) -> Path:
    """An untrained CLIP of the synthetic vocabulary (2 vision blocks of width 64 on 32-pixel patches, 1 text block
    of width 64, joint width embed_dim), written as stage 0 writes its product (pretrain.export_clip): what stage
    1's tests adapt in seconds, in place of the shipped synthetic CLIP."""
    folder.mkdir(parents=True, exist_ok=True)
    synth.write_bpe(folder / data.SYNTH_BPE_FILE, synth.synth_vocabulary())
    vocab_size = clip.get_tokenizer(folder / data.SYNTH_BPE_FILE).vocab_size
    config = pretrain.Config(clip_model="scratch", scratch_width=64, scratch_layers=2, scratch_text_width=64,
                             scratch_text_layers=1, scratch_embed_dim=embed_dim)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = pretrain.build_clip(config, vocab_size)
    return pretrain.export_clip(model, folder / f"tiny-clip-{embed_dim}.pt")


@pytest.fixture(scope="module")
def tiny_adapt(tmp_path_factory) -> list:
    """adapt.py's flags for a tiny run on 40 synthetic pairs: a tiny CLIP (write_tiny_clip), 1 intra-image block."""
    return [*TINY_ADAPT, "--clip_model", str(write_tiny_clip(tmp_path_factory.mktemp("clip"), embed_dim=32))]


def run_adapt(tiny_adapt, *args, env=None, torchrun=False, **kwargs):
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
               else [sys.executable]) + [str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)]
    return subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kwargs)


@pytest.fixture(scope="module")
def synth40_root(tmp_path_factory):
    """A 40-pair synthetic dataset, drawn once for this file's tests."""
    root = tmp_path_factory.mktemp("adapt") / "synth"
    synth.ensure_synth(root, synth.SynthConfig(pairs=40))
    return root


def test_learning_rate_warms_up_linearly_then_follows_the_reference_cosine():
    config = adapt.Config(lr=1e-4, warmup=0.1)
    assert adapt.get_lr(0, 100, config) == 0
    assert adapt.get_lr(5, 100, config) == pytest.approx(0.5e-4)
    # the reference's warmup_cosine is not rescaled after warmup: 0.5(1 + cos(0.1 pi)) = 0.9755
    assert adapt.get_lr(10, 100, config) == pytest.approx(1e-4 * 0.97553, rel=1e-4)
    assert adapt.get_lr(100, 100, config) == pytest.approx(0, abs=1e-12)


# --- both stages' optimizer step in float16 (GradScaler) and bfloat16, and the device of every tensor it makes ---


def cpu_precision(dtype: str):
    """The precision context the scripts' setup() makes for this dtype on the CPU (autocast, or none)."""
    return processes.setup(adapt.Config(device="cpu", dtype=dtype))[2]

def applied_gradient_norms(optimizer) -> list:
    """Record, at each optimizer step, the norm of the gradients that the step applies.

    GradScaler.step passes gradients it has not unscaled to a fused optimizer with optimizer.grad_scale set,
    and the optimizer divides by it inside its kernel: what it applies is then p.grad / grad_scale.
    """
    norms = []

    def hook(opt, args, kwargs):
        grads = [p.grad.float() for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = getattr(opt, "grad_scale", None)
        norms.append(float(norm / scale) if scale is not None else float(norm))
    optimizer.register_step_pre_hook(hook)
    return norms


def tiny_adapt_step(dtype, grad_clip=1.0):
    """adapt.py's optimizer, scaler and train_step on the tiny pair encoder; returns (model, scaler, step)."""
    torch.manual_seed(0)
    model = PairEncoder(clip.CLIP(clip.CLIPConfig(**TINY)), EncoderConfig(intra_layers=3)).train()
    config = adapt.Config(grad_clip=grad_clip, max_words=16)
    optimizer = adapt.build_optimizer(model, config)
    # a first scale of 2^8: the default 2^16 overflows this model's float16 gradients, and its first steps are skipped
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=dtype == "float16")
    caption_ids = torch.randint(1, TINY["vocab_size"] - 2, (4, 16))
    caption_ids[:, 0], caption_ids[:, -1] = TINY["vocab_size"] - 2, TINY["vocab_size"] - 1  # SOT ... EOT
    batch = {"before": _images(4, seed=1), "after": _images(4, seed=2), "caption": caption_ids}
    ctx = cpu_precision(dtype)
    step = lambda: adapt.train_step(model, optimizer, scaler, [batch], ctx, config, False, model.clip.logit_scale)
    return model, optimizer, scaler, step


def tiny_caption_step(dtype, grad_clip=1.0):
    """caption.py's optimizer, scaler and train_step on a tiny captioner over cached pair tokens."""
    captioner = caption.Captioner(tiny_decoder().train(), None, pad_id=0)
    config = caption.Config(grad_clip=grad_clip)
    optimizer = caption.build_optimizer(captioner, config)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=dtype == "float16")
    words = torch.randint(1, SOT_ID, (4, 6), generator=torch.Generator().manual_seed(2))
    padding = torch.zeros(4, 2, dtype=torch.long)
    items = {"visual": visual_tokens(4),
             "caption_in": torch.cat([torch.full((4, 1), SOT_ID), words, padding], dim=1),  # (4, 9)
             "caption_out": torch.cat([words, torch.full((4, 1), EOT_ID), padding], dim=1)}  # (4, 9)
    batch = data.collate_captions([{k: v[i] for k, v in items.items()} for i in range(4)])  # cut to 7 columns
    ctx = cpu_precision(dtype)
    step = lambda: caption.train_step(captioner, optimizer, scaler, [batch], ctx, config, False)
    return captioner, optimizer, scaler, step


def tiny_step(stage: str, dtype: str, grad_clip: float = 1.0):
    """Either stage's optimizer, scaler and train_step, on a tiny model: (model, optimizer, scaler, step)."""
    return tiny_adapt_step(dtype, grad_clip) if stage == "stage 1" else tiny_caption_step(dtype, grad_clip)


@pytest.mark.parametrize("stage", ["stage 1", "stage 2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_mixed_precision_step_of_either_stage_clips_the_true_gradients_not_the_loss_scaled_ones(stage, dtype):
    model, optimizer, scaler, step = tiny_step(stage, dtype, grad_clip=1e9)
    unclipped = applied_gradient_norms(optimizer)
    step()
    assert unclipped[0] > 0.01
    model, optimizer, scaler, step = tiny_step(stage, dtype, grad_clip=1e-3)
    applied = applied_gradient_norms(optimizer)
    step()
    # unscale_ before clipping: the optimizer applies a gradient of norm grad_clip. Clipping the scaled gradients
    # (or never unscaling them) would apply grad_clip / 256, and not clipping would apply the unclipped norm.
    assert applied[0] == pytest.approx(1e-3, rel=1e-3)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # autocast: the weights stay float32


def test_a_training_batch_holds_the_captions_only_up_to_its_last_end_of_text_token():
    model, optimizer, scaler, step = tiny_adapt_step("float32")
    sot, eot = TINY["vocab_size"] - 2, TINY["vocab_size"] - 1
    caption = torch.zeros(4, 16, dtype=torch.long)  # padded to max_words 16; the longest caption has 5 tokens
    for row, words in enumerate([[5, 7], [9, 4, 3], [8], [6, 2, 11]]):
        caption[row, :len(words) + 2] = torch.tensor([sot, *words, eot])
    samples = [{"before": before, "after": after, "caption": c}
               for before, after, c in zip(_images(4, seed=1), _images(4, seed=2), caption)]
    batch = data.collate_text(samples)  # what the training DataLoader hands over
    assert batch["caption"].shape == (4, 5)
    with torch.no_grad():  # the loss of the full padded rows, before the step
        out = model(batch["before"], batch["after"], caption)
        full = contrastive_loss(out["text_embedding"], out["pair_embedding"], out["logit_scale"])
    seen = []
    hook = model.clip.transformer.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    loss, _ = adapt.train_step(model, optimizer, scaler, [batch], cpu_precision("float32"),
                               adapt.Config(max_words=16), False, model.clip.logit_scale)
    hook.remove()
    assert seen == [5]  # the text tower ran on 5 columns, not 16
    torch.testing.assert_close(loss, full, rtol=0, atol=1e-5)  # and the padding it skipped changed nothing


@pytest.mark.parametrize("stage, poisoned", [("stage 1", "after_embedding"), ("stage 2", "decoder.output_bias")])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_float16_step_of_either_stage_with_an_inf_or_nan_gradient_is_skipped_and_the_loss_scale_halves(stage,
                                                                                                       poisoned, bad):
    model, optimizer, scaler, step = tiny_step(stage, "float16")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    poison = model.get_parameter(poisoned).register_hook(lambda grad: torch.full_like(grad, bad))
    step()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # the update was skipped
    assert scaler.get_scale() == 2.0 ** 7  # and the loss scale backed off from 2^8
    poison.remove()
    step()
    assert not torch.equal(model.get_parameter(poisoned), before[poisoned])  # the next clean step updates
    assert scaler.get_scale() == 2.0 ** 7  # it grows again only after growth_interval (2000) clean steps


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_training_step_and_the_encoders_make_every_tensor_on_the_models_device(dtype):
    model, optimizer, scaler, step = tiny_adapt_step(dtype)
    sot, eot = TINY["vocab_size"] - 2, TINY["vocab_size"] - 1
    before, after, text_ids = _images(2), _images(2, seed=2), torch.tensor([[sot, 5, 7, eot]])
    # A stand-in for a GPU: the model is on the CPU and the default device is "meta", so any tensor made inside
    # without device= lands on "meta" and the first operation mixing it with the model's tensors fails.
    with torch.device("meta"):
        loss, _ = step()
        model.eval()
        with torch.no_grad(), cpu_precision(dtype):
            pair = model.encode_pair(before, after)["pair_embedding"]
            text = model.encode_text(text_ids)
    assert loss.device.type == pair.device.type == text.device.type == "cpu"
    assert torch.isfinite(loss) and torch.isfinite(pair).all() and torch.isfinite(text).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_captioner_step_and_greedy_decoding_make_every_tensor_on_the_models_device(dtype):
    captioner, optimizer, scaler, step = tiny_caption_step(dtype)
    features = visual_tokens(3, seed=4).numpy()  # (3, M, E), as caption.py's feature cache holds them
    pairs = [data.ImagePair(f"pair{i}", Path("before.png"), Path("after.png"), captions=[]) for i in range(3)]
    tokenizer = types.SimpleNamespace(sot_id=SOT_ID, eot_id=EOT_ID, decode=lambda ids: " ".join(map(str, ids)))
    config = caption.Config(eval_batch_size=2, max_len=5)
    with torch.device("meta"):  # a tensor made without device= lands on "meta" and fails (see the adapt.py test)
        loss, _ = step()
        predictions = caption.predict(captioner.decoder, features, pairs, tokenizer, config, torch.device("cpu"),
                                      cpu_precision(dtype))
    assert loss.device.type == "cpu" and torch.isfinite(loss)
    assert list(predictions) == ["pair0", "pair1", "pair2"]


# --- the operators a step issues: blocks on rows, the matrix weights cast once a step, a ceiling (bench/gpu.py) ---


def test_a_clip_block_on_rows_gives_the_numbers_and_gradients_of_the_block_on_sequences_bit_for_bit():
    torch.manual_seed(0)
    block = clip.ResidualAttentionBlock(64, 4)
    x = torch.randn(3, 10, 64, requires_grad=True)  # (B, L, D)

    def on_sequences(x):  # the block as written before it computed on rows: every product on (B, L, D)
        attn, (B, L, D) = block.attn, x.shape
        q, k, v = F.linear(block.ln_1(x), attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(B, L, attn.n_head, D // attn.n_head).transpose(1, 2) for t in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        x = x + attn.out_proj(h)
        return x + block.mlp(block.ln_2(x))

    for forward in (on_sequences, lambda x: block(x, causal=True)):
        out = forward(x)
        out.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        x.grad = None
        block.zero_grad(set_to_none=True)
        if forward is on_sequences:
            expected = (out, grads)
    assert torch.equal(out, expected[0]) and all(torch.equal(g, e) for g, e in zip(grads, expected[1]))


@pytest.mark.parametrize("stage", ["stage1", "stage2_cached", "stage2_finetune"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_casting_the_matrix_weights_once_a_step_gives_autocasts_steps_bit_for_bit_with_fewer_operators(stage, dtype):
    runs = {}
    for cast_weights in (False, True):  # autocast's casts at each use, then plumbing.cast_once's, as the scripts
        torch.manual_seed(0)
        model, step = bench.cost_step(stage, 2, bench.TINY_COST_SIZES, dtype=dtype, cast_weights=cast_weights)
        losses = [step()[0] for _ in range(2)]
        with bench_ops.OperationCount() as operators:
            losses.append(step()[0])
        runs[cast_weights] = losses, model.state_dict(), operators.counts["_to_copy"]
    (plain_losses, plain, plain_casts), (losses, weights, casts) = runs[False], runs[True]
    assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
    assert all(torch.equal(weights[name], plain[name]) for name in plain)
    trained = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model.modules())  # at least a weight each, twice
    assert casts <= plain_casts - trained


def test_the_matrix_weights_cast_once_are_every_parameter_only_products_read():
    torch.manual_seed(0)
    encoder = PairEncoder(clip.CLIP(tiny_config()), EncoderConfig(1))
    names = plumbing.casts.matrix_weights(encoder)
    assert "clip.visual.transformer.resblocks.0.attn.in_proj_weight" in names and "clip.visual.proj" in names
    assert "clip.visual.conv1.weight" in names and "clip.text_projection" in names
    assert not [n for n in names if "ln_" in n or "embedding" in n or n.endswith("logit_scale")]  # read by others
    casted = set()

    class Casts(TorchDispatchMode):  # the parameters autocast casts, and the products' other inputs
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "aten::_to_copy" and isinstance(args[0], nn.Parameter):
                casted.add(id(args[0]))
            return func(*args, **(kwargs or {}))

    tokens = torch.tensor([[598, 5, 599]])
    with Casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        encoder(torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32), tokens.expand(2, 3))
    by_id = {id(p): n for n, p in encoder.named_parameters()}
    assert {by_id[i] for i in casted} == set(names)


def test_adaptation_on_tiny_synth_writes_checkpoints_that_load_without_code(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "2")
    assert result.returncode == 0, result.stderr
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        state = torch.load(out / name, weights_only=True)
        assert {"model", "optimizer", "config", "clip_config", "step", "rng"} <= set(state)
    scores = json.loads((out / "test_retrieval.json").read_text())
    assert 0 <= scores["text_to_pair_R1"] <= 100 and "pair_to_text_R1" in scores
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "split" in r] == ["val", "val", "test"]


def test_an_existing_run_is_not_overwritten_without_resume(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    assert run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1").returncode == 0
    again = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1")
    assert again.returncode == 1 and "--resume" in again.stderr


def same_run_files(first: Path, second: Path, result: str) -> None:
    """Two runs' folders hold the same result file byte for byte, checkpoints whose tensors are equal byte for
    byte, and logs with the same records, each step once (their times aside)."""
    assert (first / result).read_bytes() == (second / result).read_bytes()
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        a, b = (torch.load(folder / name, weights_only=True) for folder in (first, second))
        assert a["step"] == b["step"] and a["history"] == b["history"], name
        for key, tensor in a["model"].items():
            assert tensor.numpy().tobytes() == b["model"][key].numpy().tobytes(), (name, key)
        for index, moments in a["optimizer"]["state"].items():
            for key, tensor in moments.items():
                assert torch.equal(tensor, b["optimizer"]["state"][index][key]), (name, index, key)
    logs = [[{k: v for k, v in json.loads(line).items() if k != "time"} for line in (folder / "log.jsonl").open()]
            for folder in (first, second)]
    assert logs[0] == logs[1]
    steps = [r["step"] for r in logs[1] if "split" not in r]
    assert steps == sorted(set(steps))


def wait_for_log_step(process, out: Path, step: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        log = out / "log.jsonl"
        steps = [json.loads(line)["step"] for line in log.read_text().splitlines()] if log.exists() else []
        if steps and steps[-1] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run never logged step {step}")


def test_a_second_run_in_a_busy_out_dir_is_refused_in_one_line_naming_the_first_which_finishes_untouched(
        synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth40_root, "--out_dir", out]
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args), "--epochs", "12"]
    first = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_log_step(first, out, 1)
    seconds = [subprocess.Popen([sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args), *extra],
                                cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for extra in (["--seed", "7"], ["--seed", "7", "--resume"], ["--eval"])]
    for second in seconds:  # another training run, a resume, and an --eval that would write test_retrieval.json
        _, stderr = second.communicate(timeout=120)
        assert second.returncode == 1 and stderr.count("\n") == 1, stderr
        assert f"--out_dir {out} is in use by process {first.pid} (python {HERE / 'adapt.py'} --data synth" in stderr
    stdout, stderr = first.communicate(timeout=240)
    assert first.returncode == 0, stderr
    assert json.loads((out / "config.json").read_text())["seed"] == 42  # the first run's files, its own scores
    printed = re.search(r"test retrieval of the best epoch.*\n +text_to_pair_R1 +([\d.]+)", stdout).group(1)
    assert f'{json.loads((out / "test_retrieval.json").read_text())["text_to_pair_R1"]:.2f}' == printed
    assert not (out / ".lock").exists()  # removed at the end of the run
    (out / ".lock").write_text("process 1 (a run killed long ago)\n")  # a dead process holds no lock
    assert run_adapt(tiny_adapt, *args, "--eval").returncode == 0


def test_an_out_dir_that_is_a_file_or_lies_under_one_is_refused_before_any_work(synth40_root, tiny_adapt, tmp_path,
                                                                                 stage1):
    file = tmp_path / "file"
    file.write_text("")
    for out in (file, file / "run"):
        result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert f"--out_dir {out} " in result.stderr and "not a folder" in result.stderr
        started = time.time()  # caption.py --eval decoded the whole test split before it found out
        result = stage2(stage1, out, "--eval", "--checkpoint", stage1["encoder"])
        assert result.returncode == 1 and "not a folder" in result.stderr and "Traceback" not in result.stderr
        assert time.time() - started < 30


def test_a_new_run_after_one_stopped_before_its_first_checkpoint_starts_a_fresh_log(synth40_root, tiny_adapt,
                                                                                    tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # the stopped run's step
    assert run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1").returncode == 0
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "split" not in r]
    assert steps == list(range(1, len(steps) + 1)) and 9.0 not in [r.get("loss") for r in records]


def test_a_stage_1_run_killed_at_a_step_and_resumed_writes_the_uninterrupted_runs_files(synth40_root, tiny_adapt,
                                                                                        tmp_path):
    args = ["--data_root", synth40_root, "--epochs", "2", "--save_every", "3"]
    assert run_adapt(tiny_adapt, *args, "--out_dir", tmp_path / "whole").returncode == 0
    out = tmp_path / "killed"
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args), "--out_dir", str(out)]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_log_step(process, out, 8)  # past the mid-epoch saves at steps 3 and 6, and logged beyond them
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    assert killed_at % 3 == 0 and killed_at < 22  # a mid-epoch checkpoint (22 steps per epoch)
    resumed = run_adapt(tiny_adapt, *args, "--out_dir", out, "--resume")
    assert resumed.returncode == 0 and f"at step {killed_at}" in resumed.stdout, resumed.stderr
    same_run_files(tmp_path / "whole", out, "test_retrieval.json")


def test_sigterm_saves_stage_2_at_the_step_boundary_exits_143_and_the_resumed_run_is_the_uninterrupted_one(
        stage1, tmp_path):
    args = ["--epochs", "2", "--batch_size", "4", "--save_every", "100"]
    assert stage2(stage1, tmp_path / "whole", *args).returncode == 0
    out = tmp_path / "stopped"
    command = [sys.executable, str(HERE / "caption.py"), "--data", "synth", *TINY_DECODER, "--data_root",
               str(stage1["root"]), "--encoder_ckpt", str(stage1["encoder"]), "--out_dir", str(out), *args]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_log_step(process, out, 2)
    process.send_signal(signal.SIGTERM)  # what Slurm sends before preemption
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr
    state = torch.load(out / "ckpt_last.pt", weights_only=True)  # saved at the step the signal let finish
    logged = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert state["step"] == logged[-1] >= 2
    line = stderr.strip().splitlines()[-1]
    assert line == (f"caption.py: terminated (SIGTERM): {out / 'ckpt_last.pt'} holds step {state['step']}; continue "
                    f"with: {shlex.join(['python', *command[1:], '--resume'])}")
    resumed = stage2(stage1, out, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    same_run_files(tmp_path / "whole", out, "test_predictions.json")


def test_sigterm_under_torchrun_stops_every_process_at_the_same_step_after_the_master_saves(synth40_root, tiny_adapt,
                                                                                           tmp_path):
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(HERE / "adapt.py"), *tiny_adapt, "--data_root", str(synth40_root), "--out_dir", str(out),
               "--epochs", "20", "--log_every", "3"]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_log_step(process, out, 4)
    started = time.time()
    process.send_signal(signal.SIGTERM)  # torchrun sends it on to both processes
    _, stderr = process.communicate(timeout=120)
    assert time.time() - started < 25  # no process waits for the other (torchrun kills them after 30 s)
    step = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    assert step % 3 == 0 or step % 11 == 0  # a check step (log steps, or an epoch's end: 11 steps per epoch)
    assert f"adapt.py: terminated (SIGTERM): {out / 'ckpt_last.pt'} holds step {step}; continue with: " \
           f"{shlex.join(['python', *command[1:], '--resume'])}\n" in stderr  # the command keeps torchrun
    assert stderr.count("adapt.py: terminated") == 1 and "Traceback" not in stderr.split("adapt.py: terminated")[0]


def test_a_damaged_image_met_in_training_stops_in_one_line_naming_it_after_saving_the_last_step(synth40_root,
                                                                                                tiny_adapt,
                                                                                                 tmp_path):
    root = tmp_path / "synth"
    shutil.copytree(synth40_root, root, ignore=shutil.ignore_patterns(".cache"))
    pairs = data.load_split("synth", "train", root)
    samples = data.AdaptationSamples(pairs, clip.get_tokenizer(data.bpe_path("synth", root)), train=True)
    sampler = torch.utils.data.DistributedSampler(samples, num_replicas=1, rank=0, shuffle=True, seed=42)
    order = [samples.samples[i][0] for i in sampler]  # pair of each sample of epoch 1, in the training order
    first_use = {p: order.index(p) for p in set(order)}
    pair = max(first_use, key=first_use.get)  # its after image is read first by the latest step
    damaged = pairs[pair].after
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)  # the middle of the image data
    damaged.write_bytes(bytes(raw))
    out = tmp_path / "run"
    result = run_adapt(tiny_adapt, "--data_root", root, "--out_dir", out, "--no-image_cache", "--no-freeze_intra",
                       "--num_workers", "1")  # a worker reads the images, decoded at each step
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "Caught" not in result.stderr, result.stderr
    step = first_use[pair] // 8  # the steps completed before the batch that holds it (8 samples a step)
    assert result.stderr.startswith(f"adapt.py: error: image {damaged} is corrupt")
    assert f"stopped: {out / 'ckpt_last.pt'} holds step {step}; continue with: " in result.stderr
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["step"] == step > 0


def test_resume_refuses_a_checkpoint_of_another_model_config(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    assert run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1").returncode == 0
    other = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "2", "--resume",
                      "--intra_layers", "2")  # a model of another shape: both vision blocks intra-image
    assert other.returncode == 1 and "--intra_layers: checkpoint 1 vs now 2" in other.stderr, other.stderr
    config = (out / "config.json").read_text()
    for flag, value in (("--lr", "3e-4"), ("--batch_size", "4")):  # a setting that changes what training computes
        changed = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1", "--resume",
                            flag, value)
        assert changed.returncode == 1 and f"{flag}: checkpoint" in changed.stderr, changed.stderr
    assert (out / "config.json").read_text() == config  # the run's record is not overwritten


def test_a_diverging_learning_rate_stops_stage_1_at_once_in_one_line_and_saves_nothing(synth40_root, tiny_adapt,
                                                                                       tmp_path):
    out = tmp_path / "run"
    result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "2", "--lr", "1e30",
                       "--warmup",
                       "0", "--grad_clip", "1e30")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert "\n" not in line
    assert re.search(r"diverged at step \d+: loss nan, .*learning rate [\d.]+e\+(29|30);.*--lr", line), line
    assert not (out / "ckpt_best.pt").exists() and not (out / "ckpt_last.pt").exists()


def test_ctrl_c_prints_what_was_saved_and_the_resume_command_and_exits_130(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth40_root, "--out_dir", out, "--epochs", "20", "--save_every", "2"]
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=ctrl_c_as_in_a_terminal)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "ckpt_last.pt").exists():
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    step = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    line = stderr.strip().splitlines()[-1]  # the lines before it are the image cache's progress
    assert line.startswith("adapt.py: interrupted: ") and f"{out / 'ckpt_last.pt'} holds step {step}" in line
    assert line.endswith(shlex.join(["python", *command[1:], "--resume"]))
    assert not list(out.glob(".*.tmp*"))


def test_torchrun_with_two_cpu_processes_trains_and_only_rank_0_writes(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "ddp"
    result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1", torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 = 4 x 2 processes" in result.stdout  # the global batch is split over the two processes
    assert sorted(p.name for p in out.iterdir()) == ["ckpt_best.pt", "ckpt_last.pt", "config.json", "log.jsonl",
                                                   "test_retrieval.json"]
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["step"] > 0
    evaluated = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--eval", torchrun=True)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert evaluated.stdout.count("test retrieval of") == 1  # rank 0 alone scores the test split; rank 1 waits
    rank1 = processes.Distributed(True, 1, 1, 2, torch.device("cpu"), False)
    missing = adapt.Config(checkpoint=str(tmp_path / "missing.pt"))  # read by rank 0 only: rank 1 opens nothing
    adapt.evaluate_checkpoint(loop.Run(missing, rank1, "float32", contextlib.nullcontext(), None, tmp_path))
    caption.evaluate(loop.Run(caption.Config(), rank1, "float32", contextlib.nullcontext(), None, tmp_path),
                     tmp_path / "none", None, None, None)
    assert not (tmp_path / "test_retrieval.json").exists() and not (tmp_path / "test_predictions.json").exists()


def test_a_compiled_model_trains_under_two_process_ddp_compiled_after_the_wrap(synth40_root, tiny_adapt, tmp_path):
    # torch.compile on the CPU needs a C++ compiler (this machine's and CI's gcc); about 45 s on 2 cores
    out = tmp_path / "compiled"
    result = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", out, "--epochs", "1", "--compile",
                       torchrun=True)
    if adapt.torch_version() < adapt.COMPILED_DDP_TORCH:  # torch 2.5.1: refused in one line, before any step
        assert result.returncode != 0 and "--compile under torchrun needs torch 2.11 or newer" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 = 4 x 2 processes" in result.stdout and (out / "test_retrieval.json").is_file()
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["step"] > 0
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:  # the order: DDP first, compiled over it, so that DDP's bucketed all-reduce overlaps the compiled backward
        one = processes.Distributed(True, 0, 0, 1, torch.device("cpu"), True)
        wrapped = adapt.wrap(_tiny_encoder(), adapt.Config(compile=True), one)
        assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and isinstance(wrapped._orig_mod, DDP)
    finally:
        dist.destroy_process_group()


def pairs_without_distractors(synth_root: Path, folder: Path, per_split: int = 4) -> Path:
    """A `--data pairs` dataset of synthetic pairs without distractor views, so that stage 1 draws nothing at
    random (its only random choice swaps the before image for the distractor): runs with different process
    counts then see the same samples in every step."""
    for split in data.SPLITS:
        pairs = data.load_split("synth", split, synth_root)[:per_split]
        write_json(folder / f"{split}.json", [{"id": p.id, "before": str(p.before), "after": str(p.after),
                                               "captions": p.captions} for p in pairs])
    return folder


def pairs_run(synth_root: Path, folder: Path, per_split: int = 4) -> tuple[list, dict]:
    """adapt.py's flags and environment for the tiny model on pairs_without_distractors (6 captions per pair)."""
    root = pairs_without_distractors(synth_root, folder, per_split)
    env = {**os.environ, "CLIP_BPE_PATH": str(synth_root / data.SYNTH_BPE_FILE)}  # the synthetic vocabulary
    return ["--data", "pairs", "--data_root", root, "--num_workers", "0"], env


def test_a_float16_run_keeps_its_loss_scale_in_the_checkpoint_and_resume_goes_on_from_it(synth40_root, tiny_adapt,
                                                                                         tmp_path):
    out = tmp_path / "run"
    args, env = pairs_run(synth40_root, tmp_path / "pairs", per_split=8)  # 48 samples: 6 steps per epoch
    args += ["--out_dir", out, "--dtype", "float16"]  # the GPU's float16 path (autocast, GradScaler), on the CPU
    first = run_adapt(tiny_adapt, *args, "--epochs", "1", env=env)
    assert first.returncode == 0, first.stderr
    assert "float16 on cpu" in first.stdout
    state = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert set(state["scaler"]) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    # give the saved scaler a state that no new GradScaler has: scale 4, doubled after every 3 steps without overflow
    state["scaler"].update(scale=4.0, growth_interval=3, _growth_tracker=0)
    state["config"]["epochs"] = 2  # as a 2-epoch run interrupted after its first: --resume refuses another schedule
    checkpoints.save_checkpoint(state, out / "ckpt_last.pt")
    resumed = run_adapt(tiny_adapt, *args, "--epochs", "2", "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    last = torch.load(out / "ckpt_last.pt", weights_only=True)
    steps = last["step"] - state["step"]
    assert steps == 6 and last["scaler"]["growth_interval"] == 3
    # a scaler started afresh on resume would be at 2^16 with growth interval 2000
    assert (last["scaler"]["scale"], last["scaler"]["_growth_tracker"]) == (4.0 * 2 ** (steps // 3), steps % 3)


def start_agent(tiny_adapt, machine: int, port: int, args, env) -> subprocess.Popen:
    """One torchrun agent of a 2-machine job (c10d rendezvous on 127.0.0.1), pinned to a core of its own."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = (lambda: os.sched_setaffinity(0, {cores[machine % len(cores)]})) if cores else None
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-machines",
               "--rdzv_conf=join_timeout=120", "--local_addr=127.0.0.1", "--max_restarts=0",
               str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)]
    return subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=pin)


def test_two_torchrun_agents_as_two_machines_train_like_one_process_and_only_global_rank_0_writes(synth40_root,
                                                                                                   tiny_adapt,
                                                                                                   tmp_path):
    args, env = pairs_run(synth40_root, tmp_path / "pairs")  # 24 samples: 3 steps of 8 per epoch
    args += ["--epochs", "2"]
    one = run_adapt(tiny_adapt, *args, "--out_dir", tmp_path / "one", env=env)  # one process, the global batch of 8
    assert one.returncode == 0, one.stderr
    # each machine gets its own --out_dir, as its own disk: only the folder of global rank 0 may appear
    port = _free_port()
    agents = [start_agent(tiny_adapt, m, port, [*args, "--out_dir", tmp_path / f"machine{m}"], env) for m in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:  # on a time-out: the agent and its worker, by their process group
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    written = [m for m in (0, 1) if (tmp_path / f"machine{m}").exists()]
    assert len(written) == 1, written
    rank0 = written[0]
    assert "global batch 8 = 4 x 2 processes" in outputs[rank0]  # rank 0 prints, and its machine has every file
    assert "global batch" not in outputs[1 - rank0]
    assert sorted(p.name for p in (tmp_path / f"machine{rank0}").iterdir()) == \
        sorted(p.name for p in (tmp_path / "one").iterdir())
    losses = [[r["loss"] for r in map(json.loads, (folder / "log.jsonl").read_text().splitlines()) if "loss" in r]
              for folder in (tmp_path / "one", tmp_path / f"machine{rank0}")]
    assert len(losses[0]) == 6  # 2 epochs of 3 steps
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # the global loss, all-gathered over the machines
    weights = [torch.load(folder / "ckpt_last.pt", weights_only=True)["model"]
               for folder in (tmp_path / "one", tmp_path / f"machine{rank0}")]
    for name, expected in weights[0].items():
        torch.testing.assert_close(weights[1][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_killed_mid_epoch_resumes_and_finishes_with_intact_checkpoints(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth40_root, "--out_dir", out, "--epochs", "3", "--save_every", "2"]
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # wait until the first epoch is over (ckpt_best.pt) and a later mid-epoch save happened, then SIGKILL
    deadline = time.time() + 240
    while time.time() < deadline:
        log = out / "log.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        steps = [json.loads(line)["step"] for line in lines if "split" not in json.loads(line)]
        if (out / "ckpt_best.pt").exists() and steps and steps[-1] >= 5 and steps[-1] % 4 != 0:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    best_before = torch.load(out / "ckpt_best.pt", weights_only=True)
    result = run_adapt(tiny_adapt, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"resumed {out / 'ckpt_last.pt'} at step {killed_at}" in result.stdout
    last = torch.load(out / "ckpt_last.pt", weights_only=True)
    total = last["step"]
    assert total > killed_at and total % 3 == 0  # 3 epochs of equal length were completed
    assert len(last["history"]) == 3  # one validation per epoch, none lost or repeated
    best = torch.load(out / "ckpt_best.pt", weights_only=True)
    assert best["best_epoch"] >= best_before["best_epoch"]
    assert not list(out.glob(".*.tmp*"))  # no half-written file left behind


def test_the_synth_preset_is_clip4idcs_recipe_on_the_synthetic_clip(tmp_path, monkeypatch):
    config = flags.parse_config(adapt.Config, adapt.PRESETS, ["--data", "synth"])
    assert config.clip_model == "synth-ViT/32" and config.clip_model in clip_files.MODELS
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path))  # build_encoder loads it by name, through the checksummed cache
    model, _ = adapt.build_encoder(config, vocab_size=clip_files.load("synth-ViT/32")[0].config.vocab_size)
    b, a = torch.randn(2, 50, 128), torch.randn(2, 50, 128)  # two images' intra-image tokens (B, N+1, D)
    with torch.no_grad():  # CLIP4IDC's join: before and after tokens as they are, marked, positioned, normalised
        joined = torch.cat([b + model.before_embedding, a + model.after_embedding], dim=1)
        torch.testing.assert_close(model.join(b, a), model.ln_mid(joined + model.joint_positional_embedding))
    assert config.freeze and config.intra_layers == 4  # the reference's frozen set and split, scaled to 6 blocks
    assert config.freeze_intra  # the intra-image blocks frozen, as the reference's 1e-7 all but freezes them
    assert config.clip_lr_scale < 1  # the reference's two rates: new joint parameters fast, pretrained CLIP slower


# ======== pretrain.py ========

# Stage 0: CLIP's own pretraining on single synthetic scenes, with adapt.py's loop.

TINY_SCENES = ["--scratch_width", "64", "--scratch_layers", "2", "--scratch_text_width", "64", "--scratch_text_layers", "1",
               "--scratch_embed_dim", "32", "--batch_size", "8", "--epochs", "2", "--eval_batch_size", "16", "--log_every", "1"]


@pytest.fixture(scope="module")
def scenes_root(tmp_path_factory):
    return synth.make_scenes(tmp_path_factory.mktemp("scenes") / "scenes", splits={"train": 24, "val": 8, "test": 8})


def test_stage_0_pretrains_clip_on_scenes_and_writes_openai_style_weights_the_same_every_time(scenes_root, tmp_path):
    runs = []
    for name in ("first", "second"):
        command = [sys.executable, str(HERE / "pretrain.py"), *TINY_SCENES, "--data_root", str(scenes_root),
                   "--out_dir", str(tmp_path / name)]
        runs.append(subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}))
        assert runs[-1].returncode == 0, runs[-1].stderr
    weights = tmp_path / "first" / pretrain.SYNTH_CLIP_FILE
    assert weights.read_bytes() == (tmp_path / "second" / pretrain.SYNTH_CLIP_FILE).read_bytes()  # rebuilt bit for bit
    assert f"sha256 {clip_files.sha256_of(weights)}" in runs[0].stdout
    model, _ = clip_files.load(weights)  # OpenAI's names and format: clip.load reads it like ViT-B-32.pt
    assert model.config.vision_width == 64 and model.config.vocab_size == 2 * 256 + len(synth.synth_vocabulary()) + 2
    zero_shot = json.loads((tmp_path / "first" / "zero_shot.json").read_text())
    assert set(zero_shot) == {"object", *synth.ATTRIBUTE_ORDER} and all(0 <= v <= 100 for v in zero_shot.values())
    records = [json.loads(line) for line in (tmp_path / "first" / "log.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "split" in r] == ["val", "val", "test"]
    assert records[0]["step"] == 1 and math.isfinite(records[0]["loss"])


def test_zero_shot_attributes_scores_a_model_that_knows_the_answer_100_percent(synth_tokenizer):
    class Oracle(nn.Module):  # embeds an image and a description alike: the object's attributes, one-hot
        def forward(self, images):
            return {"pair_embedding": self.embedding(truth)}

        def encode_text(self, prompts):
            return self.embedding(classes)

        @staticmethod
        def embedding(objects):
            values = [synth.SIZES, list(synth.COLORS), synth.MATERIALS, synth.SHAPES]
            return torch.tensor([[float(o[a] == v) for a, vs in zip(synth.ATTRIBUTE_ORDER, values) for v in vs]
                                 for o in objects])
    cfg = synth.SynthConfig()
    truth = [synth.pretrain_objects(pretrain.ZERO_SHOT_FIRST + i, cfg, n_objects=1)[0]
             for i in range(pretrain.ZERO_SHOT_SCENES)]
    classes = [dict(zip(synth.ATTRIBUTE_ORDER, v))
               for v in itertools.product(synth.SIZES, synth.COLORS, synth.MATERIALS, synth.SHAPES)]
    config = pretrain.Config()
    accuracy = pretrain.zero_shot_attributes(Oracle(), synth_tokenizer, config, torch.device("cpu"), contextlib.nullcontext())
    assert accuracy == {"object": 100.0, "size": 100.0, "color": 100.0, "material": 100.0, "shape": 100.0}


def test_stage_0_is_its_own_command_whose_default_is_the_scenes_preset_on_adapts_knobs(capsys):
    config = flags.parse_config(pretrain.Config, pretrain.PRESETS, [])
    assert config.data == "scenes" and config.clip_model == "scratch" and not config.freeze
    assert isinstance(config, adapt.Config) and "scenes" not in adapt.PRESETS  # adapt.py is stage 1 alone
    assert not [name for name in vars(adapt.Config()) if name.startswith("scratch_")]  # its sizes are stage 0's
    with pytest.raises(SystemExit):
        flags.parse_config(pretrain.Config, pretrain.PRESETS, ["--help"])
    help_text = capsys.readouterr().out  # adapt.py's comments, and pretrain.py's own where it changes a default
    assert "scratch model: vision width" in help_text and "runs/pretrain_scenes" in help_text



# ======== caption.py ========

TINY_CLIP = ["--synth_pairs", "40", "--intra_layers", "1"]  # adapt.py's, on write_tiny_clip's CLIP of joint width 64
TINY_DECODER = ["--synth_pairs", "40", "--decoder_layers", "1", "--decoder_heads", "2", "--decoder_ffn", "128",
                "--batch_size", "8", "--eval_batch_size", "32", "--log_every", "1"]


def run(script, *args, **kwargs):
    return subprocess.run([sys.executable, str(HERE / script), "--data", "synth", *map(str, args)], cwd=HERE,
                          capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A 40-pair synthetic dataset and a tiny stage-1 checkpoint, made once for this file's tests."""
    base = tmp_path_factory.mktemp("caption")
    result = run("adapt.py", *TINY_CLIP, "--clip_model", write_tiny_clip(base / "clip", embed_dim=64), "--data_root",
                 base / "synth", "--out_dir", base / "adapt", "--epochs", "1", "--batch_size", "8")
    assert result.returncode == 0, result.stderr
    return {"root": base / "synth", "encoder": base / "adapt" / "ckpt_best.pt"}


def stage2(stage1, out, *args, **kwargs):
    return run("caption.py", *TINY_DECODER, "--data_root", stage1["root"], "--encoder_ckpt", stage1["encoder"],
               "--out_dir", out, *args, **kwargs)


def test_warmup_linear_schedule_matches_the_reference():
    config = caption.Config(lr=1e-4, warmup=0.1)
    assert caption.get_lr(5, 100, config) == pytest.approx(0.5e-4)
    assert caption.get_lr(10, 100, config) == pytest.approx(1e-4)
    assert caption.get_lr(55, 100, config) == pytest.approx(0.5e-4)
    assert caption.get_lr(100, 100, config) == 0.0


# The aten operations of a training step (bench/ops.py: full depth, narrow width, the third step), each a kernel
# launch on a GPU: held here so that the step does not grow, counted on 2026-11-28 after the blocks ran on (B*L, D)
# rows and the matrix weights were cast once a step (plumbing/casts.py); before: stage 1 2,794 float32 / 3,342
# bfloat16, stage 2 1,633 / 2,000
STEP_OPERATIONS = {("stage1", "float32"): 2353, ("stage1", "bfloat16"): 2511,
                   ("stage2", "float32"): 1537, ("stage2", "bfloat16"): 1710}


@pytest.mark.parametrize("stage, dtype", STEP_OPERATIONS)
def test_a_training_step_issues_no_more_operations_than_counted_whatever_its_batch(stage, dtype):
    counted = sum(bench_ops.step_operations(stage, dtype).values())
    assert counted <= STEP_OPERATIONS[stage, dtype]
    step = (bench_ops.stage1_step if stage == "stage1" else bench_ops.stage2_step)(dtype, pairs=1)
    step()
    step()
    with bench_ops.OperationCount() as one_pair:
        step()
    assert sum(one_pair.counts.values()) == counted  # the launches a step costs do not grow with its batch


def test_a_captured_steps_batches_keep_one_shape_and_its_loss_whatever_the_caption_lengths():
    # stage 2 (--cuda_graphs): two batches of different caption lengths, padded to max_words, with B x T targets
    def items(lengths):
        rows = []
        for n in lengths:
            caption_in, caption_out = torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long)
            caption_in[:n + 1] = torch.tensor([SOT_ID, *range(1, n + 1)])
            caption_out[:n + 1] = torch.tensor([*range(1, n + 1), EOT_ID])
            rows.append({"visual": visual_tokens(1)[0], "caption_in": caption_in, "caption_out": caption_out})
        return rows
    short, long = items([2, 3]), items([5, 7])
    static = [data.collate_captions(batch, static=True) for batch in (short, long)]
    assert [b["caption_in"].shape for b in static] == [(2, 9)] * 2 and [len(b["caption_targets"]) for b in static] == [18] * 2
    captioner = caption.Captioner(tiny_decoder(), None, pad_id=0)  # eval: no dropout, two calls comparable
    for batch, cut in zip(static, (data.collate_captions(short), data.collate_captions(long))):
        assert cut["caption_in"].shape[1] < 9  # the eager step's batch is cut to its longest caption
        torch.testing.assert_close(captioner(batch), captioner(cut), rtol=1e-6, atol=1e-6)  # the same loss
    # one graph over both: torch.compile traces the captioner once (a new shape would trace it again)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (the suite's other compiled tests counted theirs)
    compiled = torch.compile(captioner, backend="eager")
    for batch in static:
        compiled(batch)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # stage 1 (--compile, --cuda_graphs): captions not cut, one shape
    samples = [{"caption": torch.tensor([5, 6, EOT_ID, 0, 0, 0])}, {"caption": torch.tensor([5, EOT_ID, 0, 0, 0, 0])}]
    assert data.collate_text(samples, cut=False)["caption"].shape == (2, 6)


@pytest.mark.parametrize("device, dtype, ddp, compiled, why", [
    ("cpu", "float32", False, False, "it captures CUDA kernels: run on a GPU"),
    ("cuda", "float16", False, False, "float16's loss scaler reads back"),
    ("cuda", "bfloat16", True, False, "DDP's all-reduce is not captured yet"),
    ("cuda", "bfloat16", False, True, "it replaces --compile")])
def test_cuda_graphs_where_a_step_cannot_be_captured_is_refused_in_one_line(device, dtype, ddp, compiled, why):
    process = processes.Distributed(ddp, 0, 0, 2 if ddp else 1, torch.device(device), True)
    with pytest.raises(flags.ConfigError, match=f"^--cuda_graphs: {re.escape(why)}"):
        plumbing.check_capture(adapt.Config(compile=compiled, cuda_graphs=True), process, dtype)
    if (device, dtype, ddp, compiled) == ("cpu", "float32", False, False):  # the scripts refuse it before a step
        assert (HERE / "adapt.py").read_text().count("plumbing.check_capture(") == 1


class HostWaits(TorchDispatchMode):
    """Records the operations that, on CUDA, make the host wait for the device: a number read back
    (_local_scalar_dense: .item(), bool(), int(), float()), nonzero and masked_select (their output's size is
    data), indexing by a boolean mask (a nonzero inside), and a tensor made from host data (lift_fresh:
    torch.tensor(list), indexing by a Python list), which is copied to the GPU and waited for. On the CPU the
    same operations run, so they are seen here without a GPU."""
    WAITS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
             "aten::lift_fresh", "aten::equal"}
    INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in self.WAITS or name in self.INDEXING and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def waits_in_a_second_step(step) -> list:
    """The host waits (HostWaits) of a training step after the first (which makes the optimizer's state)."""
    step()
    with HostWaits() as waits:
        step()
    return waits.seen


def test_under_autocast_the_vision_residual_stream_stays_float32_as_the_text_towers():
    model = _tiny_encoder()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        embedded = model.clip.visual.embed(clip.normalize(_pixels(2, 1)))
        intra = model.intra_image(clip.normalize(_pixels(2, 1)))
        text = model.clip.transformer(model.clip.token_embedding(torch.tensor([[5, 7]])), causal=True)
    assert embedded.dtype == intra.dtype == text.dtype == torch.float32


def test_attention_maps_are_computed_in_float32_under_autocast():
    query, keys = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)  # (B, H, T, d), (B, H, S, d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = explain.attention_weights(query, keys)
    assert under_autocast.dtype == torch.float32
    assert torch.equal(under_autocast, explain.attention_weights(query, keys))  # not the bf16 product's rounding
    encoder = _tiny_encoder()
    before, after = clip.normalize(_pixels(2, 1)), clip.normalize(_pixels(2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        maps = explain.encoder_attention(encoder, before, after)
    assert maps["intra"].dtype == maps["inter"].dtype == torch.float32


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_training_step_that_is_not_a_log_step_never_makes_the_host_wait_for_the_device(dtype, tmp_path):
    ctx, cpu = cpu_precision(dtype), torch.device("cpu")
    pixels = lambda seed: _pixels(4, seed)  # uint8 (B, R, R, 3), as the DataLoader hands them over
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=dtype == "float16")
    alone = processes.Distributed(False, 0, 0, 1, cpu, True)
    run = loop.Run(types.SimpleNamespace(log_every=10, save_every=10), alone, dtype, ctx, scaler, tmp_path)
    boundary = loop.StepBoundary(run, steps_per_epoch=100, total_steps=1000, first_step=0, state=None)
    # stage 1: the batch to the device (normalised there), the step, the step boundary (step 1: no check)
    encoder = _tiny_encoder().train()
    config1 = adapt.Config(max_words=16)
    optimizer1 = adapt.build_optimizer(encoder, config1)
    ids = torch.zeros(4, 16, dtype=torch.long)
    ids[:, :4] = torch.tensor([TINY["vocab_size"] - 2, 5, 7, TINY["vocab_size"] - 1])
    host1 = data.collate_text([{"before": b, "after": a, "caption": c} for b, a, c in zip(pixels(1), pixels(2), ids)])

    def stage1():
        batch = data.to_device(host1, cpu, ("before", "after", "caption"))
        loss, norm = adapt.train_step(encoder, optimizer1, scaler, [batch], ctx, config1, False,
                                      encoder.clip.logit_scale)
        assert not boundary.after_step(1, 1e-3, loss, norm)
    assert waits_in_a_second_step(stage1) == []
    # stage 2, end to end from pixels (the change pair and the distractor pair), and on cached float16 tokens
    words = torch.tensor([[5, 7, 9], [4, 3, 0], [8, 0, 0], [6, 2, 1]])  # 0: padding
    caption_in = torch.cat([torch.full((4, 1), TINY["vocab_size"] - 2), words], 1)  # (4, 4)
    caption_out = torch.cat([words, torch.zeros(4, 1, dtype=torch.long)], 1)
    caption_out[torch.arange(4), (words != 0).sum(1)] = TINY["vocab_size"] - 1  # EOT after the last word
    for finetune in (True, False):
        config2 = caption.Config(finetune_encoder=finetune, decoder_layers=1, decoder_heads=2, decoder_ffn=64,
                                 max_words=16)
        tied = {**TINY, "transformer_width": E}  # the decoder's width is CLIP's text width and joint width
        torch.manual_seed(0)
        captioner = caption.build_captioner(config2, PairEncoder(clip.CLIP(clip.CLIPConfig(**tied)), EncoderConfig(3)),
                                            tied, clip.PAD_ID).train()
        optimizer2 = caption.build_optimizer(captioner, config2)
        items = [{"caption_in": i, "caption_out": o, "no_change_caption_in": i, "no_change_caption_out": o}
                 for i, o in zip(caption_in, caption_out)]
        for k, item in enumerate(items):
            if finetune:
                item.update(before=pixels(3)[k], after=pixels(4)[k], distractor=pixels(5)[k])
            else:
                item.update(visual=torch.randn(2 * (N + 1), E).half(), no_change_visual=torch.randn(2 * (N + 1), E).half())
        host2 = data.collate_captions(items)

        def stage2():
            loss, norm = caption.train_step(captioner, optimizer2, scaler, [data.to_device(host2, cpu)], ctx,
                                            config2, False)
            assert not boundary.after_step(1, 1e-3, loss, norm)
        assert waits_in_a_second_step(stage2) == [], f"finetune_encoder={finetune}"
    with HostWaits() as waits:  # what the steps did before: a length read back, rows picked by a list, a mask
        int(ids.argmax(dim=-1).max())
        host1["before"][:, [0, 5]]
        ids[ids != 0]
        bool(torch.isfinite(ids.float()).all())
    assert waits.seen == ["aten::_local_scalar_dense", "aten::lift_fresh", "aten::index", "aten::_local_scalar_dense"]


def test_training_on_cached_features_then_eval_writes_predictions_scores_and_grid(stage1, tmp_path):
    out = tmp_path / "cap"
    result = stage2(stage1, out, "--no-finetune_encoder", "--epochs", "2")  # the synth preset finetunes
    assert result.returncode == 0, result.stderr
    assert len(list((out / "features").glob("*.npy"))) == 3  # train, val, test, each encoded once
    evaluated = stage2(stage1, out, "--eval")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "encoding" not in evaluated.stdout  # the cached test features were reused
    predictions = json.loads((out / "test_predictions.json").read_text())
    ids = {p["image_id"] for p in predictions}
    assert any(i.endswith("_n") for i in ids) and any(not i.endswith("_n") for i in ids)  # change + distractor
    table = json.loads((out / "test_scores.json").read_text())
    assert {"total", "semantic change", "distractor"} <= set(table["scores"])
    assert set(table["scores"]["total"]) >= {"BLEU_4", "METEOR", "ROUGE_L", "CIDEr"}
    assert (out / "test_grid.png").stat().st_size > 10_000
    assert (out / "test_attention.png").stat().st_size > 10_000
    located = table["localisation"]  # the pointing game: every change pair of the synthetic test split has boxes
    assert located["semantic change"]["pairs"] == 5 and 0 < located["semantic change"]["chance"] < 100
    assert {"intra", "inter", "decoder"} <= set(located["color"])
    assert "localisation (pointing game)" in (out / "test_scores.txt").read_text()
    state = torch.load(out / "ckpt_best.pt", weights_only=True)  # loads without running code
    assert state["encoder_sha256"] == clip_files.sha256_of(stage1["encoder"])
    assert from_checkpoint(checkpoints.read_encoder(stage1["encoder"])).config.intra_layers == 1  # rebuilt as saved


def test_the_synth_preset_finetunes_the_inter_image_blocks_and_keeps_stage_1s_frozen_intra_image_blocks(stage1,
                                                                                                         tmp_path):
    result = stage2(stage1, tmp_path / "cap", "--epochs", 1)
    assert result.returncode == 0, result.stderr
    assert "finetuning the encoder" in result.stdout and "intra-image tokens of" in result.stdout
    before = torch.load(stage1["encoder"], weights_only=True)["model"]
    after = {k.removeprefix("encoder."): v for k, v in
             torch.load(tmp_path / "cap" / "ckpt_last.pt", weights_only=True)["model"].items()
             if k.startswith("encoder.")}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    intra = "clip.visual.transformer.resblocks.0."  # TINY_CLIP: 1 intra-image block, 1 inter-image block
    assert not any(k.startswith(intra) or k.startswith("clip.visual.conv1") for k in changed)
    assert "clip.visual.transformer.resblocks.1.attn.in_proj_weight" in changed and "before_embedding" in changed


def test_stage_2_draws_a_missing_synthetic_dataset_before_reading_its_vocabulary(stage1, tmp_path):
    root = tmp_path / "fresh"  # a stage-1 checkpoint exists but its data folder was removed or never made here
    result = run("caption.py", *TINY_DECODER, "--data_root", root, "--synth_pairs", 40, "--encoder_ckpt",
                 stage1["encoder"], "--out_dir", tmp_path / "cap", "--epochs", 1)
    assert result.returncode == 0, result.stderr
    assert (root / "splits.json").exists() and (root / "bpe_synth_vocab.txt.gz").exists()


def test_pair_prints_a_caption_and_rejects_missing_or_non_image_files(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    before = next((stage1["root"] / "images").iterdir())
    after = stage1["root"] / "sc_images" / before.name.replace("default", "semantic")
    result = stage2(stage1, out, "--pair", before, after)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # one caption, whatever a 1-epoch model says
    explained = stage2(stage1, out, "--pair", before, after, "--explain", tmp_path / "why.png")
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.splitlines()[0] == result.stdout.strip()  # the same caption
    assert Image.open(tmp_path / "why.png").size[0] > 400
    alone = stage2(stage1, out, "--explain", tmp_path / "why.png")
    assert alone.returncode == 1 and "--pair" in alone.stderr
    missing = stage2(stage1, out, "--pair", before, tmp_path / "nothing.png")
    assert missing.returncode == 1 and "nothing.png" in missing.stderr and "missing" in missing.stderr
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    not_image = stage2(stage1, out, "--pair", before, text)
    assert not_image.returncode == 1 and "notes.png" in not_image.stderr and "not an image" in not_image.stderr


def test_checkpoints_moved_with_their_data_to_another_folder_give_the_same_captions_and_retrieval(stage1, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(stage1["root"], here / "synth")
    shutil.copytree(stage1["encoder"].parent, here / "adapt")
    pair = [here / "synth" / "images" / "CLEVR_default_000034.png", here / "synth" / "sc_images" /
            "CLEVR_semantic_000034.png"]
    answers = {}
    for mode in ("--no-finetune_encoder", "--finetune_encoder"):  # the encoder's weights in "stage1", or in "model"
        trained = run("caption.py", *TINY_DECODER, mode, "--epochs", "1", "--data_root", here / "synth",
                      "--encoder_ckpt", here / "adapt" / "ckpt_best.pt", "--out_dir", here / mode)
        assert trained.returncode == 0, trained.stderr
        said = run("caption.py", *TINY_DECODER, "--out_dir", here / mode, "--pair", *pair)
        assert said.returncode == 0, said.stderr
        answers[mode] = said.stdout
    retrieval = run("adapt.py", *TINY_CLIP, "--eval", "--data_root", here / "synth", "--out_dir", here / "adapt")
    assert retrieval.returncode == 0, retrieval.stderr
    shutil.move(here, there)  # the stage-1 checkpoint, its vocabulary's path and the data: gone from where they were
    pair = [there / p.relative_to(here) for p in pair]
    for mode in answers:
        best = there / mode / "ckpt_best.pt"  # alone: --out_dir is a new folder, no cached features, no stage 1
        said = run("caption.py", *TINY_DECODER, "--checkpoint", best, "--out_dir", tmp_path / "new", "--pair", *pair)
        assert said.returncode == 0 and said.stdout == answers[mode], said.stderr
    best = there / "--no-finetune_encoder" / "ckpt_best.pt"
    evaluated = run("caption.py", *TINY_DECODER, "--checkpoint", best, "--data_root", there / "synth", "--out_dir",
                    tmp_path / "eval", "--eval")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "encoding test" in evaluated.stdout  # the test split encoded afresh, by the weights the checkpoint holds
    before = json.loads((there / "--no-finetune_encoder" / "test_predictions.json").read_text())
    assert json.loads((tmp_path / "eval" / "test_predictions.json").read_text()) == before
    scored = run("adapt.py", *TINY_CLIP, "--eval", "--data_root", there / "synth", "--checkpoint",
                 there / "adapt" / "ckpt_best.pt", "--out_dir", tmp_path / "adapt_eval")
    assert scored.returncode == 0, scored.stderr
    assert json.loads((tmp_path / "adapt_eval" / "test_retrieval.json").read_text())["text_to_pair_R1"] == \
        json.loads((there / "adapt" / "test_retrieval.json").read_text())["text_to_pair_R1"]


def test_a_stage_1_file_given_as_a_captioner_is_named_with_the_flag_that_takes_it(stage1, tmp_path):
    result = stage2(stage1, tmp_path / "cap", "--eval", "--checkpoint", stage1["encoder"])
    assert result.returncode == 1 and "is a stage-1 checkpoint" in result.stderr
    assert f"--encoder_ckpt {stage1['encoder']}" in result.stderr


def test_a_diverging_learning_rate_stops_stage_2_in_one_line_and_saves_no_best_model(stage1, tmp_path):
    out = tmp_path / "cap"
    result = stage2(stage1, out, "--epochs", "2", "--lr", "1e30", "--warmup", "0", "--grad_clip", "1e30")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and re.search(r"diverged at step \d+: .*learning rate [\d.]+e\+(29|30);.*--lr", line), line
    if (out / "ckpt_best.pt").exists():  # the epochs before it diverged may keep their best model: finite
        state = torch.load(out / "ckpt_best.pt", weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_corrupt_captioner_checkpoint_is_named_in_the_error(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    best = out / "ckpt_best.pt"
    best.write_bytes(best.read_bytes()[:1000])
    result = stage2(stage1, out, "--eval")
    assert result.returncode == 1 and str(best) in result.stderr and "corrupt" in result.stderr


def test_a_run_killed_during_training_resumes_and_keeps_every_checkpoint_loadable(stage1, tmp_path):
    out = tmp_path / "cap"
    args = ["--epochs", "4", "--save_every", "2", "--batch_size", "4"]
    command = [sys.executable, str(HERE / "caption.py"), "--data", "synth", *TINY_DECODER,
               "--data_root", str(stage1["root"]), "--encoder_ckpt", str(stage1["encoder"]), "--out_dir", str(out),
               *args]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first epoch's checkpoints and a later step, then SIGKILL
        log = out / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if (out / "ckpt_best.pt").exists() and records and "split" not in records[-1] and records[-1]["step"] % 2:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    result = stage2(stage1, out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"at step {killed_at}" in result.stdout
    last = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert last["step"] > killed_at and len(last["history"]) + last["bad_epochs"] >= 1
    assert [h["epoch"] for h in last["history"]] == list(range(len(last["history"])))  # no epoch lost or repeated
    for name in ("ckpt_best.pt", "ckpt_last.pt"):
        checkpoints.load_checkpoint(out / name)
    assert not list(out.glob(".*.tmp*"))


def test_a_bfloat16_run_saves_no_scaler_state_and_resumes_in_float16_with_a_new_loss_scale(stage1, tmp_path):
    out = tmp_path / "cap"
    first = stage2(stage1, out, "--epochs", "1", "--dtype", "bfloat16")
    assert first.returncode == 0, first.stderr
    state = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert state["scaler"] == {}  # bfloat16: no scaler, no state
    state["config"]["epochs"] = 2  # as a 2-epoch run interrupted after its first: --resume refuses another schedule
    checkpoints.save_checkpoint(state, out / "ckpt_last.pt")
    resumed = stage2(stage1, out, "--epochs", "2", "--resume", "--dtype", "float16")
    assert resumed.returncode == 0, resumed.stderr
    assert "float16 on cpu" in resumed.stdout
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["scaler"]["scale"] > 0  # saved from now on


def test_resuming_with_another_decoder_config_is_refused(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    result = stage2(stage1, out, "--epochs", "2", "--resume", "--decoder_ffn", "256")
    assert result.returncode == 1 and "decoder_ffn" in result.stderr


# --- the results page (results.py): written by --eval and the end of training, read in Python and in Chromium ---

class PageParts(html.parser.HTMLParser):
    """What the tests read of results.html: each table's rows of exact values (the data-value beside each printed
    number), the pairs' cards, the curves, and where every image and script comes from."""

    def __init__(self, text: str):
        super().__init__()
        self.tables, self.cards, self.curves, self.sources, self.row = {}, [], [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = self.tables.setdefault(attrs["id"], {})
        elif tag == "tr":
            name = attrs.get("data-subset")
            self.row = None if name is None else self.table.setdefault((name, attrs.get("data-way")), [])
        elif tag == "td" and self.row is not None:
            self.row.append(float(attrs["data-value"]) if "data-value" in attrs else None)
        elif tag == "article":
            self.cards.append(attrs)
        elif tag == "polyline":
            self.curves.append((attrs["data-series"], int(attrs["data-n"]), len(attrs["points"].split())))
        if tag in ("img", "script", "link", "iframe", "source"):
            self.sources.append(attrs.get("src") or attrs.get("href"))


@pytest.fixture(scope="module")
def evaluated(stage1, tmp_path_factory):
    """A tiny stage-2 run (the synth preset, 2 epochs) and its --eval: the run folder and what the page shows."""
    out = tmp_path_factory.mktemp("results") / "cap"
    trained = stage2(stage1, out, "--epochs", "2")
    assert trained.returncode == 0, trained.stderr
    assert (out / results.PAGE_NAME).is_file()  # the end of training writes it
    evaluated = stage2(stage1, out, "--eval")
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"results page {out / results.PAGE_NAME}" in evaluated.stdout
    predictions = {p["image_id"]: p["caption"] for p in json.loads((out / "test_predictions.json").read_text())}
    pairs = data.evaluation_pairs(data.load_split("synth", "test", stage1["root"]), use_no_change_pair=True)
    return {"out": out, "pairs": pairs, "predictions": predictions, "page": (out / results.PAGE_NAME).read_text(),
            "table": json.loads((out / "test_scores.json").read_text())}


def test_eval_writes_one_self_contained_results_page_whose_numbers_are_the_score_files_and_the_scorers(evaluated,
                                                                                                     stage1):
    page, table, pairs, predictions = (evaluated[k] for k in ("page", "table", "pairs", "predictions"))
    parts = PageParts(page)
    assert parts.sources and all(s is None or s.startswith("data:") for s in parts.sources)  # inline, nothing fetched
    thumbs = json.loads(re.search(r'<script type="application/json" id="thumbs">(.*?)</script>', page).group(1))
    assert all(uri.startswith(("data:image/webp;base64,", "data:image/jpeg;base64,", "data:image/png;base64,"))
               for uri in thumbs)
    for subset, scores in table["scores"].items():  # the score table: the exact numbers of test_scores.json
        assert parts.tables["scores"][(subset, None)][1:] == [scores[c] for c in results.TABLE_COLUMNS]
    for kind, right in table["kinds"]["right"].items():  # the kinds said: right, of how many
        assert f'<tr data-subset="{kind}"><th>{kind}</th><td>{right}</td><td>{table["kinds"]["total"][kind]}' in page
    for subset, row in table["localisation"].items():
        assert parts.tables["localisation"][(subset, None)][1:] == [row[k] for k in ("chance", "intra", "inter",
                                                                                     "decoder")]
    # every pair, in test order, with the plain scorer's own numbers for it on the whole split
    scored = metrics.score_captions(predictions, data.references(pairs))
    assert [c["id"] for c in parts.cards] == [f"pair-{p.id}" for p in pairs]
    for card, pair in zip(parts.cards, pairs):
        items = scored["items"][pair.id]
        assert (float(card["data-cider"]), float(card["data-meteor"]), float(card["data-bleu4"])) == (
            items["CIDEr"], items["METEOR"], items["BLEU_4"])
        assert card["data-type"] == pair.change_type
        assert card["data-wrong"] == str(int(metrics.said_kind(predictions[pair.id]) != pair.change_type))
    assert np.mean([float(c["data-cider"]) for c in parts.cards]) == pytest.approx(table["scores"]["total"]["CIDEr"],
                                                                                  rel=1e-12)
    assert sum("hidden" not in c for c in parts.cards) == min(results.PER_PAGE, len(pairs))  # the first page
    assert page.count('class="heat"') == 2 * sum(p.change_type != data.DISTRACTOR for p in pairs)  # all 5 pointed at
    # both stages' curves: a point per logged step and per validation
    logs = [[json.loads(line) for line in path.read_text().splitlines()]
            for path in (stage1["encoder"].parent / "log.jsonl", evaluated["out"] / "log.jsonl")]
    steps = [sum("loss" in r for r in log) for log in logs]
    epochs = [sum(r.get("split") == "val" for r in log) for log in logs]
    assert parts.curves == [("loss", steps[0], steps[0]), ("lr", steps[0], steps[0]),
                            ("R@1 text → pair", epochs[0], epochs[0]), ("R@1 pair → text", epochs[0], epochs[0]),
                            ("loss", steps[1], steps[1]), ("lr", steps[1], steps[1]),
                            ("CIDEr-D", epochs[1], epochs[1])]
    best = max(range(epochs[1]), key=lambda k: ([r for r in logs[1] if r.get("split") == "val"][k]["CIDEr"], k))
    assert f"chosen: epoch {best + 1}, the best CIDEr-D" in page


def test_the_results_page_refuses_another_splits_or_runs_predictions_and_says_what_it_cannot_show(evaluated, stage1,
                                                                                                tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("test_predictions.json", "test_scores.json", "log.jsonl"):
        shutil.copy(evaluated["out"] / name, out / name)
    flags_ = ["--data", "synth", "--data_root", str(stage1["root"]), "--out_dir", str(out), "--encoder_ckpt",
              str(stage1["encoder"])]
    results.main(flags_)  # the page again from the files: the same pairs and numbers, no attention maps
    again = PageParts((out / results.PAGE_NAME).read_text())
    assert again.cards == PageParts(evaluated["page"]).cards
    assert "results page: no attention maps: caption.py --eval reads them out" in capsys.readouterr().out
    predictions = json.loads((out / "test_predictions.json").read_text())
    val = data.evaluation_pairs(data.load_split("synth", "val", stage1["root"]), use_no_change_pair=True)
    write_json(out / "test_predictions.json", [{"image_id": p.id, "caption": "x"} for p in val])
    with pytest.raises(data.DataError, match=r"results page: 10 of the 10 predicted ids are not pairs of the test "
                                             r"split read \(first: '\d+\.png'\): the predictions are another split's"):
        results.main(flags_)
    write_json(out / "test_predictions.json", [{**p, "caption": "the little cube moved"} if k == 0 else p
                                               for k, p in enumerate(predictions)])
    with pytest.raises(data.DataError, match="the predictions and the table come from different runs"):
        results.main(flags_)
    write_json(out / "test_predictions.json", predictions)
    (out / "log.jsonl").write_text("")
    after = evaluated["pairs"][1].after
    pairs = [dataclasses.replace(p, after=tmp_path / "gone.png") if p.after == after else p for p in evaluated["pairs"]]
    nowhere = types.SimpleNamespace(data="synth", encoder_ckpt=str(tmp_path / "gone" / "ckpt_best.pt"), checkpoint="")
    results.results_page(out, evaluated["predictions"], evaluated["table"], pairs, metrics.FastCaptionScorer,
                         logs=results.training_logs(nowhere, out))
    said = capsys.readouterr().out.splitlines()
    gone = tmp_path / "gone.png"
    assert said == [f"results page: 1 of the 15 images cannot be shown (first: image {gone} is missing)",
                    "results page: no attention maps: caption.py --eval reads them out",
                    f"results page: stage 1, adaptation: no curves: {tmp_path / 'gone' / 'log.jsonl'} is missing",
                    f"results page: stage 2, captioning: no curves: {out / 'log.jsonl'} is empty"]
    page = (out / results.PAGE_NAME).read_text()
    assert f'<div class="missing">image {html.escape(str(tmp_path / "gone.png"))} is missing</div>' in page
    with pytest.raises(SystemExit):
        results.main([*flags_, "--per_page", "0"])
    (out / "test_scores.json").unlink()
    with pytest.raises(data.DataError, match=r"test_scores.json: cannot read it .*; evaluate first \(caption.py "
                                             r"--data synth --eval\)"):
        results.main(flags_)


def choose(browser: Chromium, **values) -> tuple[int, list[str]]:
    """Set the page's search form as a person would (a select, a box ticked, words typed), then read how many pairs
    match and which cards are shown, in order."""
    for name, value in values.items():
        kind = "checked" if isinstance(value, bool) else "value"
        browser.run(f"(f => {{ f.{kind} = {json.dumps(value)}; f.dispatchEvent(new Event('input', {{bubbles: true}})) "
                    f"}})(document.getElementById('find').elements[{json.dumps(name)}])")
    shown = browser.run("[...document.querySelectorAll('#cards > article')].filter(c => !c.hidden).map(c => c.id)")
    matching = int(browser.run("document.getElementById('count').dataset.matching"))
    return matching, [s.removeprefix("pair-") for s in shown]


def test_the_results_page_in_headless_chromium_draws_its_images_and_curves_and_its_filters_find_the_pairs(
        evaluated, stage1, tmp_path):
    """Chromium (Debian's chromium; .ci/run installs it) opens the page at a desktop's and a phone's width. A clone
    without it checks in Python what the script reads, and says once that the browser check needs Chromium."""
    pairs, predictions, out = evaluated["pairs"], evaluated["predictions"], evaluated["out"]
    cards = PageParts(evaluated["page"]).cards
    types_ = collections.Counter(p.change_type for p in pairs)
    wrong = [p.id for p in pairs if metrics.said_kind(predictions[p.id]) != p.change_type]
    worst = sorted(range(len(pairs)), key=lambda k: (float(cards[k]["data-cider"]), k))
    word = "cylinder"  # in some pairs' references, and in no word the page adds
    with_word = [p.id for p in pairs if word in " ".join([p.id, predictions[p.id], *p.captions]).lower()]
    assert 0 < len(with_word) < len(pairs)
    assert [c["data-type"] for c in cards] == [p.change_type for p in pairs]  # what the script filters by
    assert [c["id"].removeprefix("pair-") for c in cards if c["data-wrong"] == "1"] == wrong
    if CHROMIUM is None:
        assert not os.environ.get("CLIP4IDC_REQUIRE_CHROMIUM"), "Chromium is required here (.ci/run installs it)"
        warnings.warn("the results page's browser check needs Chromium (apt-get install chromium): it checked in "
                      "Python only what the page's script reads")
        return
    (tmp_path / "again").mkdir()  # the same run's page rebuilt with 3 pairs per page, to turn pages
    for name in ("test_predictions.json", "test_scores.json"):
        shutil.copy(out / name, tmp_path / "again" / name)
    results.main(["--data", "synth", "--data_root", str(stage1["root"]), "--out_dir", str(tmp_path / "again"),
                  "--encoder_ckpt", str(stage1["encoder"]), "--checkpoint", str(out / "ckpt_best.pt"),
                  "--per_page", "3"])
    browser = Chromium(tmp_path / "profile")
    try:
        browser.open(out / results.PAGE_NAME, 1280, 900)
        assert browser.run("document.body.classList.contains('js')")  # the script ran
        drawn = browser.run("Promise.all([...document.querySelectorAll('img')].filter(i => i.offsetParent)"
                            ".map(i => i.decode().then(() => [i.alt, i.naturalWidth])))")
        changes = len(pairs) - types_[data.DISTRACTOR]  # each with its attention maps over both images
        assert len(drawn) == 2 * len(pairs) + 2 * changes and all(w > 0 for _, w in drawn)
        assert [w for alt, w in drawn if alt == "after attention"] == [7] * changes  # a pixel per patch, 7 x 7
        curves = browser.run("[...document.querySelectorAll('polyline.curve')].map(p => [p.dataset.series, "
                             "p.points.numberOfItems, p.getTotalLength() > 0 || p.points.numberOfItems == 1])")
        assert [tuple(c[:2]) for c in curves] == [c[:2] for c in PageParts(evaluated["page"]).curves] and curves
        assert all(c[1] > 0 and c[2] for c in curves)
        desktop = browser.screenshot(tmp_path / "results-desktop.png", whole_page=True)
        assert choose(browser) == (len(pairs), [p.id for p in pairs])
        for kind, count in types_.items():
            assert choose(browser, type=kind) == (count, [p.id for p in pairs if p.change_type == kind])
        assert choose(browser, type="", wrong=True) == (len(wrong), wrong)
        assert choose(browser, wrong=False, sort="worst") == (len(pairs), [pairs[k].id for k in worst])
        assert choose(browser, sort="test", query=word.upper()) == (len(with_word), with_word)
        assert choose(browser, query="no such words") == (0, [])
        assert browser.console_errors() == []
        browser.open(out / results.PAGE_NAME, 390, 844, phone=True)
        assert browser.run("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
        browser.run("document.getElementById('pairs').scrollIntoView()")
        phone = browser.screenshot(tmp_path / "results-phone.png", whole_page=False)
        browser.call("Emulation.setScriptExecutionDisabled", page=True, value=True)  # readable without JavaScript:
        browser.open(out / results.PAGE_NAME, 1280, 900)  # the tables, the curves, the first page, no controls
        assert browser.run("[...document.querySelectorAll('#cards > article')].filter(c => c.offsetParent).length "
                           "+ ' ' + getComputedStyle(document.getElementById('find')).display + ' ' + "
                           "document.querySelectorAll('#scores tr, polyline').length") == \
            f"{len(pairs)} none {1 + len(evaluated['table']['scores']) + len(curves)}"
        assert len(browser.run("Promise.all([...document.querySelectorAll('img')].filter(i => i.offsetParent)"
                               ".map(i => i.decode()))")) == len(drawn)
        browser.call("Emulation.setScriptExecutionDisabled", page=True, value=False)
        browser.open(tmp_path / "again" / results.PAGE_NAME, 1280, 900)  # 3 per page: 4 pages of 10
        assert choose(browser) == (len(pairs), [p.id for p in pairs[:3]])
        browser.run("document.querySelector('.pager button[data-step=\"1\"]').click()")
        assert choose(browser) == (len(pairs), [p.id for p in pairs[3:6]])
        assert browser.run("document.getElementById('count').textContent") == "pairs 4–6 of 10; page 2 of 4"
        assert browser.run("Promise.all([...document.querySelectorAll('#cards > article:not([hidden]) img')]"
                           ".map(i => i.decode().then(() => i.naturalWidth)))") == [192] * 6  # set by the script
        assert browser.console_errors() == []
    finally:
        browser.close()
    for shot, width in ((desktop, 1280), (phone, 390)):
        with Image.open(shot) as image:
            assert image.width == width and image.height >= 844


# --- faults: stale caches, empty splits, terminals, unwritable folders, SIGHUP, resume checks (BENCHMARKS.md §9) ---

def test_a_replaced_image_gives_new_pixels_new_intra_tokens_and_new_pair_features(tmp_path):
    model = _tiny_encoder()  # 64-pixel images
    for name, color in (("b0", (200, 0, 0)), ("a0", (0, 200, 0))):
        write_png(tmp_path / "images" / f"{name}.png", color, size=(64, 64))
    pairs = [data.ImagePair(id="0", before=tmp_path / "images" / "b0.png", after=tmp_path / "images" / "a0.png",
                            captions=["x"])]
    reader = data.ImageReader(64)
    cpu, plain = torch.device("cpu"), contextlib.nullcontext()

    def numbers():
        pixels = caches.image_cache(pairs, tmp_path / "cache", "all", 64, workers=0)[pairs[0].after].copy()
        intra = caches.IntraTokens(model, pairs, reader, 4, cpu, plain, tmp_path / "cache")(pairs[0].after).clone()
        path = cached_pair_features(model, pairs, reader, tmp_path / "features")
        return pixels, intra, np.load(path).copy()

    first = numbers()
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, numbers()))  # found, the same
    write_png(pairs[0].after, (0, 0, 200), size=(64, 64))  # the after image replaced under the same name
    os.utime(pairs[0].after, ns=(1, 1))  # a different time even where the clock's step is coarse
    for old, new, cache in zip(first, numbers(), ("pixels", "intra tokens", "pair features")):
        assert not np.array_equal(np.asarray(old), np.asarray(new)), cache


def test_a_split_without_pairs_is_refused_in_one_line_before_the_first_step_in_both_stages(synth40_root, tiny_adapt,
                                                                                        stage1, tmp_path):
    args, env = pairs_run(synth40_root, tmp_path / "pairs")
    write_json(tmp_path / "pairs" / "val.json", [])
    out = tmp_path / "adapt"
    result = run_adapt(tiny_adapt, *args, "--out_dir", out, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"adapt.py: error: the val split of pairs in {tmp_path / 'pairs'} has no pairs: training and evaluation need")
    assert not (out / "ckpt_last.pt").exists() and "step" not in result.stdout
    pairs_without_distractors(stage1["root"], tmp_path / "pairs2")
    write_json(tmp_path / "pairs2" / "test.json", [])
    out = tmp_path / "caption"
    result = subprocess.run([sys.executable, str(HERE / "caption.py"), *TINY_DECODER, "--data", "pairs",
                             "--data_root", str(tmp_path / "pairs2"), "--encoder_ckpt", str(stage1["encoder"]),
                             "--out_dir", str(out)], cwd=HERE, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CLIP_BPE_PATH": str(stage1["root"] / data.SYNTH_BPE_FILE)})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "caption.py: error: the test split of pairs" in result.stderr and "has no pairs" in result.stderr
    assert not (out / "ckpt_last.pt").exists() and "encoding" not in result.stdout
    empty = [data.ImagePair(id="0", before=Path("b.png"), after=Path("a.png"), captions=[" "])]
    config = types.SimpleNamespace(data="spot", data_root=str(tmp_path))
    with pytest.raises(data.DataError, match="the train split of spot .* has 1 pairs but no caption that is not empty"):
        stopping.refuse_empty_splits({"train": empty}, ("train",), config)


def test_output_a_stream_cannot_encode_is_written_with_replacement_never_an_exception():
    script = ("from plumbing import stopping; "
              "stopping.run_main(lambda: print('the cube turned \\u00e9carlate \\u2192 red'), 'x.py')")
    for encoding in ("ascii", "latin-1"):
        result = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True,
                                env={**os.environ, "PYTHONIOENCODING": encoding})
        assert result.returncode == 0 and result.stderr == b"", result.stderr
        assert result.stdout == "the cube turned \u00e9carlate ? red\n".encode(encoding, errors="replace")


def test_an_epochs_checkpoints_are_saved_before_its_validation_line_so_a_failing_print_loses_neither(
        synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    # the validation line's print fails (a terminal gone, a full pipe): the epoch's checkpoints were handed to the
    # writer before it, and the loop's end waits for them
    failing_print = ("import builtins, runpy, sys; real = builtins.print\n"
                     "def print_(*args, **kwargs):\n"
                     "    if args and str(args[0]).startswith('epoch 1 validation'):\n"
                     "        raise OSError(5, 'Input/output error')\n"
                     "    real(*args, **kwargs)\n"
                     "builtins.print = print_; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    command = [sys.executable, "-c", failing_print, str(HERE / "adapt.py"), *tiny_adapt, "--data_root",
               str(synth40_root), "--out_dir", str(out), "--epochs", "1"]
    result = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "Input/output error" in result.stderr
    steps = [checkpoints.load_checkpoint(out / name)["step"] for name in ("ckpt_best.pt", "ckpt_last.pt")]
    assert steps[0] == steps[1] > 0  # both written whole, at the epoch's end


def test_an_unwritable_out_dir_cache_or_clip_cache_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    def refused(*args, **kwargs):  # what another user's folder answers (the tests run as root: chmod would not stop it)
        raise PermissionError(errno.EACCES, "Permission denied", str(args[0]) if args else None)
    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", refused)
        with pytest.raises(files.Unwritable, match=f"cannot write in {tmp_path / 'theirs' / 'run'} \\(Permission "
                                                   "denied\\); choose an --out_dir of your own"):
            files.OutDirLock(tmp_path / "theirs" / "run").__enter__()
    (tmp_path / "run").mkdir()
    with monkeypatch.context() as patch:  # a folder that exists, read-only: --eval into another's run
        patch.setattr(os, "open", refused)
        with pytest.raises(files.Unwritable, match=f"cannot write in {tmp_path / 'run'} .*choose an --out_dir"):
            files.OutDirLock(tmp_path / "run").__enter__()
    pairs = [data.ImagePair(id="0", before=tmp_path / "b.png", after=tmp_path / "a.png", captions=["x"])]
    for path in (pairs[0].before, pairs[0].after):
        write_png(path, size=(64, 64))
    with monkeypatch.context() as patch:
        patch.setattr(np.lib.format, "open_memmap", refused)
        with pytest.raises(files.Unwritable, match=f"cannot write in {tmp_path / 'features'} .*pair features"):
            cached_pair_features(_tiny_encoder(), pairs, data.ImageReader(64), tmp_path / "features")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", refused)
        with pytest.raises(files.Unwritable, match=f"cannot write in {tmp_path / 'cache'} .*intra-image tokens"):
            caches.IntraTokens(_tiny_encoder(), pairs, data.ImageReader(64), 4, torch.device("cpu"),
                               contextlib.nullcontext(), tmp_path / "cache")
    with monkeypatch.context() as patch:  # an unwritable HOME: the shipped synthetic CLIP is not "not downloaded"
        patch.setenv("CLIP_CACHE", str(tmp_path / "home" / ".cache" / "clip"))
        patch.setattr(clip_files, "download", refused)
        with pytest.raises(clip_files.FileError, match=f"cannot write CLIP's cache folder {tmp_path / 'home'}.*set "
                                                 "CLIP_CACHE to a folder this user can write"):
            clip_files.load("synth-ViT/32")
    with pytest.raises(SystemExit) as exit_:  # what nothing else answered: one line naming the file and its folder
        stopping.run_main(lambda: refused(tmp_path / "elsewhere" / "x.json"), "x.py")
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (f"x.py: error: permission denied: {tmp_path / 'elsewhere' / 'x.json'} "
                                       f"(Permission denied); make {tmp_path / 'elsewhere'} readable and writable "
                                       f"for this user, or point the run elsewhere: --out_dir for its files, "
                                       f"--data_root for a dataset and its caches, CLIP_CACHE for CLIP's weights\n")


def test_a_json_nested_too_deeply_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "train.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(data.DataError, match=f"image pairs: {tmp_path / 'train.json'} nests lists or objects too "
                                             "deeply for Python's JSON reader"):
        data.load_split("pairs", "train", tmp_path)
    with pytest.raises(metrics.CaptionInputError, match="train.json: its lists or objects nest too deeply"):
        metrics.load_json(tmp_path / "train.json")  # the scorer's command line reads results and references
    (tmp_path / "results.json").write_bytes(b"\xef\xbb\xbf" + b'[{"image_id": 1, "caption": "a cube"}]')
    assert metrics.load_json(tmp_path / "results.json") == [{"image_id": 1, "caption": "a cube"}]  # a BOM is read


def test_sighup_saves_at_the_step_boundary_prints_the_resume_command_and_exits_129(synth40_root, tiny_adapt,
                                                                                  tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth40_root, "--out_dir", out, "--epochs", "20", "--save_every", "100"]
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)]
    # A terminal's run: SIGHUP not ignored, even where this suite runs under nohup (whose runs keep ignoring it)
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    wait_for_log_step(process, out, 2)
    process.send_signal(signal.SIGHUP)  # what a closed terminal or a dropped ssh session sends
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 129 and "Traceback" not in stderr, stderr
    step = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]  # saved at the step the signal let finish
    assert step >= 2
    assert stderr.strip().splitlines()[-1] == (
        f"adapt.py: hung up (SIGHUP: its terminal or ssh session closed): {out / 'ckpt_last.pt'} holds step {step}; "
        f"continue with: {shlex.join(['python', *command[1:], '--resume'])}")


def test_a_resumed_run_checks_its_training_split_its_flags_and_its_files_before_any_work(synth40_root, tiny_adapt,
                                                                                        stage1, tmp_path):
    out = tmp_path / "run"
    args, env = pairs_run(synth40_root, tmp_path / "pairs", per_split=8)
    args += ["--out_dir", out]
    assert run_adapt(tiny_adapt, *args, "--epochs", "1", env=env).returncode == 0
    state = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert state["train_split"]["pairs"] == 8
    state["config"]["epochs"] = 2  # as a 2-epoch run stopped after its first
    checkpoints.save_checkpoint(state, out / "ckpt_last.pt")
    train = json.loads((tmp_path / "pairs" / "train.json").read_text())
    write_json(tmp_path / "pairs" / "train.json", train[:5])
    changed = run_adapt(tiny_adapt, *args, "--epochs", "2", "--resume", env=env)
    assert changed.returncode == 1 and changed.stderr.strip().splitlines()[-1] == (
        f"adapt.py: error: {out / 'ckpt_last.pt'} was trained on another training split (8 pairs then, 5 now): "
        f"resumed on it, the steps per epoch, the epoch, the learning-rate schedule and the data order would all "
        f"shift. Resume with the split it was trained on, or start a new --out_dir")
    flagged = run_adapt(tiny_adapt, *args, "--epochs", "2", "--resume", "--checkpoint", out / "ckpt_best.pt", env=env)
    assert flagged.returncode == 2 and "--checkpoint" in flagged.stderr and "--resume continues" in flagged.stderr
    (out / "ckpt_best.pt").rename(tmp_path / "moved.pt")
    lost = run_adapt(tiny_adapt, *args, "--epochs", "2", "--resume", env=env)
    assert lost.returncode == 1 and f"{out / 'ckpt_best.pt'} is missing" in lost.stderr
    assert "training samples" not in lost.stdout  # refused before the data was read
    (tmp_path / "moved.pt").rename(out / "ckpt_best.pt")
    write_json(tmp_path / "pairs" / "train.json", train)
    del state["train_split"]  # a checkpoint of an earlier version, which recorded no split: resumed as before
    checkpoints.save_checkpoint(state, out / "ckpt_last.pt")
    resumed = run_adapt(tiny_adapt, *args, "--epochs", "2", "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    cap = tmp_path / "cap"
    assert stage2(stage1, cap, "--no-finetune_encoder", "--epochs", "1", "--save_every", "1").returncode == 0
    other = tmp_path / "other_stage1.pt"  # the same weights in another file: another sha256
    checkpoints.save_checkpoint({**torch.load(stage1["encoder"], weights_only=True), "note": 1}, other)
    replaced = run("caption.py", *TINY_DECODER, "--data_root", stage1["root"], "--encoder_ckpt", other, "--out_dir",
                   cap, "--no-finetune_encoder", "--epochs", "1", "--save_every", "1", "--resume")
    assert replaced.returncode == 1 and "was trained on another stage-1 checkpoint" in replaced.stderr
    assert "encoding" not in replaced.stdout  # refused before any split was encoded


def test_partial_files_of_killed_runs_are_removed_at_the_next_start_wherever_they_are_written(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    features = tmp_path / "features"
    features.mkdir()
    (features / f".train_0123.npy.tmp{dead.pid}").write_bytes(b"x")
    pairs = [data.ImagePair(id="0", before=tmp_path / "b.png", after=tmp_path / "a.png", captions=["x"])]
    for path in (pairs[0].before, pairs[0].after):
        write_png(path, size=(64, 64))
    cached_pair_features(_tiny_encoder(), pairs, data.ImageReader(64), features)
    assert [p.name for p in features.iterdir() if p.name.startswith(".")] == []
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f"intra_tokens_0123.partial-{dead.pid}").write_bytes(b"x")
    caches.IntraTokens(_tiny_encoder(), pairs, data.ImageReader(64), 4, torch.device("cpu"), contextlib.nullcontext(),
                       tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.partial-*"))
    (tmp_path / "run").mkdir()  # an --eval's: its out_dir, cleaned once the lock is taken
    (tmp_path / "run" / f".test_scores.json.tmp{dead.pid}").write_text("{")
    with files.OutDirLock(tmp_path / "run"):
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    index = tmp_path / "meteor" / "paraphrase-en"  # a killed METEOR index build's folder
    (index.parent / f"{index.name}.tmp{dead.pid}").mkdir(parents=True)
    (index.parent / f"{index.name}.tmp{dead.pid}" / "words.npy").write_bytes(b"x" * 100)
    gz = tmp_path / "paraphrase-en.gz"
    gz.write_bytes(gzip.compress(b"0.5\nthe cube\nthe block\n"))
    scoring_fast._build_paraphrase_index(gz, index)
    assert sorted(p.name for p in index.parent.iterdir()) == ["paraphrase-en"]


def test_eval_replaces_its_outputs_together_and_a_stop_in_the_final_test_gives_the_eval_command(stage1, tmp_path,
                                                                                                 monkeypatch):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--no-finetune_encoder", "--epochs", "1").returncode == 0
    old = {name: (out / name).read_bytes() for name in caption.TEST_OUTPUTS}

    def stopped(*args, **kwargs):  # Ctrl-C while the grid is drawn, after the scores are written
        raise KeyboardInterrupt
    monkeypatch.setattr(explain, "contact_sheet", stopped)
    monkeypatch.setenv("CLIP_BPE_PATH", str(stage1["root"] / data.SYNTH_BPE_FILE))
    with pytest.raises(KeyboardInterrupt):
        caption.main(["--data", "synth", *TINY_DECODER, "--data_root", str(stage1["root"]), "--out_dir", str(out),
                      "--eval", "--max_len", "3"])
    assert (out / "test_predictions.json").read_bytes() != old["test_predictions.json"]  # 3 tokens at most now
    assert not (out / "test_grid.png").exists() and not (out / "test_attention.png").exists()  # none of the old
    monkeypatch.setattr(sys, "argv", ["caption.py", "--data", "synth", "--resume"])
    line = str(stopping.final_test_stopped(stopping.Interrupted("", 143), out))
    assert line == (f"terminated (SIGTERM) during the final test: the training finished and {out / 'ckpt_best.pt'} "
                    f"holds its best epoch; score it with: python caption.py --data synth --eval")


def test_messages_say_what_is_true_of_a_bom_a_folder_a_link_loop_a_url_and_a_repeated_key(tmp_path, monkeypatch,
                                                                                        capsys):
    write_png(tmp_path / "b.png")
    write_png(tmp_path / "a.png")
    item = {"before": "b.png", "after": "a.png", "captions": ["the cube moved"]}
    (tmp_path / "train.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([item]).encode())  # Windows editors' BOM
    assert data.load_split("pairs", "train", tmp_path)[0].captions == ["the cube moved"]
    (tmp_path / "train.json").write_text('[{"before": "b.png", "after": "a.png", "before": "a.png", "captions": []}]')
    with pytest.raises(data.DataError, match="train.json repeats the key 'before' inside one object"):
        data.load_split("pairs", "train", tmp_path)
    (tmp_path / "train.json").write_text('[{"before": "b.png", "after": "a.png", "captions": ["x"],}]')
    with pytest.raises(data.DataError, match="is not valid JSON .*; correct it there") as error:
        data.load_split("pairs", "train", tmp_path)
    assert "download it again)" in str(error.value)  # only for a dataset's file
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    (tmp_path / "folder.png").mkdir()
    for name, said in (("folder.png", "a folder, not a file"), ("loop.png", "not readable (Too many levels of "
                                                                             "symbolic links)")):
        write_json(tmp_path / "train.json", [{**item, "after": name}])
        with pytest.raises(data.DataError, match=re.escape(f"image {tmp_path / name} is {said}")):
            data.load_split("pairs", "train", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        caption.main(["--data", "synth", "--pair", "https://example.com/a.png", "b.png"])
    assert exit_.value.code == 2 and "--pair https://example.com/a.png: a URL" in capsys.readouterr().err
    result = subprocess.run([sys.executable, str(HERE / "data.py"), "--check"], cwd=HERE, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "takes no arguments" in result.stderr and "check.py" in result.stderr


def test_adapt_eval_given_a_captioner_names_the_command_that_scores_one(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    result = run("adapt.py", *TINY_CLIP, "--data_root", stage1["root"], "--out_dir", tmp_path / "a", "--eval",
                 "--checkpoint", out / "ckpt_best.pt")
    assert result.returncode == 1 and "--encoder_ckpt" not in result.stderr
    assert (f"adapt.py --eval --checkpoint takes adapt.py's checkpoint (runs/adapt_<data>/ckpt_best.pt) or a "
            f"CLIP4IDC release; a captioner is scored with caption.py --eval --checkpoint {out / 'ckpt_best.pt'}"
            in result.stderr)


def test_check_notes_pairs_in_train_and_test_and_types_the_score_table_does_not_know(tmp_path):
    def pair(i, before, kind=None):
        return data.ImagePair(id=str(i), before=Path(before), after=Path("a.png"), captions=["x"], change_type=kind)
    splits = {"train": [pair(0, "b0.png", "move"), pair(1, "b1.png")], "val": [pair(2, "b2.png", "recolour")],
              "test": [pair(3, "b1.png", "recolour")]}
    assert check.split_notes(splits) == [
        "1 test pair(s) are also in train (the same before and after images): 3; their scores measure what was "
        "memorised, not captioning",
        "change types ['recolour'] are not CLEVR-Change's ['color', 'material', 'add', 'drop', 'move', "
        "'distractor']: the score table gives each its own row"]
    table_pairs = [pair(i, f"b{i}.png", "recolour" if i < 2 else "move") for i in range(4)]
    monkeypatch_scores = {p.id: "x" for p in table_pairs}
    table = caption.score_table(monkeypatch_scores, table_pairs)
    assert table["sizes"] == {"total": 4, "move": 2, "recolour": 2}


def test_levir_cc_tiny_stage_1_and_stage_2_end_to_end_print_the_papers_table_scored_both_ways(tmp_path):
    """--data levir on a LEVIR-CC-form folder (write_levir), with a tiny CLIP of the synthetic vocabulary: stage 1
    adapts to the changed pairs, stage 2 trains on all, --eval prints the papers' table, ours and the field's."""
    root = write_levir(tmp_path / "levir")
    clip_file = write_tiny_clip(tmp_path / "clip", embed_dim=64)
    env = {**os.environ, "CLIP_BPE_PATH": str(tmp_path / "clip" / data.SYNTH_BPE_FILE)}  # the tiny CLIP's vocabulary

    def levir(script, *args):
        return subprocess.run([sys.executable, str(HERE / script), "--data", "levir", "--data_root", str(root),
                               "--num_workers", "0", *map(str, args)], cwd=HERE, capture_output=True, text=True,
                              timeout=300, env=env)

    stage_1 = levir("adapt.py", "--clip_model", clip_file, "--intra_layers", "1", "--out_dir", tmp_path / "adapt",
                    "--epochs", "1", "--batch_size", "8", "--eval_batch_size", "16")
    assert stage_1.returncode == 0, stage_1.stderr
    assert "20 training samples from 4 pairs" in stage_1.stdout  # the changed pairs' 5 captions each
    stage_2 = levir("caption.py", *TINY_DECODER[2:], "--encoder_ckpt", tmp_path / "adapt" / "ckpt_best.pt",
                    "--out_dir", tmp_path / "caption", "--epochs", "1", "--batch_size", "4")
    assert stage_2.returncode == 0, stage_2.stderr
    assert "8 training pairs" in stage_2.stdout  # the unchanged pairs too, with their captions
    table = stage_2.stdout[stage_2.stdout.index("x100 "):stage_2.stdout.index("S*m = (BLEU-4")]
    assert [line[:28] for line in table.splitlines()[1:7]] == [
        "whole test, ours           4", "whole test, field's        4", "change, ours               2",
        "change, field's            2", "no change, ours            2", "no change, field's         2"]
    scores = json.loads((tmp_path / "caption" / "test_scores.json").read_text())
    assert scores["field"]["sizes"] == {"whole test": 4, "change": 2, "no change": 2}
    assert scores["field"]["vocabulary"] == len(field.field_vocabulary(
        c for s in data.SPLITS for p in data.load_split("levir", s, root) for c in p.captions))
    written = (tmp_path / "caption" / "test_scores.txt").read_text()
    again = levir("caption.py", "--eval", "--out_dir", tmp_path / "caption")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "caption" / "test_scores.txt").read_text() == written and table in again.stdout
    page = PageParts((tmp_path / "caption" / results.PAGE_NAME).read_text())  # the results page: both scorings
    assert {name: row[1:] for name, row in page.tables["field"].items()} == {
        (name, way): [scores["field"][way][name][m] for m in metrics.field.FIELD_METRICS]
        for name in scores["field"]["sizes"] for way in ("project", "field")}
    assert sorted(c["data-type"] for c in page.cards) == [data.CHANGED] * 2 + [data.UNCHANGED] * 2


# --- faults, round four: waits, full caches, stops that say what is on disk, requeues, loader workers (BENCHMARKS §9) ---


def _by_hand(rank: int, port: int, wait=None) -> dict:
    """The environment of process `rank` of a run of two started by hand (no torchrun), on this machine."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return env | ({processes.PEER_WAIT_ENV: str(wait)} if wait is not None else {})


def test_a_process_started_by_hand_names_the_peer_that_never_came_within_its_wait_and_sigterm_ends_the_wait(
        synth40_root, tiny_adapt, tmp_path):
    args = ["--data_root", synth40_root, "--out_dir", tmp_path / "run"]
    started = time.time()
    alone = run_adapt(tiny_adapt, *args, env=_by_hand(0, _free_port(), wait=2))
    assert alone.returncode == 1 and "Traceback" not in alone.stderr and time.time() - started < 60, alone.stderr
    assert re.fullmatch(r"adapt.py: error: WORLD_SIZE=2, but RANK 1 never came to MASTER_ADDR:MASTER_PORT "
                        r"127.0.0.1:\d+ in 2 s: start it \(the same command with RANK=1 in its environment\), or "
                        r"launch with torchrun; CLIP4IDC_PEER_WAIT=SECONDS sets the wait",
                        alone.stderr.strip().splitlines()[-1])
    no_master = run_adapt(tiny_adapt, *args, env=_by_hand(1, _free_port(), wait=2))
    assert no_master.returncode == 1 and no_master.stderr.count("\n") == 1, no_master.stderr
    assert "RANK 1 found no RANK 0 at MASTER_ADDR:MASTER_PORT 127.0.0.1:" in no_master.stderr
    # the default wait (600 s), which SIGTERM ends at once
    process = subprocess.Popen([sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)], cwd=HERE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=_by_hand(0, _free_port()))
    said = process.stderr.readline()
    assert said.startswith("RANK 0 waits up to 600 s for RANK 1 of WORLD_SIZE 2 at MASTER_ADDR:MASTER_PORT"), said
    started = time.time()
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    process.wait(timeout=30)
    assert process.returncode == 143 and time.time() - started < 10
    assert re.fullmatch(r"adapt.py: terminated \(SIGTERM\) while RANK 0 waited for the other processes of the run at "
                        r"MASTER_ADDR:MASTER_PORT 127.0.0.1:\d+: nothing was started\n", rest), rest
    assert not (tmp_path / "run").exists()


def test_processes_started_by_hand_meet_in_a_store_of_their_own_and_a_stray_rank_or_a_taken_port_is_one_line(
        monkeypatch):
    script = ("import torch, adapt; from plumbing import processes\n"
              "dist_ = processes.setup(adapt.Config(device='cpu'))[0]\n"
              "total = torch.tensor([dist_.rank + 1.0]); torch.distributed.all_reduce(total)\n"
              "print(dist_.rank, dist_.world_size, int(total)); torch.distributed.destroy_process_group()\n")
    port = _free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", script], cwd=HERE, env=_by_hand(rank, port, wait=60),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (1, 0)]  # RANK 1 first: it waits for its master
    outputs = [process.communicate(timeout=120) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], outputs
    assert sorted(out for out, _ in outputs) == ["0 2 3\n", "1 2 3\n"]
    monkeypatch.setenv("RANK", "0")  # a stray RANK in a shell, without torchrun
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(flags.ConfigError, match=r"^RANK=0 is set in the environment, but not WORLD_SIZE, MASTER_ADDR, "
                                                r"MASTER_PORT, which torchrun sets with it: to train as one process, "
                                                r"unset RANK \(env -u RANK python \.\.\.\); as several, launch with "
                                                r"torchrun"):
        processes.setup(adapt.Config(device="cpu"))
    with socket.socket() as taken:  # another run's store, or any other program, on MASTER_PORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(name, _by_hand(0, taken.getsockname()[1])[name])
        with pytest.raises(flags.ConfigError, match=r"RANK 0 cannot serve the run's store at MASTER_ADDR:MASTER_PORT "
                                                    r"127.0.0.1:\d+: another process holds that port \(another run\?\); "
                                                    r"choose a free MASTER_PORT, or launch with torchrun --standalone"):
            processes.setup(adapt.Config(device="cpu"))


def test_a_full_disk_while_the_pair_features_or_the_intra_tokens_are_written_is_one_line_and_leaves_no_file(
        tmp_path, monkeypatch):
    pairs = [data.ImagePair(id="0", before=tmp_path / "b.png", after=tmp_path / "a.png", captions=["x"])]
    for path in (pairs[0].before, pairs[0].after):
        write_png(path, size=(64, 64))
    monkeypatch.setattr(os, "posix_fallocate", _no_space)  # the reservation fails, as on a full disk
    with pytest.raises(files.DiskFull, match=rf"^not enough space for {re.escape(str(tmp_path / 'features'))}/"
                                             rf"test_[0-9a-f]{{16}}\.npy: it needs .*, .* free; free some "
                                             rf"space there, or choose an --out_dir on a disk with room"):
        cached_pair_features(_tiny_encoder(), pairs, data.ImageReader(64), tmp_path / "features")  # not Bus error
    assert list((tmp_path / "features").iterdir()) == []
    with pytest.raises(files.DiskFull, match=rf"^not enough space for {re.escape(str(tmp_path / 'cache'))}/"
                                             rf"intra_tokens_[0-9a-f]{{16}}\.pt: it needs .*the intra-image tokens "
                                             rf"are kept beside the dataset's image cache"):
        caches.IntraTokens(_tiny_encoder(), pairs, data.ImageReader(64), 4, torch.device("cpu"),
                           contextlib.nullcontext(), tmp_path / "cache")  # not torch.save's "unexpected pos"
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_stop_on_an_epochs_last_step_or_during_its_validation_says_what_is_on_disk_once_it_is_there(
        tmp_path, monkeypatch):
    alone = processes.Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    monkeypatch.setattr(sys, "argv", ["adapt.py", "--data", "synth"])
    real_save, model = checkpoints.save_checkpoint, nn.Linear(2, 2)
    monkeypatch.setattr(checkpoints, "save_checkpoint", lambda state, path: (time.sleep(0.3), real_save(state, path)))

    def boundary(folder, resume=False, first_step=0):
        config = types.SimpleNamespace(log_every=100, save_every=100, resume=resume)
        run = loop.Run(config, alone, "float32", contextlib.nullcontext(), torch.amp.GradScaler("cpu", enabled=False),
                       folder)
        return loop.StepBoundary(run, steps_per_epoch=2, total_steps=4, first_step=first_step,
                                 state=lambda path: {"model": model.state_dict(), "step": step, "config": {}})

    with boundary(tmp_path / "a") as steps, pytest.raises(stopping.Interrupted) as stopped:
        for step in (1, 2):
            steps.after_step(step, 1e-3, torch.tensor(1.0), torch.tensor(1.0))
            steps.save_or_stop()
        steps.end_epoch(model)  # ckpt_last.pt at step 2, before the validation, on a slow disk
        steps.stop.note(signal.SIGTERM, None)  # SIGTERM during the validation
        steps.save(tmp_path / "a" / "ckpt_best.pt", tmp_path / "a" / "ckpt_last.pt")  # the validated epoch's files
        steps.stop_if_signalled()
    last = tmp_path / "a" / "ckpt_last.pt"
    assert str(stopped.value) == (f"terminated (SIGTERM): {last} holds step 2; continue with: python adapt.py "
                                  f"--data synth --resume")  # the validated file, once it is written
    assert "validated" not in torch.load(last, weights_only=True) and (tmp_path / "a" / "ckpt_best.pt").is_file()
    with boundary(tmp_path / "b") as steps, pytest.raises(stopping.Interrupted) as stopped:
        for step in (1, 2):
            if step == 2:
                steps.stop.note(signal.SIGTERM, None)  # during the epoch's last step: stop before validating
            steps.after_step(step, 1e-3, torch.tensor(1.0), torch.tensor(1.0))
            steps.save_or_stop()
        steps.end_epoch(model)
    last = tmp_path / "b" / "ckpt_last.pt"
    assert str(stopped.value) == (f"terminated (SIGTERM): {last} holds step 2, the end of an epoch not yet validated "
                                  f"(the resumed run validates it first); continue with: python adapt.py --data synth "
                                  f"--resume")
    resumed = boundary(tmp_path / "b", resume=True, first_step=2)
    assert resumed.pending_validation and resumed.position(2) == (0, 2)  # epoch 1, all its steps done: validate it
    assert not resumed.pending_validation and resumed.position(2) == (1, 0)


def test_stdout_going_away_a_closed_pipe_or_a_full_device_loses_no_step(synth40_root, tiny_adapt, tmp_path):
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, "--data_root", str(synth40_root), "--epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    piped = subprocess.Popen([*command, "--out_dir", str(tmp_path / "piped")], cwd=HERE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(3):  # `python adapt.py ... | head -3`: the reader leaves after three lines
        piped.stdout.readline()
    piped.stdout.close()
    stderr = piped.stderr.read()
    assert piped.wait(timeout=240) == 0 and "Traceback" not in stderr, stderr
    assert "adapt.py: note: stdout is gone (Broken pipe): the run goes on without it" in stderr
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC, from the first line on
        result = subprocess.run([*command, "--out_dir", str(tmp_path / "full")], cwd=HERE, stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=240, env=env)
    assert result.returncode == 0 and "stdout is gone (No space left on device)" in result.stderr, result.stderr
    for name in ("piped", "full"):  # every step trained, saved and scored
        assert torch.load(tmp_path / name / "ckpt_last.pt", weights_only=True)["step"] == 22
        assert (tmp_path / name / "test_retrieval.json").is_file()


def test_an_image_unreadable_during_validation_saves_the_epoch_first_and_the_resumed_run_is_the_uninterrupted_one(
        synth40_root, tiny_adapt, tmp_path):
    root = shutil.copytree(synth40_root, tmp_path / "synth", ignore=shutil.ignore_patterns(".cache"))
    splits = {s: data.load_split("synth", s, root) for s in data.SPLITS}
    elsewhere = {p for s in ("train", "test") for pair in splits[s] for p in (pair.before, pair.after, pair.distractor)}
    image = next(p for pair in splits["val"] for p in (pair.after, pair.before) if p not in elsewhere)
    good = image.read_bytes()
    image.write_bytes(good[:len(good) // 2] + bytes(64) + good[len(good) // 2 + 64:])  # a stale mount's read
    args = ["--data_root", root, "--epochs", "2", "--no-image_cache"]  # validation decodes its images
    out = tmp_path / "stopped"
    stopped = run_adapt(tiny_adapt, *args, "--out_dir", out)
    assert stopped.returncode == 1 and stopped.stderr.count("\n") == 1, stopped.stderr
    assert stopped.stderr.startswith(f"adapt.py: error: image {image} is corrupt")
    assert f"; stopped while validating: {out / 'ckpt_last.pt'} holds step 22, the end of an epoch not yet " \
           f"validated (the resumed run validates it first); continue with: " in stopped.stderr
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["validated"] is False
    image.write_bytes(good)
    resumed = run_adapt(tiny_adapt, *args, "--out_dir", out, "--resume")
    assert resumed.returncode == 0 and "epoch 1 validation" in resumed.stdout, resumed.stderr
    assert run_adapt(tiny_adapt, *args, "--out_dir", tmp_path / "whole").returncode == 0
    same_run_files(tmp_path / "whole", out, "test_retrieval.json")


def test_sigusr1_saves_at_the_step_boundary_as_sigterm_does_and_exits_138(synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, "--data_root", str(synth40_root), "--out_dir",
               str(out), "--epochs", "20", "--save_every", "100"]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_log_step(process, out, 2)
    process.send_signal(signal.SIGUSR1)  # Slurm's --signal=USR1@90: checkpoint now
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 138 and "Traceback" not in stderr, stderr
    step = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    assert stderr.strip().splitlines()[-1] == (
        f"adapt.py: stopped by SIGUSR1 (a scheduler's notice before the job's end, Slurm's --signal): "
        f"{out / 'ckpt_last.pt'} holds step {step}; continue with: {shlex.join(['python', *command[1:], '--resume'])}")


def test_resume_auto_starts_a_first_run_and_continues_it_after_a_stop_with_the_same_command(synth40_root, tiny_adapt,
                                                                                            tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, str(HERE / "adapt.py"), *tiny_adapt, "--data_root", str(synth40_root), "--out_dir",
               str(out), "--epochs", "3", "--resume", "auto"]  # one command for a job's start and its requeue
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_log_step(process, out, 3)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    step = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    assert process.returncode == 143 and stderr.strip().endswith(
        f"continue with: {shlex.join(['python', *command[1:-2], '--resume'])}"), stderr
    again = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=240, env=env)
    assert again.returncode == 0 and f"resumed {out / 'ckpt_last.pt'} at step {step}" in again.stdout, again.stderr
    assert json.loads((out / "config.json").read_text())["resume"] is True  # what it did, not "auto"
    none = run_adapt(tiny_adapt, "--data_root", synth40_root, "--out_dir", tmp_path / "none", "--resume")
    assert none.returncode == 1 and f"--resume: there is no {tmp_path / 'none' / 'ckpt_last.pt'} to continue; start " \
                                    f"without --resume, or pass --resume auto" in none.stderr


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_torchrun_restart_after_a_killed_worker_resumes_with_resume_auto_in_a_store_of_its_own(
        synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
               str(HERE / "adapt.py"), *tiny_adapt, "--data_root", str(synth40_root), "--out_dir", str(out),
               "--epochs", "6", "--save_every", "4", "--resume", "auto"]
    agent = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "ckpt_last.pt").exists():
            time.sleep(0.02)
        os.kill(max(_children(agent.pid)), signal.SIGKILL)  # a worker killed (the OOM killer, a lost GPU)
        output = agent.communicate(timeout=240)[0]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 0, output[-3000:]
    assert re.search(rf"resumed {re.escape(str(out / 'ckpt_last.pt'))} at step \d+", output)  # not "Connection refused"
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["step"] == 6 * 22
    assert (out / "test_retrieval.json").is_file()


class _Unsendable:
    """A sample that no worker can hand over, as when no file descriptor is left (ulimit -n): pickling it fails."""

    def __reduce__(self):
        raise OSError(errno.EMFILE, "Too many open files")


class _LoaderFault(torch.utils.data.Dataset):
    """Eight samples; from `after` on, the fault `how`: a sample no worker can hand over, a full /dev/shm, the
    worker killed, or a read that never ends."""

    def __init__(self, how: str, after: int = 0):
        self.how, self.after = how, after

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i >= self.after:
            if self.how == "hand over":
                return _Unsendable()
            if self.how == "shared memory":  # what torch says when a worker's batch does not fit in /dev/shm
                raise RuntimeError("unable to write to file </torch_1_2_3>: No space left on device (28)")
            if self.how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hangs":
                time.sleep(60)
        return torch.zeros(2)


def _fault_loader(how: str, after: int = 0):
    dataset = _LoaderFault(how, after)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    return batches.training_loader(dataset, sampler, 2, 1, torch.device("cpu"), lambda samples: samples)


def test_loader_workers_that_die_cannot_start_or_cannot_hand_over_a_batch_end_in_one_line_naming_the_fix(
        monkeypatch):
    for how, expected in (("hand over", r"^the DataLoader's worker processes ran out of file descriptors \(Too many "
                                        r"open files; ulimit -n is \d+\).* Raise the limit \(ulimit -n 65536 before "
                                        r"the command\), or train with --num_workers 0"),
                          ("shared memory", r"^the DataLoader's worker processes ran out of shared memory \(/dev/shm "
                                            r".*docker run --shm-size=8g .*--num_workers 0"),
                          ("killed", r"^a DataLoader worker process died \(worker \(pid.*; the out-of-memory killer "
                                     r".*: train with fewer --num_workers, or --num_workers 0")):
        with pytest.raises(stopping.LoaderError, match=expected):  # a DataError: the loops save their last step
            next(batches.epoch_batches(_fault_loader(how), 0, 0, 1))  # a batch that never comes: no wait for ever
    def no_fork(self):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_fork)  # ulimit -u, a container's pids
    with pytest.raises(stopping.LoaderError, match=r"^the DataLoader's worker processes could not start \(Resource "
                                                   r"temporarily unavailable\): .*--num_workers 0.*ulimit -u"):
        next(batches.epoch_batches(_fault_loader("none"), 0, 0, 1))
    monkeypatch.undo()
    assert stopping.loader_failure(RuntimeError("DataLoader worker (pid 7) is killed by signal: Bus error. It is "
                                                "possible that dataloader's workers are out of shared memory.")) \
        .startswith("the DataLoader's worker processes ran out of shared memory")  # Docker's 64 MB, unreserved
    with pytest.raises(SystemExit) as exit_:  # the evaluation's loaders: one line all the same
        stopping.run_main(lambda: next(iter(torch.utils.data.DataLoader(_LoaderFault("shared memory"),
                                                                        num_workers=1))), "x.py")
    assert exit_.value.code == 1


def test_a_signal_while_the_loop_waits_for_a_batch_saves_the_last_step_and_stops_at_once(tmp_path, monkeypatch):
    alone = processes.Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    monkeypatch.setattr(sys, "argv", ["adapt.py"])
    config = types.SimpleNamespace(log_every=100, save_every=100, resume=False)
    run = loop.Run(config, alone, "float32", contextlib.nullcontext(), torch.amp.GradScaler("cpu", enabled=False),
                   tmp_path)
    loader = _fault_loader("hangs", after=2)  # the first batch comes, the second never does
    with pytest.raises(stopping.Interrupted) as stopped:
        with loop.StepBoundary(run, 4, 4, 0, lambda path: {"model": {}, "step": step, "config": {}}) as boundary:
            batches_of_epoch = boundary.epoch_batches(loader, 0, 0, 1)
            next(batches_of_epoch)
            step = 1
            boundary.after_step(step, 1e-3, torch.tensor(1.0), torch.tensor(1.0))
            boundary.save_or_stop()
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # Slurm's, while it waits
            started = time.time()
            next(batches_of_epoch)
    assert time.time() - started < 10 and stopped.value.status == 143
    assert str(stopped.value) == (f"terminated (SIGTERM): {tmp_path / 'ckpt_last.pt'} holds step 1; continue with: "
                                  f"python adapt.py --resume")


def test_an_out_dir_deleted_during_the_run_keeps_the_model_in_memory_and_the_resumed_run_finishes(
        synth40_root, tiny_adapt, tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth40_root, "--out_dir", out, "--epochs", "3"]
    process = subprocess.Popen([sys.executable, str(HERE / "adapt.py"), *tiny_adapt, *map(str, args)], cwd=HERE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_log_step(process, out, 26)  # in the second epoch: the first one's ckpt_best.pt is on disk
    out.rename(tmp_path / "deleted")  # `rm -rf runs/...` as one step: the path names no folder of the run's now
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1 and stderr.count("\n") == 1, stderr
    state = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert state["step"] > 26 and state["best_epoch"] == -1  # the model in memory, without the best epoch it lost
    assert stderr == (f"adapt.py: error: {out} was deleted during the run, with its checkpoints and log: the model in "
                      f"memory is saved there again, {out / 'ckpt_last.pt'} at step {state['step']}, but the best "
                      f"epoch so far went with the folder (the resumed run chooses one among the epochs still to "
                      f"come); continue with: {shlex.join(['python', str(HERE / 'adapt.py'), *tiny_adapt, *map(str, args), '--resume'])}\n")
    resumed = run_adapt(tiny_adapt, *args, "--resume")
    assert resumed.returncode == 0 and (out / "test_retrieval.json").is_file(), resumed.stderr


_KILLED = {}  # _killed_while_decoding's image, and the process that is not killed


def _killed_while_decoding(path):
    """check.image_check, but the decoding process of one image is killed, as the out-of-memory killer would."""
    if path == _KILLED["image"] and os.getpid() != _KILLED["parent"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return _KILLED["check"](path)


def test_check_goes_on_in_its_own_process_when_a_decoding_process_is_killed(clevr_root, synth_root, monkeypatch,
                                                                            capsys):
    shutil.copy(synth_root / data.SYNTH_BPE_FILE, clevr_root)
    monkeypatch.setattr(check, "CHECK_PARALLEL_MIN", 4)  # 15 images: decoded by 2 processes, as a large dataset is
    monkeypatch.setattr(check, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sys.modules[__name__], "_KILLED", {"image": sorted(clevr_root.glob("*/*.png"))[6],
                                                           "parent": os.getpid(), "check": check.image_check})
    monkeypatch.setattr(check, "image_check", _killed_while_decoding)
    assert check_command(monkeypatch, "--data", "synth", "--data_root", str(clevr_root)) == 0  # it used to hang
    captured = capsys.readouterr()
    assert "check.py: note: a decoding process died (killed: out of memory?) after " in captured.err
    assert captured.out.endswith("complete: every split reads, every image opens\n")


def test_levir_cc_split_names_valid_and_capitals_are_read_with_a_line_others_refused_and_the_file_read_named(
        tmp_path, capsys):
    root = write_levir(tmp_path / "levir")
    content = json.loads((root / "LevirCCcaptions.json").read_text())
    for record in content["images"]:  # the names other copies of the file write
        record["split"] = {"val": "valid", "test": "Test"}.get(record["split"], record["split"])
    write_json(root / "LevirCCcaptions.json", content)
    capsys.readouterr()
    assert [len(data.load_split("levir", s, root)) for s in data.SPLITS] == [8, 2, 4]  # none dropped
    out = capsys.readouterr().out
    assert 'LEVIR-CC: 2 record(s) of LevirCCcaptions.json with "split": "valid" read as val\n' in out
    assert 'LEVIR-CC: 4 record(s) of LevirCCcaptions.json with "split": "Test" read as test\n' in out
    content["images"][0]["split"] = "extra"
    write_json(root / "LevirCCcaptions.json", content)
    with pytest.raises(data.DataError, match=r'LevirCCcaptions.json, record 0: split "extra" is none of train, val, '
                                             r'test \(or valid, validation; in any case\): correct it there'):
        data.load_split("levir", "test", root)
    content["images"][0]["split"] = "train"
    write_json(root / "LevirCCcaptions.json", content)
    write_json(root / "LevirCCcaptions_v1.json", content)
    data.load_split("levir", "train", root)
    assert f"LEVIR-CC: {root} holds both LevirCCcaptions.json and LevirCCcaptions_v1.json; reading " \
           f"LevirCCcaptions.json (move it away to read the other)\n" in capsys.readouterr().out


def test_a_float_image_of_0_to_255_is_read_and_one_past_255_refused_in_training_and_by_check(tmp_path):
    grey = np.array([[0, 64, 255]], np.float32)
    Image.fromarray(grey, "F").save(tmp_path / "a.tif")  # a float TIFF on the 8-bit scale: it read all white
    assert np.asarray(data.load_image(tmp_path / "a.tif"))[0, :, 0].tolist() == [0, 64, 255]
    Image.fromarray(grey * 10, "F").save(tmp_path / "b.tif")  # 0..2550: on no scale that can be told
    with pytest.raises(data.DataError, match=r"^image .*b.tif holds floats up to 2550, past both scales float images "
                                             r"are written on \(0..1, 0..255\): save it as an 8-bit PNG"):
        data.load_image(tmp_path / "b.tif")
    assert check.image_problem(tmp_path / "a.tif") is None
    assert check.image_problem(tmp_path / "b.tif").startswith("holds floats up to 2550")  # check.py called it fine


def test_check_on_levir_cc_has_no_clevr_change_note_and_calls_a_split_of_unchanged_pairs_incomplete_as_stage_1_does(
        tmp_path, synth_root, monkeypatch, capsys):
    monkeypatch.setenv("CLIP_BPE_PATH", str(synth_root / data.SYNTH_BPE_FILE))
    root = write_levir(tmp_path / "levir")
    content = json.loads((root / "LevirCCcaptions.json").read_text())
    content["images"] = [levir_record("val", r["imgid"], changed=False) if r["split"] == "val" else r
                         for r in content["images"]]
    write_json(root / "LevirCCcaptions.json", content)
    assert check_command(monkeypatch, "--data", "levir", "--data_root", str(root)) == 1
    out = capsys.readouterr().out
    assert "    no change pairs: stage 1 (adapt.py) adapts to the change pairs alone, and needs one in every split\n" \
           in out and "; val: no change pairs" in out.splitlines()[-1]
    assert "note: change types" not in out  # LEVIR-CC's two kinds are its own table's rows
    val = data.adaptation_pairs(data.load_split("levir", "val", root))
    with pytest.raises(data.DataError, match=r"the val split of levir in .* has no changed pairs \(2 unchanged, which "
                                             r"stage 1 leaves out: their captions tell no pair apart\)"):
        stopping.refuse_empty_splits({"val": val}, ("val",), types.SimpleNamespace(data="levir", data_root=str(root)))


# --- the reference's released weights, through the commands ---


def run_clevr(script, root, *args, **kwargs):
    """A script on a CLEVR-Change-layout folder, with OpenAI's vocabulary (the reference's) from tests/clip_vectors."""
    env = {**os.environ, "CLIP_BPE_PATH": str(vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz")),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(HERE / script), "--data", "clevr", "--data_root", str(root),
                           "--intra_layers", "3", "--num_workers", "0", *map(str, args)], cwd=HERE,
                          capture_output=True, text=True, timeout=300, env=env, **kwargs)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Tiny releases of both stages in the reference's format, OpenAI's vocabulary (49,408 ids)."""
    folder = tmp_path_factory.mktemp("release")
    for stage, name in ((1, "pretrained"), (2, "trained")):
        (folder / name).mkdir()
        torch.save(reference_release(stage, seed=stage, vocab=49408), folder / name / "pytorch_model.bin.clevr")
    return {1: folder / "pretrained" / "pytorch_model.bin.clevr", 2: folder / "trained" / "pytorch_model.bin.clevr"}


def release_captions(path, root) -> dict[str, str]:
    """The release's greedy captions of the test split, computed here step by step: its encoder and decoder,
    the pairs resized to 224 (here 64) and normalised, 32 greedy steps, cut at EOT and then at '!'."""
    state = torch.load(path, weights_only=True)
    pair_encoder = from_checkpoint(release_checkpoint(state, intra_layers=3))
    decoder = caption.release_decoder(state, 2 * (pair_encoder.n_patches + 1))
    tokenizer = clip.get_tokenizer(vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz"))
    images = data.ImageReader(pair_encoder.clip.visual.input_resolution)
    captions = {}
    for pair in data.evaluation_pairs(data.load_split("clevr", "test", root), use_no_change_pair=True):
        with torch.no_grad():
            before, after = (clip.normalize(images(path)[None]) for path in (pair.before, pair.after))  # (1, 3, R, R)
            visual = pair_encoder.encode_pair(before, after)["pair_tokens"]
            ids = decoder.greedy_decode(visual, tokenizer.sot_id, tokenizer.eot_id, max_len=32)[0]
        captions[pair.id] = ids_to_text(ids, tokenizer.decode, tokenizer.eot_id)
    return captions


def test_the_released_captioner_evaluates_and_captions_a_pair_as_its_own_model_does(releases, clevr_root, tmp_path):
    result = run_clevr("caption.py", clevr_root, "--eval", "--checkpoint", releases[2], "--out_dir", tmp_path)
    assert result.returncode == 0, result.stderr
    predictions = {p["image_id"]: p["caption"] for p in json.loads((tmp_path / "test_predictions.json").read_text())}
    assert predictions == release_captions(releases[2], clevr_root)  # the change pair and its distractor pair
    assert (tmp_path / "test_scores.json").is_file() and (tmp_path / "test_grid.png").is_file()
    pair = data.load_split("clevr", "test", clevr_root)[0]
    one = run_clevr("caption.py", clevr_root, "--pair", pair.before, pair.after, "--checkpoint", releases[2],
                    "--explain", tmp_path / "explain.png")
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines()[0] == predictions[pair.id] and (tmp_path / "explain.png").is_file()


def test_stage_2_trains_on_the_released_stage_1_weights(releases, clevr_root, tmp_path):
    result = run_clevr("caption.py", clevr_root, "--encoder_ckpt", releases[1], "--out_dir", tmp_path, "--epochs", 1,
                       "--batch_size", 2, "--decoder_layers", 1, "--decoder_heads", 2, "--decoder_ffn", 64)
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "ckpt_best.pt", weights_only=True)
    assert state["encoder_sha256"] == clip_files.sha256_of(releases[1]) and (tmp_path / "test_scores.json").is_file()


def test_adapt_scores_the_released_stage_1_weights_on_the_test_split(releases, clevr_root, tmp_path):
    result = run_clevr("adapt.py", clevr_root, "--eval", "--checkpoint", releases[1], "--out_dir", tmp_path)
    assert result.returncode == 0, result.stderr
    scores = json.loads((tmp_path / "test_retrieval.json").read_text())
    assert scores["checkpoint"] == str(releases[1]) and 0 <= scores["text_to_pair_R1"] <= 100


def test_adapt_scores_a_released_stage_1_in_ieee_float32_with_tf32_off_as_caption_does(releases, clevr_root, tmp_path,
                                                                                       monkeypatch):
    seen = {}

    def evaluate(model, split, tokenizer, images, config, device, ctx):  # what the test split is scored under
        seen.update(tf32=torch.backends.cuda.matmul.allow_tf32, autocast=not isinstance(ctx, contextlib.nullcontext))
        return {"text_to_pair_R1": 0.0}

    monkeypatch.setattr(adapt, "evaluate", evaluate)
    monkeypatch.setenv("CLIP_BPE_PATH", str(vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz")))
    config = adapt.Config(data="clevr", data_root=str(clevr_root), intra_layers=3, num_workers=0, eval=True,
                          checkpoint=str(releases[1]))
    alone = processes.Distributed(False, 0, 0, 1, torch.device("cpu"), True)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        processes.set_tf32(True)  # what setup() leaves on a GPU with --tf32, the default
        adapt.evaluate_checkpoint(loop.Run(config, alone, "bfloat16", torch.autocast("cpu", dtype=torch.bfloat16),
                                           None, tmp_path))
        assert seen == {"tf32": False, "autocast": False} and torch.backends.cuda.matmul.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_file_that_is_neither_ours_nor_a_release_is_refused_in_one_line(releases, clevr_root, tmp_path):
    notes = tmp_path / "notes.bin"
    notes.write_text("not weights")
    for args in (("--eval", "--checkpoint", notes), ("--encoder_ckpt", notes)):
        result = run_clevr("caption.py", clevr_root, *args, "--out_dir", tmp_path)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert str(notes) in result.stderr and "CLIP4IDC release file" in result.stderr
    stage_1_as_captioner = run_clevr("caption.py", clevr_root, "--eval", "--checkpoint", releases[1])
    assert stage_1_as_captioner.returncode == 1 and "--encoder_ckpt" in stage_1_as_captioner.stderr


# ======== explain.py ========

def test_attention_weights_are_a_distribution_over_keys_with_masked_keys_at_zero():
    torch.manual_seed(0)
    query, keys, values = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)  # (B, H, T, d)
    weights = explain.attention_weights(query, keys, causal=True)  # (B, H, T, S)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3, 5))
    assert (weights.triu(diagonal=1) == 0).all()  # a later key is masked
    # the same weights as the fused kernel uses: weights @ values is its output
    fused = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True)
    assert torch.allclose(weights @ values, fused, atol=1e-5)
    mask = torch.tensor([True, False, True, True, False])  # a padding-style mask over the keys
    weights = explain.attention_weights(query, keys, mask=mask)
    assert (weights[..., ~mask] == 0).all() and torch.allclose(weights.sum(-1), torch.ones(2, 3, 5))


def tiny_pair_models():
    torch.manual_seed(0)
    config = clip.CLIPConfig(embed_dim=32, image_resolution=64, vision_layers=4, vision_width=64, vision_patch_size=16,
                             context_length=77, vocab_size=300, transformer_width=32, transformer_heads=1,
                             transformer_layers=1)
    encoder = PairEncoder(clip.CLIP(config), EncoderConfig(intra_layers=2)).eval()
    decoder = CaptionDecoder(DecoderConfig(hidden=32, heads=4, ffn=64, vocab_size=300,
                                           visual_tokens=2 * (encoder.n_patches + 1))).eval()
    return encoder, decoder


def test_reading_attention_out_changes_neither_the_pair_tokens_nor_the_caption():
    encoder, decoder = tiny_pair_models()
    before, after, caption_in = torch.randn(3, 3, 64, 64), torch.randn(3, 3, 64, 64), torch.randint(0, 298, (3, 6))
    with torch.no_grad():
        tokens = encoder.encode_pair(before, after)["pair_tokens"]  # (B, L, E)
        logits = decoder(tokens, caption_in)  # (B, T, V)
    seen = explain.encoder_attention(encoder, before, after)
    assert torch.equal(seen["pair_tokens"], tokens)
    n = encoder.n_patches  # 16 patches per image; 2 inter-image blocks
    assert seen["intra"].shape == (3, 2, n + 1) and seen["inter"].shape == (3, 2, 2, 2 * (n + 1))
    assert torch.allclose(seen["inter"].sum(-1), torch.ones(3, 2, 2)) and torch.allclose(seen["intra"].sum(-1),
                                                                                         torch.ones(3, 2))
    caption, cross = explain.decode_with_attention(decoder, tokens, 298, 299, max_len=10)
    assert torch.equal(caption, decoder.greedy_decode(tokens, 298, 299, max_len=10))
    assert cross.shape == (3, caption.shape[1], 3, 2 * (n + 1))  # (B, S, layers, M)
    assert torch.allclose(cross.sum(-1), torch.ones(cross.shape[:3]))
    assert not any(m._forward_hooks for m in [*encoder.modules(), *decoder.modules()])  # nothing left behind
    with torch.no_grad():
        assert torch.equal(decoder(tokens, caption_in), logits)


def test_pointing_game_on_a_hand_made_map_and_box():
    # a 480 x 320 image in a 7 x 7 grid: patches of 68.6 x 45.7 pixels; this box lies in row 1, column 2
    target = explain.box_patches([140, 50, 60, 40], 480, 320, grid=7)
    assert np.flatnonzero(target).tolist() == [1 * 7 + 2]
    # a box over a patch corner touches four patches
    assert np.flatnonzero(explain.box_patches([60, 40, 20, 10], 480, 320, grid=7)).tolist() == [0, 1, 7, 8]
    patch_map = np.zeros(2 * 49)  # [before patches; after patches]
    patch_map[49 + 9] = 1.0  # the after image's patch at row 1, column 2
    assert explain.pointing_hit(patch_map, target)
    patch_map[10] = 2.0  # now the before image's patch beside it is the highest
    assert not explain.pointing_hit(patch_map, target)
    table = explain.localisation_table({"inter": {"color": [True, False], "add": [True]}},
                                       {"color": [0.1, 0.3], "add": [0.4]})
    assert table["color"] == pytest.approx({"pairs": 2, "chance": 20.0, "inter": 50.0})
    assert table["semantic change"] == pytest.approx({"pairs": 3, "chance": 80 / 3, "inter": 200 / 3})


# ======== bench/ ========


def test_bench_clip_prints_the_image_tower_rate_and_the_tokenizer_rates_cold_and_warm(capsys):
    vocabulary = vectors("clip_vectors", "bpe_simple_vocab_16e6.txt.gz")
    # the cheapest figure, on tiny inputs: a full-size ViT-B/32 timed once on one image, 20 captions tokenized;
    # the thread count is the one already set, so the call leaves it as it was
    bench.main(["clip", "--bpe-path", str(vocabulary), "--threads", str(torch.get_num_threads()),
                "--batch", "1", "--repeats", "1", "--captions", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "best of 1 runs" in lines[0]
    assert lines[1].startswith("ViT-B/32 image tower, batch 1, float32: ") and " images/s (" in lines[1]
    assert [line.split(":")[0] for line in lines[2:]] == [
        "tokenizer, 20 CLEVR-style captions, cold (empty encode cache)",
        "tokenizer, 20 CLEVR-style captions, warm (every word cached)"]
    assert all(line.endswith(" per CPU-second)") for line in lines[1:])


def test_bench_operator_clock_times_every_aten_operator_of_the_forward_and_the_backward():
    a, b = torch.randn(8, 4, requires_grad=True), torch.randn(4, 3)
    clock = bench.OperatorClock()
    with clock:
        (a @ b).sum().backward()
    assert clock.calls["mm"] == 2  # the product, and in the backward the gradient of a (b needs none)
    assert clock.calls["sum"] == 1 and all(seconds >= 0 for seconds in clock.seconds.values())
    lines = clock.table().splitlines()
    assert lines[0].split() == ["operator", "ms", "share", "calls"] and lines[-1].startswith("all operators")
    assert len(lines) == len(clock.seconds) + 2
    assert clock.product_calls == {("mm", ((8, 4), True), ((4, 3), True)): 1,   # a @ b
                                   ("mm", ((8, 3), False), ((3, 4), False)): 1}  # grad @ b.T, grad expanded ones
    rows = bench.product_rates(clock).splitlines()[1:]  # by time, so in either order
    assert sorted(" ".join(row.split()[:6]) for row in rows) == ["mm (8, 3)ᵀ x (3, 4)ᵀ", "mm (8, 4) x (4, 3)"]
    assert all(float(row.split()[-1]) >= 0 and float(row.split()[-2]) >= 0 for row in rows)  # rates (tiny here)


def test_bench_gpu_tiny_runs_every_part_of_the_gpu_run_in_its_order_and_folders_and_none_fails(tmp_path):
    out = tmp_path / "gpu"
    (out / "failures.log").parent.mkdir()
    (out / "failures.log").write_text("an earlier run's\n")  # replaced, not appended to
    result = bench.gpu_figures(str(out), tiny=True)
    assert json.loads((out / "gpu.json").read_text()) == json.loads(json.dumps(result))
    assert result["dtype_auto"] == "float32" and result["device"] == "cpu"
    assert result["failed"] == [], ((out / "failures.log").read_text() if (out / "failures.log").exists() else "")
    assert not (out / "failures.log").exists()
    stage1 = [f"stage1 float32 {n} per GPU" for n in bench.STAGE1_PER_GPU]
    stage2 = [f"{stage} {dtype}" for stage in ("stage2_cached", "stage2_finetune")
              for dtype in ("bfloat16", "float16", "float32")]
    parts = ["card commands", "torchrun", "checkpoint save", "loader image cache", "loader PNG", "loader resident",
             "decoding",
             "decoding static", *stage2, *stage1, "stage1 float16", "stage1 float32", "stage1 float32 captured",
             "stage2_cached float32 captured", "stage1 compiled"]
    assert [name for name in result if name in parts or name.startswith("stage")] == parts  # the GPU run's order
    card, torchrun = result["card commands"], result["torchrun"]
    assert all(card[c]["exit_status"] == 0 for c in ("adapt", "caption")) and "runs/caption_synth/ckpt_best.pt" in card["files"]
    assert torchrun["adapt --resume"]["resumed"] and torchrun["caption"]["exit_status"] == 0
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["card", "loader", "save", "torchrun"]
    assert all(result[name]["ms_per_step"] > 0 and result[name]["flops_per_step"] > 0 for name in stage1 + stage2)
    assert result["loader image cache"]["pairs_per_s"] > 0 and result["decoding"]["captions_per_s"] > 0
    assert result["decoding static"]["captions_per_s"] > 0 and result["loader resident"]["pairs_per_s"] > 0
    margins = result["loaders over the step's demand"]  # each source's pairs/s over the step's (the eager one here)
    step_demand = 2 * 1000 / result["stage1 float32 128 per GPU"]["ms_per_step"]  # --tiny: 2 pairs a step
    assert margins["resident"] == round(result["loader resident"]["pairs_per_s"] / step_demand, 2)
    # each step's operations and its host issue time (on a GPU also the GPU's time beside it)
    assert all(result[name]["ops_per_step"] > 100 and result[name]["host_issue_ms"] > 0 for name in stage1 + stage2)
    assert result["stage1 float32 captured"] == {"not_run": "a CUDA graph needs a GPU"}


def test_a_failed_gpu_part_is_recorded_with_its_whole_output_and_the_later_parts_still_run(tmp_path, monkeypatch):
    runs = bench.ScriptRuns(tmp_path / "part", tmp_path / "failures.log", timeout_s=5)
    quick = runs("fails", [sys.executable, "-c", "import sys; print('said before'); sys.exit('the reason')"])
    slow = runs("hangs", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])
    assert quick["exit_status"] == 1 and quick["last_line"] == "the reason"
    assert slow["exit_status"] == "timed out after 5 s" and slow["seconds"] < 30
    log = (tmp_path / "failures.log").read_text()
    assert "===== fails" in log and "said before" in log and "the reason" in log and "===== hangs" in log
    assert "started" in log and bench.failed({"torchrun": {"adapt": quick}}) and not bench.failed({"x": {"exit_status": 0}})


def test_gpu_peaks_are_the_data_sheets_dense_figures_tf32_included():
    assert bench.gpu_peak("NVIDIA H100 80GB HBM3") == (989, 989, 495)
    assert bench.gpu_peak("NVIDIA H100 PCIe") == (756, 756, 378)
    assert bench.gpu_peak("Tesla V100-SXM2-32GB") == (None, 125, None) and bench.gpu_peak("NVIDIA H200")[2] == 495
    assert bench.gpu_peak("NVIDIA A100-SXM4-80GB") == (312, 312, 156) and bench.gpu_peak("NVIDIA A10G")[0] == 125
    assert bench.gpu_peak("a GPU nobody listed") == (None, None, None)


def test_bench_synth_counts_both_synth_steps_flops_and_their_fraction_of_the_matmul_rate():
    # the synth preset's real model sizes, one timed step and one profiled step each; the counts do not depend on
    # the machine
    result = bench.synth_steps(threads=torch.get_num_threads(), steps=1, caption_length=4, profile=1)
    for stage in ("stage1", "stage2"):
        figures = result[stage]
        assert figures["gflop_per_step"] > 1 and figures["step_ms"] > 0
        assert figures["fraction_of_matmul"] == pytest.approx(figures["gflop_per_s"] / result["matmul_gflop_per_s"],
                                                              abs=0.002)
        products = figures["matrix_products"]  # the products' own rate, from the profile's clock
        assert 0 < products["share_of_operator_time"] < 1 and products["gflop_per_s"] > 0
    # stage 2 runs the inter-image blocks on 64 pairs (change + distractor) and a decoder; stage 1 on 128 pairs
    assert result["stage2"]["gflop_per_step"] != result["stage1"]["gflop_per_step"]


def test_bench_stamped_run_logs_both_streams_line_by_line_with_the_seconds_since_the_start(tmp_path, capsys):
    child = ("import sys, time; print('one'); time.sleep(0.3); print('two', file=sys.stderr); "
             "ballast = bytearray(200_000_000); sys.exit(3)")
    t0 = time.time() - 100  # the command started 100 s before this script
    result = bench.stamped_run([sys.executable, "-u", "-c", child], tmp_path, dict(os.environ), tmp_path / "x.log", t0)
    lines = bench.read_stamped(tmp_path / "x.log")
    assert [text for _, text in lines] == ["one", "two"]
    assert 100 < lines[0][0] < lines[1][0] - 0.25 and lines[1][0] < 100 + result["wall_s"] + 0.1
    assert result["exit_status"] == 3 and result["peak_rss_gb"] >= 0.2  # the child's 200 MB counted, as time -v does
    assert capsys.readouterr().out.splitlines() == (tmp_path / "x.log").read_text().splitlines()  # echoed


def test_bench_phases_are_cut_at_the_lines_the_scripts_print_and_an_unknown_end_merges_two_phases():
    adapt_lines = [(1.0, "synth.py: drawing the synthetic dataset (40 pairs, seed 0) into data/synth"),
                   (30.0, "intra-image tokens of 90 training images computed once (8 s): the intra-image blocks are frozen"),
                   (30.5, "180 training samples from 30 pairs; global batch 8 = 8 x 1 processes x 1 accumulation"),
                   (31.5, "step 20/40 | epoch 1/2 | loss 1.866 | 50 ms/step | eta 0m01s"),
                   (32.5, "epoch 1 validation: text_to_pair_R1 56.7 (best so far)"),
                   (33.0, "step 40/40 | epoch 2/2 | loss 1.329 | 60 ms/step | eta 0m00s"),
                   (33.5, "test retrieval of the best epoch (1, chosen on validation):")]
    caption_lines = [(36.0, "intra-image tokens of 90 training images read from x.pt (0 s)"),
                     (37.0, "30 training pairs; global batch 8 = 8 x 1 processes x 1 accumulation; 6 steps per epoch"),
                     (38.0, "step 3/6 | epoch 1/2 | loss 12.55 | 300 ms/step | eta 0m01s"),
                     (39.0, "step 6/6 | epoch 2/2 | loss 11.0 | 320 ms/step | eta 0m00s"),
                     (40.0, "test scores of the best epoch (2, validation CIDEr-D 0.0000):")]
    assert bench.phases(adapt_lines, caption_lines, 35.0, 42.5, drawn_at=12.0) == {
        "python start, drawing the pairs": 12.0, "image cache, loading the model": 10.0, "stage-1 intra-image tokens": 8.0,
        "stage-1 training and validations": 3.5, "stage-1 test retrieval, saving": 1.5,
        "stage-2 start: loading, the intra-image tokens": 2.0, "stage-2 training and validations": 3.0,
        "stage-2 test: decoding, scoring, pictures": 2.5}
    merged = bench.phases(adapt_lines, [], 35.0, None)  # drawing's end unknown; stage 2 failed
    assert merged == {"python start, drawing the pairs + image cache, loading the model": 22.0, "stage-1 intra-image tokens": 8.0,
                      "stage-1 training and validations": 3.5, "stage-1 test retrieval, saving": 1.5}
    assert bench.step_ms(adapt_lines) == {"logged_ms_per_step": [50, 60], "ms_per_step_between_lines": None}
    assert bench.step_ms(caption_lines) == {"logged_ms_per_step": [300, 320], "ms_per_step_between_lines": 333}


FAKE_ADAPT = """import json, os, shutil, sys
print("synth.py: drawing the synthetic dataset (20 pairs, seed 0) into data/synth", file=sys.stderr)
shutil.copytree({drawn!r}, "data/synth", copy_function=shutil.copy)  # new files, the times of a drawing now
print("intra-image tokens of 30 training images computed once (0 s): the intra-image blocks are frozen")
print("120 training samples from 16 pairs; global batch 8 = 8 x 1 processes x 1 accumulation")
print("step 2/2 | epoch 1/1 | loss 1.0 | 25 ms/step | eta 0m00s")
print("test retrieval of the best epoch (1, chosen on validation):")
os.makedirs("runs/adapt_synth")
json.dump({{"ids": {ids!r}, "isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "args": sys.argv[1:]}},
          open("runs/adapt_synth/test_retrieval.json", "w"))
"""
FAKE_CAPTION = """import json, os
ids = json.load(open("runs/adapt_synth/test_retrieval.json"))["ids"]
print("16 training pairs; global batch 8 = 8 x 1 processes x 1 accumulation")
print("test scores of the best epoch (1, validation CIDEr-D 0.0000):")
os.makedirs("runs/caption_synth")
said = [{"image_id": i, "caption": "the cube is gone"} for i in ids]
said += [{"image_id": i + "_n", "caption": "the scene is the same"} for i in ids]
json.dump(said, open("runs/caption_synth/test_predictions.json", "w"))
json.dump({"localisation": {"drop": {"pairs": 1, "chance": 10.0, "inter": 100.0}}},
          open("runs/caption_synth/test_scores.json", "w"))
"""


@pytest.fixture(scope="module")
def fake_repository(tmp_path_factory):
    """A git repository whose adapt.py and caption.py print the real scripts' marker lines and write their
    outputs in a moment (the first copies a 20-pair synthetic set drawn here); its HEAD's adapt.py fails."""
    base = tmp_path_factory.mktemp("fake_repository")
    drawn, repo = base / "synth", base / "repo"
    synth.make_synth(drawn, synth.SynthConfig(pairs=20), 1)
    test_ids = [p.id for p in data.load_split("synth", "test", drawn)]
    commit = lambda message: subprocess.run(["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit",
                                             "-qam", message], check=True)
    subprocess.run(["git", "init", "-q", repo], check=True)
    (repo / "adapt.py").write_text(FAKE_ADAPT.format(drawn=str(drawn), ids=test_ids))
    (repo / "caption.py").write_text(FAKE_CAPTION)
    subprocess.run(["git", "-C", repo, "add", "."], check=True)
    commit("working")
    working = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "adapt.py").write_text("raise SystemExit('adapt.py: broken')\n")
    commit("broken")
    return repo, working


def test_bench_first_runs_both_scripts_of_a_clean_clone_at_a_commit_and_sums_them_up(fake_repository, tmp_path,
                                                                                      capsys):
    repo, working = fake_repository
    summary = bench.first_command(tmp_path / "first", commit=working, avx2=True, extra="--epochs 1", repo=str(repo))
    assert json.loads((tmp_path / "first" / "summary.json").read_text()) == summary
    clone = tmp_path / "first" / "repo"
    assert summary["commit"] == working and summary["env"] == bench.AVX2_ONLY
    retrieval = json.loads((clone / "runs/adapt_synth/test_retrieval.json").read_text())
    assert retrieval["isa"] == "AVX2" and retrieval["args"] == ["--data", "synth", "--epochs", "1"]
    assert summary["md5"]["runs/adapt_synth/test_retrieval.json"] == hashlib.md5(
        (clone / "runs/adapt_synth/test_retrieval.json").read_bytes()).hexdigest()
    assert [run["exit_status"] for run in summary["scripts"].values()] == [0, 0]
    assert all(run["peak_rss_gb"] > 0 for run in summary["scripts"].values())
    assert list(summary["phases_s"]) == [  # every phase, the drawing's end from the dataset's files
        "python start, drawing the pairs", "image cache, loading the model", "stage-1 intra-image tokens",
        "stage-1 training and validations", "stage-1 test retrieval, saving",
        "stage-2 start: loading, the intra-image tokens", "stage-2 training and validations",
        "stage-2 test: decoding, scoring, pictures"]
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["total_s"], abs=0.6)
    assert summary["steps"]["stage1"]["logged_ms_per_step"] == [25, 25]
    types = collections.Counter(p.change_type for p in data.load_split("synth", "test", clone / "data/synth"))
    n = sum(types.values())
    assert summary["kinds"] == ", ".join(f"{t} {types[t] if t == 'drop' else 0}/{types[t]}"
                                         for t in data.CHANGE_TYPES if types[t]) + f", distractor {n}/{n}"
    capsys.readouterr()
    bench.main(["kinds", str(clone / "runs/caption_synth"), "--data_root", str(clone / "data/synth"), "--confusion"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == summary["kinds"] and out[1 + len(types) + 1].startswith("localisation (pointing game)")
    assert f"  distractor -> distractor {n}" in out and all(f"  {t} -> drop {types[t]}" in out for t in types)


def test_bench_first_stops_at_a_failing_script_and_says_where_its_output_is(fake_repository, tmp_path):
    repo, _ = fake_repository
    summary = bench.first_command(tmp_path / "first", repo=str(repo))  # HEAD: adapt.py fails
    assert list(summary["scripts"]) == ["adapt"] and summary["scripts"]["adapt"]["exit_status"] == 1
    assert "adapt.py: broken" in (tmp_path / "first" / "adapt.log").read_text() and "kinds" not in summary
    with pytest.raises(SystemExit, match="first: adapt.py failed; its output is in .*adapt.log"):
        bench.report_first(summary, str(tmp_path / "first"))
    with pytest.raises(SystemExit, match="is not empty"):
        bench.first_command(tmp_path / "first", repo=str(repo))

def test_bench_cost_counts_the_same_flops_per_pair_at_every_batch_size_and_the_activations_growing_with_it():
    # a tiny CLIP and decoder (the papers' sizes take minutes), stage 2 end to end, each batch size in its own process
    result = bench.run_costs(batch_sizes=(1, 2), stages=("stage2_finetune",), sizes=bench.TINY_COST_SIZES,
                             threads=torch.get_num_threads())
    stage = result["stages"]["stage2_finetune"]
    one, two = stage["gflop_per_pair"]
    assert one > 0 and one == two  # every operator's work grows with the batch, so a pair's FLOPs do not change
    saved_one, saved_two = stage["saved_for_backward_gb"]
    assert saved_two == pytest.approx(2 * saved_one, rel=0.05)  # the activations: per pair
    assert stage["saved_mb_per_pair"] > 0 and all(rss > 0.1 for rss in stage["peak_rss_gb"])  # torch alone is more
    assert 0 < stage["trainable_m"] < stage["parameters_m"]  # the reference's frozen set and the text tower
    flops = result["gflop_per_pair"]  # the change and the distractor pair cost about twice one pair with one caption
    assert flops["stage2_finetune_2"] == one and 1.8 < flops["stage2_finetune_2"] / flops["stage2_finetune_1"] < 2.2
    assert 0 < flops["encode"] < flops["stage2_finetune_1"]  # forward only, no decoder
    assert "estimate" not in result  # the hours need all three stages
    clevr = result["disk"]["clevr"]  # 3 images per id (default, semantic, nonsemantic), 39,803 ids in the splits
    assert clevr["images"] == 3 * 39_803 and clevr["image_cache_gb"] == round(3 * 39_803 * 224 * 224 * 3 / 1e9, 2)
    assert clevr["feature_rows"] == 2 * 39_803  # the change pair and the distractor pair


def test_bench_cost_hours_are_flops_over_the_rate_of_each_gpu_at_each_fraction_of_its_peak():
    flops = {name: 1e12 for name in ("encode", "stage1", "stage2_cached_2", "stage2_cached_1", "stage2_finetune_2",
                                     "stage2_finetune_1")}
    hours = bench.run_hours(flops)["hours"]
    # stage 1 on Spot-the-Diff: 17,676 samples x 20 epochs x 1 TFLOP, on an H100 at half its 989 TFLOP/s
    assert hours["spot"]["stage1"]["H100 SXM (bf16) at 50%"] == round(17_676 * 20 / (0.5 * 989) / 3600, 2)
    assert hours["spot"]["stage1"]["pflop"] == round(17_676 * 20 / 1e3, 1)
    # cached features: 50 epochs of 8,566 pairs, and encoding each of its 11,329 pairs once
    assert hours["spot"]["stage2_cached"]["pflop"] == round((8_566 * 50 + 11_329) / 1e3, 1)
    # LEVIR-CC: stage 1 on the 3,407 changed train pairs' 5 captions; stage 2 on all 6,815, 10,077 pairs encoded
    assert hours["levir"]["stage1"]["pflop"] == round(3_407 * 5 * 20 / 1e3, 1)
    assert hours["levir"]["stage2_cached"]["pflop"] == round((6_815 * 50 + 10_077) / 1e3, 1)



# --- the README's reading path ---

READING_PATH = {  # each stop's first line, and the line that follows the stop (the next concept)
    "clip.py": (r"# 1\. The model", r"# 2\. "), "encoder.py": (r"class EncoderConfig", r"# --- the demo"),
    "losses.py": (r"# --- Differentiable all-gather", r'if __name__ == "__main__":'),
    "data.py": (r"# 1\. The image pair", r"def to_device"),
    "adapt.py": (r"# Dataset presets", r"# What the run calls"),
    "decoder.py": (r"class DecoderConfig", r"# Demo"),
    "caption.py": (r"# Dataset presets", r"# What the jobs and the loop call"),
    "metrics.py": (r"class MetricsConfig", r"# 5\. "),
}


# A measured figure in the README: a number with a unit of time, size, rate or share, or a number with decimals.
FIGURE_UNITS = {"ms": "ms", "s": "s", "seconds": "s", "min": "min", "minutes": "min", "h": "h", "hours": "h",
                "GB": "GB", "MB": "MB", "%": "%", "pairs/s": "pairs/s", "captions/s": "captions/s", "times": "x",
                "×": "x"}
README_FIGURE = re.compile(r"(?<![\w.\-/×@])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:\s?(" + "|".join(
    sorted(map(re.escape, FIGURE_UNITS), key=len, reverse=True)) + r")(?![\w/]))?(?:[*)\]]*(<!--[^>]*-->))?")
# README figures that no record measures, each with why
NOT_MEASURED_HERE = {
    "24 h": "the reference's published time per stage",
    "2 hours": "processes.GROUP_TIMEOUT, a setting",
    "0.5%": "chance: 1 in 200 test pairs", "0.2%": "chance: 1 in 500 held-out scenes",
    "256 ×": "LEVIR-CC's image size", "224 ×": "CLIP's input size, a setting",
    "25 MB": "an estimate, said so: the synthetic page's size per pair times CLEVR-Change's pairs",
}


def readme_figures(readme: str):
    """(line, figure text, value, decimals, unit, marker) of each measured figure in the README: numbers with a unit,
    and numbers with decimals, outside the tables of published scores (those with a BLEU-4 column) and code spans;
    marker: the <!--record:key--> right after it, or None."""
    published = fenced = False
    for line in readme.splitlines():
        fenced = fenced != line.startswith("```")  # a code block's lines: commands
        if fenced or line.startswith("```"):
            continue
        if line.startswith("|"):
            published = published or "BLEU-4" in line
        else:
            published = False
        if published or line.startswith("#"):
            continue
        text = re.sub(r"`[^`]*`|([Ss]ection |§)\d+(\.\d+)*", "", line)  # commands, files, flags; sections
        for m in README_FIGURE.finditer(text):
            whole, fraction, unit, marker = m.groups()
            if unit is None and fraction is None:
                continue  # a bare integer: a count or a setting, not checked
            if re.search(r"(torch|METEOR|pycocoevalcap|Python) $", text[:m.start()]) or re.match(r"\.\d", text[m.end():]):
                continue  # a version: torch 2.11, METEOR 1.5, 2.5.1
            shown = m.group(0)[:len(m.group(0)) - len(marker or "")].rstrip("*)]")
            yield line, shown, float(whole.replace(",", "") + (fraction or "")), len(fraction or ".") - 1, unit, marker


def figure_problems(readme: str, records: dict) -> list[str]:
    """Each README figure that names no record, names one that is not there, or differs from it at the README's
    precision; a figure of a record whose code changed since must say so on its line ("stale")."""
    problems = []
    for line, text, number, decimals, unit, marker in readme_figures(readme):
        if marker is None:
            if text not in NOT_MEASURED_HERE:
                problems.append(f"{text!r} names no record: {line.strip()[:90]}")
            continue
        name, key, conversion = bench_records.MARKER.fullmatch(marker).groups()
        try:
            expected = bench_records.value(records[name], key, conversion)
        except KeyError:
            problems.append(f"{text!r}: {marker} is not in bench/records/")
            continue
        if abs(expected - number) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"{text!r} but {name}:{key} holds {expected}")
        if records[name].get("stale") and "stale" not in line:
            problems.append(f"{text!r}: its record {name} is stale, and the line does not say so")
    return problems


def test_every_measured_figure_in_the_readme_equals_the_record_it_names():
    # a figure off by one unit of its last digit, one with no record, and a stale record's unmarked one are caught
    fake = {"r": {"values": {"t": 72.51, "f": 0.4266}}, "old": {"values": {"t": 9.0}, "stale": "code changed"}}
    assert figure_problems("took 72.5 ms<!--r:t-->, R@1 42.7%<!--r:f %-->", fake) == []
    assert len(figure_problems("took 72.6 ms<!--r:t--> a step", fake)) == 1
    assert len(figure_problems("took 28 minutes a step", fake)) == 1
    assert len(figure_problems("took 9 ms<!--old:t-->", fake)) == 1 and not figure_problems(
        "took 9 ms<!--old:t--> (stale)", fake)
    readme = (HERE / "README.md").read_text()
    assert len(list(readme_figures(readme))) >= 10  # the check sees the README's figures
    assert figure_problems(readme, bench_records.all_records()) == []


def test_each_records_block_in_benchmarks_is_rendered_from_its_file_and_every_record_has_one():
    benchmarks = (HERE / "BENCHMARKS.md").read_text()
    records = bench_records.all_records()
    blocks = {m.group(1): m.group(0) for m in bench_records.BLOCK.finditer(benchmarks)}
    assert set(blocks) == set(records)
    for name, record in records.items():
        assert blocks[name] == bench_records.render(name, record), f"python -m bench records --write ({name})"


def test_a_record_whose_measured_code_changed_since_its_commit_says_so():
    for name, record in bench_records.all_records().items():
        assert {"title", "command", "commit", "date", "machine", "measures", "files", "values"} <= set(record), name
        assert bench_records.code_files(record["measures"]), name
        changed = bench_records.changed_files(record)
        assert bool(changed) == bool(record.get("stale")), (
            f"{name}: " + (f"changed since: {changed[:3]}, but says nothing" if changed else "says stale but is not"))


def test_the_readmes_reading_path_starts_each_stop_on_its_concept_and_says_how_long_it_is():
    readme = (HERE / "README.md").read_text()
    stops = re.findall(r"^\| \d \| `(\w+\.py)` \| (\d+)–(\d+) \|", readme, re.M)
    assert [path for path, _, _ in stops] == list(READING_PATH)  # 8 stops, in this order
    total = 0
    for path, first, last in stops:
        lines = (HERE / path).read_text().split("\n")
        first, last = int(first), int(last)
        start, after = READING_PATH[path]
        decorated = lines[first - 1].startswith("@")  # a stop may start on its class's decorator
        assert re.match(start, lines[first - 1 + decorated]), f"{path}:{first} is {lines[first - 1]!r}"
        following = next(i for i in range(first, len(lines)) if re.match(after, lines[i]))  # 0-based
        assert last <= following and all(not l.strip() or l.startswith(("#", "@")) for l in lines[last:following]), (
            f"{path}: the stop ends at {last}, but its concept runs to line {following}")
        total += last - first + 1
    assert total <= 2400  # the eight stops hold the method whole, and what the first command runs
    assert f"about {round(total, -1):,} lines" in readme


# --- the house: what each script names and loads, and which way the imports point ---

PROJECT_TOP = ("clip", "encoder", "decoder", "losses", "data", "synth", "metrics", "results", "explain", "adapt",
               "caption", "pretrain", "check", "scoring", "plumbing", "bench")
SCRIPT_LOADS = {  # the project modules each script loads; every plumbing/ module counts as "plumbing"
    "adapt.py": {"adapt", "clip", "data", "encoder", "losses", "plumbing"},  # no decoder, no METEOR; synth on use
    "caption.py": {"caption", "clip", "data", "decoder", "encoder", "explain", "losses", "metrics", "results",
                   "plumbing", "scoring", "scoring.fast", "scoring.field", "scoring.meteor", "scoring.ptb"},
    "pretrain.py": {"pretrain", "adapt", "clip", "data", "encoder", "losses", "synth", "plumbing"},
    "check.py": {"check", "clip", "data", "explain", "losses", "plumbing"},
    "results.py": {"results", "clip", "data", "metrics", "plumbing", "scoring", "scoring.fast", "scoring.field",
                   "scoring.meteor", "scoring.ptb"},
}


def project_imports(path: Path) -> set[str]:
    """The project modules a file names in its imports, as dotted names (plumbing.flags), wherever they stand."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" if node.module in ("plumbing", "scoring", "bench")
                         and (HERE / node.module / f"{alias.name}.py").is_file() else node.module
                         for alias in node.names)
    return {n for n in names if n.split(".")[0] in PROJECT_TOP}


@pytest.mark.parametrize("script", SCRIPT_LOADS)
def test_each_script_names_at_most_8_project_modules_and_loads_only_the_ones_it_uses(script):
    named = project_imports(HERE / script)
    assert len(named) <= 8, sorted(named)
    probe = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {PROJECT_TOP!r})))")
    result = subprocess.run([sys.executable, "-c", probe, script.removesuffix(".py")], cwd=HERE,
                            capture_output=True, text=True, timeout=120)
    loaded = {"plumbing" if m.startswith("plumbing") else m for m in json.loads(result.stdout)}
    assert loaded == SCRIPT_LOADS[script]


def readme_file_rows() -> list[str]:
    """The first column of the README's file table, in order: `clip.py`, `scoring/`, ..."""
    readme = (HERE / "README.md").read_text()
    table = readme[readme.index("| file | what it holds |"):]
    return re.findall(r"^\| `([\w./]+)` \|", table.split("\n\n")[0], re.M)


def test_imports_point_up_the_readmes_file_list_and_close_no_circle():
    rows = readme_file_rows()
    row_of = lambda module: rows.index(f"{module.split('.')[0]}/" if "." in module or module in ("plumbing", "scoring",
                                       "bench") else f"{module}.py")  # noqa: E731
    files = {p.stem: p for p in HERE.glob("*.py") if p.stem != "test_all"}
    files.update({f"{d}.{p.stem}": p for d in ("plumbing", "scoring", "bench") for p in (HERE / d).glob("*.py")
                  if p.stem != "__init__"})
    graph = {module: {m for m in project_imports(path) if m != module} for module, path in files.items()}
    upward = [(m, i) for m, imported in graph.items() for i in imported if row_of(i) > row_of(m)]
    assert upward == [], "imports that point down the README's file list"
    done, visiting = set(), []

    def visit(module):  # depth first: a module met again on its own path closes a circle
        assert module not in visiting, f"import circle: {' -> '.join(visiting + [module])}"
        if module in done or module not in graph:
            return
        visiting.append(module)
        for imported in graph[module]:
            visit(imported)
        visiting.pop()
        done.add(module)
    for module in graph:
        visit(module)
    assert "scoring.meteor" not in graph["plumbing.loop"] | graph["adapt"] and "decoder" not in graph["adapt"]


def test_the_plumbing_and_scoring_maps_name_tests_that_exist():
    names = {node.name for node in ast.parse(Path(__file__).read_text()).body if isinstance(node, ast.FunctionDef)}
    for package in ("plumbing", "scoring"):
        text = re.sub(r"_\n\s+", "_", ast.get_docstring(ast.parse((HERE / package / "__init__.py").read_text())))
        cited = [c for c in re.findall(r"test_[a-z0-9_]+", text) if c != "test_all"]  # test_all.py, the file
        assert cited and [c for c in cited if c not in names] == [], package
