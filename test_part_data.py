# --- data.py ---
# Run:  python -m pytest test_part_data.py -q
# The fixtures write each dataset's published layout in a temporary folder, awkward parts included;
# the synthetic dataset is drawn once per session, small.
import gzip
import json

import numpy as np
import pytest
import torch
from PIL import Image

import clip
import data
from test_all import shared

SYNTH = data.SynthConfig(pairs=40, seed=3)


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    return data.make_synth(tmp_path_factory.mktemp("synth") / "synth", SYNTH)


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


def test_an_empty_caption_is_an_error_naming_the_pair(clevr_root):
    captions = json.loads((clevr_root / "change_captions.json").read_text())
    captions["CLEVR_default_000005.png"] = ["the cube moved", "  "]
    write_json(clevr_root / "change_captions.json", captions)
    with pytest.raises(data.DataError, match="pair 000005.png: empty"):
        data.read_clevr_change(clevr_root, "test")


def test_a_missing_image_is_an_error_naming_the_file(clevr_root):
    missing = clevr_root / "nsc_images" / "CLEVR_nonsemantic_000005.png"
    missing.unlink()
    with pytest.raises(data.DataError, match=f"image {missing} is missing"):
        data.read_clevr_change(clevr_root, "test")
    with pytest.raises(data.DataError, match=f"image {missing} is missing"):
        data.load_image(missing)


def test_a_corrupt_image_is_an_error_naming_the_file(clevr_root):
    corrupt = clevr_root / "images" / "CLEVR_default_000005.png"
    corrupt.write_bytes(corrupt.read_bytes()[:40])  # a truncated PNG
    pairs = data.read_clevr_change(clevr_root, "test")
    with pytest.raises(data.DataError, match=f"image {corrupt} is corrupt"):
        data.PairImages(pairs, data.ImageReader(32))[0]


def test_a_missing_dataset_folder_says_which_dataset_where_and_how_to_get_it(tmp_path):
    with pytest.raises(data.DataError, match=r"CLEVR-Change: no folder .*nowhere.*RobustChangeCaptioning"):
        data.load_split("clevr", "train", tmp_path / "nowhere")
    with pytest.raises(data.DataError, match=r"Spot-the-Diff: no folder .*harsh19/spot-the-diff"):
        data.load_split("spot", "train", tmp_path / "nowhere")
    with pytest.raises(data.DataError, match=r"Image-Editing-Request: no folder .*VisualRelationships"):
        data.load_split("ier", "train", tmp_path / "nowhere")


def test_an_incomplete_synthetic_folder_is_an_error_saying_it_will_be_drawn_again(tmp_path):
    (tmp_path / "synth").mkdir()
    with pytest.raises(data.DataError, match="not a complete synthetic dataset.*remove it and it will be drawn again"):
        data.load_split("synth", "train", tmp_path / "synth")


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


def test_mixed_case_requests_tokenize_as_lower_case():
    tokenizer = clip.get_tokenizer(shared("clip_vectors", "bpe_simple_vocab_16e6.txt.gz"))
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


