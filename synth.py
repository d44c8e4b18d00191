"""The synthetic world: CLEVR-Change-style image pairs, their captions and their vocabulary, drawn on a CPU.

CLIP4IDC (CLIP for Image Difference Captioning; Guo et al., 2022) is trained and evaluated on CLEVR-Change
(Park et al., 2019): rendered scenes of a few objects in which one object changes colour or material, appears,
disappears or moves, each with a "distractor" view of the unchanged scene from another camera or light. Training
on CLEVR-Change takes a large download and a GPU; this file draws a small world of the same kind in a minute or
two on a CPU, so that the whole pipeline can be run, read and tested without them (`--data synth`, the project's
default). Like nanoGPT's data/<name>/prepare.py it only writes files: data.py reads them in the CLEVR-Change
layout, with the same reader as the real dataset. It teaches the data, not the method: a first reading of
CLIP4IDC can skip it.

It holds, top to bottom:
  1. scenes and captions: objects placed on a floor, one change of CLEVR-Change's five types, the
     distractor's camera and light, and sentences from a small grammar with CLEVR's synonyms;
  2. drawing: one Blinn-Phong shaded sprite per object (numpy, supersampled), soft shadows, a PNG writer;
  3. the splits, and the BPE (byte-pair encoding) vocabulary learned from the grammar's words (OpenAI's merges
     format);
  4. the changed object's boxes, in the change_captions_with_bbox.json format of RCC (Robust Change Captioning,
     Park et al., 2019, the CLEVR-Change authors' code) for explain.py's pointing game;
  5. make_synth / ensure_synth: the dataset written in the CLEVR-Change layout (see data.py's docstring);
  6. stage 0: single scenes with sentences naming their objects, and their samples: the synthetic CLIP
     (assets/synth-ViT-32.pt, clip.py's "synth-ViT/32") was pretrained on them by `pretrain.py`.

What it writes:
  data/synth         the CLEVR-Change layout (data.py's docstring), with change_captions_with_bbox.json, plus
                     bpe_synth_vocab.txt.gz (the BPE merges, OpenAI's format) and synth_scenes.json (the config
                     and every scene drawn, for tests and to check a folder against the settings asked for).
  data/synth_scenes  stage 0 only: pixels_224.npy (every scene preprocessed, uint8), scenes.json (the config,
                     the objects of each scene, the splits), bpe_synth_vocab.txt.gz.

A scene is a list of objects {"shape", "color", "material", "size", "x", "y"} on a grey floor, (x, y) the
object's centre in pixels of the 480 x 320 image. Each pair changes one object in one of CLEVR-Change's
five ways; its distractor shows the unchanged scene after a small camera shift, zoom or light change.
Unlike CLEVR, objects never overlap or hide each other and there is no perspective (an object's size
does not depend on its depth), so that every change can be seen: after the 224 x 224 resize a small
object still covers about 21 x 32 pixels. Same config, same bytes (on the same numpy and zlib): every
random number of a pair comes from the seed and the pair's number, whatever the number of processes.

Run:  python synth.py                                  draw 10 pairs in a temp folder, print one with its tokens
      python synth.py --make-synth DIR [--pairs N] [--seed S] [--workers W]
      python synth.py --make-scenes DIR [--seed S] [--workers W]   stage 0's 21,000 scenes (3.2 GB)
adapt.py and caption.py draw data/synth on first use of --data synth; pretrain.py draws data/synth_scenes.

Shape letters: H, W height and width of a drawn image (320 x 480), S side of an object's sprite,
R image side after preprocessing (224), T caption tokens (max_words, 32).
"""
import argparse
import gzip
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
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

import clip
import data

SYNTH_SCENES_FILE = "synth_scenes.json"  # what make_synth drew: its config and every scene


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


# ---------------------------------------------------------------------------------------------------
# 1. Scenes and captions
# ---------------------------------------------------------------------------------------------------

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
# (the words of CLEVR-Change's change_captions.json; facebookresearch/clevr-dataset-gen,
# question_generation/synonyms.json).
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
    kind = data.CHANGE_TYPES[pair_id % len(data.CHANGE_TYPES)]
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


# ---------------------------------------------------------------------------------------------------
# 2. Drawing: sprites, shadows, a scene, a PNG
# ---------------------------------------------------------------------------------------------------
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
    """An RGB PNG with no row filter and zlib at level: faster than Pillow's encoder, which tries filters (BENCHMARKS.md section 7)."""
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


