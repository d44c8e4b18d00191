"""Draw clevr_style_public.json: CLEVR-Change-style difference captions, each with a candidate to score.

Run by hand, never by the tests (see README.md beside this file); it needs nothing but the Python standard
library. OUT_DIR is a folder of your choice, outside the repository:

    python tests/metrics_vectors/make_clevr_style.py OUT_DIR                 # OUT_DIR/clevr_style_public.json
    python tests/metrics_vectors/make_clevr_style.py --check                 # compares with the .json.gz here
    python tests/metrics_vectors/make_toolkit_scores.py --cut-from OUT_DIR   # cuts it to 1,200 items, scores it

What it draws, all from one `random.Random(seed)` (seed 11, 2,000 items), item by item in this order:

- a scene: a change (`add`, `drop`, `move`, `color`, `material` or `none`, weights 18:18:18:18:14:14); the
  object that changed (size, color, material, shape of CLEVR's 2 x 8 x 2 x 3); for a color change its new
  color, for a material change the other material; for every change but `none`, with probability 1/2, a
  second object and the first one's place beside it (left, right, in front, behind, near);
- 5 to 7 different references: sentences of the change's templates (CLEVR-Change's wording: "the small red
  metal cube changed its location", "the tiny green rubber sphere has disappeared", "there is no difference"),
  the object named with words drawn from its synonyms (small/tiny, large/big, rubber/matte,
  metal/metallic/shiny, cube/block, sphere/ball), each of size, color and material left out at times, the
  place said in 7 references of 10 when there is one (1 in 10 of them with the wrong side, as people
  err); what METEOR's stem ("moved"/"has moved", "metallic"/"metal"), synonym ("big"/"large") and
  paraphrase ("was taken away"/"has been removed") matching is for;
- a candidate of one kind (`kind`; weights in KINDS): `identical` (one of the references), `paraphrase`
  (another sentence drawn as a reference is), `styled` (a reference or a paraphrase in capitals,
  capitalised with a full stop or "!", with a comma put in, or with doubled spaces and a " ?"),
  `partial_wrong` (a paraphrase with one fact wrong and said: the size, color, material or shape, the
  side, the new color, or the kind of change; for `none` a change that did not happen), `wrong` (another
  change of another object), `truncated` (a paraphrase cut after 1 to all-but-one words), `repetitive`
  (a paraphrase said twice, or with words doubled), `one_word` (a word of ONE_WORDS), `empty` ("").

Items are {"id": "pub-00000", "candidate", "references", "kind", "change"}; meta names this generator, its
seed and the item count. The same seed gives the same file, byte for byte.
"""
import argparse
import random
import sys
from pathlib import Path

from corpus_files import check_or_write

NAME = "clevr_style_public"
SEED = 11
N = 2000

SIZES = {"small": ("small", "tiny"), "large": ("large", "big")}
COLORS = ("gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow")
MATERIALS = {"rubber": ("rubber", "matte"), "metal": ("metal", "metallic", "shiny")}
SHAPES = {"cube": ("cube", "block"), "sphere": ("sphere", "ball"), "cylinder": ("cylinder",)}
PLACES = {"left": ("left of", "to the left of", "that is to the left of", "on the left side of"),
          "right": ("right of", "to the right of", "that is to the right of", "on the right side of"),
          "front": ("in front of", "that is in front of"),
          "behind": ("behind", "that is behind"),
          "near": ("near",)}
CHANGES = {"add": 18, "drop": 18, "move": 18, "color": 18, "material": 14, "none": 14}

