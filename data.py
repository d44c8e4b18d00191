"""Image-pair datasets for image difference captioning: the pair record, caption tokens, each stage's samples.

An image difference captioning (IDC) dataset is a set of image pairs (before, after) with sentences that
say what changed. CLIP4IDC (Guo et al., 2022) trains on them twice: stage 1, "IDC adaptation" (paper
section 3.2), contrasts pair embeddings with caption embeddings; stage 2, "IDC finetuning" (section 3.3),
trains a captioner. This file turns the datasets people download into the samples of both stages.

It holds, top to bottom, the lesson first:
  1. ImagePair, the one record every reader returns, and which of its captions a model may learn to write;
  2. caption token ids: stage 1's text tokens, stage 2's decoder input and target;
  3. the samples: stage 1 (one per pair and caption), stage 2 (one per pair, plus the no-change pair),
     evaluation pairs with the scorer's ids and reference lists, ids per change type (stage 0's samples of
     single synthetic scenes are synth.py's SceneSamples), and to_device, where a batch meets the GPU;
then the file handling:
  4. the readers of the published layouts: CLEVR-Change, Spot-the-Diff, Image-Editing-Request (IER), LEVIR-CC
     (remote-sensing change captioning) and a simple JSON format for your own pairs; the synthetic dataset
     (`--data synth`, the project's default) is drawn by synth.py in the CLEVR-Change layout and read here like
     CLEVR-Change;
  5. images: loading with readable errors, CLIP4IDC's preprocessing, the image reader.
The caches of preprocessed pixels, intra-image tokens and pair features are plumbing/caches.py's; checking a
download, check.py's; a contact sheet of pairs, explain.py's.

The layouts, under the default roots (a `root` argument overrides them):
  data/clevr_change  images/CLEVR_default_XXXXXX.png, sc_images/CLEVR_semantic_XXXXXX.png,
                     nsc_images/CLEVR_nonsemantic_XXXXXX.png, change_captions.json, no_change_captions.json
                     (both keyed by the default image's file name), splits.json ({"train": [int, ...], ...};
                     some ids are in no split), type_mapping.json ({"color": ["XXXXXX.png", ...], ...});
                     optionally RCC's (Robust Change Captioning, github.com/Seth-Park/RobustChangeCaptioning)
                     change_captions_with_bbox.json, the changed object's box in each image:
                     {"123": {"bbox_before": [x, y, w, h] or null, "bbox_after": [x, y, w, h] or null}, ...}
                     (pixels of the stored image; null where the object is not in that image: add, drop).
  data/spot          reformat_{train,val,test}.json, or the raw annotations/{train,val,test}.json whose
                     items repeat img_id (merged here, as CLIP4IDC's reformat_dataset.py does);
                     images/<img_id>.png (before) and images/<img_id>_2.png (after).
  data/ier           {train,valid,test}.json, lists of {"img0", "img1", "sents", "uid"}; images/<img0>, images/<img1>.
  data/levir_cc      LevirCCcaptions.json ({"images": [{"filename": "train_000016.png", "split": "train",
                     "changeflag": 0 or 1 (older copies lack it), "sentences": [{"tokens": [...], "raw": "..."}, ...]},
                     ...]}, five sentences per pair) and images/{train,val,test}/{A,B}/<filename> (A before, B after,
                     256 x 256 PNG; the folders hold more images than the file names, which are never read); your
                     own set in this form with --data_root.
  data/pairs         your own pairs: {train,val,test}.json, each a list of
                       {"before": "a.png", "after": "b.png", "captions": ["..."],       (required)
                        "id": "...", "type": "...", "distractor": "c.png", "no_change_captions": ["..."]}
                     with paths relative to the JSON file's folder; "id" defaults to the item's position.
  data/synth         drawn by synth.py: the CLEVR-Change layout with change_captions_with_bbox.json, plus
                     bpe_synth_vocab.txt.gz (its BPE merges, OpenAI's format) and synth_scenes.json (what was
                     drawn, for tests).

What differs from the reference (github.com/sushizixin/CLIP4IDC at commit ca49461, "the reference" in this file):
  - one reader per layout returns the same ImagePair records; the reference has a loader class per dataset
    and stage, and branches on the dataset's name; here "train on the no-change pair too" is the flag
    use_no_change_pair and the before/distractor swap happens wherever a pair has a distractor;
  - errors instead of asserts or skipping: a missing folder, file or image, an id without captions;
  - empty and whitespace-only captions (the published Spot-the-Diff files have some) are never training
    targets (the reference trains on them); they stay evaluation references, as in the reference's ground truth;
  - random choices (the 0.5 swap, the caption drawn in stage 2) use torch's generator, which DataLoader
    seeds per worker, instead of Python's random module;
  - images are float32 (the reference builds float64 arrays); an opt-in uint8 cache skips PNG decoding.
  - every image mode becomes its 8-bit RGB view (rgb_view): a 16-bit PNG keeps its picture, where the reference's
    convert("RGB") turns it white.

Run:  python data.py                                   write a pair of your own in a temp folder, print its samples
      python check.py --data clevr|spot|ier|levir|pairs [--data_root DIR]   after downloading: is it complete?

Shape letters: B pairs in a batch, R image side after preprocessing (224), T caption tokens (max_words, 32), N+1
and D the intra-image tokens per image and their width (encoder.py: 50 and 768 for ViT-B/32),
H, W height and width of a stored image (320 x 480 for CLEVR-Change and the synthetic set, 256 x 256 for LEVIR-CC).
"""
import gzip
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, UnidentifiedImageError
from torch.utils.data import Dataset, default_collate