# ---------------------------------------------------------------------------------------------------
# 3. The splits and the BPE vocabulary
# ---------------------------------------------------------------------------------------------------

EVAL_PAIRS_PER_TYPE = 40  # at most this many validation (and test) pairs of each type: 200, however many are drawn


def synth_splits(cfg: SynthConfig) -> dict[str, list[int]]:
    """Each change type's ids shuffled and cut by split_fractions (validation and test capped at
    EVAL_PAIRS_PER_TYPE), so every split has every type evenly and more pairs drawn go to training."""
    rng = np.random.default_rng([cfg.seed, SPLIT_STREAM])
    splits = {name: [] for name in data.SPLITS}
    for t in range(len(data.CHANGE_TYPES)):
        ids = [int(i) for i in rng.permutation(np.arange(t, cfg.pairs, len(data.CHANGE_TYPES)))]
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


# ---------------------------------------------------------------------------------------------------
# 4. The changed object's boxes
# ---------------------------------------------------------------------------------------------------

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
    partial = root / f".{data.CHANGE_BOXES_FILE}.partial-{os.getpid()}"
    partial.write_text(json.dumps(boxes), encoding="utf-8")
    os.replace(partial, root / data.CHANGE_BOXES_FILE)


# ---------------------------------------------------------------------------------------------------
# 5. Writing the dataset
# ---------------------------------------------------------------------------------------------------

def make_synth(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int = 1) -> Path:
    """Draw the synthetic dataset into root (which must not exist) in the CLEVR-Change layout.

    The pairs are drawn in a temporary folder beside root, which is renamed to root at the end, so an
    interrupted run leaves no half-written dataset. If another process finished root first (two ranks of
    torchrun), its identical copy is kept. The bytes depend on cfg alone, not on the number of workers.
    """
    root, cfg = Path(root), cfg or SynthConfig()
    if not isinstance(cfg.pairs, int) or cfg.pairs < 1:
        raise data.DataError(f"pairs {cfg.pairs!r}: the synthetic dataset needs a whole number of at least 1 pair "
                             f"(the default is {SynthConfig.pairs})")
    if root.exists():
        raise data.DataError(f"{root} already exists; remove it to draw the synthetic dataset again, "
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
                                  for t in data.CHANGE_TYPES},
            SYNTH_SCENES_FILE: {"config": asdict(cfg), "scenes": {
                n: {k: v for k, v in s.items() if k not in ("captions", "no_change_captions")}
                for n, s in zip(names, scenes)}}}
        for name, content in files.items():
            (building / name).write_text(json.dumps(content), encoding="utf-8")
        for scene in scenes:  # CLIP's pre-tokenizer then splits at spaces only, and every word is one token
            for caption in scene["captions"] + scene["no_change_captions"]:
                assert set(caption) <= CAPTION_CHARACTERS and set(caption.split()) <= grammar_words(), caption
        write_change_boxes(building, scenes, cfg)
        write_bpe(building / data.SYNTH_BPE_FILE, synth_vocabulary())
        try:
            os.rename(building, root)
        except OSError:
            if not (root / "splits.json").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def ensure_synth(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int | None = None) -> Path:
    """root holding the synthetic dataset: drawn now if it does not exist, checked against cfg if it does."""
    root = Path(root)
    if not root.exists():
        cfg = cfg or SynthConfig()
        workers = workers or data.usable_cpus()
        print(f"synth.py: drawing the synthetic dataset ({cfg.pairs} pairs, seed {cfg.seed}) into {root} "
              f"with {workers} processes", file=sys.stderr)
        return make_synth(root, cfg, workers)
    scenes_file = root / SYNTH_SCENES_FILE
    if not (root / "splits.json").is_file() or not scenes_file.is_file():
        raise data.DataError(f"{root} exists but is not a complete synthetic dataset (no splits.json or "
                             f"{SYNTH_SCENES_FILE}); remove it and it will be drawn again")
    if clip.read_merges(root / data.SYNTH_BPE_FILE) != synth_vocabulary():
        raise data.DataError(f"the synthetic dataset in {root} has another vocabulary than the synthetic CLIP's "
                             f"(it was drawn by an older data.py or synth.py); remove the folder and it will be "
                             f"drawn again")
    drawn = json.loads(scenes_file.read_text(encoding="utf-8"))
    if not (root / data.CHANGE_BOXES_FILE).is_file():  # drawn before the boxes were written: the scenes hold them
        stored_cfg = SynthConfig(**{k: v for k, v in drawn["config"].items() if k in SynthConfig.__dataclass_fields__})
        write_change_boxes(root, list(drawn["scenes"].values()), stored_cfg)
    if cfg is not None:
        stored = drawn["config"]
        wanted = json.loads(json.dumps(asdict(cfg)))  # tuples become lists, as in the stored file
        if stored != wanted:
            differences = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
            if set(differences) == {"pairs"}:  # the one setting a flag chooses: say which value reads it as drawn
                raise data.DataError(f"the synthetic dataset in {root} was drawn with --synth_pairs {stored['pairs']}, "
                                     f"not {cfg.pairs}: pass --synth_pairs {stored['pairs']} to read it as drawn (the "
                                     f"value a checkpoint trained on it records in its config), or remove the folder "
                                     f"to draw {cfg.pairs} pairs, or use another --data_root")
            raise data.DataError(f"the synthetic dataset in {root} was drawn with other settings (stored, wanted: "
                                 f"{differences}); remove the folder to draw it again, or use another root")
    return root