# {obj}: the object ("the"/"a" is in the template); {new}: its new color or material
TEMPLATES = {
    "add": ("a new {obj} appeared", "someone put a {obj} in the scene", "a {obj} has been added",
            "there is a new {obj}", "the {obj} has been added", "the {obj} has been newly placed",
            "someone added a {obj}", "the {obj} has appeared", "a {obj} was put in the scene"),
    "drop": ("the {obj} vanished", "the {obj} is no longer there", "the {obj} is missing",
             "someone removed the {obj}", "the {obj} was taken away", "the {obj} has disappeared",
             "the {obj} is gone", "the {obj} has been removed"),
    "move": ("the {obj} changed its location", "the {obj} has been moved", "the position of the {obj} changed",
             "someone moved the {obj}", "the {obj} changed its position", "the {obj} was moved to a new position",
             "the {obj} is in a different location", "the {obj} moved", "the {obj} has moved"),
    "color": ("the {obj} changed color", "the color of the {obj} changed to {new}", "the {obj} became {new}",
              "someone changed the color of the {obj} to {new}", "the {obj} changed its color to {new}",
              "the {obj} has been painted {new}", "the {obj} is now a {new} one", "the {obj} is now {new}",
              "the {obj} changed to {new}", "the {obj} turned {new}"),
    "material": ("the material of the {obj} changed to {new}", "someone changed the {obj} to {new}",
                 "the {obj} is now {new}", "the {obj} turned {new}", "the {obj} changed its material",
                 "the {obj} became {new}", "the {obj} changed to {new}", "the {obj} is made of {new} now"),
    "none": ("there is no difference", "nothing has changed", "the scene is the same as before",
             "the scene remains the same", "no object has changed", "no change was made",
             "the two scenes seem identical", "there is no change", "the two scenes are the same",
             "nothing was modified"),
}
KINDS = {"paraphrase": 27, "partial_wrong": 25, "styled": 13, "identical": 10, "truncated": 7, "wrong": 7,
         "one_word": 5, "repetitive": 4, "empty": 3}
ONE_WORDS = ("difference", "identical", "nothing", "moved", "added", "changed", "gone", "missing", "cube", "block",
             "sphere", "the") + COLORS
KEEP = {"size": 0.85, "color": 0.9, "material": 0.75}  # how often a reference names each attribute
SAY_PLACE, WRONG_SIDE = 0.7, 0.1