import clip

IMAGE_SIZE = 224           # CLIP4IDC resizes every image straight to 224 x 224 (the reference's rawimage_util.py)
MAX_WORDS = 32             # caption length in tokens, start (SOT) and end of text (EOT) included (the reference: 32)
SWAP_PROB = 0.5            # stage 1, train only: chance that the before image is replaced by the distractor view
SPLITS = ("train", "val", "test")
CHANGE_TYPES = ("color", "material", "add", "drop", "move")  # CLEVR-Change's type_mapping.json keys
DISTRACTOR = "distractor"  # the type of a no-change pair; the papers' "DI" column
NO_CHANGE_SUFFIX = "_n"    # CLEVR-Change's evaluation id of the distractor pair: "000123.png_n"
SYNTH_BPE_FILE = "bpe_synth_vocab.txt.gz"  # synth.py writes its vocabulary there, beside the dataset
CHANGE_BOXES_FILE = "change_captions_with_bbox.json"  # RCC's file of the changed object's boxes (optional)
CHANGED, UNCHANGED = "change", "no change"  # LEVIR-CC's two kinds of pair: its papers score each kind alone too


class DataError(ValueError):
    """Bad or missing input data; the message says what, where and how to fix it."""


# ---------------------------------------------------------------------------------------------------
# 1. The image pair
# ---------------------------------------------------------------------------------------------------

@dataclass
class ImagePair:
    """One image pair of a split, as every reader returns it."""
    id: str                              # evaluation id: "000123.png" (CLEVR), "<img_id>.png" (Spot), uid (IER)
    before: Path
    after: Path
    captions: list[str]                  # change captions: training targets and evaluation references
    change_type: str | None = None       # one of CHANGE_TYPES where the dataset says (CLEVR-Change, synth);
    #                                      CHANGED or UNCHANGED (LEVIR-CC)
    distractor: Path | None = None       # the before scene from another viewpoint or light (CLEVR's nsc image)
    no_change_captions: list[str] = field(default_factory=list)  # captions of the pair (before, distractor)
    change_boxes: dict | None = None     # {"before", "after": [x, y, w, h] or None}: the changed object, where known


def training_captions(captions: list[str]) -> list[str]:
    """The captions a model may learn to write: all but the empty and whitespace-only ones."""
    # differs from reference: its dataloader_spot_caption.py trains on Spot-the-Diff's empty sentences too ([SOT, EOT]
    # as the target)
    return [caption for caption in captions if caption.strip()]


# ---------------------------------------------------------------------------------------------------
# 2. Caption token ids
# ---------------------------------------------------------------------------------------------------

def text_tokens(tokenizer: clip.SimpleTokenizer, text: str, max_words: int = MAX_WORDS) -> torch.Tensor:
    """Stage 1 (the reference's dataloader_clevr_retrieval.py, `_get_text`): [SOT] + ids cut to max_words - 1 in
    all, then EOT, padded with PAD_ID -> (T,)."""
    ids = ([tokenizer.sot_id] + tokenizer.encode(text))[:max_words - 1] + [tokenizer.eot_id]
    tokens = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    tokens[:len(ids)] = torch.tensor(ids)
    return tokens  # (T,)


def caption_tokens(tokenizer: clip.SimpleTokenizer, text: str, max_words: int = MAX_WORDS) -> dict[str, torch.Tensor]:
    """Stage 2 (the reference's dataloader_clevr_caption.py, `_get_text`): the caption cut to max_words - 1 ids;
    input [SOT] + ids, target ids + [EOT], padded."""
    ids = tokenizer.encode(text)[:max_words - 1]
    caption_in = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    caption_out = torch.full((max_words,), clip.PAD_ID, dtype=torch.long)
    caption_in[:len(ids) + 1] = torch.tensor([tokenizer.sot_id, *ids])
    caption_out[:len(ids) + 1] = torch.tensor([*ids, tokenizer.eot_id])
    return {"caption_in": caption_in, "caption_out": caption_out}  # (T,) each


# ---------------------------------------------------------------------------------------------------
# 3. The samples of each stage, and evaluation
# ---------------------------------------------------------------------------------------------------

def random_index(n: int) -> int:
    """A uniform index below n from torch's generator, which DataLoader seeds in every worker."""
    # differs from reference: its dataloader_clevr_caption.py draws captions with Python's random.choice
    return int(torch.randint(n, ()))


