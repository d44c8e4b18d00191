"""Tests of clip.py (to be merged into test_all.py by the lead).

Run them with:  python -m pytest test_part_clip.py -q
The known answers come from OpenAI's own CLIP code (../shared/clip_vectors/README.md says how they were made).
"""
import functools
import gzip
import hashlib
import http.server
import json
import math
import shutil
import threading
import warnings
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

import clip
from test_all import shared

# --- clip.py ---

# tolerances from ../shared/clip_vectors/README.md, "Tolerances (float32, CPU)"
EMBEDDING_TOL = dict(rtol=1e-5, atol=1e-5)
LOGITS_TOL = dict(rtol=1e-5, atol=1e-4)
INTERMEDIATE_TOL = dict(rtol=1e-5, atol=2e-5)


@pytest.fixture(scope="module")
def openai_tokenizer():
    return clip.get_tokenizer(shared("clip_vectors", "bpe_simple_vocab_16e6.txt.gz"))


@pytest.fixture(scope="module")
def tokenizer_cases():
    return json.loads(shared("clip_vectors", "tokenizer_public.json").read_text())["cases"]


@pytest.fixture(scope="module")
def expected():
    return torch.load(shared("clip_vectors", "tiny_expected.pt"), weights_only=True)


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
    with pytest.raises(ValueError, match="vocab.txt.gz.*#version"):
        clip.SimpleTokenizer(path)


def test_the_vocabulary_is_found_through_clip_bpe_path(monkeypatch):
    vocabulary = shared("clip_vectors", "bpe_simple_vocab_16e6.txt.gz")
    monkeypatch.setenv("CLIP_BPE_PATH", str(vocabulary))
    assert clip.get_tokenizer() is clip.get_tokenizer(vocabulary)  # one tokenizer per vocabulary file
    assert clip.tokenize("a cube")[0, :4].tolist() == [49406, 320, 11353, 49407]


def test_a_missing_vocabulary_offline_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CLIP_BPE_PATH", raising=False)
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path))
    monkeypatch.setattr(clip, "BPE_URL", (tmp_path / "offline" / "bpe_simple_vocab_16e6.txt.gz").as_uri())
    with pytest.raises(FileNotFoundError) as error:
        clip.SimpleTokenizer()
    assert "bpe_simple_vocab_16e6.txt.gz" in str(error.value) and str(tmp_path) in str(error.value)
    assert "curl" in str(error.value) and "CLIP_BPE_PATH" in str(error.value)
    assert list(tmp_path.iterdir()) == []  # no partial download left behind


def test_openai_preprocessing_matches_openais_on_every_test_image():
    folder = shared("clip_vectors", "preprocess_vectors")
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
    white = np.full((2, 4, 4, 3), 255, dtype=np.uint8)  # (B, H, W, 3), as data.py caches them
    x = clip.normalize(white)
    assert x.shape == (2, 3, 4, 4) and x.dtype == torch.float32
    assert math.isclose(x[0, 0, 0, 0].item(), (1 - clip.CLIP_MEAN[0]) / clip.CLIP_STD[0], rel_tol=1e-6)


@pytest.mark.parametrize("filename", ["tiny_openai_jit.pt", "tiny_openai_state_dict.pt"])
def test_both_tiny_checkpoints_load_and_reproduce_openais_outputs(filename, expected, openai_tokenizer):
    model, preprocess = clip.load(shared("clip_vectors", filename))
    assert model.config.image_resolution == 64 and model.visual.input_resolution == 64
    tokens = clip.tokenize(expected["texts"], truncate=True, tokenizer=openai_tokenizer)
    assert torch.equal(tokens, expected["text_tokens"])
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(expected["images"]), expected["encode_image"], **EMBEDDING_TOL)
        torch.testing.assert_close(model.encode_text(tokens), expected["encode_text"], **EMBEDDING_TOL)
        logits_per_image, logits_per_text = model(expected["images"], tokens)
    torch.testing.assert_close(logits_per_image, expected["logits_per_image"], **LOGITS_TOL)
    torch.testing.assert_close(logits_per_text, expected["logits_per_text"], **LOGITS_TOL)
    torch.testing.assert_close(model.logit_scale.exp().detach(), expected["logit_scale_exp"])


def test_every_intermediate_activation_matches_openais(expected):
    model, _ = clip.load(shared("clip_vectors", "tiny_openai_jit.pt"))
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
    assert tokens.argmax(-1).tolist() == expected["text_eot_index"].tolist() == [9, 1, 19, 76]


