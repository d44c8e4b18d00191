"""Make empty_references.json: a small Spot-the-Diff-style corpus, four of whose items have empty references, with
the coco-caption toolkit's scores of it (the test of how empty references count in a corpus reads both).

Run by hand, never by the tests; it needs pycocoevalcap 1.2 and Java (README.md beside this file):

    python tests/metrics_vectors/make_empty_references.py

The corpus is written here, in ITEMS, by hand: two items whose only reference is empty (one of them with an empty
candidate), one whose only reference is whitespace, one with an empty reference among others, and ordinary items
around them. The toolkit's pipeline is make_toolkit_scores.score's (PTBTokenizer, Bleu(4), Meteor(), Rouge(),
Cider()); the file keeps the corpus scores and each item's.
"""
import json

from corpus_files import HERE
from make_toolkit_scores import score

ITEMS = [  # (id, candidate, references)
    ("256.png", "the person with the umbrella is gone",
     ["person with umbrella is gone", "person with red coat is moved", "car up at top to left is now missing"]),
    ("294.png", "there is a red car in the top left",
     ["on the top left side of the right image there is a red car that is not in the left image"]),
    ("187.png", "there is no difference", ["i see no differences between the two images"]),
    ("9420.png", "the car is gone", [""]),
    ("3.png", "", [""]),
    ("36.png", "a person walking appears on the left",
     ["walking person on right near red car in before image is gone in after image",
      "walking person in red coat appears on left near arrow in after image", "",
      "white suv on end of left side of center lot is gone"]),
    ("8069.png", "the white car is no longer there", ["  "]),
    ("223.png", "the white car is no longer in the lot", ["the white car is no longer in the parking lot"]),
    ("61.png", "the person walking is gone", ["the person walking is no longer there"]),
    ("151.png", "black car missing from the bottom left", ["black car missing from bottom left corner"]),
    ("91.png", "nothing has changed", ["nothing has changed", "everything is the same"]),
    ("564.png", "the people are gone", ["the white care on the bottom left is gone",
                                        "the people walking across the intersection are gone",
                                        "there are now people waiting to cross the intersection"]),
]


def main():
    items = [{"id": i, "candidate": candidate, "references": references} for i, candidate, references in ITEMS]
    toolkit = score(items, with_modules=False)
    out = {"items": items, "toolkit": {"corpus": toolkit["corpus"],
                                       "items": {it["id"]: {k: v for k, v in it.items() if k.isupper() or k[0].isupper()}
                                                 for it in toolkit["items"]}}}
    (HERE / "empty_references.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print({k: round(v, 6) for k, v in toolkit["corpus"].items()})


if __name__ == "__main__":
    main()
