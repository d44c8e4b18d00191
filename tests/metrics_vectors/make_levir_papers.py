"""Make levir_papers.json.gz: two LevirCCcaptions.json-form corpora with predictions, and what each LEVIR-CC paper's
own code makes of them (word map, references, the scores of each subset, the lines its test script prints): the
known answers of scoring/field.py (`metrics.py --as rsicc|rscama|chg2cap`).

Run by hand, never by the tests (see README.md beside this file). It needs the three papers' repositories, Java, and
pycocoevalcap 1.2 (whose meteor-1.5.jar and data/paraphrase-en.gz are copied beside each paper's eval_func/meteor/
meteor.py, since their checkouts may lack them):

    git clone https://github.com/Chen-Yang-Liu/RSICC PAPERS/RSICC           # at d1505e5
    git clone https://github.com/Chen-Yang-Liu/RSCaMa PAPERS/RSCaMa         # at 563e2c5
    git clone https://github.com/ShizhenChang/Chg2Cap PAPERS/Chg2Cap        # at 7b8cda9
    python tests/metrics_vectors/make_levir_papers.py PAPERS                # draw, run each paper's code, write
    python tests/metrics_vectors/make_levir_papers.py --check               # draw again, compare with the file

The corpora are drawn with the Python standard library alone (random.Random(SEED)): LEVIR-CC-style pairs (a grammar
of remote-sensing changes; the five no-change sentences of every unchanged pair, as the papers' `nochange_list`),
with the cases where the papers' rules part: words seen exactly 5 and 6 times (at the vocabulary threshold, > 5 or
>= 5), hyphenated words, `raw` texts that tokenize otherwise than their `tokens` ("built," and "0.5km"), three spaces
in a `raw` (RSCaMa's tokenizer keeps an empty token), a training sentence of more than 50 tokens (RSICC leaves it
out and draws another, which moves its random draws of every later pair's references), pairs that mix change and
no-change sentences (which reference says no change decides the subset), and predictions that are empty, hold an
unknown word, a hyphen as CLIP decodes it ("lower - right"), a final " .", or a word at the threshold. "main" has 24
test pairs; "tiny" 2, one changed and one unchanged, so each subset is one item (the copy's one-item CIDEr-D).

Each paper's code runs as shipped, in its own process, in a copy of its files: RSICC utils.py `create_input_files`
then eval.py `evaluate_transformer`; RSCaMa and Chg2Cap preprocess_data.py then test.py (`__main__`). Stand-ins
replace what the scoring never reads: the models (they emit each prediction's ids, one per step, then the end id:
a word of the paper's word map is its id, any other <unk>'s, the words split as field.prediction_words does),
image reading, HDF5 (in memory), CUDA (`.cuda()` returns the tensor), tqdm, torchvision's Normalize, and Chg2Cap's
hard-coded input path. Each get_eval_score call is recorded (its id lists and its scores), and the printout kept.
"""
import argparse
import contextlib
import gzip
import importlib
import io
import json
import os
import random
import runpy
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from corpus_files import HERE, gz_json_bytes

SEED = 54
NO_CHANGE = ("there is no difference", "the two scenes seem identical", "the scene is the same as before",
             "no change has occurred", "almost nothing has changed")
OBJECTS = ("houses", "buildings", "villas", "roads", "a road", "trees", "some trees", "a parking lot", "a lane",
           "several buildings", "a playground", "many houses", "a river bank")
VERBS = ("appear", "are built", "have been constructed", "are removed", "disappear")
SINGULAR_VERBS = ("appears", "is built", "has been constructed", "is removed", "disappears")
PLACES = ("at the bottom", "on the left", "on the right", "at the top", "in the lower-right corner",
          "in the upper-left corner", "along the road", "beside the road", "near the woods", "in the middle")
AT_THRESHOLD = {"greenhouse": 5, "t-shaped": 5, "stadium": 6, "cul-de-sac": 6, "pond": 4}  # times in all captions
CORPORA = {"main": {"train": 40, "val": 8, "test": 24}, "tiny": {"train": 30, "val": 2, "test": 2}}
PAPERS = {"rsicc": "RSICC", "rscama": "RSCaMa", "chg2cap": "Chg2Cap",
          "rscama shipped vocab": "RSCaMa"}   # RSCaMa's test.py with the vocab.json it ships, not the one its