# --- the synthetic dataset ---

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
    again = data.make_synth(tmp_path / "again", SYNTH, workers=2)
    files = sorted(p.relative_to(synth_root) for p in synth_root.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((synth_root / f).read_bytes() == (again / f).read_bytes() for f in files)
    other = data.make_synth(tmp_path / "other", data.SynthConfig(pairs=5, seed=4))
    name = "images/CLEVR_default_000000.png"
    assert (other / name).read_bytes() != (synth_root / name).read_bytes()


WORD_ATTRIBUTE = {w: (attribute, value) for attribute, table in (
    ("size", data.SIZE_WORDS), ("material", data.MATERIAL_WORDS), ("shape", data.SHAPE_WORDS))
    for value, words in table.items() for w in words} | {c: ("color", c) for c in data.COLORS}


def named_objects(expression, scene):
    """The objects of scene that a referring expression like 'the tiny red shiny block' fits."""
    words = expression.split()
    assert words[0] == "the" and (words[-1] in data.NOUN_WORDS or WORD_ATTRIBUTE[words[-1]][0] == "shape")
    wanted = dict(WORD_ATTRIBUTE[w] for w in words[1:] if w not in data.NOUN_WORDS)
    return [i for i, obj in enumerate(scene) if all(obj[a] == v for a, v in wanted.items())]


def split_caption(caption, kind):
    """A change caption -> (referring expression, the verb phrase's new attribute value or None)."""
    for phrase in data.VERB_PHRASES[kind]:
        head = phrase.split(" {new}")[0]
        if f" {head}" in caption:
            expression, rest = caption.split(f" {head}", 1)
            return expression, WORD_ATTRIBUTE[rest.split()[-1]][1] if "{new}" in phrase else None
    raise AssertionError(f"no {kind} verb phrase in {caption!r}")


def test_synthetic_captions_name_exactly_the_changed_object_of_the_drawn_scene(synth_root):
    scenes = json.loads((synth_root / data.SYNTH_SCENES_FILE).read_text())["scenes"]
    captions = json.loads((synth_root / "change_captions.json").read_text())
    no_change = json.loads((synth_root / "no_change_captions.json").read_text())
    for name, scene in scenes.items():
        kind = scene["type"]
        assert len(set(captions[name])) == SYNTH.captions_per_pair
        assert set(no_change[name]) <= set(data.NO_CHANGE_SENTENCES)
        named_in = "after" if kind == "add" else "before"
        for caption in captions[name]:
            expression, new_value = split_caption(caption, kind)
            assert named_objects(expression, scene[named_in]) == [scene["changed"][named_in]], caption
            if kind in ("color", "material"):
                assert scene["after"][scene["changed"]["after"]][kind] == new_value != \
                    scene["before"][scene["changed"]["before"]][kind]
        count = {"add": 1, "drop": -1}.get(kind, 0)
        assert len(scene["after"]) == len(scene["before"]) + count


def test_synthetic_changes_stay_visible_after_the_224_resize(synth_root):
    scenes = json.loads((synth_root / data.SYNTH_SCENES_FILE).read_text())["scenes"]
    for pair in data.load_split("synth", "test", synth_root):
        scene = scenes[f"CLEVR_default_{pair.id}"]
        before = data.preprocess_uint8(pair.before, 224).astype(int)
        after = data.preprocess_uint8(pair.after, 224).astype(int)
        changed = np.abs(before - after).max(-1)  # (224, 224)
        named_in = "after" if pair.change_type == "add" else "before"
        obj = scene[named_in][scene["changed"][named_in]]
        r = 0.8 * data.SIZE_RADIUS[obj["size"]]  # the object's box, in the 224 x 224 image
        box = changed[round((obj["y"] - r) * 224 / 320):round((obj["y"] + r) * 224 / 320) + 1,
                      round((obj["x"] - r) * 224 / 480):round((obj["x"] + r) * 224 / 480) + 1]
        assert box.max() > 40, (pair.id, pair.change_type)
        assert (changed > 40).mean() < 0.15  # the rest of the scene is the same


def test_the_synthetic_vocabulary_makes_every_grammar_word_one_token(synth_tokenizer, synth_root):
    lines = gzip.open(synth_root / data.SYNTH_BPE_FILE, "rt").read().split("\n")
    assert lines[0] == "#version: 0.2" and synth_tokenizer.vocab_size == 512 + len(lines) - 1 + 2
    for word in sorted(data.grammar_words()):
        assert len(synth_tokenizer.encode(word)) == 1, word
    for caption in data.load_split("synth", "train", synth_root)[0].captions + list(data.NO_CHANGE_SENTENCES):
        ids = synth_tokenizer.encode(caption)
        assert len(ids) == len(caption.split())
        assert synth_tokenizer.decode(ids).strip() == caption


def test_learn_bpe_merges_the_most_frequent_pair_first_and_breaks_ties_by_order():
    assert data.learn_bpe({"ab": 3, "cb": 1}) == [("a", "b</w>"), ("c", "b</w>")]
    assert data.learn_bpe({"cb": 2, "ab": 2}) == [("a", "b</w>"), ("c", "b</w>")]


def test_ensure_synth_refuses_a_folder_drawn_with_other_settings(synth_root):
    assert data.ensure_synth(synth_root, SYNTH) == synth_root
    with pytest.raises(data.DataError, match=r"drawn with other settings .*'pairs': \(40, 41\)"):
        data.ensure_synth(synth_root, data.SynthConfig(pairs=41, seed=3))


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
    batch = next(iter(torch.utils.data.DataLoader(samples, batch_size=4)))
    assert (batch["before"].shape, batch["after"].shape, batch["caption"].shape) == \
        ((4, 3, 32, 32), (4, 3, 32, 32), (4, 12))
    assert batch["pair_index"].tolist() == [0, 0, 1, 1]


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
    cache = data.image_cache(pairs, tmp_path / "cache", "train", image_size=32)
    assert len(cache.row) == 9
    assert np.array_equal(cache[pairs[2].after], data.preprocess_uint8(pairs[2].after, 32))
    write_png(pairs[2].after, (255, 255, 255))
    rebuilt = data.image_cache(pairs, tmp_path / "cache", "train", image_size=32)
    assert rebuilt[pairs[2].after].min() == 255
    assert torch.equal(data.ImageReader(32, rebuilt)(pairs[0].before), data.ImageReader(32)(pairs[0].before))
