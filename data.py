"""Image-pair datasets for image difference captioning: readers, a synthetic dataset, and the samples of each stage.

An image difference captioning (IDC) dataset is a set of image pairs (before, after) with sentences that
say what changed. CLIP4IDC (Guo et al., 2022) trains on them twice: stage 1, "IDC adaptation" (paper
section 3.2), contrasts pair embeddings with caption embeddings; stage 2, "IDC finetuning" (section 3.3),
trains a captioner. This file turns the datasets people download into the samples of both stages.

It holds, top to bottom:
  1. ImagePair, the one record every reader returns, and the readers of the published layouts:
     CLEVR-Change, Spot-the-Diff, Image-Editing-Request (IER) and a simple JSON format for your own pairs;
  2. the synthetic dataset (`--data synth`, the project's default): CLEVR-Change-style scenes drawn here,
     with their captions and the synthetic CLIP's BPE vocabulary, written in the CLEVR-Change layout; and
     stage 0's single scenes with sentences naming their objects, on which that CLIP was pretrained;
  3. images: loading with readable errors, CLIP4IDC's preprocessing, an opt-in cache of preprocessed pixels;
  4. caption token ids;
  5. the samples: stage 1 (one per pair and caption), stage 2 (one per pair, plus the no-change pair),
     evaluation pairs with the scorer's ids and reference lists, ids per change type;
  6. a contact sheet of pairs with their captions, a loading benchmark, a check of a download, the command line.

The layouts (REFERENCE.md section 5), under the default roots (a `root` argument overrides them):
  data/clevr_change  images/CLEVR_default_XXXXXX.png, sc_images/CLEVR_semantic_XXXXXX.png,
                     nsc_images/CLEVR_nonsemantic_XXXXXX.png, change_captions.json, no_change_captions.json
                     (both keyed by the default image's file name), splits.json ({"train": [int, ...], ...};
                     some ids are in no split), type_mapping.json ({"color": ["XXXXXX.png", ...], ...});
                     optionally RCC's change_captions_with_bbox.json, the changed object's box in each image:
                     {"123": {"bbox_before": [x, y, w, h] or null, "bbox_after": [x, y, w, h] or null}, ...}
                     (pixels of the stored image; null where the object is not in that image: add, drop).
  data/spot          reformat_{train,val,test}.json, or the raw annotations/{train,val,test}.json whose
                     items repeat img_id (merged here, as CLIP4IDC's reformat_dataset.py does);
                     images/<img_id>.png (before) and images/<img_id>_2.png (after).
  data/ier           {train,valid,test}.json, lists of {"img0", "img1", "sents", "uid"}; images/<img0>, images/<img1>.
  data/pairs         your own pairs: {train,val,test}.json, each a list of
                       {"before": "a.png", "after": "b.png", "captions": ["..."],       (required)
                        "id": "...", "type": "...", "distractor": "c.png", "no_change_captions": ["..."]}
                     with paths relative to the JSON file's folder; "id" defaults to the item's position.
  data/synth         the CLEVR-Change layout with change_captions_with_bbox.json, plus bpe_synth_vocab.txt.gz
                     (its BPE merges, OpenAI's format) and synth_scenes.json (what was drawn, for tests).
  data/synth_scenes  stage 0 only: pixels_224.npy (every scene preprocessed, uint8), scenes.json (the objects
                     of each scene, the splits), bpe_synth_vocab.txt.gz.

What differs from the reference:
  - one reader per layout returns the same ImagePair records; the reference has a loader class per dataset
    and stage, and branches on the dataset's name; here "train on the no-change pair too" is the flag
    use_no_change_pair and the before/distractor swap happens wherever a pair has a distractor;
  - errors instead of asserts or skipping: a missing folder, file or image, an id without captions;
  - empty and whitespace-only captions (the published Spot-the-Diff files have some) are never training
    targets (the reference trains on them); they stay evaluation references, as in the reference's ground truth;
  - random choices (the 0.5 swap, the caption drawn in stage 2) use torch's generator, which DataLoader
    seeds per worker, instead of Python's random module;
  - images are float32 (the reference builds float64 arrays); an opt-in uint8 cache skips PNG decoding.

Run:  python data.py                                   draw a tiny synthetic set in a temp folder, print a sample
      python data.py --make-scenes DIR [--workers W]     draw stage 0's single scenes
      python data.py --make-synth DIR --pairs N [--seed S] [--workers W]
      python data.py --show [--data synth] [--split test] [--n 6] [--model-view] [--out sheet.png]
      python data.py --bench [--data synth] [--batch-size 16] [--batches 20]
      python data.py --check --data clevr|spot|ier|pairs [--data_root DIR]   after downloading: is it complete?

Shape letters: B pairs in a batch, R image side after preprocessing (224), T caption tokens (max_words, 32),
H, W height and width of a stored image (320 x 480 for CLEVR-Change and the synthetic set).
"""
import argparse
import gzip
import hashlib
import itertools
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

import clip

IMAGE_SIZE = 224           # CLIP4IDC resizes every image straight to 224 x 224 (REFERENCE 2.4)
MAX_WORDS = 32             # caption length in tokens, SOT and EOT included (REFERENCE 2.3, 3.3)
SWAP_PROB = 0.5            # stage 1, train only: chance that the before image is replaced by the distractor view
SPLITS = ("train", "val", "test")
CHANGE_TYPES = ("color", "material", "add", "drop", "move")  # CLEVR-Change's type_mapping.json keys
DISTRACTOR = "distractor"  # the type of a no-change pair; the papers' "DI" column
NO_CHANGE_SUFFIX = "_n"    # CLEVR-Change's evaluation id of the distractor pair: "000123.png_n"
SYNTH_BPE_FILE = "bpe_synth_vocab.txt.gz"
SYNTH_SCENES_FILE = "synth_scenes.json"
CHANGE_BOXES_FILE = "change_captions_with_bbox.json"  # RCC's file of the changed object's boxes (optional)


class DataError(ValueError):
    """Bad or missing input data; the message says what, where and how to fix it."""


# ---------------------------------------------------------------------------------------------------
# 1. Image pairs and the readers of the published layouts
# ---------------------------------------------------------------------------------------------------

@dataclass
class ImagePair:
    """One image pair of a split, as every reader returns it."""
    id: str                              # evaluation id: "000123.png" (CLEVR), "<img_id>.png" (Spot), uid (IER)
    before: Path
    after: Path
    captions: list[str]                  # change captions: training targets and evaluation references
    change_type: str | None = None       # one of CHANGE_TYPES where the dataset says (CLEVR-Change, synth)
    distractor: Path | None = None       # the before scene from another viewpoint or light (CLEVR's nsc image)
    no_change_captions: list[str] = field(default_factory=list)  # captions of the pair (before, distractor)
    change_boxes: dict | None = None     # {"before", "after": [x, y, w, h] or None}: the changed object, where known


def read_json(path: Path, what: str):
    if not path.is_file():
        raise DataError(f"{what}: {path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{what}: {path} is not valid JSON ({error}); download it again") from error


def checked_captions(captions, pair_id: str, where: Path) -> list[str]:
    """A non-empty list of strings, or an error naming the pair.

    Empty and whitespace-only strings are kept: the published Spot-the-Diff files hold some, and the papers'
    ground truth (C4I's gt/spot_total_change_captions_reformat.json) scores against them; training leaves
    them out (training_captions).
    """
    if not isinstance(captions, list) or not captions:
        raise DataError(f"pair {pair_id}: no captions in {where} (got {captions!r})")
    for caption in captions:
        if not isinstance(caption, str):
            raise DataError(f"pair {pair_id}: caption {caption!r} in {where} is not text; captions are strings")
    return captions


def training_captions(captions: list[str]) -> list[str]:
    """The captions a model may learn to write: all but the empty and whitespace-only ones."""
    # differs from reference: C4I trains on Spot-the-Diff's empty sentences too ([SOT, EOT] as the target)
    return [caption for caption in captions if caption.strip()]


def checked_items(items, keys: tuple[str, ...], path: Path) -> list[dict]:
    """A JSON list of objects that each have keys, or an error naming the file and the item."""
    if not isinstance(items, list):
        raise DataError(f"{path} should hold a JSON list of items, each with {list(keys)}")
    for position, item in enumerate(items):
        missing = [key for key in keys if not isinstance(item, dict) or key not in item]
        if missing:
            raise DataError(f"{path}, item {position}: missing {missing}; each item needs {list(keys)}")
    return items


def checked_files(pairs: list[ImagePair]) -> list[ImagePair]:
    """Fail now, naming the file, rather than hours into training when a worker reaches it (`--check` lists all)."""
    for pair in pairs:
        for path in (pair.before, pair.after, pair.distractor):
            if path is not None and not path.is_file():
                raise DataError(f"pair {pair.id}: image {path} is missing; download the dataset's images again")
    return pairs


def read_clevr_change(root: Path, split: str) -> list[ImagePair]:
    """CLEVR-Change (and the synthetic set): one pair per split id, with its distractor and no-change captions."""
    what = f"CLEVR-Change layout in {root}"
    splits = read_json(root / "splits.json", what)
    change = read_json(root / "change_captions.json", what)
    no_change = read_json(root / "no_change_captions.json", what)
    type_mapping = read_json(root / "type_mapping.json", what)
    if split not in splits:
        raise DataError(f"{root / 'splits.json'} has no split {split!r}; it has {sorted(splits)}")
    type_of = {name: kind for kind, names in type_mapping.items() for name in names}  # "000123.png" -> "color"
    boxes = read_change_boxes(root)
    pairs = []
    for number in splits[split]:  # ids are not contiguous: some are in no split (REFERENCE 5.1)
        number = int(number)
        key = f"CLEVR_default_{number:06d}.png"  # the caption files are keyed by the default image's name
        pair_id = f"{number:06d}.png"
        if key not in change:  # differs from reference: an error naming the id where C4I asserts
            raise DataError(f"split {split} id {number}: {key} has no entry in {root / 'change_captions.json'}")
        if key not in no_change:
            raise DataError(f"split {split} id {number}: {key} has no entry in {root / 'no_change_captions.json'}")
        if pair_id not in type_of:
            raise DataError(f"split {split} id {number}: {pair_id} is in no list of {root / 'type_mapping.json'}")
        pairs.append(ImagePair(
            id=pair_id,
            before=root / "images" / key,
            after=root / "sc_images" / f"CLEVR_semantic_{number:06d}.png",
            captions=checked_captions(change[key], pair_id, root / "change_captions.json"),
            change_type=type_of[pair_id],
            distractor=root / "nsc_images" / f"CLEVR_nonsemantic_{number:06d}.png",
            no_change_captions=checked_captions(no_change[key], pair_id, root / "no_change_captions.json"),
            change_boxes=boxes.get(str(number))))
    return pairs