#                                             preprocess_data.py writes
COMMITS = {"RSICC": "d1505e5", "RSCaMa": "563e2c5", "Chg2Cap": "7b8cda9"}


def sentence(rng, thing, place):
    singular = thing.startswith(("a ", "an "))
    verb = rng.choice(SINGULAR_VERBS if singular else VERBS)
    return rng.choice((f"{thing} {verb} {place}", f"{place} {thing} {verb}", f"{thing} {verb}"))


def draw_corpus(name, rng):
    """{"records": LevirCCcaptions.json's "images", "predictions": [{image_id, caption}] of its test pairs}."""
    records, sentences_of_changes, sentid = [], [], 0
    for split, n in CORPORA[name].items():
        for k in range(n):
            changed = k % 2 == 0 if not (split == "test" and k in (3, 5)) else None  # None: a mixed pair
            if changed is False:
                texts = list(NO_CHANGE)
            else:
                thing, place = rng.choice(OBJECTS), rng.choice(PLACES)
                texts = [sentence(rng, thing, place) for _ in range(5)]
                if changed is None:              # a no-change sentence first (k 3) or second (k 5), as it lands
                    texts[0 if k == 3 else 1] = rng.choice(NO_CHANGE)
            sentences = []
            for j, text in enumerate(texts):
                raw = f" {text} ."
                sentences.append({"tokens": text.split(), "raw": raw, "imgid": len(records), "sentid": sentid})
                sentid += 1
                if text not in NO_CHANGE:
                    sentences_of_changes.append(sentences[-1])
            records.append({"filepath": split, "filename": f"{split}_{k + 1:06d}.png", "imgid": len(records),
                            "changeflag": int(changed is not False), "sentences": sentences,
                            "sentids": [s["sentid"] for s in sentences], "split": split})
    for word, times in AT_THRESHOLD.items():       # rare words, each seen exactly `times` times in all captions
        for s in rng.sample(sentences_of_changes, times):
            s["tokens"] = s["tokens"] + ["near", "a", word]
            s["raw"] = s["raw"][:-2] + f" near a {word} ."
    edits = rng.sample(sentences_of_changes, 4)
    edits[0]["raw"] = edits[0]["raw"].replace(" ", ", ", 2).replace(", ", " ", 1)   # "houses, appear": a comma
    edits[1]["tokens"], edits[1]["raw"] = edits[1]["tokens"] + ["0.5km"], edits[1]["raw"][:-2] + " 0.5km ."
    edits[2]["raw"] = edits[2]["raw"].replace(" ", "   ", 2).replace("   ", " ", 1)  # three spaces, once
    long = next(r for r in records if r["split"] == "train" and r["changeflag"])["sentences"][2]
    long["tokens"] = long["tokens"] + ["and", "the", "road"] * 16            # more than 50 tokens (train only)
    long["raw"] = " " + " ".join(long["tokens"]) + " ."
    predictions, test = [], [r for r in records if r["split"] == "test"]
    kinds = ("copy", "other change", "no change", "empty", "unknown word", "clip hyphen", "final period",
             "threshold word", "truncated")
    for k, record in enumerate(test):
        kind = kinds[k % len(kinds)] if name == "main" else ("copy", "other change")[k]
        first = " ".join(record["sentences"][0]["tokens"])
        caption = {"copy": first, "other change": sentence(rng, rng.choice(OBJECTS), "in the lower-right corner"),
                   "no change": rng.choice(NO_CHANGE), "empty": "", "unknown word": f"{first} quonset",
                   "clip hyphen": "a road is built in the lower - right corner", "final period": f"{first} .",
                   "threshold word": f"{first} near a greenhouse", "truncated": " ".join(first.split()[:2])}[kind]
        predictions.append({"image_id": record["filename"], "caption": caption, "kind": kind})
    return {"records": records, "predictions": predictions}