class AdaptationSamples(Dataset):
    """Stage 1: one sample per (pair, change caption), as the reference's dataloader_clevr_retrieval.py; empty
    captions give no sample.

    In training, with probability swap_prob (SWAP_PROB, 0.5, as the reference) the before image is replaced by the
    pair's distractor view (pairs without one, as in Spot-the-Diff, never swap); the caption stays the change
    caption. Why: the distractor is the before scene from a slightly moved camera or under other light, so the
    pair (distractor, after) holds the same change plus a nuisance one, and the change caption is still true of it.
    Matching both pairs to one caption teaches the pair embedding to follow what changed in the scene and to
    ignore viewpoint and lighting, which CLEVR-Change's distractors test (Robust Change Captioning, Park et al.).
    A sample: {"before", "after": what `images` gives for the image file: uint8 pixels (R, R, 3) from an ImageReader,
    or, when stage 1 freezes the intra-image blocks (the synth preset), the image's intra-image tokens (N+1, D);
    "caption": (T,), "pair_index": int, "swapped": bool}.
    """

    def __init__(self, pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer, train: bool,
                 images: "ImageReader | None" = None, max_words: int = MAX_WORDS, swap_prob: float = SWAP_PROB):
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


def collate_text(samples: list[dict], cut: bool = True) -> dict:
    """A stage-1 (or stage-0) batch, its captions (B, T) cut after the batch's last end-of-text token, the
    largest id: the columns after it are padding in every row, and in the causal text tower no token sees the
    ones after it. Cut here, on the host, from the token ids: the training step never waits for the device
    to learn a length. cut=False keeps every batch at T (--compile: one caption length, compiled once)."""
    batch = default_collate(samples)
    if cut:  # a copy, contiguous: a pinned copy to the GPU needs no temporary
        batch["caption"] = batch["caption"][:, :int(batch["caption"].argmax(dim=-1).max()) + 1].contiguous()  # (B, T')
    return batch


