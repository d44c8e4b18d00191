"""Make levir_field.json.gz, a LEVIR-CC-style corpus, and levir_field.coco.json.gz, the Java toolkit's scores of
it in the field's form: what scoring/field.py's field_ids and score_both_ways must give.

Run by hand, never by the tests (see README.md beside this file); scoring needs pycocoevalcap 1.2 and Java:

    python tests/metrics_vectors/make_levir_field.py            # draw the corpus, score it, write both files
    python tests/metrics_vectors/make_levir_field.py --check    # draw it again and compare with the file here

The corpus is drawn with the Python standard library alone (random.Random(SEED)): 240 pairs in the style of
LEVIR-CC's captions (github.com/Chen-Yang-Liu/LEVIR-CC-Dataset; none of its sentences is copied but the five
no-change sentences every unchanged pair has, listed in github.com/Chen-Yang-Liu/RSICC eval.py `nochange_list`).
Each changed pair gets five references drawn from a grammar of remote-sensing changes (houses, roads, trees ...
appearing, being built or removed, somewhere in the scene, hyphenated places such as "lower-right" included), some
with a misspelt or a rare word; its candidate is a reference, another drawing of the same change, a sentence with a
wrong object, a truncated or repeated one, a no-change sentence, or a sentence with a word seen nowhere else
(`kind` says which). Each unchanged pair has the five no-change sentences as references; its candidate is one of
them, or a change sentence.

The toolkit scores it as the LEVIR-CC papers do (github.com/Chen-Yang-Liu/RSICC utils.py `get_eval_score`):
the vocabulary is the words seen at least 5 times in all the references, numbered after <NULL> <UNK> <START>
<END> in sorted order (as github.com/Chen-Yang-Liu/RSCaMa preprocess_data.py numbers them); each caption becomes
the string of its words' ids, a word outside the vocabulary <UNK>'s id, in the candidates and the references
alike; no PTB tokenizer; Bleu(4) (closest reference length), Meteor() (meteor-1.5.jar -l en -norm, every module,
as the field runs it), Rouge(), Cider(). The whole corpus, its changed pairs and its unchanged pairs are each
scored on their own (CIDEr's IDF is per corpus). The same jar run with `-m exact` is kept too (METEOR_exact): on
id strings stem and synonym matching find nothing, but the paraphrase table joins a few phrases of numbers, so
METEOR with every module, the papers' number, differs a little from the exact-only one.
"""
import argparse
import random
import sys
from collections import Counter

from corpus_files import HERE, gz_json_bytes

SEED = 46
PAIRS = 240                 # pairs in the corpus: about half changed, half unchanged, as in LEVIR-CC
MIN_COUNT = 5               # the field's vocabulary rule: a word seen fewer times is <unk>
SPECIALS = ("<NULL>", "<UNK>", "<START>", "<END>")
NO_CHANGE = ("there is no difference", "the two scenes seem identical", "the scene is the same as before",
             "no change has occurred", "almost nothing has changed")
OBJECTS = ("houses", "buildings", "villas", "roads", "a road", "trees", "some trees", "a parking lot", "a lane",
           "several buildings", "a playground", "many houses", "a river bank")
VERBS = ("appear", "are built", "have been constructed", "are removed", "disappear", "are replaced by bareland")
SINGULAR_VERBS = ("appears", "is built", "has been constructed", "is removed", "disappears",
                  "is replaced by bareland")
PLACES = ("at the bottom", "on the left", "on the right", "at the top", "in the lower-right corner",
          "in the upper-left corner", "along the road", "beside the road", "near the woods", "in the middle",
          "on the bareland", "in the lower-left")
RARE = ("t-shaped", "greenhouse", "stadium", "cul-de-sac", "a\\almost", "tennis court")


def sentence(rng: random.Random, thing: str, place: str) -> str:
    """One change sentence about thing at place."""
    singular = thing.startswith(("a ", "an "))
    verb = rng.choice(SINGULAR_VERBS if singular else VERBS)
    shape = rng.randrange(3)
    if shape == 0:
        return f"{thing} {verb} {place}"
    if shape == 1:
        return f"{place} {thing} {verb}"
    return f"{thing} {verb} {place} and the road is widened" if rng.random() < 0.5 else f"{thing} {verb}"