def draw():
    rng = random.Random(SEED)
    return {"meta": {"builder": "make_levir_papers.py", "seed": SEED, "papers": COMMITS},
            "corpora": {name: draw_corpus(name, rng) for name in CORPORA}}


# --- each paper's own code, in a process of its own ---------------------------------------------------------------

def stub(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def prediction_ids(captions, word_map, specials, tokenize=None):
    """Each prediction as the ids the paper's model would emit, then the end id: the paper's tokenizer (or a split
    on spaces), CLIP's " - " joined; a word outside the word map is <unk>'s id."""
    unknown, end = word_map[specials[0]], word_map[specials[2]]
    out = []
    for caption in captions:
        text = " ".join(caption.replace(" - ", "-").split())
        words = [] if not text else tokenize(text) if tokenize else text.split()
        out.append([word_map.get(w, unknown) for w in words] + [end])
    return out


def record_eval_scores(module):
    """Wrap module.get_eval_score so that every call's id lists and scores are kept, in call order."""
    calls, original = [], module.get_eval_score

    def recorded(references, hypotheses):
        scores = original(references, hypotheses)
        calls.append({"references": [[list(map(int, r)) for r in refs] for refs in references],
                      "hypotheses": [list(map(int, h)) for h in hypotheses],
                      "scores": {k: float(v) for k, v in scores.items()}})
        return scores
    return calls, recorded


def common_stubs(torch):
    """What the papers' code imports but the scoring never needs."""
    stub("tqdm", tqdm=lambda iterable=None, *args, **kwargs: iterable)
    stub("matplotlib", use=lambda *a, **k: None)
    stub("matplotlib.pyplot")
    zeros = lambda *args, **kwargs: __import__("numpy").zeros((256, 256, 3), "uint8")  # noqa: E731
    stub("imageio", imread=zeros)
    stub("cv2", resize=lambda image, size: image)
    stub("skimage")
    stub("skimage.io", imread=zeros)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self      # no GPU here; the scores never touch one


class FakeModel:
    """A model part that does nothing but what the test loop calls on it."""
    def __init__(self, *args, **kwargs): pass
    def load_state_dict(self, *args, **kwargs): pass
    def eval(self): return self
    def cuda(self): return self
    def to(self, *args, **kwargs): return self
    def __call__(self, x, *rest): return x


def run_rsicc(folder, corpus_path, captions, out):
    import torch
    common_stubs(torch)
    stored = {}

    class H5File:                      # h5py.File, in memory: create_input_files writes, CaptionDataset reads
        def __init__(self, path, mode="r"):
            self.path, self.attrs = str(path), stored.setdefault(str(path) + ".attrs", {})
        def __enter__(self): return self
        def __exit__(self, *args): return False
        def create_dataset(self, name, shape, dtype):
            stored[self.path] = __import__("numpy").zeros(shape, dtype)
            return stored[self.path]
        def __getitem__(self, name): return stored[self.path]
    stub("h5py", File=H5File)
    transforms = types.SimpleNamespace(Normalize=lambda **kwargs: (lambda x: x),
                                       Compose=lambda fs: (lambda x: x))
    stub("torchvision", transforms=transforms)
    stub("torchvision.transforms", **vars(transforms))
    utils = importlib.import_module("utils")
    data_folder = folder / "data"
    data_folder.mkdir(exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):
        utils.create_input_files(dataset="LEVIR_CC", karpathy_json_path=str(corpus_path), image_folder="images",
                                 captions_per_image=5, min_word_freq=5, output_folder=str(data_folder), max_len=50)
    word_map = json.loads((data_folder / "WORDMAP_LEVIR_CC_5_cap_per_img_5_min_word_freq.json").read_text())
    targets = prediction_ids(captions, word_map, ("<unk>", "<start>", "<end>", "<pad>"))
    state = {"image": -1}

    class EncoderFeat(FakeModel):
        def __call__(self, a, b):
            state["image"] += 1
            return torch.zeros(4, 1, 8)                                   # (S, batch, dim)

    class Decoder(FakeModel):
        def vocab_embedding(self, tgt): return torch.zeros(tgt.shape[0], tgt.shape[1], 8)
        def position_encoding(self, x): return x
        def transformer(self, tgt, memory, tgt_mask=None): return tgt
        def wdc(self, pred):                                              # one-hot of the prediction, step by step
            target, logits = targets[state["image"]], torch.zeros(pred.shape[0], pred.shape[1], len(word_map))
            for position, word in enumerate(target[:pred.shape[0]]):
                logits[position, :, word] = 100.0
            return logits
    evaluation = importlib.import_module("eval")
    calls, evaluation.get_eval_score = record_eval_scores(evaluation)
    args = argparse.Namespace(data_folder=str(data_folder), data_name="LEVIR_CC_5_cap_per_img_5_min_word_freq",
                              encoder_image="resnet101", encoder_feat="MCCFormers_diff_as_Q", decoder="trans",
                              Split="TEST", epoch="epoch", beam_size=1, path="")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        metrics = evaluation.evaluate_transformer(args, FakeModel(), EncoderFeat(), Decoder())
        print("{} - beam size {}: BLEU-1 {} BLEU-2 {} BLEU-3 {} BLEU-4 {} METEOR {} ROUGE_L {} CIDEr {}".format
              (args.decoder, args.beam_size, metrics["Bleu_1"], metrics["Bleu_2"], metrics["Bleu_3"],
               metrics["Bleu_4"], metrics["METEOR"], metrics["ROUGE_L"], metrics["CIDEr"]))   # eval.py __main__
    return {"word_map": word_map, "calls": calls, "printed": printed.getvalue()}


def run_raw_paper(name, folder, corpus_path, captions, out):
    """RSCaMa or Chg2Cap: preprocess_data.py, then test.py, each as __main__."""
    import torch
    common_stubs(torch)
    save_dir = folder / "data" / "LEVIR_CC"
    save_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    if name != "chg2cap":
        sys.argv = ["preprocess_data.py", "--input_captions_json", str(corpus_path), "--save_dir", "./data/LEVIR_CC/"]
        init = {}
    else:                                   # Chg2Cap reads a hard-coded path: its open() is pointed at the corpus
        sys.argv = ["preprocess_data.py"]
        init = {"open": lambda path, *a, **k: open(str(corpus_path) if path == "/root/Data/LEVIR_CC/LevirCCcaptions"
                                                    ".json" else path, *a, **k)}
    with contextlib.redirect_stdout(io.StringIO()):
        preprocess = runpy.run_path("preprocess_data.py", init_globals=init, run_name="__main__")
    if name == "rscama shipped vocab":
        shutil.copy(Path(out) / "shipped_vocab.json", save_dir / "vocab.json")
    word_map = json.loads((save_dir / "vocab.json").read_text())
    order = [line.strip() for line in (save_dir / "test.txt").read_text().splitlines()]
    by_name = dict(zip([p["image_id"] for p in captions], [p["caption"] for p in captions]))
    tokenize = lambda text: preprocess["tokenize"](text, add_start_token=False, add_end_token=False,  # noqa: E731
                                                   punct_to_keep=[";", ","], punct_to_remove=["?", "."])
    targets = iter(prediction_ids([by_name[n] for n in order], word_map, ("<UNK>", "<START>", "<END>", "<NULL>"),
                                  tokenize))

    class Decoder(FakeModel):
        def sample(self, *features, **kwargs): return [word_map["<START>"], *next(targets)]

    class Encoder(FakeModel):
        def __call__(self, a, b): return a, b

    class AttentiveEncoder(FakeModel):
        def __call__(self, a, b): return a if name != "chg2cap" else (a, b)
    stub("model")
    stub("model.model_encoder_attMamba" if name != "chg2cap" else "model.model_encoder", Encoder=Encoder,
         AttentiveEncoder=AttentiveEncoder)
    stub("model.model_decoder", DecoderTransformer=Decoder)
    stub("clip", load=lambda *a, **k: (None, lambda image: torch.zeros(3, 2, 2)))
    torch.load = lambda *args, **kwargs: {"encoder_dict": {}, "encoder_trans_dict": {}, "decoder_dict": {}}
    utils = importlib.import_module("utils_tool.utils" if name != "chg2cap" else "utils")
    calls, utils.get_eval_score = record_eval_scores(utils)
    sys.argv = ["test.py", "--checkpoint", "fake.pth", "--workers", "0", "--savepath", str(folder / "ckpt")]
    if name != "chg2cap":
        sys.argv = sys.argv[:5] + ["--result_path", str(folder / "result")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path("test.py", run_name="__main__")
    return {"word_map": word_map, "calls": calls, "printed": printed.getvalue(), "order": order}


def run_paper(paper, papers_dir, corpus, work):
    """The paper's answers for one corpus, from a child process (each paper's modules are named alike)."""
    folder = work / PAPERS[paper]
    source = papers_dir / PAPERS[paper]
    if paper == "rscama shipped vocab":
        shutil.copy(source / "data" / "LEVIR_CC" / "vocab.json", work / "shipped_vocab.json")
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns(".git", "*.png", "*.jpg", "__pycache__"))
    import pycocoevalcap
    jar_dir = Path(pycocoevalcap.__path__[0]) / "meteor"
    shutil.copy(jar_dir / "meteor-1.5.jar", folder / "eval_func" / "meteor" / "meteor-1.5.jar")
    (folder / "eval_func" / "meteor" / "data").mkdir(exist_ok=True)
    shutil.copy(jar_dir / "data" / "paraphrase-en.gz", folder / "eval_func" / "meteor" / "data" / "paraphrase-en.gz")
    corpus_path = work / "LevirCCcaptions.json"
    corpus_path.write_text(json.dumps({"images": corpus["records"]}))
    (work / "predictions.json").write_text(json.dumps(corpus["predictions"]))
    result = subprocess.run([sys.executable, __file__, "--child", paper, str(folder), str(work)], cwd=folder,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{paper}: its code failed:\n{result.stderr[-4000:]}")
    return json.loads((work / f"{paper}.answer.json").read_text())


def child(paper, folder, work):
    folder, work = Path(folder), Path(work)
    sys.path.insert(0, str(folder))
    os.chdir(folder)
    predictions = json.loads((work / "predictions.json").read_text())
    corpus_path = work / "LevirCCcaptions.json"
    if paper == "rsicc":
        answer = run_rsicc(folder, corpus_path, [p["caption"] for p in predictions], work)
    else:
        answer = run_raw_paper(paper, folder, corpus_path, predictions, work)
    (work / f"{paper}.answer.json").write_text(json.dumps(answer))


def commit_of(folder):
    try:
        return subprocess.run(["git", "-C", str(folder), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("papers", nargs="?", type=Path, help="folder with RSICC/, RSCaMa/ and Chg2Cap/")
    parser.add_argument("--check", action="store_true", help="draw the corpora again, compare with the file here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    drawn = draw()
    path = HERE / "levir_papers.json.gz"
    if args.check:
        kept = json.loads(gzip.decompress(path.read_bytes()))
        same = all(kept["corpora"][n]["records"] == c["records"] and kept["corpora"][n]["predictions"] ==
                   c["predictions"] for n, c in drawn["corpora"].items())
        print(f"levir_papers.json.gz: {'the same corpora' if same else 'DIFFERENT corpora'}")
        return 0 if same else 1
    if args.papers is None:
        parser.error("give the folder of the papers' repositories, or --check")
    drawn["meta"]["papers_found"] = {name: commit_of(args.papers / name) for name in PAPERS.values()}
    for name, corpus in drawn["corpora"].items():
        corpus["answers"] = {}
        for paper in PAPERS:
            with tempfile.TemporaryDirectory() as work:
                corpus["answers"][paper] = run_paper(paper, args.papers, corpus, Path(work))
            whole = corpus["answers"][paper]["calls"][-1]["scores"]
            print(name, paper, {k: round(v, 4) for k, v in whole.items()}, file=sys.stderr)
    path.write_bytes(gz_json_bytes(drawn))
    print(f"{path}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