def test_reading_the_torchscript_archive_gives_exactly_its_jit_state_dict():
    path = shared("clip_vectors", "tiny_openai_jit.pt")
    ours = clip.load_state_dict(path, dtype=None)  # stored dtypes, as torch.jit.load gives them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated in torch 2.13
        theirs = torch.jit.load(str(path), map_location="cpu").state_dict()
    assert list(ours) == list(theirs) and len(ours) == 89
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


def test_load_state_dict_casts_weights_to_float32_and_keeps_the_metadata_ints():
    state_dict = clip.load_state_dict(shared("clip_vectors", "tiny_openai_state_dict.pt"))
    assert {v.dtype for k, v in state_dict.items() if k not in clip.METADATA_KEYS} == {torch.float32}
    assert [state_dict[k].item() for k in clip.METADATA_KEYS] == [64, 77, 49408]


def test_an_archive_that_asks_for_any_other_python_name_is_refused_not_run(tmp_path):
    path = tmp_path / "evil.pt"
    payload = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R."  # would call os.system("true")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("evil/data.pkl", payload)
        archive.writestr("evil/constants.pkl", b"\x80\x02).")
    with pytest.raises(RuntimeError, match="refusing to load os.system; .* not what it claims"):
        clip.load_state_dict(path)


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
    state_dict = clip.load_state_dict(shared("clip_vectors", "tiny_openai_state_dict.pt"))
    change(state_dict)
    with pytest.raises((RuntimeError, KeyError), match=message):
        clip.build_model(state_dict)


def test_a_missing_weights_file_is_reported_with_its_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        clip.load(tmp_path / "nowhere.pt")
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        clip.load_state_dict(tmp_path / "nowhere.pt")


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
def test_a_truncated_or_corrupt_weights_file_gives_a_clear_error(filename, damage, tmp_path):
    path = tmp_path / filename
    path.write_bytes(damage(shared("clip_vectors", filename).read_bytes()))
    with pytest.raises(RuntimeError, match=f"{filename}.*(corrupt|truncated)"):
        clip.load(path)


def test_a_named_model_offline_fails_fast_naming_the_missing_file(tmp_path, monkeypatch):
    url = (tmp_path / "offline" / ("0" * 64) / "ViT-B-32.pt").as_uri()
    monkeypatch.setitem(clip.MODEL_URLS, "ViT-B/32", url)
    with pytest.raises(FileNotFoundError) as error:
        clip.load("ViT-B/32", download_root=tmp_path / "cache")
    assert str(tmp_path / "cache" / "ViT-B-32.pt") in str(error.value) and "curl" in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_load_downloads_a_named_model_into_the_cache_once_its_checksum_matches(tmp_path, monkeypatch, expected):
    source = shared("clip_vectors", "tiny_openai_jit.pt")
    sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    (tmp_path / "server" / sha256).mkdir(parents=True)  # OpenAI's URLs embed the sha256 the same way
    shutil.copy(source, tmp_path / "server" / sha256 / "tiny.pt")
    monkeypatch.setitem(clip.MODEL_URLS, "tiny", (tmp_path / "server" / sha256 / "tiny.pt").as_uri())
    monkeypatch.setenv("CLIP_CACHE", str(tmp_path / "cache"))
    model, _ = clip.load("tiny")
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
        clip.download(f"{base_url}/weights.bin", cache, "0" * 64)
    assert list(cache.iterdir()) == []  # the bad download is gone, no temporary file left
    path = clip.download(f"{base_url}/weights.bin", cache, hashlib.sha256(data).hexdigest())
    assert path == cache / "weights.bin" and path.read_bytes() == data
    assert list(cache.iterdir()) == [path]


def test_download_from_a_file_url_deletes_a_bad_download_and_keeps_a_good_one(tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"abc")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="sha256"):
        clip.download(source.as_uri(), cache, "0" * 64)
    assert list(cache.iterdir()) == []
    sha256 = hashlib.sha256(b"abc").hexdigest()
    assert clip.download(source.as_uri(), cache, sha256).read_bytes() == b"abc"
    assert list(cache.iterdir()) == [cache / "weights.bin"]


def test_download_replaces_a_cached_file_whose_checksum_is_wrong(tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"good")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "weights.bin").write_bytes(b"bad")
    with pytest.warns(UserWarning, match="downloading it again"):
        path = clip.download(source.as_uri(), cache, hashlib.sha256(b"good").hexdigest())
    assert path.read_bytes() == b"good" and list(cache.iterdir()) == [path]


def test_a_failed_download_raises_oserror_and_leaves_nothing_behind(http_folder, tmp_path):
    _, base_url = http_folder
    with pytest.raises(OSError, match="404"):
        clip.download(f"{base_url}/missing.bin", tmp_path / "cache", "0" * 64)
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


def test_layer_norm_computes_in_float32_and_returns_the_input_dtype():
    norm = clip.LayerNorm(8)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 1000
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, norm(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)