def evaluation_pairs(pairs: list[ImagePair], use_no_change_pair: bool) -> list[ImagePair]:
    """The pairs a split is scored on: every change pair, then (use_no_change_pair) every distractor pair.

    A distractor pair is (before, distractor) with id "<id>_n", the no-change captions as references and
    type DISTRACTOR, as the CLEVR-Change toolkit scores them (RECIPES.md, "Stage 2"). Row i is pair i's change
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
    """Stage 1 evaluation (the reference's main_task_retrieval.py, `eval_epoch`): every change caption, and the
    index of the pair it belongs to.

    Empty captions are ranked too, as the reference does: some Spot-the-Diff pairs have no other.
    """
    texts = [c for pair in pairs for c in pair.captions]
    text_to_pair = [p for p, pair in enumerate(pairs) for _ in pair.captions]
    return texts, text_to_pair


class PairImages(Dataset):
    """The images of evaluation pairs, without captions: {"before", "after": uint8 (R, R, 3), "row": int, "id": str}.

    Stage 2 encodes every pair of a split once through this (feature cache), and decodes from it.
    """

    def __init__(self, pairs: list[ImagePair], images: "ImageReader | None" = None):
        self.pairs, self.images = pairs, images or ImageReader()

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        pair = self.pairs[i]
        return {"before": self.images(pair.before), "after": self.images(pair.after), "row": i, "id": pair.id}


class CaptionItems(Dataset):
    """Stage 2 training: one item per pair per epoch with a random change caption (the reference's
    dataloader_clevr_caption.py and dataloader_spot_caption.py).

    Empty captions are never drawn, and a pair with no other caption is left out (see training_captions).

    With use_no_change_pair (CLEVR-Change, synth), the item also holds a random no-change caption for
    the pair (before, distractor); the reference sums the two losses. "row" and "no_change_row" index the
    rows of evaluation_pairs(pairs, use_no_change_pair), so cached pair features can stand in for images;
    with images, the item also holds the pixels.
    An item: {"row", "caption_in" (T,), "caption_out" (T,)[, "before", "after": what `images` gives, uint8 pixels
    (R, R, 3) or intra-image tokens (N+1, D)]} and, with the no-change pair, {"no_change_row",
    "no_change_caption_in", "no_change_caption_out"[, "distractor"]}. caption.py's training_set chooses `images`.
    """

    def __init__(self, pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer, use_no_change_pair: bool,
                 images: "ImageReader | None" = None, max_words: int = MAX_WORDS):
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


def collate_captions(items: list[dict], static: bool = False) -> dict:
    """A stage-2 batch of CaptionItems, cut to its longest caption, change and no-change captions alike (the
    columns after it are padding in every row), with, for each kind of caption, the positions the loss reads:
    "<kind>_targets", the flat indices into (B x T') of the targets that are not padding. Both come from the
    token ids, here on the host: the training step never waits for the device to count a mask.
    static=True (a step captured whole, --cuda_graphs): every batch of the same shape, (B, T) and B x T targets,
    the padding among them; the loss ignores padding, so it is the same up to float rounding (tested)."""
    batch = default_collate(items)
    kinds = [kind for kind in ("caption", "no_change_caption") if f"{kind}_out" in batch]
    length = max(int((batch[f"{kind}_out"] != clip.PAD_ID).sum(dim=1).max()) for kind in kinds)
    for kind in kinds:  # contiguous copies: a pinned copy to the GPU needs no temporary
        if static:
            batch[f"{kind}_targets"] = torch.arange(batch[f"{kind}_out"].numel())  # (B x T,)
            continue
        batch[f"{kind}_in"] = batch[f"{kind}_in"][:, :length].contiguous()    # (B, T')
        batch[f"{kind}_out"] = batch[f"{kind}_out"][:, :length].contiguous()  # (B, T')
        batch[f"{kind}_targets"] = (batch[f"{kind}_out"] != clip.PAD_ID).flatten().nonzero().squeeze(1)  # (n,)
    return batch


def to_device(batch: dict, device: torch.device, keys=None, resident: torch.Tensor | None = None) -> dict:
    """The tensors of a batch (those named in keys, default all) on the device, widened there: uint8 pixels
    (B, R, R, 3) normalised to float32 (B, 3, R, R) by clip.normalize, float16 pair tokens to float32. resident:
    the training images' pixels on the device (n, R, R, 3) uint8 (plumbing.ResidentPixels), whose rows the
    batch's "before" and "after" (B,) name: looked up there, then normalised.

    The DataLoader pins its batches when training on CUDA, so each copy is asynchronous: the host goes on to
    queue the step while the pixels travel.
    """
    # differs from reference: its loader hands over float64 arrays, cast in the model; here uint8 travels
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and (keys is None or key in keys):
            value = value.to(device, non_blocking=True)
            if resident is not None and key in ("before", "after"):
                value = resident[value]  # (B, R, R, 3) uint8
            out[key] = clip.normalize(value) if value.dtype == torch.uint8 else \
                value.float() if value.dtype == torch.float16 else value
    return out


# ---------------------------------------------------------------------------------------------------
# 4. Reading a dataset: the published layouts
# ---------------------------------------------------------------------------------------------------

def read_json(path: Path, what: str, unique_keys: bool = False):
    """A JSON file, read as UTF-8 with or without the byte-order mark that Windows editors write; unique_keys: an
    object that repeats a key is refused (JSON would keep only its last value)."""
    if not path.is_file():
        raise DataError(f"{what}: {path} is {absence(path)}")
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=_unique if unique_keys else None)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{what}: {path} is not valid JSON ({error}); correct it there (a dataset's file: download "
                        f"it again)") from error
    except RecursionError:
        raise DataError(f"{what}: {path} nests lists or objects too deeply for Python's JSON reader; a dataset "
                        f"file is a few levels deep: write it as data.py's docstring shows") from None
    except KeyError as error:
        raise DataError(f"{what}: {path} repeats the key {error.args[0]!r} inside one object (JSON keeps only its "
                        f"last value): keep one") from None


def _unique(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object as a dict; KeyError naming a key that repeats."""
    found = {}
    for key, value in pairs:
        if key in found:
            raise KeyError(key)
        found[key] = value
    return found


def absence(path: Path) -> str:
    """Why path is not a file to read: 'missing', 'a folder, not a file', or a link that cannot be followed."""
    if path.is_dir():
        return "a folder, not a file"
    try:
        os.stat(path)
    except FileNotFoundError:
        return "a symbolic link to a missing file" if path.is_symlink() else "missing"
    except OSError as error:  # a loop of symbolic links: ELOOP
        return f"not readable ({error.strerror})"
    return "not a regular file"


def checked_type(value, kinds: type | tuple[type, ...], where: str, expected: str):
    """value if it is one of kinds (never a bool for int), else an error: where, the field, what it should be."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple)
                                                                                  else (kinds,))):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise DataError(f"{where} should be {expected}, got {shown}")
    return value


def checked_captions(captions, pair_id: str, where: Path) -> list[str]:
    """A non-empty list of strings, or an error naming the pair.

    Empty and whitespace-only strings are kept: the published Spot-the-Diff files hold some, and the papers'
    ground truth (the reference's gt/spot_total_change_captions_reformat.json) scores against them; training leaves
    them out (training_captions).
    """
    if not isinstance(captions, list) or not captions:
        shown = repr(captions) if len(repr(captions)) <= 60 else repr(captions)[:57] + "..."
        raise DataError(f"pair {pair_id}: no captions in {where} (got {shown}); captions are a non-empty list of "
                        f"strings")
    for caption in captions:
        if not isinstance(caption, str):
            raise DataError(f"pair {pair_id}: caption {caption!r} in {where} is not text; captions are strings")
    return captions


def checked_items(items, keys: tuple[str, ...], path: Path) -> list[dict]:
    """A JSON list of objects that each have keys, or an error naming the file and the item."""
    if not isinstance(items, list):
        raise DataError(f"{path} should hold a JSON list of items, each with {list(keys)}")
    for position, item in enumerate(items):
        missing = [key for key in keys if not isinstance(item, dict) or key not in item]
        if missing:
            raise DataError(f"{path}, item {position}: missing {missing}; each item needs {list(keys)}")
    return items


def checked_files(pairs: list[ImagePair], fix: str = "download the dataset's images again") -> list[ImagePair]:
    """Fail now, naming the file, rather than hours into training when a worker reaches it (check.py lists all);
    fix: what to do about a missing image (Source.repair)."""
    for pair in pairs:
        for path in (pair.before, pair.after, pair.distractor):
            if path is not None and not path.is_file():
                raise DataError(f"pair {pair.id}: image {path} is {absence(path)}; {fix}")
    return pairs


def read_clevr_change(root: Path, split: str) -> list[ImagePair]:
    """CLEVR-Change (and the synthetic set): one pair per split id, with its distractor and no-change captions."""
    what = f"CLEVR-Change layout in {root}"
    splits = read_json(root / "splits.json", what)
    change = read_json(root / "change_captions.json", what)
    no_change = read_json(root / "no_change_captions.json", what)
    type_mapping = read_json(root / "type_mapping.json", what)
    for name, content in (("splits.json", splits), ("change_captions.json", change),
                          ("no_change_captions.json", no_change), ("type_mapping.json", type_mapping)):
        checked_type(content, dict, f"{root / name}", "a JSON object (see data.py's docstring)")
    for kind, names in type_mapping.items():
        where = f"{root / 'type_mapping.json'}, {kind!r}"
        for name in checked_type(names, list, where, 'a list of file names such as "000123.png"'):
            checked_type(name, str, f"{where}, item {name!r}", 'a file name such as "000123.png"')
    if split not in splits:
        raise DataError(f"{root / 'splits.json'} has no split {split!r}; it has {sorted(splits)}")
    type_of = {name: kind for kind, names in type_mapping.items() for name in names}  # "000123.png" -> "color"
    boxes = read_change_boxes(root)
    pairs = []
    where = f"{root / 'splits.json'}, split {split!r}"
    for number in checked_type(splits[split], list, where, "a list of pair numbers"):
        checked_type(number, int, f"{where}, item {number!r}", "a whole number")  # ids are not contiguous: some
        # are in no split (197 in the published splits.json)
        key = f"CLEVR_default_{number:06d}.png"  # the caption files are keyed by the default image's name
        pair_id = f"{number:06d}.png"
        if key not in change:  # differs from reference: an error naming the id where its dataloaders assert
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
        checked_type(entry, dict, f"{path}, id {number}", '{"bbox_before": [x, y, w, h] or null, "bbox_after": ...}')
        pair = {}
        for image in ("before", "after"):
            box = entry.get(f"bbox_{image}")
            if box and not (isinstance(box, list) and len(box) == 4
                            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
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
        checked_type(item["img_id"], (str, int), f"{found[0]}, item {position}: img_id", "a string or a whole number")
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
    for position, datum in enumerate(checked_items(read_json(path, "Image-Editing-Request"),
                                                   ("img0", "img1", "sents", "uid"), path)):
        uid = checked_type(datum["uid"], (str, int), f"{path}, item {position}: uid", "a string")
        for key in ("img0", "img1"):
            checked_type(datum[key], str, f"{path}, item {position} (uid {uid}): {key}", "an image file name")
        if uid in seen:
            raise DataError(f"{path}: uid {uid} appears twice; evaluation ids must be unique")
        seen.add(uid)
        pairs.append(ImagePair(id=uid, before=root / "images" / datum["img0"], after=root / "images" / datum["img1"],
                               captions=checked_captions(datum["sents"], uid, path)))
    return pairs


LEVIR_ARCHIVE_FOLDER = "Levir-CC-dataset"  # the download's top folder (RSCaMa preprocess_data.py's default path)
LEVIR_CAPTIONS = ("LevirCCcaptions.json", "LevirCCcaptions_v1.json")  # the download's name; PromptCC's copy with
# changeflag (github.com/Chen-Yang-Liu/PromptCC, data/LEVIR_CC/)
# A record's "split" as read, and the split it means: other copies write "valid" (IER's name), capitals
LEVIR_SPLIT_NAMES = {"train": "train", "val": "val", "test": "test", "valid": "val", "validation": "val"}
# The five sentences of every unchanged LEVIR-CC pair, the list its papers' evaluation scripts find those pairs by
# (github.com/Chen-Yang-Liu/RSICC eval.py, `nochange_list`): a file without changeflag is read by them too.
LEVIR_NO_CHANGE = ("there is no difference", "the two scenes seem identical", "the scene is the same as before",
                   "no change has occurred", "almost nothing has changed")


def levir_caption(sentence, where: str) -> str:
    """A LEVIR-CC sentence as the words its papers score: its "tokens" joined by spaces (the JSON's own
    tokenization, which github.com/Chen-Yang-Liu/RSICC utils.py `create_input_files` reads), or, in a record
    without them, its "raw" text tokenized as the papers that read "raw" do (github.com/Chen-Yang-Liu/RSCaMa
    preprocess_data.py `tokenize`): "," and ";" split off, "." and "?" dropped (" the road is built, 0.5km ." ->
    "the road is built , 05km")."""
    checked_type(sentence, dict, where, 'a sentence {"tokens": [...], "raw": "..."}')
    tokens = sentence.get("tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens):
        return " ".join(tokens)
    raw = checked_type(sentence.get("raw"), str, f"{where}: 'raw' (there are no 'tokens')", "the sentence's text")
    return " ".join(raw.replace(";", " ;").replace(",", " ,").replace("?", "").replace(".", "").split())


def adaptation_pairs(pairs: list[ImagePair]) -> list[ImagePair]:
    """The pairs stage 1 adapts to: all but the unchanged pairs of a dataset that mixes them in (LEVIR-CC).

    Stage 1 learns what changed: CLEVR-Change's no-change captions are not used in it (the reference's
    dataloader_clevr_retrieval.py), and LEVIR-CC's unchanged pairs are left out the same way. Their five captions
    are the same five for every unchanged pair, so in a contrastive batch each would be a false negative of the
    others (RECIPES.md, "LEVIR-CC"). Stage 2 trains on them, with their captions."""
    return [pair for pair in pairs if pair.change_type != UNCHANGED]


def read_levir_cc(root: Path, split: str) -> list[ImagePair]:
    """LEVIR-CC: one pair per record of LevirCCcaptions.json whose "split" is this one, in file order; the images
    are images/<split>/A/<filename> (before) and images/<split>/B/<filename> (after).

    The image folders hold more files than the JSON names: only the records are read, never the folders. A pair
    is unchanged when its "changeflag" is 0, or, in a file without changeflag, when its captions are the five
    no-change sentences (LEVIR_NO_CHANGE), as the papers' evaluation scripts find them.
    """
    if not any((root / name).is_file() for name in LEVIR_CAPTIONS) and (root / LEVIR_ARCHIVE_FOLDER).is_dir():
        root = root / LEVIR_ARCHIVE_FOLDER   # the folder the download unpacks to
    found = [root / name for name in LEVIR_CAPTIONS if (root / name).is_file()]
    if not found:
        raise DataError(f"LEVIR-CC: no {LEVIR_CAPTIONS[0]} in {root} (nor in {LEVIR_ARCHIVE_FOLDER}/ there, the "
                        f"folder the download unpacks to); {SOURCES['levir'].get_it}")
    path = found[0]
    if len(found) > 1 and split == SPLITS[0]:  # said once, with the first split read
        reader_note(f"LEVIR-CC: {root} holds both {' and '.join(f.name for f in found)}; reading {path.name} "
                    f"(move it away to read the other)")
    content = read_json(path, "LEVIR-CC")
    if not isinstance(content, dict) or not isinstance(content.get("images"), list):
        raise DataError(f'{path} should be {{"images": [...]}}, one record per pair (LEVIR-CC\'s Karpathy-style file)')
    records = checked_items(content["images"], ("filename", "split", "sentences"), path)
    pairs, seen, renamed = [], set(), {}
    for position, record in enumerate(records):
        named = checked_type(record["split"], str, f"{path}, record {position}: split", '"train", "val" or "test"')
        if LEVIR_SPLIT_NAMES.get(named.lower()) is None:
            raise DataError(f'{path}, record {position}: split "{named}" is none of train, val, test (or valid, '
                            f'validation; in any case): correct it there')
        if LEVIR_SPLIT_NAMES[named.lower()] != split:
            continue
        if named != split:
            renamed[named] = renamed.get(named, 0) + 1
        name = checked_type(record["filename"], str, f"{path}, record {position}: filename", 'a name such as '
                            '"train_000016.png"')
        if name in seen:
            raise DataError(f"{path}: {name} appears twice in split {split}; evaluation ids must be unique")
        seen.add(name)
        where = f"{path}, record {position} ({name})"
        prefix = name.split("_")[0]
        if prefix in SPLITS and prefix != split:  # RSCaMa and Chg2Cap take the split from the name, RSICC from "split"
            raise DataError(f"{where}: its name says {prefix!r} but its split is {split!r}; the papers' scripts "
                            f"would put it in different splits: correct its name or its \"split\"")
        sentences = checked_type(record["sentences"], list, f"{where}: sentences", "a list of sentences")
        captions = checked_captions([levir_caption(s, f"{where}, sentence {k}") for k, s in enumerate(sentences)],
                                    name, path)
        if "changeflag" in record:
            flag = checked_type(record["changeflag"], int, f"{where}: changeflag", "0 (unchanged) or 1 (changed)")
            if flag not in (0, 1):
                raise DataError(f"{where}: changeflag should be 0 (unchanged) or 1 (changed), got {flag}")
            unchanged = flag == 0
        else:
            unchanged = all(caption in LEVIR_NO_CHANGE for caption in captions)
        pairs.append(ImagePair(id=name, before=root / "images" / split / "A" / name,
                               after=root / "images" / split / "B" / name, captions=captions,
                               change_type=UNCHANGED if unchanged else CHANGED))
    for named, count in renamed.items():
        reader_note(f'LEVIR-CC: {count:,} record(s) of {path.name} with "split": "{named}" read as {split}')
    return pairs


def reader_note(note: str) -> None:
    """A reader's note on stdout; under torchrun every process reads, and the first one says it."""
    if os.environ.get("RANK", "0") == "0":
        print(note)


def read_user_pairs(root: Path, split: str) -> list[ImagePair]:
    """Your own pairs: root/<split>.json, a list of
    {before, after, captions[, id, type, distractor, no_change_captions]} (see the docstring at the top)."""
    path = root / f"{split}.json"
    pairs, seen = [], set()
    items = checked_items(read_json(path, "image pairs", unique_keys=True), ("before", "after", "captions"), path)
    for position, item in enumerate(items):
        where = f"{path}, item {position}"
        for key in ("before", "after", "distractor"):
            if key != "distractor" or item.get(key) is not None:
                checked_type(item[key], str, f"{where}: {key!r}", "an image path relative to the JSON's folder")
        checked_type(item.get("id", position), (str, int), f"{where}: 'id'", "a string or a whole number")
        if item.get("type") is not None:
            checked_type(item["type"], str, f"{where}: 'type'", "a string such as \"move\" or null")
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
    repair: str = "download the dataset's images again"  # a missing or unreadable image; {root}, {json} filled in
    field_scoring: bool = False  # caption.py --eval also scores the test split as the dataset's papers do (LEVIR-CC)


SOURCES = {
    "synth": Source("the synthetic dataset", "data/synth", read_clevr_change,
                    "adapt.py and caption.py draw it there on first use of --data synth, or draw it now with: "
                    "python synth.py --make-synth DIR",
                    "remove the folder {root} and it will be drawn again"),
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
    "levir": Source("LEVIR-CC", "data/levir_cc", read_levir_cc,
                    "download it as the README of github.com/Chen-Yang-Liu/LEVIR-CC-Dataset says (Google Drive, "
                    "Baidu or Hugging Face lcybuaa/LEVIR-CC) and put its LevirCCcaptions.json and images/ folder "
                    "there, or give your own set in the same form with --data_root", field_scoring=True),
    "pairs": Source("your image pairs", "data/pairs", read_user_pairs,
                    "write {train,val,test}.json there, lists of {\"before\", \"after\", \"captions\"} "
                    "(format in data.py's docstring)",
                    "put a readable copy there, or remove its pair from {json}"),
}


def dataset_root(data: str, root: str | os.PathLike | None = None) -> Path:
    if data not in SOURCES:
        raise DataError(f"unknown dataset {data!r}; choose one of {sorted(SOURCES)}")
    return Path(root if root is not None else SOURCES[data].root)


def load_split(data: str, split: str, root: str | os.PathLike | None = None) -> list[ImagePair]:
    """The pairs of one split of a dataset ("synth", "clevr", "spot", "ier", "levir" or "pairs").

    The synthetic dataset is read, not drawn: the training scripts call synth.ensure_synth first.
    """
    root = dataset_root(data, root)
    if not root.is_dir():
        raise DataError(f"{SOURCES[data].name}: no folder {root}; {SOURCES[data].get_it} (or give its folder "
                        f"with --data_root)")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {SPLITS}")
    pairs = checked_files(SOURCES[data].reader(root, split), repair(data, root, split))
    note = empty_caption_note(f"{SOURCES[data].name} {split}", pairs)
    if note and os.environ.get("RANK", "0") == "0":  # under torchrun every process reads; the first one says so
        print(note)
    return pairs


def repair(data: str, root: Path, split: str) -> str:
    """What to do about a missing or unreadable image of a dataset's split (Source.repair, filled in)."""
    return SOURCES[data].repair.format(root=root, json=root / f"{split}.json")


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
# 5. Images: loading, CLIP4IDC's preprocessing, the reader
# ---------------------------------------------------------------------------------------------------

def load_image(path: Path, fix: str = "replace it with a readable copy (python check.py lists every unreadable "
                                     "image of a dataset)") -> Image.Image:
    """The image at path as 8-bit RGB (rgb_view), decoded now; an error naming the file and saying how to fix it
    (fix: what the reader of its dataset advises) when it is missing, unreadable or past Pillow's size limit."""
    try:
        with warnings.catch_warnings():  # past the limit Pillow only warns, past twice the limit it refuses
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()
                return rgb_view(image, path)
    except FileNotFoundError as error:
        raise DataError(f"image {path} is missing; {fix}") from error
    except DataError:  # rgb_view's: an image on no scale it can read
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise DataError(f"image {path} is too large for Pillow ({error}); shrink it below "
                        f"{Image.MAX_IMAGE_PIXELS:,} pixels (the model sees it at {IMAGE_SIZE} x {IMAGE_SIZE})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise DataError(f"image {path} is corrupt or not an image ({error}); {fix}") from error


FLOAT_OVERSHOOT = 1.5  # rgb_view: a float image whose values stay below this is on the 0..1 scale


def rgb_view(image: Image.Image, path: Path | str = "") -> Image.Image:
    """Any mode Pillow opens -> 8-bit RGB, the pixels an 8-bit viewer shows.

    RGB, L, 1, P, CMYK, YCbCr and the rest: Pillow's convert("RGB"), as CLIP's _convert_image_to_rgb does.
    Alpha (RGBA, LA, PA) is dropped: the colour stored under a transparent pixel is used, as convert("RGB") and
    CLIP do. 16-bit grey (I;16, I;16B, ...) and 32-bit integers (I, how Pillow opens 16-bit PGMs and older
    Pillows 16-bit PNGs): the high byte of the 16-bit value (clipped to 0..65535), as Pillow reads 16-bit
    colour PNGs; an 8-bit image stored in 16 bits (v = 257 k) gives back its k. Floats (F): 0..1 is black to
    white, as float images are written, rounded (an overshoot up to FLOAT_OVERSHOOT clipped); one with a value
    past that is on the 8-bit scale, 0..255; one past 255 (a float TIFF of 0..2550) is on no scale this can tell
    and is refused (DataError). convert("RGB") alone would clip these three at 255: a 16-bit PNG, a float image of
    0..255, would be all white.
    """
    if image.mode == "RGB":
        return image
    # differs from reference: convert("RGB") clips I;16, I and F at 255, so a 16-bit PNG would be all white
    if image.mode.startswith("I") or image.mode == "F":  # I;16*, I, F: one grey channel
        values = np.asarray(image)  # (H, W)
        if image.mode == "F":
            values = np.nan_to_num(values.astype(np.float64))
            top = float(values.max()) if values.size else 0.0
            if top > 255:
                raise DataError(f"image {path} holds floats up to {top:g}, past both scales float images are written "
                                f"on (0..1, 0..255): save it as an 8-bit PNG, or scaled to 0..255")
            scale = 255 if top <= FLOAT_OVERSHOOT else 1  # 0..1, or already 0..255
            grey = np.round(np.clip(values * scale, 0, 255))
        else:
            grey = np.clip(values.astype(np.int64), 0, 65535) >> 8
        return Image.fromarray(grey.astype(np.uint8), "L").convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as error:  # a mode Pillow cannot turn into RGB, such as premultiplied La
        raise DataError(f"image {path} has mode {image.mode}, which cannot be read as RGB ({error}); "
                        f"save it as an 8-bit RGB PNG") from None


def preprocess_uint8(path: Path, image_size: int) -> np.ndarray:
    """CLIP4IDC's preprocessing up to the pixels: RGB, bicubic resize to a square -> uint8 (R, R, 3)."""
    return clip.resize_to_uint8(load_image(path), image_size)


class ImageReader:
    """path -> uint8 pixels (R, R, 3): decoded and resized, or taken from an image cache (plumbing/caches.py's
    ImageCache, whose reader its image_reader makes).

    The pixels stay uint8 until they are on the training device, where to_device normalises them: a DataLoader
    worker then hands over a quarter of the bytes of float32 images, and a cached image is a memory copy.
    """

    def __init__(self, image_size: int = IMAGE_SIZE, cache=None):
        self.image_size, self.cache = image_size, cache

    @property
    def cache_dir(self) -> Path | None:
        """The folder of the image cache, where other caches derived from the images may go too (None: no cache)."""
        return None if self.cache is None else Path(self.cache.array_path).parent

    def __call__(self, path: Path) -> torch.Tensor:
        if self.cache is not None:
            return torch.from_numpy(self.cache[path])  # (R, R, 3), shares the memory map until a batch is stacked
        return torch.from_numpy(preprocess_uint8(path, self.image_size))  # (R, R, 3)


def usable_cpus() -> int:
    """The CPUs this process may run on (a container may allow fewer than the machine has): drawing the synthetic
    set (synth.py) and building the image cache (plumbing/caches.py) use them all; the training scripts share them between
    their processes (plumbing/processes.py)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def demo() -> None:
    """One pair of your own (the "pairs" layout) written in a temporary folder, read back, and its samples."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for name, x, floor in (("before.png", 40, "gray"), ("after.png", 150, "gray"), ("darker.png", 40, "dimgray")):
            image = Image.new("RGB", (240, 160), floor)  # a red square that moves; the distractor: less light
            ImageDraw.Draw(image).rectangle((x, 60, x + 40, 100), fill="red")
            image.save(root / name)
        (root / "train.json").write_text(json.dumps([{
            "id": "moved", "before": "before.png", "after": "after.png", "type": "move", "distractor": "darker.png",
            "captions": ["the red square moved", "the square is somewhere else"],
            "no_change_captions": ["nothing has changed"]}]), encoding="utf-8")
        # a vocabulary without merges: one token per character (CLIP's and synth.py's merge them into words)
        (root / "bpe_no_merges.txt.gz").write_bytes(gzip.compress(b"#version: 0.2\n"))
        tokenizer = clip.get_tokenizer(root / "bpe_no_merges.txt.gz")
        pairs = load_split("pairs", "train", root)
        pair = pairs[0]
        print(f"read {len(pairs)} pair from {root / 'train.json'}: {pair.id!r} ({pair.change_type}), "
              f"{len(pair.captions)} captions; vocabulary: {tokenizer.vocab_size} ids")
        sample = AdaptationSamples(pairs, tokenizer, train=True)[0]
        for key, value in sample.items():
            print(f"  stage 1 sample[{key!r}]: {tuple(value.shape) if torch.is_tensor(value) else value}")
        item = CaptionItems(pairs, tokenizer, use_no_change_pair=True)[0]
        out = item["caption_out"].tolist()
        print(f"  stage 2 caption_in:  {item['caption_in'].tolist()}")
        print(f"  stage 2 caption_out: {out} -> {tokenizer.decode(out[:out.index(tokenizer.eot_id)])!r}")
        print(f"  evaluation ids: {[p.id for p in evaluation_pairs(pairs, use_no_change_pair=True)]}")


if __name__ == "__main__":
    if sys.argv[1:]:  # the demo takes none: an old command (data.py --check) must not pass as done
        sys.exit(f"data.py: error: it takes no arguments (got {' '.join(sys.argv[1:])}), it prints a demo; a "
                 f"download is checked by check.py: python check.py --data clevr (or spot, ier, pairs, synth)")
    demo()