def pick(rng, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def draw_object(rng) -> dict:
    return {"size": rng.choice(list(SIZES)), "color": rng.choice(COLORS),
            "material": rng.choice(list(MATERIALS)), "shape": rng.choice(list(SHAPES))}


def draw_scene(rng, change=None) -> dict:
    scene = {"change": change or pick(rng, CHANGES), "object": draw_object(rng), "new": None, "place": None}
    if scene["change"] == "color":
        scene["new"] = rng.choice([c for c in COLORS if c != scene["object"]["color"]])
    elif scene["change"] == "material":
        scene["new"] = "metal" if scene["object"]["material"] == "rubber" else "rubber"
    if scene["change"] != "none" and rng.random() < 0.5:
        scene["place"] = (rng.choice(list(PLACES)), draw_object(rng))
    return scene


def noun_phrase(rng, obj: dict, said=()) -> str:
    """The object in words: each attribute kept at the rate KEEP (always if in `said`), words from its synonyms."""
    words = [rng.choice(SIZES[obj["size"]]) if "size" in said or rng.random() < KEEP["size"] else None,
             obj["color"] if "color" in said or rng.random() < KEEP["color"] else None,
             rng.choice(MATERIALS[obj["material"]]) if "material" in said or rng.random() < KEEP["material"] else None,
             rng.choice(SHAPES[obj["shape"]])]
    return " ".join(w for w in words if w)


def sentence(rng, scene: dict, said=()) -> str:
    """One caption of the scene; `said`: facts it must state (attributes, "place")."""
    template = rng.choice(TEMPLATES[scene["change"]])
    obj = noun_phrase(rng, scene["object"], said)
    if scene["place"] and ("place" in said or rng.random() < SAY_PLACE):
        side, other = scene["place"]
        if "place" not in said and rng.random() < WRONG_SIDE:
            side = rng.choice([s for s in PLACES if s != side])
        obj += f" {rng.choice(PLACES[side])} the {noun_phrase(rng, other)}"
    new = scene["new"] and (scene["new"] if scene["change"] == "color" else rng.choice(MATERIALS[scene["new"]]))
    return template.format(obj=obj, new=new)


def partly_wrong(rng, scene: dict) -> str:
    """A caption of the scene with one fact wrong, the wrong fact stated."""
    if scene["change"] == "none":  # a change that did not happen, to the object drawn for the scene
        return sentence(rng, draw_scene(rng, rng.choice([c for c in CHANGES if c != "none"])) | {
            "object": scene["object"]})
    facts = ["size", "color", "material", "shape", "change"]
    if scene["place"]:
        facts.append("place")
    if scene["change"] == "color":
        facts.append("new")
    fact = rng.choice(facts)
    wrong = dict(scene, object=dict(scene["object"]))
    if fact in ("size", "material", "shape"):
        table = {"size": SIZES, "material": MATERIALS, "shape": SHAPES}[fact]
        wrong["object"][fact] = rng.choice([v for v in table if v != scene["object"][fact]])
        if fact == "material" and scene["change"] == "material":
            wrong["new"] = scene["object"]["material"]
    elif fact == "color":
        wrong["object"]["color"] = rng.choice([c for c in COLORS if c not in (scene["object"]["color"], scene["new"])])
    elif fact == "new":
        wrong["new"] = rng.choice([c for c in COLORS if c not in (scene["object"]["color"], scene["new"])])
    elif fact == "place":
        side, other = scene["place"]
        wrong["place"] = (rng.choice([s for s in PLACES if s != side]), other)
    else:  # another kind of change of the same object
        change = rng.choice([c for c in CHANGES if c not in ("none", scene["change"])])
        wrong = draw_scene(rng, change) | {"object": scene["object"], "place": scene["place"]}
    return sentence(rng, wrong, said=(fact,))


def styled(rng, text: str) -> str:
    words = text.split()
    style = rng.choice(("upper", "full stop", "exclamation", "comma", "spaces"))
    if style == "upper":
        return text.upper()
    if style == "full stop":
        return text[:1].upper() + text[1:] + "."
    if style == "exclamation":
        return text[:1].upper() + text[1:] + "!"
    if style == "comma" and len(words) > 1:
        at = rng.randrange(len(words) - 1)
        return " ".join(words[:at] + [words[at] + ","] + words[at + 1:]) + "."
    at = rng.randrange(len(words))
    return "  " + " ".join(words[:at] + [""] + words[at:]) + " ? "


def candidate(rng, kind: str, scene: dict, references: list) -> str:
    if kind == "identical":
        return rng.choice(references)
    if kind == "paraphrase":
        return sentence(rng, scene)
    if kind == "styled":
        return styled(rng, rng.choice(references) if rng.random() < 0.5 else sentence(rng, scene))
    if kind == "partial_wrong":
        return partly_wrong(rng, scene)
    if kind == "wrong":
        return sentence(rng, draw_scene(rng, rng.choice([c for c in CHANGES if c != scene["change"]])))
    if kind == "truncated":
        words = sentence(rng, scene).split()
        return " ".join(words[:rng.randint(1, len(words) - 1)])
    if kind == "repetitive":
        text = sentence(rng, scene)
        if rng.random() < 0.5:
            return f"{text} {text}"
        words = text.split()
        doubled = [rng.random() < 0.5 for _ in words]
        doubled[rng.randrange(len(words))] = True
        return " ".join(w for w, twice in zip(words, doubled) for w in [w] * (1 + twice))
    if kind == "one_word":
        return rng.choice(ONE_WORDS)
    return ""  # empty


def build(seed: int = SEED, n: int = N) -> dict:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        scene = draw_scene(rng)
        references = []
        count = rng.randint(5, 7)
        while len(references) < count:
            text = sentence(rng, scene)
            if text not in references:
                references.append(text)
        kind = pick(rng, KINDS)
        items.append({"id": f"pub-{i:05d}", "candidate": candidate(rng, kind, scene, references),
                      "references": references, "kind": kind, "change": scene["change"]})
    return {"meta": {"generator": "make_clevr_style.py", "seed": seed, "n": n}, "items": items}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path, nargs="?", help=f"where to write {NAME}.json")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--n", type=int, default=N)
    parser.add_argument("--check", action="store_true", help=f"compare with {NAME}.json.gz here; write nothing")
    args = parser.parse_args(argv)
    full = build(args.seed, args.n)
    return check_or_write(NAME, full, args.out_dir, args.check, parser)


if __name__ == "__main__":
    sys.exit(main())