# ---------------------------------------------------------------------------------------------------
# 6. Stage 0: single scenes described object by object, to pretrain the synthetic CLIP
# ---------------------------------------------------------------------------------------------------
# CLIP4IDC starts from OpenAI's CLIP, pretrained on 400M (image, text) pairs of the web, whose blocks already
# know objects and their attributes; adaptation (stage 1) then teaches them to compare. This world has no
# such CLIP, so stage 0 (`python pretrain.py`) makes one the way OpenAI did: CLIP's contrastive loss on
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


def scene_pixels(scenes: list[list[dict]], cfg: SynthConfig, image_size: int = data.IMAGE_SIZE) -> np.ndarray:
    """Render scenes (each a list of objects) and preprocess them as a PNG of them would be -> uint8 (n, R, R, 3)."""
    return np.stack([clip.resize_to_uint8(Image.fromarray(render(objects, cfg)), image_size) for objects in scenes])


def make_scenes(root: str | os.PathLike, cfg: SynthConfig | None = None, workers: int = 1,
                image_size: int = data.IMAGE_SIZE, splits: dict[str, int] = SCENE_SPLITS) -> Path:
    """Draw the stage-0 scenes into root: pixels_<R>.npy (n, R, R, 3) uint8, scenes.json, the BPE vocabulary.

    Written in a temporary folder renamed to root at the end, like make_synth. The pixels are stored
    preprocessed (150 KB a scene at 224; 3.2 GB for the 21,000 scenes) instead of as PNGs: nothing but
    stage 0 reads them. The bytes depend on cfg and image_size alone.
    """
    root, cfg = Path(root), cfg or SynthConfig()
    if root.exists():
        raise data.DataError(f"{root} already exists; remove it to draw the stage-0 scenes again")
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
                print(f"\rsynth.py: stage-0 scenes {start + len(part)}/{total}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        pixels.flush()
        del pixels
        bounds = np.cumsum([0, *splits.values()])
        scenes = {"config": asdict(cfg), "image_size": image_size,
                  "splits": {s: [int(a), int(b)] for s, a, b in zip(splits, bounds, bounds[1:])},
                  "objects": objects}
        (building / SCENES_FILE).write_text(json.dumps(scenes), encoding="utf-8")
        write_bpe(building / data.SYNTH_BPE_FILE, synth_vocabulary())
        os.rename(building, root)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def ensure_scenes(root: str | os.PathLike, cfg: SynthConfig | None = None) -> Path:
    """root holding the stage-0 scenes, drawn now (a minute or two) if it does not exist."""
    root = Path(root)
    if not (root / SCENES_FILE).is_file():
        if root.exists():
            raise data.DataError(f"{root} exists but holds no {SCENES_FILE}; remove it and it will be drawn again")
        print(f"synth.py: drawing {sum(SCENE_SPLITS.values())} stage-0 scenes into {root} "
              f"with {data.usable_cpus()} processes", file=sys.stderr)
        make_scenes(root, cfg, data.usable_cpus())
    return root
class SceneSamples(Dataset):
    """Stage 0: one sample per single scene of a split of make_scenes: {"image": (R, R, 3) uint8, "caption": (T,)}.

    In training each sample describes its scene anew, objects in a random order with random synonyms
    (torch's generator); otherwise the description is the canonical one (describe_scene's default).
    """

    def __init__(self, root: str | os.PathLike, split: str, tokenizer: clip.SimpleTokenizer, train: bool,
                 max_words: int = data.MAX_WORDS):
        root = Path(root)
        scenes = data.read_json(root / SCENES_FILE, "the stage-0 scenes")
        first, stop = scenes["splits"][split]
        self.objects, self.first = scenes["objects"][first:stop], first
        self.array_path = root / f"pixels_{scenes['image_size']}.npy"
        self.tokenizer, self.train, self.max_words = tokenizer, train, max_words
        self.pixels = None

    def __len__(self):
        return len(self.objects)

    def description(self, i: int) -> str:
        return describe_scene(self.objects[i], data.random_index if self.train else (lambda n: 0))

    def __getitem__(self, i: int) -> dict:
        if self.pixels is None:  # opened in each DataLoader worker, memory-mapped
            self.pixels = np.load(self.array_path, mmap_mode="r")  # (n, R, R, 3) uint8
        return {"image": torch.from_numpy(np.array(self.pixels[self.first + i])),  # (R, R, 3) uint8, as data.ImageReader
                "caption": data.text_tokens(self.tokenizer, self.description(i), self.max_words)}

    def __getstate__(self):  # a worker opens its own memory map
        return {**self.__dict__, "pixels": None}


# ---------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------

def demo() -> None:
    """Draw 10 pairs in a temporary folder, read them back with data.py, print one pair and its tokens."""
    with tempfile.TemporaryDirectory() as folder:
        root = make_synth(Path(folder) / "synth", SynthConfig(pairs=10))
        pairs = data.load_split("synth", "train", root)
        tokenizer = clip.get_tokenizer(root / data.SYNTH_BPE_FILE)
        print(f"drew 10 pairs in {root}; train split: {len(pairs)} pairs; vocabulary: {tokenizer.vocab_size} ids")
        scene = json.loads((root / SYNTH_SCENES_FILE).read_text(encoding="utf-8"))["scenes"]
        pair = pairs[0]
        drawn = scene[pair.before.name]
        print(f"pair {pair.id} ({pair.change_type}): {len(drawn['before'])} objects before, "
              f"{len(drawn['after'])} after; distractor view {drawn['distractor']}")
        for caption in pair.captions[:3]:
            print(f"  {caption!r} -> {tokenizer.encode(caption)}")
        print(f"  {pair.no_change_captions[0]!r} (the distractor pair)")
        objects = pretrain_objects(0, SynthConfig())
        print(f"stage-0 scene 0: {describe_scene(objects)!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-synth", metavar="DIR", help="draw the synthetic dataset into DIR")
    parser.add_argument("--make-scenes", metavar="DIR", help="draw stage 0's single scenes into DIR")
    parser.add_argument("--pairs", type=int, default=SynthConfig.pairs)
    parser.add_argument("--seed", type=int, default=SynthConfig.seed)
    parser.add_argument("--workers", type=int, default=1, help="processes drawing pairs or scenes")
    args = parser.parse_args()
    for name, least in (("pairs", 1), ("seed", 0), ("workers", 1)):  # one line, as argparse's own errors
        if getattr(args, name) < least:
            parser.exit(2, f"{parser.prog}: error: --{name} {getattr(args, name)}: it must be at least {least}\n")

    start = time.perf_counter()
    try:
        if args.make_synth:
            make_synth(args.make_synth, SynthConfig(pairs=args.pairs, seed=args.seed), args.workers)
            print(f"drew {args.pairs} pairs in {args.make_synth} with {args.workers} process(es) in "
                  f"{time.perf_counter() - start:.1f} s")
        elif args.make_scenes:
            make_scenes(args.make_scenes, SynthConfig(seed=args.seed), args.workers)
            print(f"drew {sum(SCENE_SPLITS.values())} scenes in {args.make_scenes} with {args.workers} process(es) "
                  f"in {time.perf_counter() - start:.1f} s")
        else:
            demo()
    except data.DataError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
