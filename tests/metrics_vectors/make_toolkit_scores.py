"""Remake the coco-caption toolkit's answers (<name>.coco.json.gz) for the corpora in this folder.

Run by hand, never by the tests (see README.md beside this file); it needs pycocoevalcap 1.2 and Java:

    python tests/metrics_vectors/make_toolkit_scores.py                      # score the corpora kept here
    python tests/metrics_vectors/make_toolkit_scores.py --cut-from FOLDER    # first cut them from the full files

FOLDER holds full <name>.json corpora; those it holds are cut, the others are scored as kept here. Two are
remade by builders beside this file (make_clevr_style.py writes clevr_style_public.json, make_spot.py
spot_public.json); edge_cases.json.gz is hand-written, its own source (README.md beside this file).

The pipeline is the toolkit's own, as pycocoevalcap.eval.COCOEvalCap.evaluate runs it without SPICE:
PTBTokenizer (references, then candidates), then Bleu(4), Meteor(), Rouge(), Cider(). Two extra runs of
the toolkit's METEOR jar with fewer modules (its -m option) give the "exact" and "exact stem" corpus scores,
and the CLEVR-style corpus's first 100 items are scored again on their own (CIDEr's IDF is per corpus).
"""
import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from corpus_files import CUTS, HERE, cut, gz_json_bytes

from pycocoevalcap.bleu.bleu_scorer import BleuScorer
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

LINE_BREAKS = re.compile("[\r\x0b\x0c\u2028\u2029]")  # PTBTokenizer ends a line at these; the wrapper only maps \n


def read_gz_json(path: Path):
    return json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))


def write_gz_json(path: Path, data):
    path.write_bytes(gz_json_bytes(data))


def tokenize(items):
    """{position: [tokenized references]}, {position: [tokenized candidate]} from the toolkit's PTBTokenizer."""
    clean = lambda text: LINE_BREAKS.sub(" ", text)  # noqa: E731  (the line breaks the wrapper misses, as spaces)
    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": clean(r)} for r in it["references"]] for i, it in enumerate(items)})
    res = tokenizer.tokenize({i: [{"caption": clean(it["candidate"])}] for i, it in enumerate(items)})
    return gts, res


def bleu(gts, res):
    """Bleu(4)'s scores, and each item's statistics, from the toolkit's own BleuScorer."""
    scorer = BleuScorer(n=4)
    for i in gts:
        scorer += (res[i][0], gts[i])
    stdout, sys.stdout = sys.stdout, sys.stderr  # compute_score prints its totals
    try:
        corpus, items = scorer.compute_score(option="closest", verbose=1)
    finally:
        sys.stdout = stdout
    stats = [{"testlen": c["testlen"], "reflen_closest": scorer._single_reflen(c["reflen"], "closest", c["testlen"]),
              "guess": c["guess"], "correct": c["correct"]} for c in scorer.ctest]
    return corpus, items, stats


class MeteorWithModules(Meteor):
    """The toolkit's Meteor wrapper, its jar started with -m (modules) added to the wrapper's own command."""

    def __init__(self, modules: str):
        jar_folder = os.path.dirname(os.path.abspath(sys.modules[Meteor.__module__].__file__))
        self.meteor_cmd = ["java", "-jar", "-Xmx2G", "meteor-1.5.jar", "-", "-", "-stdio", "-l", "en", "-norm",
                           "-m", modules]
        self.meteor_p = subprocess.Popen(self.meteor_cmd, cwd=jar_folder, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lock = threading.Lock()


def stop(meteor: Meteor):
    with meteor.lock:
        meteor.meteor_p.stdin.close()
        meteor.meteor_p.kill()
        meteor.meteor_p.wait()


def score(items, with_modules=True):
    gts, res = tokenize(items)
    out = {"corpus": {}, "items": [{"id": it["id"]} for it in items]}
    corpus, per_item, stats = bleu(gts, res)
    for n in range(4):
        out["corpus"][f"BLEU_{n + 1}"] = corpus[n]
        for item, value in zip(out["items"], per_item[n]):
            item[f"BLEU_{n + 1}"] = value
    for name, scorer in (("METEOR", Meteor()), ("ROUGE_L", Rouge()), ("CIDEr", Cider())):
        corpus, per_item = scorer.compute_score(gts, res)
        out["corpus"][name] = float(corpus)
        for item, value in zip(out["items"], per_item):
            item[name] = float(value)
        if isinstance(scorer, Meteor):
            stop(scorer)
    out["corpus_bleu_stats"] = {"testlen": sum(s["testlen"] for s in stats),
                                "reflen": sum(s["reflen_closest"] for s in stats),
                                "guess": [sum(s["guess"][k] for s in stats) for k in range(4)],
                                "correct": [sum(s["correct"][k] for s in stats) for k in range(4)]}
    for i, (item, s) in enumerate(zip(out["items"], stats)):
        item |= {"bleu_stats": s, "candidate_tok": res[i][0], "references_tok": gts[i]}
    if with_modules:
        out["meteor_modules"] = {}
        for modules in ("exact", "exact stem"):
            meteor = MeteorWithModules(modules)
            out["meteor_modules"][modules.replace(" ", "+")] = float(meteor.compute_score(gts, res)[0])
            stop(meteor)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cut-from", type=Path,
                        help="a folder with full <name>.json corpora to cut first (those it holds)")
    args = parser.parse_args(argv)
    for name in CUTS:
        if args.cut_from and (args.cut_from / f"{name}.json").exists():
            full = json.loads((args.cut_from / f"{name}.json").read_text(encoding="utf-8"))
            write_gz_json(HERE / f"{name}.json.gz", cut(name, full))
        items = read_gz_json(HERE / f"{name}.json.gz")["items"]
        out = score(items)
        if name == "clevr_style_public":  # CIDEr depends on the corpus: the first 100 scored as a corpus of their own
            out["first_100"] = score(items[:100], with_modules=False)["corpus"]
        write_gz_json(HERE / f"{name}.coco.json.gz", out)
        print(name, len(items), {k: round(v, 4) for k, v in out["corpus"].items()}, out["meteor_modules"])


if __name__ == "__main__":
    main()