def draw() -> dict:
    rng = random.Random(SEED)
    items = []
    for n in range(PAIRS):
        if rng.random() < 0.5:
            candidate = rng.choice(NO_CHANGE) if rng.random() < 0.8 else sentence(rng, rng.choice(OBJECTS),
                                                                                   rng.choice(PLACES))
            items.append({"id": f"test_{n:06d}.png", "kind": "no change", "candidate": candidate,
                          "references": list(NO_CHANGE),
                          "candidate_kind": "no-change sentence" if candidate in NO_CHANGE else "change sentence"})
            continue
        thing, place = rng.choice(OBJECTS), rng.choice(PLACES)
        references = [sentence(rng, thing, place) for _ in range(5)]
        if rng.random() < 0.2:  # a misspelt or rare word in one reference: <unk> in the field's references
            k = rng.randrange(5)
            references[k] = f"{references[k]} {rng.choice(RARE)}"
        kind = rng.choice(("copy", "redrawn", "wrong object", "truncated", "repeated", "no-change sentence",
                           "unseen word"))
        candidate = {"copy": lambda: rng.choice(references),
                     "redrawn": lambda: sentence(rng, thing, place),
                     "wrong object": lambda: sentence(rng, rng.choice(OBJECTS), place),
                     "truncated": lambda: " ".join(references[0].split()[:rng.randrange(1, 4)]),
                     "repeated": lambda: " ".join([thing] * rng.randrange(2, 5)),
                     "no-change sentence": lambda: rng.choice(NO_CHANGE),
                     "unseen word": lambda: f"{sentence(rng, thing, place)} quonset"}[kind]()
        items.append({"id": f"test_{n:06d}.png", "kind": "change", "candidate": candidate, "references": references,
                      "candidate_kind": kind})
    return {"meta": {"builder": "make_levir_field.py", "seed": SEED, "pairs": PAIRS, "min_count": MIN_COUNT},
            "items": items}


def vocabulary(items) -> dict:
    """{word: id}: the words seen at least MIN_COUNT times in the references, numbered after SPECIALS, sorted."""
    counts = Counter(word for item in items for reference in item["references"] for word in reference.split())
    return {word: len(SPECIALS) + k for k, word in enumerate(sorted(w for w, n in counts.items() if n >= MIN_COUNT))}


def as_ids(text: str, words: dict) -> str:
    return " ".join(str(words.get(word, SPECIALS.index("<UNK>"))) for word in text.split())


def score(items, words: dict) -> dict:
    """The toolkit's scores of items in the field's form, as get_eval_score runs it (dicts for pycocoevalcap 1.2)."""
    from make_toolkit_scores import MeteorWithModules, bleu, stop
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge

    gts = {i: [as_ids(r, words) for r in item["references"]] for i, item in enumerate(items)}
    res = {i: [as_ids(item["candidate"], words)] for i, item in enumerate(items)}
    corpus, _, _ = bleu(gts, res)
    out = {f"BLEU_{n + 1}": corpus[n] for n in range(4)}
    for name, scorer in (("METEOR", Meteor()), ("ROUGE_L", Rouge()), ("CIDEr", Cider())):
        out[name] = float(scorer.compute_score(gts, res)[0])
        if isinstance(scorer, Meteor):
            stop(scorer)
    meteor = MeteorWithModules("exact")
    out["METEOR_exact"] = float(meteor.compute_score(gts, res)[0])
    stop(meteor)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the drawn corpus with the file here")
    args = parser.parse_args(argv)
    corpus = draw()
    if args.check:
        same = (HERE / "levir_field.json.gz").read_bytes() == gz_json_bytes(corpus)
        print(f"levir_field.json.gz: {'the same bytes' if same else 'DIFFERENT bytes'}")
        return 0 if same else 1
    words = vocabulary(corpus["items"])
    subsets = {"whole": corpus["items"], **{kind: [it for it in corpus["items"] if it["kind"] == kind]
                                            for kind in ("change", "no change")}}
    answer = {"vocabulary": words, "scores": {name: score(items, words) for name, items in subsets.items()},
              "sizes": {name: len(items) for name, items in subsets.items()},
              "items": [{"id": it["id"], "candidate_ids": as_ids(it["candidate"], words),
                         "references_ids": [as_ids(r, words) for r in it["references"]]} for it in corpus["items"]]}
    (HERE / "levir_field.json.gz").write_bytes(gz_json_bytes(corpus))
    (HERE / "levir_field.coco.json.gz").write_bytes(gz_json_bytes(answer))
    for name, scores in answer["scores"].items():
        print(name, answer["sizes"][name], {k: round(v, 4) for k, v in scores.items()})
    print(f"vocabulary: {len(words)} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