def read_change_boxes(root: Path) -> dict[str, dict]:
    """RCC's change_captions_with_bbox.json if the folder has it: {"123": {"before", "after": [x, y, w, h] or None}}.

    Only its two box fields are read; an empty box (null or []) means the object is not in that image.
    """
    path = root / CHANGE_BOXES_FILE
    if not path.is_file():
        return {}
    boxes = {}
    for number, entry in read_json(path, "boxes of the changed objects").items():
        if not str(number).isdigit():
            raise DataError(f"{path}: key {number!r} is not a pair number such as \"123\"; download RCC's file again")
        pair = {}
        for image in ("before", "after"):
            box = entry.get(f"bbox_{image}") if isinstance(entry, dict) else None
            if box and not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
                raise DataError(f"{path}, id {number}: bbox_{image} should be [x, y, width, height] in pixels or "
                                f"null, got {box!r}; download RCC's file again")
            pair[image] = [float(v) for v in box] if box else None
        boxes[str(int(number))] = pair
    return boxes


def read_spot_the_diff(root: Path, split: str) -> list[ImagePair]:
    """Spot-the-Diff: items merged by img_id (raw annotations repeat it), sentences concatenated in file order."""
    candidates = [root / f"reformat_{split}.json", root / "annotations" / f"{split}.json"]
    found = [path for path in candidates if path.is_file()]
    if not found:
        raise DataError(f"Spot-the-Diff split {split}: neither {candidates[0]} nor {candidates[1]} exists; "
                        f"put CLIP4IDC's reformat_{split}.json or spot-the-diff's data/annotations/{split}.json there")
    items = checked_items(read_json(found[0], "Spot-the-Diff"), ("img_id", "sentences"), found[0])
    sentences: dict[str, list[str]] = {}  # img_id -> sentences; dicts keep first-seen order
    for position, item in enumerate(items):
        if not isinstance(item["sentences"], list):
            raise DataError(f"{found[0]}, item {position} (img_id {item['img_id']}): sentences should be a list of "
                            f"strings, got {item['sentences']!r}")
        sentences.setdefault(str(item["img_id"]), []).extend(item["sentences"])
    return [ImagePair(id=f"{img_id}.png", before=root / "images" / f"{img_id}.png",
                      after=root / "images" / f"{img_id}_2.png",
                      captions=checked_captions(texts, f"{img_id}.png", found[0]))
            for img_id, texts in sentences.items()]


def read_ier(root: Path, split: str) -> list[ImagePair]:
    """Image-Editing-Request: one pair per datum, identified by its uid; requests are kept as written (mixed case)."""
    path = root / f"{'valid' if split == 'val' else split}.json"  # IER calls its validation split "valid"
    pairs, seen = [], set()
    for datum in checked_items(read_json(path, "Image-Editing-Request"), ("img0", "img1", "sents", "uid"), path):
        uid = datum["uid"]
        if uid in seen:
            raise DataError(f"{path}: uid {uid} appears twice; evaluation ids must be unique")
        seen.add(uid)
        pairs.append(ImagePair(id=uid, before=root / "images" / datum["img0"], after=root / "images" / datum["img1"],
                               captions=checked_captions(datum["sents"], uid, path)))
    return pairs


def read_user_pairs(root: Path, split: str) -> list[ImagePair]:
    """Your own pairs: root/<split>.json, a list of
    {before, after, captions[, id, type, distractor, no_change_captions]} (see the docstring at the top)."""
    path = root / f"{split}.json"
    pairs, seen = [], set()
    items = checked_items(read_json(path, "image pairs"), ("before", "after", "captions"), path)
    for position, item in enumerate(items):
        pair_id = str(item.get("id", position))
        if pair_id in seen:
            raise DataError(f"{path}: id {pair_id} appears twice")
        seen.add(pair_id)
        distractor = item.get("distractor")
        pairs.append(ImagePair(
            id=pair_id, before=root / item["before"], after=root / item["after"],
            captions=checked_captions(item["captions"], pair_id, path), change_type=item.get("type"),
            distractor=root / distractor if distractor else None,
            no_change_captions=checked_captions(item["no_change_captions"], pair_id, path)
            if "no_change_captions" in item else []))
    return pairs


@dataclass(frozen=True)
class Source:
    """Where a dataset lives by default, which reader reads it, and where to get it."""
    name: str
    root: str
    reader: Callable[[Path, str], list[ImagePair]]
    get_it: str


SOURCES = {
    "synth": Source("the synthetic dataset", "data/synth", read_clevr_change,
                    "it is drawn there on first use by --data synth, or now with: python data.py --make-synth DIR"),
    "clevr": Source("CLEVR-Change", "data/clevr_change", read_clevr_change,
                    "download clevr_change.tar.gz (Google Drive link in the README of "
                    "github.com/Seth-Park/RobustChangeCaptioning), extract it, and move its data/ folder there"),
    "spot": Source("Spot-the-Diff", "data/spot", read_spot_the_diff,
                   "put the annotations of github.com/harsh19/spot-the-diff (data/annotations/*.json, or "
                   "CLIP4IDC's reformat_*.json) there, and the images (link in spot-the-diff's "
                   "data/get_images.txt) in its images/ folder"),
    "ier": Source("Image-Editing-Request", "data/ier", read_ier,
                  "put {train,valid,test}.json of github.com/airsplay/VisualRelationships (dataset/adobe/) "
                  "there, and the images (link in its README) in its images/ folder"),
    "pairs": Source("your image pairs", "data/pairs", read_user_pairs,
                    "write {train,val,test}.json there, lists of {\"before\", \"after\", \"captions\"} "
                    "(format in data.py's docstring)"),
}


def dataset_root(data: str, root: str | os.PathLike | None = None) -> Path:
    if data not in SOURCES:
        raise DataError(f"unknown dataset {data!r}; choose one of {sorted(SOURCES)}")
    return Path(root if root is not None else SOURCES[data].root)


def load_split(data: str, split: str, root: str | os.PathLike | None = None,
               synth: "SynthConfig | None" = None) -> list[ImagePair]:
    """The pairs of one split of a dataset ("synth", "clevr", "spot", "ier" or "pairs").

    The synthetic dataset is drawn first when its folder does not exist (with `synth`, or the defaults).
    """
    root = dataset_root(data, root)
    if data == "synth":
        ensure_synth(root, synth)
    if not root.is_dir():
        raise DataError(f"{SOURCES[data].name}: no folder {root}; {SOURCES[data].get_it} (or pass its path as root)")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {SPLITS}")
    pairs = checked_files(SOURCES[data].reader(root, split))
    note = empty_caption_note(f"{SOURCES[data].name} {split}", pairs)
    if note and os.environ.get("RANK", "0") == "0":  # under torchrun every process reads; the first one says so
        print(note)
    return pairs


def empty_caption_note(what: str, pairs: list[ImagePair]) -> str | None:
    """One line on the empty captions of a split, or None when it has none: 'Spot-the-Diff train: 3 pairs,
    6 sentences, 3 empty (1 pairs without any) left out of training; evaluation keeps them as references'."""
    captions = sum(len(pair.captions) for pair in pairs)
    empty = captions - sum(len(training_captions(pair.captions)) for pair in pairs)
    no_change_empty = sum(len(p.no_change_captions) - len(training_captions(p.no_change_captions)) for p in pairs)
    if not empty and not no_change_empty:
        return None
    without = sum(not training_captions(pair.captions) for pair in pairs)
    also = f", and {no_change_empty:,} empty no-change captions" if no_change_empty else ""
    return (f"{what}: {len(pairs):,} pairs, {captions:,} sentences, {empty:,} empty ({without:,} pairs without any)"
            f"{also} left out of training; evaluation keeps them as references")


def bpe_path(data: str, root: str | os.PathLike | None = None) -> Path | None:
    """The vocabulary a dataset tokenizes with: synth brings its own, the others use CLIP's (None: clip.py finds it)."""
    return dataset_root(data, root) / SYNTH_BPE_FILE if data == "synth" else None


# ---------------------------------------------------------------------------------------------------
# 2. The synthetic dataset: CLEVR-Change-style scenes, captions, a BPE vocabulary, drawing, writing
# ---------------------------------------------------------------------------------------------------
# A scene is a list of objects {"shape", "color", "material", "size", "x", "y"} on a grey floor, (x, y) the
# object's centre in pixels of the 480 x 320 image. Each pair changes one object in one of CLEVR-Change's
# five ways; its distractor shows the unchanged scene after a small camera shift, zoom or light change.
# Unlike CLEVR, objects never overlap or hide each other and there is no perspective (an object's size
# does not depend on its depth), so that every change can be seen: after the 224 x 224 resize a small
# object still covers about 21 x 32 pixels. Same config, same bytes (on the same numpy and zlib).

@dataclass
class SynthConfig:
    pairs: int = 2000                 # scenes; each gives one change pair and one distractor pair
    seed: int = 0
    width: int = 480                  # CLEVR v1.0's image size
    height: int = 320
    min_objects: int = 3              # objects per scene, as CLEVR-Change
    max_objects: int = 6              # with our large objects, 6 leave room to move one far enough
    captions_per_pair: int = 6        # distinct change captions per pair
    no_change_per_pair: int = 6       # distinct no-change captions per distractor pair
    short_form_rate: float = 0.3      # chance that a caption names the object by its fewest unique attributes
    synonym_rate: float = 0.2         # chance that a word is replaced by a synonym ("tiny", "shiny", "block")
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)  # train, val, test, per change type
    png_level: int = 1                # zlib level of the PNGs: fast to write, about 50 KB per image


