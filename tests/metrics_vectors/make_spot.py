"""Remake spot_public.json (the full corpus that spot_public.json.gz is cut from) from Spot-the-Diff's annotations.

Run by hand, never by the tests (see README.md beside this file). It needs the annotations of
github.com/harsh19/spot-the-diff at commit d26bdcd4f2d33246355a503c3f8f1def9295dda2, in a checkout outside
the repository (SPOT_DIR and OUT_DIR are placeholders for folders of your choice):

    git clone https://github.com/harsh19/spot-the-diff SPOT_DIR
    git -C SPOT_DIR checkout d26bdcd4f2d33246355a503c3f8f1def9295dda2
    python tests/metrics_vectors/make_spot.py SPOT_DIR OUT_DIR            # writes OUT_DIR/spot_public.json
    python tests/metrics_vectors/make_spot.py SPOT_DIR --check            # compares with spot_public.json.gz here
    python tests/metrics_vectors/make_toolkit_scores.py --cut-from OUT_DIR  # cuts it to 600 items and scores it

How the corpus is made (the `meta` of spot_public.json.gz names this builder and its seed): the annotations
of train, val and test (in that order) are grouped by `img_id` in order of first appearance, one pair per
image id (11,329 pairs; an image id annotated by several workers gets all their sentences, `annotators`
says how many); empty sentences are dropped (66); the 6,560 pairs with two sentences or more are kept. With
`random.Random(7)`, each kept pair in turn gets a candidate sentence (`rng.randrange`), the others of the
pair, in their order, being its references; then the kept pairs are shuffled (`rng.shuffle`) and the first
half, 3,280 pairs, is the public part. It needs nothing but the Python standard library.
"""
import argparse
import json
import random
import sys
from pathlib import Path

from corpus_files import check_or_write

SOURCE_COMMIT = "d26bdcd4f2d33246355a503c3f8f1def9295dda2"
SEED = 7
SPLITS = ("train", "val", "test")


def build(spot_dir: Path) -> dict:
    sentences, split, annotators = {}, {}, {}
    empty = 0
    for name in SPLITS:
        for annotation in json.loads((spot_dir / "data" / "annotations" / f"{name}.json").read_text("utf-8")):
            image_id = annotation["img_id"]
            kept = [s for s in annotation["sentences"] if s.strip()]
            empty += len(annotation["sentences"]) - len(kept)
            sentences.setdefault(image_id, []).extend(kept)
            split[image_id] = name
            annotators[image_id] = annotators.get(image_id, 0) + 1
    pairs = [image_id for image_id in sentences if len(sentences[image_id]) >= 2]
    rng = random.Random(SEED)
    candidate = {image_id: rng.randrange(len(sentences[image_id])) for image_id in pairs}
    rng.shuffle(pairs)
    public = pairs[:len(pairs) // 2]
    items = []
    for image_id in public:
        said, chosen = sentences[image_id], candidate[image_id]
        items.append({"id": f"spot-{image_id}", "candidate": said[chosen],
                      "references": said[:chosen] + said[chosen + 1:],
                      "split": split[image_id], "annotators": annotators[image_id]})
    meta = {"source": "github.com/harsh19/spot-the-diff data/annotations (train+val+test)",
            "source_commit": SOURCE_COMMIT, "builder": "make_spot.py", "seed": SEED,
            "pairs_total": len(sentences), "pairs_with_2plus_sentences": len(pairs),
            "empty_sentences_dropped": empty, "part": "public", "n": len(items)}
    return {"meta": meta, "items": items}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spot_dir", type=Path, help=f"a checkout of harsh19/spot-the-diff at {SOURCE_COMMIT[:8]}")
    parser.add_argument("out_dir", type=Path, nargs="?", help="where to write spot_public.json")
    parser.add_argument("--check", action="store_true", help="compare with spot_public.json.gz here; write nothing")
    args = parser.parse_args(argv)
    full = build(args.spot_dir)
    return check_or_write('spot_public', full, args.out_dir, args.check, parser)


if __name__ == "__main__":
    sys.exit(main())