COLORS = {  # CLEVR's colours (clevr-dataset-gen image_generation/data/properties.json), RGB
    "gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
    "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}
SHAPES = ("cube", "sphere", "cylinder")
MATERIALS = ("rubber", "metal")
SIZES = ("small", "large")
SIZE_RADIUS = {"small": 32, "large": 50}  # pixels at 480 x 320. Larger than CLEVR's: after the resize to 224, a
# small object spans about one 32-pixel patch, which a model trained from scratch in minutes can see
FOOTPRINT = 1.25                 # an object's extent / its radius (a cube's corner reaches 1.23 r)
GAP = 6                          # pixels between two objects' footprints
MARGIN = (14, 34, 14)            # pixels kept free at the side, top and bottom (the top leaves room for zoom)
MOVE_MIN = 110                   # a moved object travels at least this far (a camera shift is at most 16)
PLACE_TRIES = 200                # random positions tried before a scene is drawn again

# The caption grammar. The first word of each tuple is the canonical one; the others are synonyms
# (REFERENCE 5.1; clevr-dataset-gen question_generation/synonyms.json).
SIZE_WORDS = {"small": ("small", "tiny"), "large": ("large", "big")}
MATERIAL_WORDS = {"rubber": ("rubber", "matte"), "metal": ("metal", "shiny", "metallic")}
SHAPE_WORDS = {"cube": ("cube", "block"), "sphere": ("sphere", "ball"), "cylinder": ("cylinder",)}
NOUN_WORDS = ("object", "thing")  # the noun when the shape is not needed to tell the object apart
VERB_PHRASES = {
    "color": ("changed to {new}", "turned {new}", "became {new}"),
    "material": ("changed to {new}", "turned {new}", "became {new}"),
    "add": ("has appeared", "has been newly placed", "has been added"),
    "drop": ("has disappeared", "is missing", "is gone", "is no longer there"),
    "move": ("changed its location", "is in a different location", "has moved")}
NO_CHANGE_SENTENCES = (
    "the scene remains the same", "nothing has changed", "nothing was modified", "the two scenes seem identical",
    "the scene is the same as before", "no change was made", "no change has occurred", "there is no change",
    "there is no difference")
ATTRIBUTE_ORDER = ("size", "color", "material", "shape")  # the order words take in a referring expression
ATTRIBUTE_PREFERENCE = ("color", "shape", "size", "material")  # which attributes a short form tries first

# The distractor: one or two of these, with magnitudes drawn from these ranges.
DISTRACTOR_KINDS = ("viewpoint", "zoom", "illumination")
SHIFT_X, SHIFT_Y = (8, 16), (5, 10)  # camera shift in pixels, either sign
ZOOMS = (0.92, 1.08)                 # two levels, so that few zoomed objects need drawing and caching
GAIN = (0.12, 0.22)                  # brightness change, either sign
TILT = 0.15                          # at most this much brighter on one side than the other

SCENE_STREAM, SPLIT_STREAM = 1, 2    # seeds [seed, stream, ...]: pairs and splits draw from separate streams
CAPTION_CHARACTERS = set("abcdefghijklmnopqrstuvwxyz ")  # lower-case words and spaces only


def words_of(obj: dict) -> dict:
    return {"size": SIZE_WORDS[obj["size"]], "color": (obj["color"],),
            "material": MATERIAL_WORDS[obj["material"]], "shape": SHAPE_WORDS[obj["shape"]]}


def pick(rng: np.random.Generator, words: tuple, synonym_rate: float) -> str:
    if len(words) > 1 and rng.random() < synonym_rate:
        return words[1 + int(rng.integers(len(words) - 1))]
    return words[0]


def unique_attributes(obj: dict, scene: list[dict]) -> tuple[str, ...]:
    """The fewest attributes that tell obj apart from every other object of the scene."""
    for count in range(1, len(ATTRIBUTE_ORDER) + 1):
        for chosen in itertools.combinations(ATTRIBUTE_PREFERENCE, count):
            matching = [other for other in scene if all(other[a] == obj[a] for a in chosen)]
            if matching == [obj]:
                return chosen
    raise AssertionError(f"two objects of a scene look the same: {obj}")  # sample_object prevents it


def referring_expression(rng: np.random.Generator, obj: dict, scene: list[dict], cfg: SynthConfig) -> str:
    """'the small red metal cube', or the short form 'the red cube' / 'the red object' when that is unique."""
    chosen = unique_attributes(obj, scene) if rng.random() < cfg.short_form_rate else ATTRIBUTE_ORDER
    words = words_of(obj)
    parts = [pick(rng, words[a], cfg.synonym_rate) for a in ATTRIBUTE_ORDER if a in chosen]
    if "shape" not in chosen:
        parts.append(pick(rng, NOUN_WORDS, cfg.synonym_rate))
    return " ".join(["the", *parts])


def change_captions(rng: np.random.Generator, scene: dict, cfg: SynthConfig) -> list[str]:
    """captions_per_pair distinct sentences '<referring expression> <verb phrase>' for the pair's change."""
    kind = scene["type"]
    index = scene["changed"]["after" if kind == "add" else "before"]
    objects = scene["after" if kind == "add" else "before"]  # an added object is named in the after scene
    obj = objects[index]
    if kind in ("color", "material"):
        new_words = words_of(scene["after"][index])[kind]
    captions = []
    for _ in range(100 * cfg.captions_per_pair):
        phrase = VERB_PHRASES[kind][int(rng.integers(len(VERB_PHRASES[kind])))]
        if kind in ("color", "material"):
            phrase = phrase.format(new=pick(rng, new_words, cfg.synonym_rate))
        caption = f"{referring_expression(rng, obj, objects, cfg)} {phrase}"
        if caption not in captions:
            captions.append(caption)
        if len(captions) == cfg.captions_per_pair:
            break
    return captions


def no_change_captions(rng: np.random.Generator, cfg: SynthConfig) -> list[str]:
    chosen = rng.choice(len(NO_CHANGE_SENTENCES), size=min(cfg.no_change_per_pair, len(NO_CHANGE_SENTENCES)),
                        replace=False)
    return [NO_CHANGE_SENTENCES[i] for i in chosen]


def place(rng: np.random.Generator, size: str, others: list[dict], cfg: SynthConfig,
          away_from: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """A free position for an object of this size, MOVE_MIN away from away_from if given; None if none found."""
    reach = FOOTPRINT * SIZE_RADIUS[size]
    for _ in range(PLACE_TRIES):
        x = int(rng.integers(int(MARGIN[0] + reach), int(cfg.width - MARGIN[0] - reach) + 1))
        y = int(rng.integers(int(MARGIN[1] + reach), int(cfg.height - MARGIN[2] - reach) + 1))
        if away_from is not None and np.hypot(x - away_from[0], y - away_from[1]) < MOVE_MIN:
            continue
        if all(np.hypot(x - o["x"], y - o["y"]) >= reach + FOOTPRINT * SIZE_RADIUS[o["size"]] + GAP for o in others):
            return x, y
    return None


def random_attributes(rng: np.random.Generator) -> dict:
    return {"shape": SHAPES[int(rng.integers(len(SHAPES)))], "color": list(COLORS)[int(rng.integers(len(COLORS)))],
            "material": MATERIALS[int(rng.integers(len(MATERIALS)))], "size": SIZES[int(rng.integers(len(SIZES)))]}


def looks_unique(attributes: dict, others: list[dict]) -> bool:
    """No other object has all four attributes the same, so a full description names exactly one object."""
    return all(any(attributes[a] != other[a] for a in ATTRIBUTE_ORDER) for other in others)


def sample_object(rng: np.random.Generator, others: list[dict], cfg: SynthConfig) -> dict | None:
    for _ in range(PLACE_TRIES):
        attributes = random_attributes(rng)
        if looks_unique(attributes, others):
            position = place(rng, attributes["size"], others, cfg)
            return None if position is None else {**attributes, "x": position[0], "y": position[1]}
    return None


def sample_objects(rng: np.random.Generator, n: int, cfg: SynthConfig) -> list[dict] | None:
    objects = []
    for _ in range(n):
        obj = sample_object(rng, objects, cfg)
        if obj is None:
            return None
        objects.append(obj)
    return objects


def apply_change(rng: np.random.Generator, kind: str, before: list[dict], cfg: SynthConfig) -> dict | None:
    """The after scene and the changed object's index in each scene; None when this scene does not allow it."""
    i = int(rng.integers(len(before)))
    obj, others = before[i], before[:i] + before[i + 1:]
    if kind == "add":
        new = sample_object(rng, before, cfg)
        return None if new is None else {"after": [*before, new], "changed": {"before": None, "after": len(before)}}
    if kind == "drop":
        return {"after": others, "changed": {"before": i, "after": None}}
    if kind == "move":
        position = place(rng, obj["size"], others, cfg, away_from=(obj["x"], obj["y"]))
        if position is None:
            return None
        changed = {**obj, "x": position[0], "y": position[1]}
    else:  # color or material: a new value that keeps every object's full description unique
        values = [v for v in (COLORS if kind == "color" else MATERIALS) if v != obj[kind]]
        values = [values[j] for j in rng.permutation(len(values))]
        candidates = [{**obj, kind: v} for v in values if looks_unique({**obj, kind: v}, others)]
        if not candidates:
            return None
        changed = candidates[0]
    return {"after": before[:i] + [changed] + before[i + 1:], "changed": {"before": i, "after": i}}


def random_sign(rng: np.random.Generator) -> int:
    return 1 if rng.random() < 0.5 else -1


def sample_view(rng: np.random.Generator, objects: list[dict], cfg: SynthConfig) -> dict:
    """The distractor's camera and light: one or two of viewpoint, zoom, illumination; objects stay in frame."""
    for _ in range(PLACE_TRIES):
        kinds = set(rng.choice(DISTRACTOR_KINDS, size=1 + int(rng.integers(2)), replace=False).tolist())
        view = {"shift": [0, 0], "zoom": 1.0, "gain": 1.0, "tilt": 0.0}
        if "viewpoint" in kinds:
            view["shift"] = [random_sign(rng) * int(rng.integers(SHIFT_X[0], SHIFT_X[1] + 1)),
                             random_sign(rng) * int(rng.integers(SHIFT_Y[0], SHIFT_Y[1] + 1))]
        if "zoom" in kinds:
            view["zoom"] = ZOOMS[int(rng.integers(len(ZOOMS)))]
        if "illumination" in kinds:
            view["gain"] = round(1 + random_sign(rng) * float(rng.uniform(*GAIN)), 3)
            view["tilt"] = round(float(rng.uniform(-TILT, TILT)), 3)
        in_frame = all(0.6 * r <= x <= cfg.width - 0.6 * r and 0.6 * r <= y <= cfg.height - 0.6 * r
                       for x, y, r in (view_position(o, view, cfg) for o in objects))
        if in_frame:
            return view
    return {"shift": [0, 0], "zoom": 1.0, "gain": 1 - GAIN[1], "tilt": 0.0}  # light only: always in frame


def view_position(obj: dict, view: dict, cfg: SynthConfig) -> tuple[int, int, float]:
    """Where the camera of view draws obj: centre (x, y) and radius, zoomed about the image centre, then shifted."""
    zoom = view["zoom"]
    x = round(cfg.width / 2 + (obj["x"] - cfg.width / 2) * zoom + view["shift"][0])
    y = round(cfg.height / 2 + (obj["y"] - cfg.height / 2) * zoom + view["shift"][1])
    return x, y, SIZE_RADIUS[obj["size"]] * zoom


def synth_scene(pair_id: int, cfg: SynthConfig) -> dict:
    """Everything about pair pair_id except its pixels: scenes, change, distractor view, captions.

    Its random numbers come from the seed and the pair id alone, so any process draws the same pair.
    """
    rng = np.random.default_rng([cfg.seed, SCENE_STREAM, pair_id])
    kind = CHANGE_TYPES[pair_id % len(CHANGE_TYPES)]
    low = cfg.min_objects + (kind == "drop")   # a dropped object leaves at least min_objects
    high = cfg.max_objects - (kind == "add")   # an added one makes at most max_objects
    while True:  # draw again until the scene has room for its objects and its change
        before = sample_objects(rng, int(rng.integers(low, high + 1)), cfg)
        change = apply_change(rng, kind, before, cfg) if before is not None else None
        if change is not None:
            break
    scene = {"type": kind, "before": before, **change, "distractor": sample_view(rng, before, cfg)}
    scene["captions"] = change_captions(rng, scene, cfg)
    scene["no_change_captions"] = no_change_captions(rng, cfg)
    return scene


# --- drawing ---------------------------------------------------------------------------------------
# Objects are drawn as sprites: shaded with a Blinn-Phong light in numpy at SUPERSAMPLE x the resolution,
# averaged down (anti-aliasing), cached per (shape, colour, material, radius). A scene is the floor, the
# soft shadows, then the sprites from back (small y) to front, alpha-blended.

SUPERSAMPLE = 3
LIGHT = np.float32([-0.448, -0.647, 0.617])    # unit vector to the light: from the upper left, towards us
HALFWAY = np.float32([-0.249, -0.360, 0.899])  # Blinn's half vector between the light and the viewer (0, 0, 1)
STRIPE = np.float32([-0.38, 0.0, 0.92])        # a metal cylinder's vertical highlight
FLOOR = 150.0                          # floor grey level at the top; it brightens towards the camera


def shade(normals: np.ndarray, color: tuple, material: str) -> np.ndarray:
    """RGB in [0, 255] of surface normals (..., 3); x right, y down, z towards the viewer."""
    base = np.asarray(color, np.float32) / 255
    diffuse = np.clip(normals @ LIGHT, 0, 1)[..., None]
    specular = np.clip(normals @ HALFWAY, 0, 1)[..., None]
    if material == "rubber":  # matte: mostly diffuse, a faint wide sheen
        rgb = base * (0.38 + 0.72 * diffuse) + 0.06 * specular ** 8
    else:  # metal: darker body, sky reflected from above, a sharp white highlight
        sky = 0.5 - 0.5 * normals[..., 1:2]
        rgb = base * (0.12 + 0.55 * diffuse + 0.45 * sky * diffuse) + 0.95 * specular ** 60 + 0.25 * specular ** 8
    return np.clip(rgb, 0, 1) * 255


@lru_cache(maxsize=None)
def sprite(shape: str, color: str, material: str, radius: float) -> tuple[np.ndarray, np.ndarray, int]:
    """A drawn object: premultiplied RGB (S, S, 3), alpha (S, S), and half the side S; its centre at (S/2, S/2)."""
    half = int(np.ceil(radius * FOOTPRINT)) + 2
    fine = ((np.arange(2 * half * SUPERSAMPLE) + 0.5) / SUPERSAMPLE - half).astype(np.float32)  # pixels from the centre
    y, x = np.meshgrid(fine, fine, indexing="ij")
    rgb = np.zeros((*x.shape, 3), np.float32)
    alpha = np.zeros(x.shape, np.float32)
    bulge = 0.6 if material == "metal" else 0.15  # a flat face's normal tilts a little across it: soft gradients

    def paint(mask, normals):
        normals = normals / np.linalg.norm(normals, axis=-1, keepdims=True)
        rgb[mask] = shade(normals, COLORS[color], material)
        alpha[mask] = 1

    if shape == "sphere":
        d2 = (x * x + y * y) / radius ** 2
        inside = d2 <= 1
        paint(inside, np.stack([x / radius, y / radius, np.sqrt(np.clip(1 - d2, 0, 1))], -1)[inside])
    elif shape == "cube":  # a front square, the top and the right side seen obliquely
        s, d = 0.82 * radius, 0.41 * radius            # half the edge, the depth offset
        x0, x1, y0, y1 = -s - d / 2, s - d / 2, -s + d / 2, s + d / 2  # the front face
        front = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
        top = (y >= y0 - d) & (y < y0) & (x >= x0 + y0 - y) & (x <= x1 + y0 - y)
        side = (x > x1) & (x <= x1 + d) & (y >= y0 - (x - x1)) & (y <= y1 - (x - x1))
        for mask, normal in ((front, (0, 0, 1)), (top, (0, -0.85, 0.53)), (side, (0.85, 0, 0.53))):
            u, v = (x[mask] - (x0 + x1) / 2) / s, (y[mask] - (y0 + y1) / 2) / s
            paint(mask, np.stack([normal[0] + bulge * 0.5 * u, normal[1] + bulge * 0.5 * v,
                                  np.full_like(u, normal[2])], -1))
    else:  # cylinder: a shaded body and an elliptic top
        rx = 0.8 * radius
        ry, height = 0.32 * rx, 1.45 * rx
        top_y = -height / 2 - 0.2 * ry
        bottom_y = top_y + height
        top = (x / rx) ** 2 + ((y - top_y) / ry) ** 2 <= 1
        bottom = (x / rx) ** 2 + ((y - bottom_y) / ry) ** 2 <= 1
        body = (np.abs(x) <= rx) & (((y >= top_y) & (y <= bottom_y)) | bottom)
        body &= ~top
        nx = np.clip(x[body] / rx, -1, 1)
        paint(body, np.stack([nx, np.zeros_like(nx), np.sqrt(1 - nx ** 2)], -1))
        if material == "metal":
            stripe = np.clip(np.stack([nx, np.zeros_like(nx), np.sqrt(1 - nx ** 2)], -1) @ STRIPE, 0, 1) ** 40
            rgb[body] = np.clip(rgb[body] + 230 * stripe[:, None], 0, 255)
        u = x[top] / rx
        paint(top, np.stack([bulge * 0.4 * u, np.full_like(u, -0.92), np.full_like(u, 0.39)], -1))

    rgb *= alpha[..., None]  # premultiplied, so that averaging blends edges with the background correctly
    offsets = list(itertools.product(range(SUPERSAMPLE), repeat=2))
    rgb = sum(rgb[i::SUPERSAMPLE, j::SUPERSAMPLE] for i, j in offsets) / len(offsets)  # (S, S, 3)
    alpha = sum(alpha[i::SUPERSAMPLE, j::SUPERSAMPLE] for i, j in offsets) / len(offsets)  # (S, S)
    return rgb, alpha, half


@lru_cache(maxsize=None)
def shadow(radius: float) -> tuple[np.ndarray, int]:
    """A soft elliptic shadow's darkness (S, S) in [0, 0.5] and half its side."""
    half = int(np.ceil(radius * 1.6)) + 2
    fine = np.arange(2 * half) + 0.5 - half
    y, x = np.meshgrid(fine, fine, indexing="ij")
    distance = np.sqrt((x / (1.15 * radius)) ** 2 + (y / (0.5 * radius)) ** 2)
    return (np.clip(1.3 * (1 - distance), 0, 1) ** 1.5 * 0.5).astype(np.float32), half


@lru_cache(maxsize=4)
def floor(width: int, height: int) -> np.ndarray:
    """The empty floor (H, W, 3), float32 in [0, 255]: lighter towards the camera, darker at the sides."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    grey = FLOOR + 25 * y / height - 72 * ((x - width / 2) / width) ** 2
    return np.repeat(grey[..., None], 3, axis=-1) * np.array([1.0, 1.0, 1.02], np.float32)


def window(canvas: np.ndarray, x: int, y: int, half: int):
    """The part of canvas under a (2 half)-wide square centred at (x, y), and the matching part of the square."""
    height, width = canvas.shape[:2]
    x0, y0 = x - half, y - half
    cx0, cy0, cx1, cy1 = max(x0, 0), max(y0, 0), min(x0 + 2 * half, width), min(y0 + 2 * half, height)
    return (slice(cy0, cy1), slice(cx0, cx1)), (slice(cy0 - y0, cy1 - y0), slice(cx0 - x0, cx1 - x0))


IDENTITY_VIEW = {"shift": [0, 0], "zoom": 1.0, "gain": 1.0, "tilt": 0.0}


def render(objects: list[dict], cfg: SynthConfig, view: dict = IDENTITY_VIEW) -> np.ndarray:
    """The scene seen by the camera and light of view -> uint8 (H, W, 3)."""
    canvas = floor(cfg.width, cfg.height).copy()  # (H, W, 3)
    placed = [(view_position(o, view, cfg), o) for o in objects]  # ((x, y, r), object)
    placed.sort(key=lambda item: (item[0][1], item[0][0]))  # back to front: by y, then x
    for (x, y, radius), obj in placed:
        darkness, half = shadow(radius)
        on_canvas, on_shadow = window(canvas, x + int(0.45 * radius), y + int(0.75 * radius), half)
        canvas[on_canvas] *= 1 - darkness[on_shadow][..., None]
    for (x, y, radius), obj in placed:
        rgb, alpha, half = sprite(obj["shape"], obj["color"], obj["material"], radius)
        on_canvas, on_sprite = window(canvas, x, y, half)
        under = canvas[on_canvas]
        under *= 1 - alpha[on_sprite][..., None]
        under += rgb[on_sprite]
    if view["gain"] != 1.0 or view["tilt"] != 0.0:  # the light: brighter or darker, more on one side
        ramp = np.linspace(-1, 1, cfg.width, dtype=np.float32)
        canvas *= (view["gain"] * (1 + view["tilt"] * ramp))[None, :, None]
    return np.clip(canvas, 0, 255, out=canvas).astype(np.uint8)


def write_png(path: Path, pixels: np.ndarray, level: int) -> None:
    """An RGB PNG with no row filter and zlib at level: 3x faster than Pillow's encoder, which tries filters."""
    height, width, _ = pixels.shape
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row starts with its filter type, 0 ("None")
    rows[:, 1:] = pixels.reshape(height, -1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, colour type 2 (RGB), no interlace
    pixels_chunk = chunk(b"IDAT", zlib.compress(rows.tobytes(), level))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + pixels_chunk + chunk(b"IEND", b""))


def draw_pairs(root: Path, first: int, stop: int, cfg: SynthConfig) -> list[dict]:
    """Draw pairs first..stop-1 and write their three images; return their scenes (run in a worker process)."""
    scenes = []
    for pair_id in range(first, stop):
        scene = synth_scene(pair_id, cfg)
        write_png(root / "images" / f"CLEVR_default_{pair_id:06d}.png", render(scene["before"], cfg), cfg.png_level)
        write_png(root / "sc_images" / f"CLEVR_semantic_{pair_id:06d}.png", render(scene["after"], cfg), cfg.png_level)
        write_png(root / "nsc_images" / f"CLEVR_nonsemantic_{pair_id:06d}.png",
                  render(scene["before"], cfg, scene["distractor"]), cfg.png_level)
        scenes.append(scene)
    return scenes


# --- splits and the BPE vocabulary ------------------------------------------------------------------

EVAL_PAIRS_PER_TYPE = 40  # at most this many validation (and test) pairs of each type: 200, however many are drawn


def synth_splits(cfg: SynthConfig) -> dict[str, list[int]]:
    """Each change type's ids shuffled and cut by split_fractions (validation and test capped at
    EVAL_PAIRS_PER_TYPE), so every split has every type evenly and more pairs drawn go to training."""
    rng = np.random.default_rng([cfg.seed, SPLIT_STREAM])
    splits = {name: [] for name in SPLITS}
    for t in range(len(CHANGE_TYPES)):
        ids = [int(i) for i in rng.permutation(np.arange(t, cfg.pairs, len(CHANGE_TYPES)))]
        n_val = min(EVAL_PAIRS_PER_TYPE, max(1, round(cfg.split_fractions[1] * len(ids)))) if len(ids) >= 3 else 0
        n_test = min(EVAL_PAIRS_PER_TYPE, max(1, round(cfg.split_fractions[2] * len(ids)))) if len(ids) >= 3 else 0
        splits["val"] += ids[:n_val]
        splits["test"] += ids[n_val:n_val + n_test]
        splits["train"] += ids[n_val + n_test:]
    return {name: [ids[i] for i in rng.permutation(len(ids))] for name, ids in splits.items()}  # types mixed


def grammar_words() -> set[str]:
    """Every word the caption grammar can produce."""
    texts = [*SIZE_WORDS.values(), *MATERIAL_WORDS.values(), *SHAPE_WORDS.values(), NOUN_WORDS, COLORS,
             *VERB_PHRASES.values(), NO_CHANGE_SENTENCES, ["the"]]
    return {w for group in texts for text in group for w in text.replace("{new}", "").split()}


def learn_bpe(word_counts: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges learned from word counts until every word is one symbol (Sennrich et al., 2016).

    Words are characters with "</w>" on the last one, as CLIP's tokenizer splits them. Each step merges
    the adjacent pair of symbols that occurs most often, counted over the corpus; ties go to the pair that
    sorts first, so the result depends on the counts alone.
    """
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): count for w, count in word_counts.items()}
    merges = []
    while True:
        pair_counts = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            return merges
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        merged_words = {}
        for symbols, count in words.items():
            merged_words[tuple(clip.merge_pair(symbols, best))] = count  # the tokenizer's own merge step
        words = merged_words


def write_bpe(path: Path, merges: list[tuple[str, str]]) -> None:
    """OpenAI's merges format: gzip text, a #version line, one "a b" per line; mtime 0 so the bytes repeat."""
    text = "\n".join(["#version: 0.2", *(f"{a} {b}" for a, b in merges)])
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode("utf-8"))


def synth_vocabulary() -> list[tuple[str, str]]:
    """Merges learned from every word of the grammar, each counted once, so that every word is one token.

    It depends on the grammar alone, not on the scenes drawn: like OpenAI's vocabulary it belongs to the
    (synthetic) CLIP, which stage 0 pretrains with it, and every dataset drawn here shares it.
    """
    return learn_bpe({word: 1 for word in sorted(grammar_words() | {DESCRIPTION_JOIN})})


# --- the changed object's boxes ---------------------------------------------------------------------

@lru_cache(maxsize=None)
def sprite_extent(shape: str, radius: float) -> tuple[int, int, int, int]:
    """Where a drawn object is at least half opaque: (left, top, right, bottom) in pixels from its centre."""
    _, alpha, half = sprite(shape, "gray", "rubber", radius)  # the outline depends on shape and size alone
    rows, columns = np.nonzero(alpha >= 0.5)
    return (int(columns.min()) - half, int(rows.min()) - half,
            int(columns.max()) + 1 - half, int(rows.max()) + 1 - half)


def change_boxes(scene: dict, cfg: SynthConfig) -> dict:
    """RCC's entry for a pair: the changed object's [x, y, w, h] in the before and the after image, or None.

    color, material: the same box twice; move: its old and its new place; drop: before only; add: after only.
    """
    entry = {}
    for image in ("before", "after"):
        index = scene["changed"][image]
        if index is None:
            entry[f"bbox_{image}"] = None
            continue
        obj = scene[image][index]
        left, top, right, bottom = sprite_extent(obj["shape"], SIZE_RADIUS[obj["size"]])
        x0, y0 = max(obj["x"] + left, 0), max(obj["y"] + top, 0)
        x1, y1 = min(obj["x"] + right, cfg.width), min(obj["y"] + bottom, cfg.height)
        entry[f"bbox_{image}"] = [x0, y0, x1 - x0, y1 - y0]
    return entry


def write_change_boxes(root: Path, scenes: list[dict], cfg: SynthConfig) -> None:
    """root/change_captions_with_bbox.json in RCC's format, keyed by the pair number ("0", "1", ...)."""
    boxes = {str(i): change_boxes(scene, cfg) for i, scene in enumerate(scenes)}
    partial = root / f".{CHANGE_BOXES_FILE}.partial-{os.getpid()}"
    partial.write_text(json.dumps(boxes), encoding="utf-8")
    os.replace(partial, root / CHANGE_BOXES_FILE)


# --- writing the dataset ----------------------------------------------------------------------------

def make_synth(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int = 1) -> Path:
    """Draw the synthetic dataset into root (which must not exist) in the CLEVR-Change layout.

    The pairs are drawn in a temporary folder beside root, which is renamed to root at the end, so an
    interrupted run leaves no half-written dataset. If another process finished root first (two ranks of
    torchrun), its identical copy is kept. The bytes depend on cfg alone, not on the number of workers.
    """
    root, cfg = Path(root), cfg or SynthConfig()
    if root.exists():
        raise DataError(f"{root} already exists; remove it to draw the synthetic dataset again, "
                        f"or choose another folder")
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
    try:
        for folder in ("images", "sc_images", "nsc_images"):
            (building / folder).mkdir()
        bounds = np.linspace(0, cfg.pairs, max(1, min(workers, cfg.pairs)) * 4 + 1).astype(int)
        chunks = [(int(a), int(b)) for a, b in zip(bounds, bounds[1:]) if b > a]
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                parts = list(pool.map(draw_pairs, *zip(*[(building, a, b, cfg) for a, b in chunks])))
        else:
            parts = [draw_pairs(building, a, b, cfg) for a, b in chunks]
        scenes = [scene for part in parts for scene in part]
        names = [f"CLEVR_default_{i:06d}.png" for i in range(cfg.pairs)]
        files = {
            "change_captions.json": {n: s["captions"] for n, s in zip(names, scenes)},
            "no_change_captions.json": {n: s["no_change_captions"] for n, s in zip(names, scenes)},
            "splits.json": synth_splits(cfg),
            "type_mapping.json": {t: [f"{i:06d}.png" for i in range(cfg.pairs) if scenes[i]["type"] == t]
                                  for t in CHANGE_TYPES},
            SYNTH_SCENES_FILE: {"config": asdict(cfg), "scenes": {
                n: {k: v for k, v in s.items() if k not in ("captions", "no_change_captions")}
                for n, s in zip(names, scenes)}}}
        for name, content in files.items():
            (building / name).write_text(json.dumps(content), encoding="utf-8")
        for scene in scenes:  # CLIP's pre-tokenizer then splits at spaces only, and every word is one token
            for caption in scene["captions"] + scene["no_change_captions"]:
                assert set(caption) <= CAPTION_CHARACTERS and set(caption.split()) <= grammar_words(), caption
        write_change_boxes(building, scenes, cfg)
        write_bpe(building / SYNTH_BPE_FILE, synth_vocabulary())
        try:
            os.rename(building, root)
        except OSError:
            if not (root / "splits.json").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def usable_cpus() -> int:
    """The CPUs this process may run on (a container may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ensure_synth(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int | None = None) -> Path:
    """root holding the synthetic dataset: drawn now if it does not exist, checked against cfg if it does."""
    root = Path(root)
    if not root.exists():
        cfg = cfg or SynthConfig()
        workers = workers or usable_cpus()
        print(f"data.py: drawing the synthetic dataset ({cfg.pairs} pairs, seed {cfg.seed}) into {root} "
              f"with {workers} processes", file=sys.stderr)
        return make_synth(root, cfg, workers)
    scenes_file = root / SYNTH_SCENES_FILE
    if not (root / "splits.json").is_file() or not scenes_file.is_file():
        raise DataError(f"{root} exists but is not a complete synthetic dataset (no splits.json or "
                        f"{SYNTH_SCENES_FILE}); remove it and it will be drawn again")
    if clip.read_merges(root / SYNTH_BPE_FILE) != synth_vocabulary():
        raise DataError(f"the synthetic dataset in {root} has another vocabulary than the synthetic CLIP's (it was "
                        f"drawn by an older data.py); remove the folder and it will be drawn again")
    drawn = json.loads(scenes_file.read_text(encoding="utf-8"))
    if not (root / CHANGE_BOXES_FILE).is_file():  # drawn before the boxes were written: the scenes hold them
        stored_cfg = SynthConfig(**{k: v for k, v in drawn["config"].items() if k in SynthConfig.__dataclass_fields__})
        write_change_boxes(root, list(drawn["scenes"].values()), stored_cfg)
    if cfg is not None:
        stored = drawn["config"]
        wanted = json.loads(json.dumps(asdict(cfg)))  # tuples become lists, as in the stored file
        if stored != wanted:
            differences = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
            raise DataError(f"the synthetic dataset in {root} was drawn with other settings "
                            f"(stored, wanted: {differences}); remove the folder to draw it again, or use another root")
    return root


# --- stage 0: single scenes described object by object, to pretrain the synthetic CLIP --------------
# CLIP4IDC starts from OpenAI's CLIP, pretrained on 400M (image, text) pairs of the web, whose blocks already
# know objects and their attributes; adaptation (stage 1) then teaches them to compare. This world has no
# such CLIP, so adapt.py's stage 0 (`--data scenes`) makes one the way OpenAI did: CLIP's contrastive loss on
# single images and sentences about them. The scenes come from their own seed stream (no IDC scene, of any
# split, is ever seen) and the sentence names every object, in a random order, with random synonyms:
# "big shiny ball and small red rubber cube and ...". With at most 6 objects it fits CLIP's 32 tokens.

SCENE_SPLITS = {"train": 20_000, "val": 500, "test": 500}  # scenes of each split, consecutive indices
SCENE_OBJECTS = (1, 6)           # objects per scene, fewest and most
DESCRIPTION_JOIN = "and"         # the word between two objects of a description
SCENES_FILE = "scenes.json"
SCENES_ROOT = "data/synth_scenes"
PRETRAIN_STREAM = 3              # seeds [seed, stream, index]: apart from SCENE_STREAM's IDC pairs


def pretrain_objects(index: int, cfg: SynthConfig, n_objects: int | None = None) -> list[dict]:
    """The objects of stage-0 scene `index`: 1 to 6 (or n_objects) placed as in an IDC scene."""
    rng = np.random.default_rng([cfg.seed, PRETRAIN_STREAM, index])
    while True:
        n = n_objects or int(rng.integers(SCENE_OBJECTS[0], SCENE_OBJECTS[1] + 1))
        objects = sample_objects(rng, n, cfg)
        if objects is not None:
            return objects


def describe_scene(objects: list[dict], choose: Callable[[int], int] = lambda n: 0) -> str:
    """Every object by its four attributes, joined by "and"; choose(n) picks the order and the synonyms.

    The default choice (always the first) gives the canonical description: objects in drawing order,
    first words ("small red metal cube and large blue rubber sphere").
    """
    remaining, parts = list(objects), []
    while remaining:
        words = words_of(remaining.pop(choose(len(remaining))))
        parts.append(" ".join(words[a][choose(len(words[a]))] for a in ATTRIBUTE_ORDER))
    return f" {DESCRIPTION_JOIN} ".join(parts)


def scene_pixels(scenes: list[list[dict]], cfg: SynthConfig, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """Render scenes (each a list of objects) and preprocess them as a PNG of them would be -> uint8 (n, R, R, 3)."""
    return np.stack([clip.resize_to_uint8(Image.fromarray(render(objects, cfg)), image_size) for objects in scenes])


def make_scenes(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int = 1,
                image_size: int = IMAGE_SIZE, splits: dict[str, int] = SCENE_SPLITS) -> Path:
    """Draw the stage-0 scenes into root: pixels_<R>.npy (n, R, R, 3) uint8, scenes.json, the BPE vocabulary.

    Written in a temporary folder renamed to root at the end, like make_synth. The pixels are stored
    preprocessed (150 KB a scene at 224; 3.2 GB for the 21,000 scenes) instead of as PNGs: nothing but
    stage 0 reads them. The bytes depend on cfg and image_size alone.
    """
    root, cfg = Path(root), cfg or SynthConfig()
    if root.exists():
        raise DataError(f"{root} already exists; remove it to draw the stage-0 scenes again")
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
    try:
        total = sum(splits.values())
        objects = [pretrain_objects(i, cfg) for i in range(total)]
        pixels = np.lib.format.open_memmap(building / f"pixels_{image_size}.npy", mode="w+", dtype=np.uint8,
                                           shape=(total, image_size, image_size, 3))  # (n, R, R, 3)
        starts = range(0, total, 250)
        with ProcessPoolExecutor(workers) as pool:
            parts = pool.map(scene_pixels, [objects[a:a + 250] for a in starts], [cfg] * len(starts),
                             [image_size] * len(starts))
            for start, part in zip(starts, parts):
                pixels[start:start + len(part)] = part
                print(f"\rdata.py: stage-0 scenes {start + len(part)}/{total}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        pixels.flush()
        del pixels
        bounds = np.cumsum([0, *splits.values()])
        scenes = {"config": asdict(cfg), "image_size": image_size,
                  "splits": {s: [int(a), int(b)] for s, a, b in zip(splits, bounds, bounds[1:])},
                  "objects": objects}
        (building / SCENES_FILE).write_text(json.dumps(scenes), encoding="utf-8")
        write_bpe(building / SYNTH_BPE_FILE, synth_vocabulary())
        os.rename(building, root)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def ensure_scenes(root: str | os.PathLike, cfg: SynthConfig | None = None) -> Path:
    """root holding the stage-0 scenes, drawn now (a minute or two) if it does not exist."""
    root = Path(root)
    if not (root / SCENES_FILE).is_file():
        if root.exists():
            raise DataError(f"{root} exists but holds no {SCENES_FILE}; remove it and it will be drawn again")
        print(f"data.py: drawing {sum(SCENE_SPLITS.values())} stage-0 scenes into {root} "
              f"with {usable_cpus()} processes", file=sys.stderr)
        make_scenes(root, cfg, usable_cpus())
    return root


# ---------------------------------------------------------------------------------------------------
# 3. Images: loading, CLIP4IDC's preprocessing, the opt-in cache
# ---------------------------------------------------------------------------------------------------

def load_image(path: Path) -> Image.Image:
    """The image at path, decoded now, with an error naming the file when it is missing or unreadable."""
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except FileNotFoundError as error:
        raise DataError(f"image {path} is missing; download the dataset's images again") from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"image {path} is corrupt or not an image ({error}); download it again") from error


def preprocess_uint8(path: Path, image_size: int) -> np.ndarray:
    """CLIP4IDC's preprocessing up to the pixels: RGB, bicubic resize to a square -> uint8 (R, R, 3)."""
    return clip.resize_to_uint8(load_image(path), image_size)


class ImageCache:
    """Preprocessed uint8 pixels of a list of image files: one .npy (n, R, R, 3), read memory-mapped.

    The index beside it (.json) lists the files and a fingerprint of their sizes and modification times;
    a cache whose files changed is built again. The array is opened in each process on first use, so a
    DataLoader worker shares the page cache instead of receiving a copy.
    """

    def __init__(self, array_path: Path, paths: list[str]):
        self.array_path = array_path
        self.row = {p: i for i, p in enumerate(paths)}
        self.pixels = None

    def __getitem__(self, path: Path) -> np.ndarray:
        if self.pixels is None:
            self.pixels = np.load(self.array_path, mmap_mode="r")  # (n, R, R, 3) uint8
        if str(path) not in self.row:
            raise DataError(f"image {path} is not in the cache {self.array_path}; delete the cache to build it again")
        return self.pixels[self.row[str(path)]]  # (R, R, 3)

    def __getstate__(self):  # a worker opens its own memory map
        return {**self.__dict__, "pixels": None}


class _Preprocess(Dataset):
    def __init__(self, paths: list[Path], image_size: int):
        self.paths, self.image_size = paths, image_size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return torch.from_numpy(preprocess_uint8(self.paths[i], self.image_size))


def fingerprint(paths: list[Path], image_size: int) -> str:
    digest = hashlib.sha256(str(image_size).encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def image_cache(pairs: list[ImagePair], cache_dir: str | os.PathLike, name: str, image_size: int = IMAGE_SIZE,
                workers: int = 0) -> ImageCache:
    """The cache of every image of pairs (before, after, distractor) in cache_dir/<name>_<R>.npy, built if needed.

    It takes 3 x R x R bytes per image (150 KB at 224): about 0.9 GB for the default synthetic set,
    18 GB for all of CLEVR-Change.
    """
    paths = list(dict.fromkeys(p for pair in pairs for p in (pair.before, pair.after, pair.distractor) if p))
    cache_dir = Path(cache_dir)
    array_path, index_path = cache_dir / f"{name}_{image_size}.npy", cache_dir / f"{name}_{image_size}.json"
    stamp = fingerprint(paths, image_size)
    if array_path.is_file() and index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if index["fingerprint"] == stamp and index["paths"] == [str(p) for p in paths]:
            return ImageCache(array_path, index["paths"])
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = array_path.with_suffix(f".partial-{os.getpid()}.npy")
    pixels = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8,
                                       shape=(len(paths), image_size, image_size, 3))  # (n, R, R, 3)
    # a generator of its own: iterating a DataLoader draws a seed from the global generator, so building the
    # cache (first run) or not (later runs) would otherwise change every random number of the training after it
    loader = DataLoader(_Preprocess(paths, image_size), batch_size=64, num_workers=workers,
                        generator=torch.Generator())
    row = 0
    for batch in loader:
        pixels[row:row + len(batch)] = batch.numpy()  # (b, R, R, 3)
        row += len(batch)
    pixels.flush()
    del pixels
    os.replace(partial, array_path)
    index_path.write_text(json.dumps({"image_size": image_size, "fingerprint": stamp,
                                      "paths": [str(p) for p in paths]}), encoding="utf-8")
    return ImageCache(array_path, [str(p) for p in paths])


class ImageReader:
    """path -> normalised float32 (3, R, R): decoded and resized, or taken from an ImageCache."""

    def __init__(self, image_size: int = IMAGE_SIZE, cache: ImageCache | None = None):
        self.image_size, self.cache = image_size, cache

    def __call__(self, path: Path) -> torch.Tensor:
        pixels = self.cache[path] if self.cache is not None else preprocess_uint8(path, self.image_size)
        # differs from reference: float32 pixels; C4I's loader builds float64 arrays and casts them in the model
        return clip.normalize(np.array(pixels))  # a writable copy: torch refuses to share read-only memory; (3, R, R)


# ---------------------------------------------------------------------------------------------------
# 4. Caption token ids
# ---------------------------------------------------------------------------------------------------

def text_tokens(tokenizer: clip.SimpleTokenizer, text: str, max_words: int = MAX_WORDS) -> torch.Tensor:
    """Stage 1 (REFERENCE 2.3): [SOT] + ids cut to max_words - 1 in all, then EOT, padded with PAD_ID -> (T,)."""
    ids = ([tokenizer.sot_id] + tokenizer.encode(text))[:max_words - 1] + [tokenizer.eot_id]
    tokens = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    tokens[:len(ids)] = torch.tensor(ids)
    return tokens  # (T,)


def caption_tokens(tokenizer: clip.SimpleTokenizer, text: str, max_words: int = MAX_WORDS) -> dict[str, torch.Tensor]:
    """Stage 2 (REFERENCE 3.3): the caption cut to max_words - 1 ids; input [SOT] + ids, target ids + [EOT], padded."""
    ids = tokenizer.encode(text)[:max_words - 1]
    caption_in = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    caption_out = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    caption_in[:len(ids) + 1] = torch.tensor([tokenizer.sot_id, *ids])
    caption_out[:len(ids) + 1] = torch.tensor([*ids, tokenizer.eot_id])
    return {"caption_in": caption_in, "caption_out": caption_out}  # (T,) each


# ---------------------------------------------------------------------------------------------------
# 5. The samples of each stage, and evaluation
# ---------------------------------------------------------------------------------------------------

def random_index(n: int) -> int:
    """A uniform index below n from torch's generator, which DataLoader seeds in every worker."""
    # differs from reference: C4I draws captions with Python's random.choice
    return int(torch.randint(n, ()))


class AdaptationSamples(Dataset):
    """Stage 1: one sample per (pair, change caption) (REFERENCE 2.3); empty captions give no sample.

    In training, with probability swap_prob the before image is replaced by the pair's distractor view
    (pairs without one, as in Spot-the-Diff, never swap); the caption stays the change caption.
    A sample: {"before": (3, R, R), "after": (3, R, R), "caption": (T,), "pair_index": int, "swapped": bool}.
    """

    def __init__(self, pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer, train: bool,
                 images: ImageReader | None = None, max_words: int = MAX_WORDS, swap_prob: float = SWAP_PROB):
        self.pairs, self.tokenizer, self.train = pairs, tokenizer, train
        self.images, self.max_words, self.swap_prob = images or ImageReader(), max_words, swap_prob
        self.samples = [(p, c) for p, pair in enumerate(pairs)
                        for c, caption in enumerate(pair.captions) if caption.strip()]  # see training_captions

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        p, c = self.samples[i]
        pair = self.pairs[p]
        # differs from reference: torch's generator (seeded per DataLoader worker) instead of Python's random
        swapped = self.train and pair.distractor is not None and float(torch.rand(())) < self.swap_prob
        return {"before": self.images(pair.distractor if swapped else pair.before),
                "after": self.images(pair.after),
                "caption": text_tokens(self.tokenizer, pair.captions[c], self.max_words),
                "pair_index": p, "swapped": swapped}


class SceneSamples(Dataset):
    """Stage 0: one sample per single scene of a split of make_scenes: {"image": (3, R, R), "caption": (T,)}.

    In training each sample describes its scene anew, objects in a random order with random synonyms
    (torch's generator); otherwise the description is the canonical one (describe_scene's default).
    """

    def __init__(self, root: str | os.PathLike, split: str, tokenizer: clip.SimpleTokenizer, train: bool,
                 max_words: int = MAX_WORDS):
        root = Path(root)
        scenes = read_json(root / SCENES_FILE, "the stage-0 scenes")
        first, stop = scenes["splits"][split]
        self.objects, self.first = scenes["objects"][first:stop], first
        self.array_path = root / f"pixels_{scenes['image_size']}.npy"
        self.tokenizer, self.train, self.max_words = tokenizer, train, max_words
        self.pixels = None

    def __len__(self):
        return len(self.objects)

    def description(self, i: int) -> str:
        return describe_scene(self.objects[i], random_index if self.train else (lambda n: 0))

    def __getitem__(self, i: int) -> dict:
        if self.pixels is None:  # opened in each DataLoader worker, memory-mapped
            self.pixels = np.load(self.array_path, mmap_mode="r")  # (n, R, R, 3) uint8
        return {"image": clip.normalize(np.array(self.pixels[self.first + i])),
                "caption": text_tokens(self.tokenizer, self.description(i), self.max_words)}

    def __getstate__(self):  # a worker opens its own memory map
        return {**self.__dict__, "pixels": None}


def evaluation_pairs(pairs: list[ImagePair], use_no_change_pair: bool) -> list[ImagePair]:
    """The pairs a split is scored on: every change pair, then (use_no_change_pair) every distractor pair.

    A distractor pair is (before, distractor) with id "<id>_n", the no-change captions as references and
    type DISTRACTOR, as the CLEVR-Change toolkit scores them (REFERENCE 4.2). Row i is pair i's change
    pair; row len(pairs) + i its no-change pair: the rows of stage 2's feature cache.
    """
    if not use_no_change_pair:
        return list(pairs)
    for pair in pairs:
        if pair.distractor is None or not pair.no_change_captions:
            raise DataError(f"pair {pair.id} has no distractor image or no no-change captions, which "
                            f"use_no_change_pair needs; turn it off for this dataset")
    return [*pairs, *(ImagePair(id=p.id + NO_CHANGE_SUFFIX, before=p.before, after=p.distractor,
                                captions=p.no_change_captions, change_type=DISTRACTOR) for p in pairs)]


def references(pairs: list[ImagePair]) -> dict[str, list[str]]:
    """Evaluation id -> reference captions, the ground truth metrics.score_captions reads."""
    return {pair.id: pair.captions for pair in pairs}


def ids_by_type(pairs: list[ImagePair]) -> dict[str, list[str]]:
    """Change type (color, material, add, drop, move, distractor) -> evaluation ids, for the per-type scores."""
    groups: dict[str, list[str]] = {}
    for pair in pairs:
        if pair.change_type is not None:
            groups.setdefault(pair.change_type, []).append(pair.id)
    return groups


def retrieval_texts(pairs: list[ImagePair]) -> tuple[list[str], list[int]]:
    """Stage 1 evaluation (REFERENCE 2.6): every change caption, and the index of the pair it belongs to.

    Empty captions are ranked too, as the reference does: some Spot-the-Diff pairs have no other.
    """
    texts = [c for pair in pairs for c in pair.captions]
    text_to_pair = [p for p, pair in enumerate(pairs) for _ in pair.captions]
    return texts, text_to_pair


class PairImages(Dataset):
    """The images of evaluation pairs, without captions: {"before", "after": (3, R, R), "row": int, "id": str}.

    Stage 2 encodes every pair of a split once through this (feature cache), and decodes from it.
    """

    def __init__(self, pairs: list[ImagePair], images: ImageReader | None = None):
        self.pairs, self.images = pairs, images or ImageReader()

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        pair = self.pairs[i]
        return {"before": self.images(pair.before), "after": self.images(pair.after), "row": i, "id": pair.id}


class CaptionItems(Dataset):
    """Stage 2 training: one item per pair per epoch with a random change caption (REFERENCE 3.4).

    Empty captions are never drawn, and a pair with no other caption is left out (see training_captions).

    With use_no_change_pair (CLEVR-Change, synth), the item also holds a random no-change caption for
    the pair (before, distractor); the reference sums the two losses. "row" and "no_change_row" index the
    rows of evaluation_pairs(pairs, use_no_change_pair), so cached pair features can stand in for images;
    with images, the item also holds the pixels.
    An item: {"row", "caption_in" (T,), "caption_out" (T,)[, "before", "after" (3, R, R)]} and, with the
    no-change pair, {"no_change_row", "no_change_caption_in", "no_change_caption_out"[, "distractor"]}.
    """

    def __init__(self, pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer, use_no_change_pair: bool,
                 images: ImageReader | None = None, max_words: int = MAX_WORDS):
        evaluation_pairs(pairs, use_no_change_pair)  # checks that every pair has what the no-change pair needs
        self.pairs, self.tokenizer, self.use_no_change_pair = pairs, tokenizer, use_no_change_pair
        self.images, self.max_words = images, max_words
        self.trained = [i for i, pair in enumerate(pairs) if training_captions(pair.captions)
                        and (not use_no_change_pair or training_captions(pair.no_change_captions))]

    def __len__(self):
        return len(self.trained)

    def __getitem__(self, k: int) -> dict:
        i = self.trained[k]  # the pair's row, also when pairs without a usable caption are left out
        pair = self.pairs[i]
        captions = training_captions(pair.captions)
        item = {"row": i, **caption_tokens(self.tokenizer, captions[random_index(len(captions))], self.max_words)}
        if self.images is not None:
            item["before"], item["after"] = self.images(pair.before), self.images(pair.after)
        if self.use_no_change_pair:
            no_change_captions = training_captions(pair.no_change_captions)
            no_change = caption_tokens(self.tokenizer, no_change_captions[random_index(len(no_change_captions))],
                                       self.max_words)
            item["no_change_row"] = len(self.pairs) + i
            item["no_change_caption_in"] = no_change["caption_in"]
            item["no_change_caption_out"] = no_change["caption_out"]
            if self.images is not None:
                item["distractor"] = self.images(pair.distractor)
        return item


# ---------------------------------------------------------------------------------------------------
# 6. Contact sheet, loading benchmark, command line
# ---------------------------------------------------------------------------------------------------

def contact_sheet(pairs: list[ImagePair], out: Path, model_view: bool = False, captions: int = 3,
                  predictions: dict[str, str] | None = None) -> Path:
    """A PNG with one row per pair: before | after | distractor, then its id, type and captions.

    With predictions ({evaluation id: caption}, as caption.py --eval writes them), each row shows the
    predicted caption of the change pair and of the distractor pair ("<id>_n") above the references.
    """
    tile = (IMAGE_SIZE, IMAGE_SIZE) if model_view else (240, 160)  # the model's input, or half of 480 x 320
    text_width, line = 470, 18
    font = ImageFont.load_default(size=14)
    height = max(tile[1], line * (captions + 3 + 2 * (predictions is not None))) + 8
    sheet = Image.new("RGB", (3 * (tile[0] + 4) + text_width, height * len(pairs)), "white")
    draw = ImageDraw.Draw(sheet)
    for row, pair in enumerate(pairs):
        top = row * height
        for column, path in enumerate((pair.before, pair.after, pair.distractor)):
            if path is not None:
                image = Image.fromarray(preprocess_uint8(path, IMAGE_SIZE)) if model_view \
                    else load_image(path).convert("RGB").resize(tile, Image.Resampling.BICUBIC)
                sheet.paste(image, (column * (tile[0] + 4), top))
        lines = [f"{pair.id}  {pair.change_type or ''}"]
        if predictions is not None:
            lines.append(f"predicted: {predictions.get(pair.id, '(none)')}")
        lines += [f"reference: {c}" if predictions is not None else c for c in pair.captions[:captions]]
        if predictions is not None and pair.id + NO_CHANGE_SUFFIX in predictions:
            lines.append(f"distractor predicted: {predictions[pair.id + NO_CHANGE_SUFFIX]}")
        lines += [f"distractor{' reference' if predictions is not None else ''}: {c}"
                  for c in pair.no_change_captions[:1]]
        for k, text in enumerate(lines):
            draw.text((3 * (tile[0] + 4) + 6, top + 4 + k * line), text, fill="black", font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


def benchmark(pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer, batch_size: int, batches: int,
              workers: int, images: ImageReader) -> dict[str, float]:
    """Stage-1 training batches (decode or cache, resize, normalise, tokenize, collate), in pairs per second.

    "wall": after one warm-up batch, pairs per second of wall time. "cpu": all pairs, warm-up included,
    per second of CPU time of this process and its DataLoader workers, which a busy machine does not change.
    """
    torch.manual_seed(0)
    samples = AdaptationSamples(pairs, tokenizer, train=True, images=images)
    loader = DataLoader(samples, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True)
    cpu_start = os.times()
    iterator = iter(loader)
    next(iterator)  # warm-up: worker start, first decode
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    del iterator  # joins the workers, so that their CPU time is counted below
    cpu = os.times()
    cpu_seconds = sum(cpu[:4]) - sum(cpu_start[:4])  # user + system, this process and its finished workers
    return {"wall": batches * batch_size / seconds, "cpu": (batches + 1) * batch_size / cpu_seconds}


# --- checking a download ---

PUBLISHED = {  # (pairs, references) per split as the datasets publish them; None where no count is published
    "clevr": {"train": (33_830, None), "val": (1_988, None), "test": (3_985, None)},  # REFERENCE 5.1
    "spot": {"train": (8_566, 17_676), "val": (1_493, 3_310), "test": (1_270, 2_107)},  # 5.2, unique img_ids
    "ier": {"train": (3_061, 3_061), "val": (383, 1_149), "test": (495, 1_485)},        # 5.3
}
CLEVR_IDS_IN_NO_SPLIT = 197     # CLEVR-Change's captioned ids that its splits.json leaves out (REFERENCE 5.1)
IMAGE_ENDS = {"PNG": b"IEND\xaeB`\x82", "JPEG": b"\xff\xd9"}  # how a complete file of each format ends
SHOWN = 5                       # problems named one by one before the rest are only counted


def image_problem(path: Path) -> str | None:
    """What is wrong with an image file ("missing", or why it cannot be read), or None when it looks complete.

    PNG and JPEG files are read as far as their header and their last bytes, where a complete file has its
    end marker (a half-downloaded file has not); other formats, and files without the marker, are decoded.
    """
    try:
        with Image.open(path) as image:
            end = IMAGE_ENDS.get(image.format)
            if end is not None:
                with open(path, "rb") as file:
                    file.seek(max(0, os.fstat(file.fileno()).st_size - 64))
                    if file.read().rstrip(b"\0").endswith(end):  # some writers pad with zeros after the marker
                        return None
            image.load()
    except FileNotFoundError:
        return "missing"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        return str(error) or type(error).__name__
    return None


def named(problems: list[str]) -> str:
    more = f", and {len(problems) - SHOWN:,} more" if len(problems) > SHOWN else ""
    return ", ".join(problems[:SHOWN]) + more


def caption_lengths(pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer | None, max_words: int) -> str:
    """Length statistics of a split's non-empty captions, in tokens with SOT and EOT (in words without a tokenizer)."""
    captions = [c for pair in pairs for c in training_captions(pair.captions)]
    if not captions:
        return "no non-empty captions"
    if tokenizer is None:
        lengths = np.array([len(c.split()) for c in captions])
        return (f"caption length in words (no BPE vocabulary for tokens): min {lengths.min()}, "
                f"median {np.median(lengths):g}, mean {lengths.mean():.1f}, max {lengths.max()}")
    lengths = np.array([len(tokenizer.encode(c)) + 2 for c in captions])  # + SOT and EOT, as text_tokens counts
    return (f"caption length in tokens with SOT and EOT: min {lengths.min()}, median {np.median(lengths):g}, "
            f"mean {lengths.mean():.1f}, max {lengths.max()}; {(lengths > max_words).sum():,} longer than "
            f"max_words {max_words} (cut there in training)")


def beside_published(found: int, published: int | None, problems: list[str], what: str, split: str) -> str:
    """'8,566 pairs (published: 8,566)'; a different count is also added to problems."""
    if published is None:
        return f"{found:,} {what}"
    if found != published:
        problems.append(f"{split}: {found:,} {what}, {published:,} published")
        return f"{found:,} {what} (published: {published:,}; DIFFERENT)"
    return f"{found:,} {what} (published: {published:,})"


def check_dataset(data: str, root: Path, tokenizer: clip.SimpleTokenizer | None, max_words: int = MAX_WORDS) -> bool:
    """Read every split of a downloaded dataset, open every image, print what is there and what is not.

    True when nothing is missing: every split reads, every image opens, the published counts are met.
    """
    source = SOURCES[data]
    print(f"{source.name} in {root}", flush=True)  # before the progress line on stderr
    if not root.is_dir():
        print(f"  no folder {root}; {source.get_it}")
        return False
    problems: list[str] = []
    splits: dict[str, list[ImagePair]] = {}
    for split in SPLITS:
        try:
            splits[split] = source.reader(root, split)
        except DataError as error:
            problems.append(f"{split}: {error}")
            print(f"  {split}: cannot be read: {error}")
    images = list(dict.fromkeys(path for pairs in splits.values() for pair in pairs
                                for path in (pair.before, pair.after, pair.distractor) if path is not None))
    bad = {}  # path -> what is wrong with it
    start = last = time.perf_counter()
    for done, path in enumerate(images, 1):
        problem = image_problem(path)
        if problem:
            bad[path] = problem
        now = time.perf_counter()
        if now - last > 1 or done == len(images):
            rate = done / max(now - start, 1e-9)
            print(f"\r  images: {done:,}/{len(images):,}, {rate:,.0f}/s, eta {(len(images) - done) / rate:.0f} s ",
                  end="\n" if done == len(images) else "", file=sys.stderr, flush=True)
            last = now
    for split, pairs in splits.items():
        published = PUBLISHED.get(data, {}).get(split, (None, None))
        references = sum(len(pair.captions) for pair in pairs)
        print(f"  {split}: {beside_published(len(pairs), published[0], problems, 'pairs', split)}, "
              f"{beside_published(references, published[1], problems, 'references', split)}")
        empty = references - sum(len(training_captions(pair.captions)) for pair in pairs)
        if empty:
            without = sum(not training_captions(pair.captions) for pair in pairs)
            print(f"    {empty:,} empty captions ({without:,} pairs without any other): "
                  f"evaluation references, never training targets")
        paths = list(dict.fromkeys(p for pair in pairs for p in (pair.before, pair.after, pair.distractor) if p))
        missing = [str(p) for p in paths if bad.get(p) == "missing"]
        unreadable = [f"{p} ({bad[p]})" for p in paths if p in bad and bad[p] != "missing"]
        print(f"    images: {len(paths):,}, {len(missing):,} missing, {len(unreadable):,} unreadable")
        for kind, listed in (("missing", missing), ("unreadable", unreadable)):
            if listed:
                problems.append(f"{split}: {len(listed):,} image(s) {kind}")
                print(f"      {kind}: {named(listed)}")
        print(f"    {caption_lengths(pairs, tokenizer, max_words)}")
    if source.reader is read_clevr_change and splits:
        in_splits = {int(n) for numbers in read_json(root / "splits.json", "splits").values() for n in numbers}
        unused = [key for key in read_json(root / "change_captions.json", "captions")
                  if int(key.removesuffix(".png").rsplit("_", 1)[1]) not in in_splits]
        expected = f" (the published files have {CLEVR_IDS_IN_NO_SPLIT})" if data == "clevr" else ""
        print(f"  {len(unused):,} captioned ids are in no split and never used{expected}")
    if problems:
        print(f"INCOMPLETE: {'; '.join(problems)}")
    else:
        met = ", the published counts are met" if data in PUBLISHED else ""
        print(f"complete: every split reads, every image opens{met}")
    return not problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-synth", metavar="DIR", help="draw the synthetic dataset into DIR")
    parser.add_argument("--make-scenes", metavar="DIR", help="draw stage 0's single scenes into DIR")
    parser.add_argument("--pairs", type=int, default=SynthConfig.pairs)
    parser.add_argument("--seed", type=int, default=SynthConfig.seed)
    parser.add_argument("--workers", type=int, default=1, help="processes drawing pairs / DataLoader workers")
    parser.add_argument("--show", action="store_true", help="write a contact sheet of a few pairs")
    parser.add_argument("--bench", action="store_true", help="measure the stage-1 loading pipeline")
    parser.add_argument("--check", action="store_true",
                        help="after a download: read every split, open every image, compare with the published "
                             "counts; exit status 1 when something is missing")
    parser.add_argument("--data", default="synth", choices=sorted(SOURCES))
    parser.add_argument("--root", "--data_root", help="dataset folder (default: data/<name>)")
    parser.add_argument("--max_words", type=int, default=MAX_WORDS,
                        help="--check: count the captions longer than this many tokens (the training scripts' flag)")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--n", type=int, default=6, help="pairs on the contact sheet")
    parser.add_argument("--model-view", action="store_true", help="show the 224 x 224 images the model sees")
    parser.add_argument("--out", help="contact sheet PNG (default: <root>/contact_sheet.png)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()

    if args.check:
        root, tokenizer = dataset_root(args.data, args.root), None
        try:
            tokenizer = clip.get_tokenizer(bpe_path(args.data, root)) if root.is_dir() else None
        except FileNotFoundError as error:
            print(f"{error}\nCaption lengths are counted in words instead of tokens until then.")
        sys.exit(0 if check_dataset(args.data, root, tokenizer, args.max_words) else 1)
    elif args.make_synth:
        cfg = SynthConfig(pairs=args.pairs, seed=args.seed)
        start, cpu_start = time.perf_counter(), os.times()
        make_synth(args.make_synth, cfg, args.workers)
        seconds, cpu = time.perf_counter() - start, os.times()
        cpu_seconds = sum(cpu[:4]) - sum(cpu_start[:4])  # user + system, this process and its finished workers
        print(f"{cfg.pairs} pairs in {args.make_synth} with {args.workers} process(es): {seconds:.1f} s, "
              f"{cfg.pairs / seconds:.1f} pairs/s; {cpu_seconds:.1f} CPU s, "
              f"{cfg.pairs / cpu_seconds:.1f} pairs per CPU second")
    elif args.make_scenes:
        start = time.perf_counter()
        make_scenes(args.make_scenes, SynthConfig(seed=args.seed), args.workers)
        print(f"{sum(SCENE_SPLITS.values())} scenes in {args.make_scenes} with {args.workers} process(es): "
              f"{time.perf_counter() - start:.1f} s")
    elif args.show:
        root = dataset_root(args.data, args.root)
        pairs = load_split(args.data, args.split, root)[:args.n]
        out = contact_sheet(pairs, Path(args.out) if args.out else root / "contact_sheet.png", args.model_view)
        print(f"contact sheet of {len(pairs)} {args.split} pairs: {out}")
    elif args.bench:
        torch.set_num_threads(1)
        root = dataset_root(args.data, args.root)
        pairs = load_split(args.data, "train", root)
        tokenizer = clip.get_tokenizer(bpe_path(args.data, root))
        print(f"{args.data} train: {len(pairs)} pairs; batch {args.batch_size}, "
              f"{args.batches} batches after one warm-up")
        start = time.perf_counter()
        cache = image_cache(pairs, root / "cache", "train", IMAGE_SIZE, workers=2)
        print(f"uint8 cache of {len(cache.row)} images ready in {time.perf_counter() - start:.1f} s: "
              f"{cache.array_path}")
        for name, images in (("decode PNG", ImageReader()), ("uint8 cache", ImageReader(cache=cache))):
            for workers in (0, 2):
                rate = benchmark(pairs, tokenizer, args.batch_size, args.batches, workers, images)
                print(f"{name:12s} workers={workers}: {rate['wall']:7.1f} pairs/s, "
                      f"{rate['cpu']:7.1f} pairs per CPU second")
    else:
        with tempfile.TemporaryDirectory() as folder:
            root = make_synth(Path(folder) / "synth", SynthConfig(pairs=10))
            pairs = load_split("synth", "train", root)
            tokenizer = clip.get_tokenizer(root / SYNTH_BPE_FILE)
            print(f"drew 10 pairs in {root}; train split: {len(pairs)} pairs; vocabulary: {tokenizer.vocab_size} ids")
            pair = pairs[0]
            print(f"pair {pair.id} ({pair.change_type}): {pair.captions[0]!r}; "
                  f"distractor: {pair.no_change_captions[0]!r}")
            sample = AdaptationSamples(pairs, tokenizer, train=True)[0]
            for key, value in sample.items():
                print(f"  stage 1 sample[{key!r}]: {tuple(value.shape) if torch.is_tensor(value) else value}")
            item = CaptionItems(pairs, tokenizer, use_no_change_pair=True)[0]
            print(f"  stage 2 caption_in:  {item['caption_in'][:12].tolist()}")
            print(f"  stage 2 caption_out: {item['caption_out'][:12].tolist()} -> "
                  f"{tokenizer.decode(item['caption_out'][:item['caption_out'].tolist().index(tokenizer.eot_id)])!r}")


if __name__ == "__main__":
    main()
