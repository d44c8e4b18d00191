"""Caption metrics (BLEU-1..4, METEOR 1.5, ROUGE-L, CIDEr-D) as the coco-caption toolkit computes them, in plain Python.

This is how stage 2 of CLIP4IDC (CLIP, Contrastive Language-Image Pre-training, adapted to image difference
captioning) is evaluated: BLEU-4, METEOR, ROUGE-L and CIDEr as computed by the Java-based coco-caption toolkit
(pycocoevalcap 1.2: a Stanford Penn Treebank (PTB) tokenizer, then four scorers), like every
image-difference-captioning paper and the reference implementation (github.com/sushizixin/CLIP4IDC at commit
ca49461, main_task_caption.py `EvalCap`). This file computes the same numbers without Java and without torch
(stage 1's retrieval recall is adapt.py's). The lesson comes first, each metric a function of tokenized text:

    1. BLEU-1..4 (BiLingual Evaluation Understudy)   n-gram precisions, closest reference length, summed statistics,
                                  the toolkit's epsilons
    2. ROUGE-L (Recall-Oriented Understudy for Gisting Evaluation, by the longest common subsequence, LCS)
                                  word LCS, beta 1.2, best precision and best recall taken separately
    3. CIDEr-D (Consensus-based Image Description Evaluation; D: the variant hardened against gaming)
                                  tf-idf (term frequency times inverse document frequency) n-grams, document frequency
                                  over the evaluated set, clipped counts, Gaussian length penalty; the metric that
                                  picks the best epoch
    4. CaptionScorer, score_captions, score_subsets   the toolkit's pipeline: PTB tokens, then the scorers; a subset
                                  is re-scored on its own, as Robust Change Captioning's (RCC) utils/eval_utils.py
                                  `score_generation_by_type` does (CIDEr's document frequencies change with it)
Then what the lesson leans on, off the reading path:
    5. reading predictions and references (COCO, Common Objects in Context, results and ground truth), checking
       them, and the printed table
    6. FastCaptionScorer          the same numbers, faster: it selects every speed variant (scoring/fast.py, the
                                  PTB shortcut of scoring/ptb.py); score_captions runs the plain CaptionScorer unless
                                  asked for it, as the scripts ask in one line
    7. the field's scoring        how the LEVIR-CC papers score (vocabulary-id strings, no tokenizer, S*m): each
                                  paper's evaluation exactly, in scoring/field.py (--as rsicc|rscama|chg2cap)
    8. the kind of change a caption says, by keywords (CLEVR-Change-style captions; no toolkit has it)
    9. the command line, and the demo
Side trips in their own files: the PTB tokenizer (scoring/ptb.py, Stanford PTBTokenizer 3.4.1 -preserveLines
-lowerCase, then 17 tokens dropped) and METEOR (scoring/meteor.py).

On the toolkit's own output for the corpora in tests/metrics_vectors every score agrees to the last bit, METEOR
included.

Differences from the toolkit (each is marked `# differs from reference:` below, or in scoring/):
  - Line-break characters other than \\n (carriage return, vertical tab, form feed, U+2028, U+2029) are spaces.
    The toolkit's tokenizer starts a new line at them and silently gives every later caption the wrong item's text.
  - A caption is tokenized on its own. The Java tokenizer reads the next caption after a newline as trailing
    context, which matters only for a caption ending in an abbreviation ("etc.", "a.", "No.") when the next starts
    with a capital, a listed word or a number.
  - A corpus whose references are all empty scores CIDEr 0; the toolkit crashes.
  - METEOR's own differences are listed in scoring/meteor.py.

Run:   python metrics.py                                   # demo: one candidate against two references
       python metrics.py PREDICTIONS.json --references FILE [--as coco|rsicc|rscama|chg2cap] [--json]
                             # any predictions against a dataset's references; LEVIR-CC as each paper scores it;
                             # --help: an example per dataset
       python metrics.py tests/metrics_vectors/edge_cases.json.gz   # items with candidate and references

Shape letters: T texts (captions).
"""
import argparse
import dataclasses
import functools
import gzip
import json
import math
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from scoring import fast, field
from scoring.fast import PARALLEL_MIN_ITEMS, FastMeteor, MeteorWorker, collector_paused
from scoring.meteor import (METEOR_DATA_ENV, METEOR_MODULES, CaptionInputError, Meteor, MeteorConfig,
                            load_meteor_resources)
from scoring.ptb import ptb_tokenize, ptb_tokenize_fast


@dataclasses.dataclass
class MetricsConfig:
    bleu_n: int = 4                                 # BLEU-1..4
    cider_n: int = 4                                # CIDEr uses 1- to 4-grams
    cider_sigma: float = 6.0                        # width of CIDEr-D's Gaussian length penalty
    rouge_beta: float = 1.2                         # ROUGE-L F-measure: recall weighs beta^2 times precision
    cider_log_n_of_one: float | None = None         # CIDEr's log N for a one-item set: None, log 1 = 0, as the
    #                                                 toolkit; the LEVIR-CC papers' copy sets 1 (scoring/field.py)
    meteor: MeteorConfig = dataclasses.field(default_factory=MeteorConfig)   # alpha, beta, gamma, delta, weights, beam


METRICS = ("BLEU", "METEOR", "ROUGE_L", "CIDEr")


# ---------------------------------------------------------------------------------------------------------------
# N-gram counts shared by BLEU and CIDEr (both split on whitespace with str.split(), as bleu_scorer / cider_scorer)
# ---------------------------------------------------------------------------------------------------------------
def _ngram_counts(sentence, n):
    """[{1-gram (word): count}, {2-gram: count}, ..., {n-gram: count}], each in order of first occurrence.

    An n-gram is its words joined by spaces (the toolkit uses tuples): a str keeps its hash once computed, a tuple
    hashes all its words again at every lookup, and the scorers look each n-gram up many times.
    """
    words = sentence.split()
    counts, grams = [], words
    for order in range(1, n + 1):
        grams = [gram + " " + word for gram, word in zip(grams, words[order - 1:])] if order > 1 else words
        counted = {}                      # a plain dict: a Counter takes twice as long to make for a few words
        for gram in grams:
            counted[gram] = counted.get(gram, 0) + 1
        counts.append(counted)
    return counts


# ---------------------------------------------------------------------------------------------------------------
# 1. BLEU (pycocoevalcap bleu/bleu_scorer.py, Bleu(4) with option "closest")
# ---------------------------------------------------------------------------------------------------------------
BLEU_TINY = 1e-15     # added to the matched n-gram counts, "so that if guess is 0 still return 0"
BLEU_SMALL = 1e-9     # added to the guessed n-gram counts and lengths, against division by zero


def bleu_item_stats(candidate_counts, candidate_len, reference_counts, reference_lens, n=4):
    """testlen, reflen (the closest reference length, the shorter on a tie), guess[n], correct[n] (clipped)."""
    reflen = min((abs(length - candidate_len), length) for length in reference_lens)[1]
    guess = [max(0, candidate_len - k) for k in range(n)]
    correct = []
    for k in range(n):
        cand, max_ref = candidate_counts[k], {}
        for counts in reference_counts:             # the largest count in any one reference (clipping)
            ref = counts[k]
            for gram in cand.keys() & ref.keys():
                if ref[gram] > max_ref.get(gram, 0):
                    max_ref[gram] = ref[gram]
        correct.append(sum(min(count, max_ref[gram]) for gram, count in cand.items() if gram in max_ref))
    return {"testlen": candidate_len, "reflen": reflen, "guess": guess, "correct": correct}


def bleu_from_stats(testlen, reflen, guess, correct):
    """[BLEU-1, ..., BLEU-n]: geometric means of the precisions, times the brevity penalty; no smoothing."""
    scores, product = [], 1.0
    for k in range(len(guess)):
        product *= (float(correct[k]) + BLEU_TINY) / (float(guess[k]) + BLEU_SMALL)
        scores.append(product ** (1.0 / (k + 1)))
    ratio = (testlen + BLEU_TINY) / (reflen + BLEU_SMALL)
    if ratio < 1:
        scores = [score * math.exp(1 - 1 / ratio) for score in scores]
    return scores


# ---------------------------------------------------------------------------------------------------------------
# 2. ROUGE-L (pycocoevalcap rouge/rouge.py)
# ---------------------------------------------------------------------------------------------------------------
def lcs_length(a, b):
    """Length of the longest common subsequence of two token lists, by dynamic programming over a table of
    len(a) + 1 rows and len(b) + 1 columns, one row kept at a time. A word that only one list holds is in no common
    subsequence, so it is dropped first: two captions share a few words, and the table shrinks to those."""
    shared = set(a).intersection(b)
    a, b = [x for x in a if x in shared], [y for y in b if y in shared]
    previous = [0] * (len(b) + 1)               # row i: LCS lengths of a[:i] with b[:j], j = 0..len(b)
    for x in a:
        current = [left := 0]
        for y, diagonal, above in zip(b, previous, previous[1:]):
            left = diagonal + 1 if x == y else (above if above > left else left)    # max(above, left)
            current.append(left)
        previous = current
    return previous[-1]


def rouge_l(candidate, references, beta=1.2):
    """ROUGE-L F of one candidate: best precision and best recall over the references, taken separately."""
    # The toolkit splits on a single space, so an empty string is one empty token: "" against "" scores 1.
    cand = candidate.split(" ")
    precision, recall = 0.0, 0.0
    for reference in references:
        ref = reference.split(" ")
        common = lcs_length(ref, cand)
        precision = max(precision, common / float(len(cand)))
        recall = max(recall, common / float(len(ref)))
    if precision != 0 and recall != 0:
        return ((1 + beta ** 2) * precision * recall) / float(recall + beta ** 2 * precision)
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# 3. CIDEr-D (pycocoevalcap cider/cider_scorer.py)
# ---------------------------------------------------------------------------------------------------------------
def cider_scores(candidate_counts, reference_counts, n=4, sigma=6.0, log_n_of_one=None):
    """Per-item CIDEr-D of a corpus: lists of n-gram counts per candidate, and per item one list per reference.

    Document frequency of an n-gram = number of items whose references hold it; weight = tf * (log N - log df);
    one cosine per n with the candidate clipped to the reference, times exp(-(l_c - l_r)^2 / (2 sigma^2));
    averaged over n, divided by the number of references, times 10. log_n_of_one: log N when N = 1, if not log 1.
    """
    document_frequency = Counter()
    for refs in reference_counts:
        grams = set()
        for counts in refs:
            for k in range(n):
                grams.update(counts[k])
        document_frequency.update(grams)
    # differs from reference: the toolkit crashes (max() of an empty table) when every reference is empty.
    log_n = math.log(float(len(reference_counts)))
    if len(reference_counts) == 1 and log_n_of_one is not None:
        log_n = log_n_of_one
    idf = {gram: log_n - math.log(float(df)) for gram, df in document_frequency.items()}   # unseen: log N
    weight_of, norms = idf.get, {}      # norms by id(): equal captions share a counts object (CaptionScorer._ngrams)

    def norm(counts):                   # the length of each n's weight vector, summed in the toolkit's order
        if id(counts) not in norms:
            out = []
            for k in range(n):
                total = 0.0
                for gram, tf in counts[k].items():
                    w = tf * weight_of(gram, log_n)             # int * float, as the toolkit
                    total += w * w
                out.append(math.sqrt(total))
            norms[id(counts)] = (counts, out)               # (keeps counts alive, so its id stays unique)
        return norms[id(counts)][1]

    scores = []
    for cand, refs in zip(candidate_counts, reference_counts):
        vec_c = [{gram: tf * weight_of(gram, log_n) for gram, tf in cand[k].items()} for k in range(n)]
        # The toolkit's "length" counts bigrams (it adds term frequencies where len(ngram) - 1 == 1).
        norm_c, len_c, total = norm(cand), sum(cand[1].values()) if n > 1 else 0, [0.0] * n
        for ref in refs:                # a reference's weights are computed only where they meet the candidate's
            norm_r, len_r = norm(ref), sum(ref[1].values()) if n > 1 else 0
            penalty = math.e ** (-(float(len_c - len_r) ** 2) / (2 * sigma ** 2))
            for k in range(n):
                cand_k, ref_k, value = vec_c[k], ref[k], 0.0
                if not cand_k.keys().isdisjoint(ref_k):
                    for gram, w in cand_k.items():        # the toolkit's order: the sum is then bit-identical
                        tf = ref_k.get(gram)
                        if tf is not None:
                            r = tf * weight_of(gram, log_n)       # the reference's weight of this n-gram
                            value += min(w, r) * r
                    if norm_c[k] != 0 and norm_r[k] != 0:
                        value /= norm_c[k] * norm_r[k]
                total[k] += value * penalty
        mean = 0.0
        for value in total:
            mean += value
        scores.append(mean / n / len(refs) * 10.0)
    return scores


# ---------------------------------------------------------------------------------------------------------------
# 4. Scoring a corpus, and subsets of it, the way the toolkit does
# ---------------------------------------------------------------------------------------------------------------
class CaptionScorer:
    """Tokenizes once and keeps per-item statistics, so that any subset of ids is scored without recomputing them.

    BLEU and METEOR per item do not depend on the other items, but their corpus values come from summed statistics;
    ROUGE-L per item is independent; CIDEr depends on the whole evaluated set through its document frequencies.
    """
    # The plain steps. FastCaptionScorer (section 6) puts faster ones with the same results in their place.
    meteor_class = Meteor
    rouge_l = staticmethod(rouge_l)       # ROUGE-L of a candidate (section 2)

    def tokenizer(self, text):
        """The text every coco-caption scorer sees: the Penn Treebank tokens of ptb_tokenize (scoring/ptb.py)."""
        return ptb_tokenize(text)

    def __init__(self, predictions, references, metrics=METRICS, tokenize=True, meteor_modules=None, config=None):
        _check_inputs(predictions, references)
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise CaptionInputError(f"unknown metrics {unknown}; choose from {METRICS}")
        self.config, self.metrics = config or MetricsConfig(), tuple(metrics)
        tokens = self.tokens(predictions, references, tokenize)
        self.ids = list(predictions)
        self.candidates = {i: tokens[predictions[i]] for i in self.ids}
        self.references = {i: [tokens[r] for r in references[i]] for i in self.ids}
        self.items = {i: {} for i in self.ids}
        self._counts = {}
        self.meteor_modules = None
        if "METEOR" in self.metrics:
            self.meteor = self.new_meteor(meteor_modules, self.config)
            self.meteor_modules = self.meteor.modules
            meteor_stats = self.start_meteor([(self.candidates[i], self.references[i]) for i in self.ids])
        if "BLEU" in self.metrics:
            self.bleu_stats = self._bleu_stats()
            for i, stats in self.bleu_stats.items():
                for k, value in enumerate(bleu_from_stats(**stats)):
                    self.items[i][f"BLEU_{k + 1}"] = value
        if "ROUGE_L" in self.metrics:
            for i in self.ids:
                self.items[i]["ROUGE_L"] = self.rouge_l(self.candidates[i], self.references[i], self.config.rouge_beta)
        if "METEOR" in self.metrics:
            self.meteor_stats = dict(zip(self.ids, meteor_stats()))
            self.meteor.forget()                              # the per-item statistics are all we keep
            for i, stats in self.meteor_stats.items():
                self.items[i]["METEOR"] = self.meteor.score(stats)

    def new_meteor(self, meteor_modules, config):
        """The Meteor that scores the items: all four stages where the METEOR 1.5 data is found, else exact and stem
        (or the stages asked for)."""
        resources = load_meteor_resources()
        if meteor_modules is None:
            meteor_modules = METEOR_MODULES if resources is not None else ("exact", "stem")
        return self.meteor_class(config.meteor, tuple(meteor_modules), resources)

    def tokens(self, predictions, references, tokenize=True):
        """{caption: its tokens} of every caption, each distinct one tokenized once."""
        tokens = {}
        for text in [*predictions.values(), *(r for i in predictions for r in references[i])]:
            if text not in tokens:
                tokens[text] = self.tokenizer(text) if tokenize else text
        return tokens

    def start_meteor(self, items):
        """A function that returns METEOR's statistics of each (candidate, references) item. Here they are
        computed when it is called; FastCaptionScorer starts on them at once, in a second process."""
        return lambda: self.meteor.item_stats_many(items)

    def _bleu_stats(self):
        """{id: BLEU statistics} of every item (bleu_item_stats)."""
        stats = {}
        for i in self.ids:
            cand, cand_len = self._ngrams(self.candidates[i])
            refs = [self._ngrams(r) for r in self.references[i]]
            stats[i] = bleu_item_stats(cand, cand_len, [c for c, _ in refs], [length for _, length in refs],
                                       self.config.bleu_n)
        return stats

    def _cider(self, ids):
        """CIDEr-D of these items, with document frequencies over their references only."""
        cands = [self._ngrams(self.candidates[i])[0] for i in ids]
        refs = [[self._ngrams(r)[0] for r in self.references[i]] for i in ids]
        return cider_scores(cands, refs, self.config.cider_n, self.config.cider_sigma, self.config.cider_log_n_of_one)

    def _ngrams(self, text):
        """(n-gram counts, word count) of a tokenized caption, computed once."""
        if text not in self._counts:
            self._counts[text] = (_ngram_counts(text, max(self.config.bleu_n, self.config.cider_n)),
                                  len(text.split()))
        return self._counts[text]

    def score(self, ids=None):
        """{"corpus": {...}, "items": {id: {...}}, "info": {...}} for these ids (all by default), scored alone."""
        ids = self.ids if ids is None else list(ids)
        missing = [i for i in ids if i not in self.items]
        if missing:
            raise CaptionInputError(f"subset ids {missing[:5]} are not among the predictions")
        if not ids:
            raise CaptionInputError("cannot score an empty subset")
        items = {i: dict(self.items[i]) for i in ids}
        corpus = {}
        if "BLEU" in self.metrics:
            total = {"testlen": 0, "reflen": 0, "guess": [0] * self.config.bleu_n, "correct": [0] * self.config.bleu_n}
            for i in ids:
                stats = self.bleu_stats[i]
                total["testlen"] += stats["testlen"]
                total["reflen"] += stats["reflen"]
                total["guess"] = [a + b for a, b in zip(total["guess"], stats["guess"])]
                total["correct"] = [a + b for a, b in zip(total["correct"], stats["correct"])]
            for k, value in enumerate(bleu_from_stats(**total)):
                corpus[f"BLEU_{k + 1}"] = value
        if "METEOR" in self.metrics:
            total = self.meteor.zero_stats()
            for i in ids:
                total = Meteor.add(total, self.meteor_stats[i])
            corpus["METEOR"] = self.meteor.score(total)
        if "ROUGE_L" in self.metrics:
            corpus["ROUGE_L"] = float(np.mean([items[i]["ROUGE_L"] for i in ids]))
        if "CIDEr" in self.metrics:
            for i, value in zip(ids, self._cider(ids)):
                items[i]["CIDEr"] = value
            corpus["CIDEr"] = float(np.mean([items[i]["CIDEr"] for i in ids]))
        info = {"items": len(ids), "references": sum(len(self.references[i]) for i in ids)}
        if self.meteor_modules is not None:
            info["meteor_modules"] = "+".join(self.meteor_modules)
            if self.meteor_modules != METEOR_MODULES:
                why = ("the METEOR 1.5 data was not found (pip install --no-deps pycocoevalcap==1.2, or set "
                       f"{METEOR_DATA_ENV})" if self.meteor.resources is None else "as asked")
                info["meteor_note"] = (f"METEOR with {info['meteor_modules']} matching only, {why}: expect it about "
                                       "0.015-0.03 below the toolkit's METEOR, which also matches synonyms and "
                                       "paraphrases")
        return {"corpus": corpus, "items": items, "info": info}


def score_captions(predictions, references, metrics=METRICS, tokenize=True, meteor_modules=None, config=None,
                   scorer=CaptionScorer):
    """Score {id: caption} against {id: [captions]} as coco-caption does; returns corpus and per-item scores.

    tokenize=False takes the captions as already PTB-tokenized. meteor_modules: None for all four when the METEOR
    data is found (exact + stem otherwise), or e.g. ("exact", "stem"). scorer: the plain CaptionScorer above, or
    FastCaptionScorer (section 6), which gives the same numbers faster and is what the scripts ask for.
    """
    return scorer(predictions, references, metrics, tokenize, meteor_modules, config).score()


def score_subsets(predictions, references, subsets, metrics=METRICS, tokenize=True, meteor_modules=None,
                  config=None, scorer=CaptionScorer):
    """{name: result} for named subsets of ids, e.g. per change type; each subset is re-scored on its own."""
    scored = scorer(predictions, references, metrics, tokenize, meteor_modules, config)
    return {name: scored.score(ids) for name, ids in subsets.items()}


# ---------------------------------------------------------------------------------------------------------------
# 5. Reading predictions and references, checking them, and printing the table
# ---------------------------------------------------------------------------------------------------------------
def _check_inputs(predictions, references):
    if not isinstance(predictions, dict) or not isinstance(references, dict):
        raise CaptionInputError("predictions must be a dict {id: caption} and references a dict {id: [captions]}")
    missing = [i for i in predictions if i not in references]
    if missing:
        same = [k for k in references if str(k) == str(missing[0])]      # the same id, of another type?
        hint = f" (the references have {same[0]!r} of type {type(same[0]).__name__}: ids must have the same type)" \
            if same else ""
        raise CaptionInputError(f"{len(missing)} prediction id(s) have no references, e.g. {missing[:5]}{hint}; "
                                f"score only ids that have reference captions")
    for i in predictions:
        refs = references[i]
        if isinstance(refs, str) or not isinstance(refs, (list, tuple)):
            raise CaptionInputError(f"references of id {i!r} must be a list of captions, got {type(refs).__name__}")
        if len(refs) == 0:
            raise CaptionInputError(f"id {i!r} has an empty list of references; every scored id needs at least one")
        for caption in [predictions[i], *refs]:
            if not isinstance(caption, str):
                raise CaptionInputError(f"id {i!r}: captions must be strings, got {caption!r}")


def load_json(path):
    """Parsed JSON (gzipped when the name ends in .gz); a malformed file is reported with its name, line and column."""
    try:
        raw = Path(path).read_bytes()
        text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode("utf-8-sig")  # a BOM, or none
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a missing file, a damaged gzip, bytes that are not UTF-8
        raise CaptionInputError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise CaptionInputError(f"{path}: duplicate key {e.args[0]!r} in one JSON object (JSON keeps only its last "
                                f"value); ids must be unique") from None
    except json.JSONDecodeError as e:
        raise CaptionInputError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                                f"(character {e.pos})") from None
    except RecursionError:
        raise CaptionInputError(f"{path}: its lists or objects nest too deeply for Python's JSON reader; results "
                                f"and references are a few levels deep") from None


class _DuplicateKey(ValueError):
    """A key seen twice in one JSON object (json.loads would keep the last value silently)."""


def _unique_keys(pairs):
    """json.loads' object_pairs_hook: the object as a dict, refused when a key repeats."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _items_field(data, path, key):
    """{id: item[key]} of a metrics_vectors file {"items": [{"id", "candidate", "references"}, ...]}."""
    out = {}
    for n, item in enumerate(data["items"]):
        if not isinstance(item, dict) or "id" not in item or key not in item:
            raise CaptionInputError(f"{path}: items[{n}] needs 'id' and '{key}'")
        if item["id"] in out:
            raise CaptionInputError(f"{path}: duplicate id {item['id']!r} (items[{n}]); ids must be unique")
        out[item["id"]] = item[key]
    return out


def read_predictions(data, path="predictions"):
    """{id: caption} from a COCO results list [{image_id, caption}], an items file, or a plain {id: caption}."""
    if isinstance(data, list):
        out, first = {}, {}
        for n, result in enumerate(data):
            if not isinstance(result, dict) or "image_id" not in result or "caption" not in result:
                raise CaptionInputError(f"{path}: entry [{n}] needs 'image_id' and 'caption' (COCO results format)")
            image_id = result["image_id"]
            if image_id in out:
                raise CaptionInputError(f"{path}: duplicate prediction for image_id {image_id!r} (entries "
                                        f"[{first[image_id]}] and [{n}]); keep one caption per id")
            out[image_id], first[image_id] = result["caption"], n
        return out
    if isinstance(data, dict) and "items" in data:
        return _items_field(data, path, "candidate")
    if isinstance(data, dict) and ("annotations" in data or field.is_levir(data)):
        raise CaptionInputError(f"{path}: this is a ground-truth file; give the predictions first, then "
                                f"--references FILE")
    if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
        return data
    raise CaptionInputError(f"{path}: expected a COCO results list [{{image_id, caption}}], {{id: caption}}, or "
                            f"{{\"items\": [...]}}")


def read_references(data, path="references"):
    """{id: [captions]} from a COCO ground truth {images, annotations}, an items file, {id: [captions]}, or a
    dataset's own file: CLEVR-Change's change_captions.json ("CLEVR_default_000123.png" is "000123.png", as
    RCC's eval_utils.py names it) or no_change_captions.json ("000123.png_n"), Spot-the-Diff's annotations/test.json
    (items merged by img_id: "<img_id>.png"), IER's test.json ({uid: sents}). LevirCCcaptions.json: scoring/field.py."""
    if isinstance(data, dict) and "annotations" in data:
        out = {}
        for image in data.get("images", []):
            out.setdefault(image["id"], [])
        for n, ann in enumerate(data["annotations"]):
            if not isinstance(ann, dict) or "image_id" not in ann or "caption" not in ann:
                raise CaptionInputError(f"{path}: annotations[{n}] needs 'image_id' and 'caption'")
            out.setdefault(ann["image_id"], []).append(ann["caption"])
        return out
    if isinstance(data, dict) and "items" in data:
        return _items_field(data, path, "references")
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        if all(str(k).startswith("CLEVR_default_") for k in data):     # CLEVR-Change's caption files
            suffix = NO_CHANGE_ID_SUFFIX if "no_change" in Path(path).name else ""
            return {k.split("_")[-1] + suffix: v for k, v in data.items()}
        return data
    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        if all("img_id" in d and "sentences" in d for d in data):      # Spot-the-Diff: items repeat img_id
            out = {}
            for d in data:
                out.setdefault(f"{d['img_id']}.png", []).extend(d["sentences"])
            return out
        if all("uid" in d and "sents" in d for d in data):             # Image-Editing-Request
            return {d["uid"]: d["sents"] for d in data}
        if all("image_id" in d and "caption" in d for d in data):
            raise CaptionInputError(f"{path}: this is a predictions file (COCO results [{{image_id, caption}}]); "
                                    f"give the ground truth as references")
    if field.is_levir(data):
        raise CaptionInputError(f"{path}: a LevirCCcaptions.json is read alone, not beside other references")
    raise CaptionInputError(f"{path}: not a references file; expected a COCO ground truth {{images, annotations}}, "
                            f"{{id: [captions]}}, {{\"items\": [...]}}, CLEVR-Change's change_captions.json, "
                            f"Spot-the-Diff's annotations/<split>.json, IER's <split>.json or LevirCCcaptions.json")


def read_reference_files(paths):
    """{id: [captions]} of one or more references files (CLEVR-Change's two caption files together), or the
    records of a LevirCCcaptions.json (scoring/field.py)."""
    loaded = [load_json(path) for path in paths]
    if any(field.is_levir(d) for d in loaded):
        if len(paths) > 1:
            raise CaptionInputError("a LevirCCcaptions.json holds all the references: give it alone")
        return field.checked_records(loaded[0], paths[0])
    out = {}
    for data, path in zip(loaded, paths):
        for i, captions in read_references(data, path).items():
            if i in out:
                raise CaptionInputError(f"{path}: id {i!r} is in an earlier references file too; give each id once")
            out[i] = captions
    return out


def format_table(result):
    corpus, info = result["corpus"], result["info"]
    lines = [f"{'metric':<9} {'score':>7}"]
    for name, value in corpus.items():
        note = f"   ({info['meteor_modules']})" if name == "METEOR" else ""
        lines.append(f"{name:<9} {value:7.4f}{note}")
    seconds = f", scored in {info['seconds']:.2f} s" if "seconds" in info else ""
    lines.append(f"{info['items']} items, {info['references']} references{seconds}")
    if "meteor_note" in info:
        lines.append(f"note: {info['meteor_note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# 6. The speed variant of the scorer: the same numbers, faster (scoring/fast.py and scoring/ptb.py's shortcut hold
#    the steps it selects; a test checks each against the plain one; what they buy: BENCHMARKS.md section 6)
# ---------------------------------------------------------------------------------------------------------------
class FastCaptionScorer(CaptionScorer):
    """CaptionScorer with every speed variant in place of the plain step it stands in for: the same numbers.
    The garbage collector is paused around its work (meteor.collector_paused). processes=2 shares METEOR with a
    forked process (MeteorWorker). The scripts ask for it in one line: score_captions(..., scorer=FastCaptionScorer).
    """
    tokenizer = staticmethod(ptb_tokenize_fast)
    meteor_class = FastMeteor
    rouge_l = staticmethod(fast.rouge_l)
    whole_set_cider = None    # CIDEr-D of all the items, computed while a METEOR worker runs
    ngram_table = None        # (fast.NgramTable, {id: item number}): BLEU's and CIDEr-D's n-grams as arrays

    def __init__(self, *args, processes=1, **kwargs):
        self.processes, self.worker = processes, None
        with collector_paused():
            self.worker = self._early_worker(*args, **kwargs)
            try:
                super().__init__(*args, **kwargs)
            except BaseException:
                if self.worker is not None:
                    self.worker.abandon()
                raise

    def _early_worker(self, predictions, references, metrics=METRICS, tokenize=True, meteor_modules=None,
                      config=None):
        """A MeteorWorker forked before anything is tokenized: it tokenizes the captions and prepares METEOR
        itself while this process does the same for BLEU and ROUGE-L (less done before the fork: BENCHMARKS.md
        section 6). None where METEOR runs in this process alone."""
        if self.processes < 2 or "METEOR" not in metrics or not isinstance(predictions, dict) or \
                len(predictions) < PARALLEL_MIN_ITEMS or "fork" not in multiprocessing.get_all_start_methods():
            return None
        _check_inputs(predictions, references)   # before the fork, not in the worker (__init__ checks again: 10 ms)
        meteor = self.new_meteor(meteor_modules, config or MetricsConfig())

        def items():                                        # run in the worker: what __init__ gives start_meteor
            tokens = self.tokens(predictions, references, tokenize)
            return [(tokens[predictions[i]], [tokens[r] for r in references[i]]) for i in predictions]
        return MeteorWorker(meteor, len(predictions), items)

    def start_meteor(self, items):
        if self.worker is None:
            return super().start_meteor(items)

        def finish():
            self.whole_set_cider = self._cider(self.ids)    # while the worker is still on METEOR
            return self.worker.finish(self.meteor, items)
        return finish

    def _cider(self, ids):
        if ids == self.ids and self.whole_set_cider is not None:
            return self.whole_set_cider
        return self._cider_of(ids)

    def _cider_of(self, ids):
        """CaptionScorer._cider from the n-gram arrays (fast.NgramTable): the same scores."""
        table, number = self._ngram_table()
        return table.cider([number[i] for i in ids], self.config.cider_n, self.config.cider_sigma,
                           self.config.cider_log_n_of_one)

    def _bleu_stats(self):
        """CaptionScorer._bleu_stats from the n-gram arrays (fast.NgramTable): the same statistics."""
        table, _ = self._ngram_table()
        return dict(zip(self.ids, table.bleu_stats(self.config.bleu_n)))

    def _ngram_table(self):
        """(fast.NgramTable of every item, {id: its item number}), made once (again if the config asks for longer
        n-grams)."""
        n = max(self.config.bleu_n, self.config.cider_n)
        if self.ngram_table is None or self.ngram_table[0].n < n:
            self.ngram_table = (fast.NgramTable([self.candidates[i] for i in self.ids],
                                                [self.references[i] for i in self.ids], n),
                                {i: k for k, i in enumerate(self.ids)})
        return self.ngram_table

    def score(self, ids=None):
        with collector_paused():
            return super().score(ids)


# ---------------------------------------------------------------------------------------------------------------
# 7. The field's scoring: how the LEVIR-CC papers score (vocabulary-id strings, no tokenizer, S*m), in
#    scoring/field.py, with each paper's rules (RSICC, RSCaMa, Chg2Cap) and caption.py's table of both ways.
#    metrics.field is that file; the command line's --as chooses a paper; it is given the scorer class above.
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# 8. The kind of change a caption says, by keywords, for CLEVR-Change-style captions (synthetic set, CLEVR-Change)
# ---------------------------------------------------------------------------------------------------------------
# No toolkit computes this score; BENCHMARKS.md's and the README's "kind of change right, by keywords" figures come
# from it, and caption.py --eval prints it when the test split's pairs carry CLEVR-Change's change types. These
# names are data.py's and synth.py's (a test checks they agree): this file reads text and imports neither.
CHANGE_KINDS = ("color", "material", "add", "drop", "move")  # data.CHANGE_TYPES
NO_CHANGE_KIND = "distractor"                                # data.DISTRACTOR, the type of a no-change pair
NO_CHANGE_ID_SUFFIX = "_n"                                   # data.NO_CHANGE_SUFFIX: a no-change pair's evaluation id
COLOR_WORDS = ("gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow")  # CLEVR's, as synth.COLORS
MATERIAL_WORDS = ("rubber", "matte", "metal", "shiny", "metallic")  # the words of synth.MATERIAL_WORDS

# The keyword rules of BENCHMARKS.md's figures "by keywords over the test predictions": the first that matches wins.
# Drops are tried before additions because "appeared" is inside "disappeared".
NO_CHANGE_WORDS = ("same", "no change", "nothing", "identical", "no difference")
ADDED_WORDS = ("appeared", "newly placed", "added")
DROPPED_WORDS = ("disappeared", "missing", "gone", "no longer")
MOVED_WORDS = ("location", "moved")


def said_kind(caption: str) -> str:
    """The kind of change a caption says: no change (NO_CHANGE_KIND), add, drop, move, else color or material
    when its last word is a colour or a material word (CLEVR's, as synth.py names them), else "?"."""
    for kind, words in ((NO_CHANGE_KIND, NO_CHANGE_WORDS), ("drop", DROPPED_WORDS), ("add", ADDED_WORDS),
                        ("move", MOVED_WORDS)):
        if any(w in caption for w in words):  # substrings of the caption, as the rules were written
            return kind
    last = caption.split()[-1] if caption.split() else ""
    return "color" if last in COLOR_WORDS else "material" if last in MATERIAL_WORDS else "?"


def change_kinds(predictions: list[dict], pairs: list) -> dict:
    """For each true kind (the change types, then distractor): how many predictions say it, out of how many
    ("right", "total"), and the confusion, true kind -> said kind -> count, most said first.

    predictions is caption.py's test_predictions.json ([{"image_id", "caption"}]); pairs the test split's
    data.ImagePair records (their id and change_type), whose no-change pairs are evaluated as "<id>_n"."""
    change_type = {pair.id: pair.change_type for pair in pairs}
    confusion: dict[str, Counter] = {}
    for prediction in predictions:
        i = prediction["image_id"]
        if not i.endswith(NO_CHANGE_ID_SUFFIX) and i not in change_type:
            raise CaptionInputError(f"kinds: prediction {i!r} is not a pair of the test split read; give the dataset "
                                    f"the run was tested on (--data, --data_root)")
        truth = NO_CHANGE_KIND if i.endswith(NO_CHANGE_ID_SUFFIX) else change_type[i]
        confusion.setdefault(truth, Counter())[said_kind(prediction["caption"])] += 1
    order = [k for k in (*CHANGE_KINDS, NO_CHANGE_KIND) if k in confusion]
    return {"right": {k: confusion[k][k] for k in order}, "total": {k: confusion[k].total() for k in order},
            "confusion": {k: dict(confusion[k].most_common()) for k in order}}


def format_kinds(kinds: dict, confusion: bool = False) -> str:
    """'color 36/40, material 27/40, ..., distractor 183/200' and, with confusion, one line per true kind."""
    lines = [", ".join(f"{k} {kinds['right'][k]}/{kinds['total'][k]}" for k in kinds["right"])]
    if confusion:
        lines += [f"  {truth} -> " + ", ".join(f"{said} {n}" for said, n in said_counts.items())
                  for truth, said_counts in kinds["confusion"].items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# 9. The command line, and a demo
# ---------------------------------------------------------------------------------------------------------------
EXAMPLES = """examples, the references as each dataset ships them (predictions: caption.py's test_predictions.json
or any COCO results list [{"image_id", "caption"}]):
  CLEVR-Change   python metrics.py test_predictions.json --references data/clevr_change/change_captions.json
                     data/clevr_change/no_change_captions.json        (ids 000123.png and 000123.png_n)
  Spot-the-Diff  python metrics.py test_predictions.json --references data/spot/annotations/test.json
  IER            python metrics.py test_predictions.json --references data/ier/test.json      (ids: uid)
  LEVIR-CC       python metrics.py test_predictions.json --references data/levir_cc/LevirCCcaptions.json --as rsicc
                     (or rscama, chg2cap: as that paper's test script scores and prints; coco: our way)
  RSCaMa's own vocabulary: ... --as rscama --vocab RSCaMa/data/LEVIR_CC/vocab.json
  any COCO set   python metrics.py results.json --references captions_val2014.json
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description="Score captions as the coco-caption toolkit does (BLEU-1..4, METEOR, "
                                     "ROUGE-L, CIDEr), without Java; or LEVIR-CC as each paper's code scores it.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("predictions", help="COCO results [{image_id, caption}], {id: caption}, or {items: [...]}")
    parser.add_argument("old_references", nargs="?", metavar="REFERENCES", help="the same as --references FILE")
    parser.add_argument("--references", nargs="+", metavar="FILE",
                        help="COCO ground truth {images, annotations}, {id: [captions]}, a dataset's own files "
                             "(below) or LevirCCcaptions.json; leave out for an {items: [...]} file")
    parser.add_argument("--as", dest="paper", default="coco", choices=("coco", *field.PAPERS),
                        help="coco: the toolkit's way (PTB tokens, words); rsicc, rscama, chg2cap: LEVIR-CC as "
                             "that paper's test script scores and prints it (scoring/field.py)")
    parser.add_argument("--vocab", metavar="FILE", help="with --as PAPER: the paper's own word map (RSCaMa's "
                        "vocab.json, RSICC's WORDMAP_*.json) instead of the one its preprocessing builds")
    parser.add_argument("--json", action="store_true", help="print corpus, per-item scores and info as JSON")
    parser.add_argument("--metrics", default=",".join(METRICS), help=f"comma-separated subset of {METRICS}")
    parser.add_argument("--meteor-modules", default=None,
                        help="e.g. exact,stem (default: all four when the METEOR data is found)")
    parser.add_argument("--pretokenized", action="store_true", help="captions are already PTB-tokenized")
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1),
                        help="2: a forked process computes part of METEOR (the same numbers; default on 2+ cores)")
    args = parser.parse_args(argv)
    try:
        started = time.perf_counter()
        with collector_paused():      # until the table is written: then the process ends, nothing left to scan
            text = score_command(args, started)
        print(text)
    except CaptionInputError as e:
        print(f"metrics.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def score_command(args, started):
    """The printed table (or JSON) of the command line's arguments."""
    if args.old_references and args.references:
        raise CaptionInputError("give the references once: as the second argument or with --references")
    paths = args.references or ([args.old_references] if args.old_references else [])
    data = load_json(args.predictions)
    predictions = read_predictions(data, args.predictions)
    if not predictions:
        raise CaptionInputError(f"{args.predictions}: no predictions in it")
    references = read_reference_files(paths) if paths else read_references(data, args.predictions)
    # the speed variant (section 6): the same numbers as the plain scorer (tested)
    scorer = functools.partial(FastCaptionScorer, processes=args.processes)
    if args.paper != "coco" or args.vocab:
        if not isinstance(references, list):
            raise CaptionInputError(f"--as {args.paper} scores LEVIR-CC as its papers do: give its "
                                    f"LevirCCcaptions.json as --references (the vocabulary comes from all its splits)")
        if args.paper == "coco":
            raise CaptionInputError("--vocab is a paper's word map: give --as rsicc, rscama or chg2cap too")
        paper = field.PAPERS[args.paper]
        vocabulary = field.checked_word_map(load_json(args.vocab), paper, args.vocab) if args.vocab else None
        result = field.score_as(paper, predictions, references, scorer, vocabulary)
        result["info"]["seconds"] = round(time.perf_counter() - started, 3)
        return json.dumps(result, ensure_ascii=False) if args.json else \
            field.format_as(result, result["info"]["seconds"])
    if isinstance(references, list):          # LevirCCcaptions.json, our way
        references = field.levir_captions(predictions, references)
    modules = tuple(args.meteor_modules.split(",")) if args.meteor_modules else None
    result = score_captions(predictions, references, tuple(args.metrics.split(",")), tokenize=not args.pretokenized,
                            meteor_modules=modules, scorer=scorer)
    result["info"]["seconds"] = round(time.perf_counter() - started, 3)
    return json.dumps(result, ensure_ascii=False) if args.json else format_table(result)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main())
    candidate = "A red metal cube has been added."
    references = ["someone added a red shiny cube", "the red metallic cube is new"]
    print(f"candidate:  {candidate!r} -> {ptb_tokenize(candidate)!r}")
    for reference in references:
        print(f"reference:  {reference!r}")
    demo = score_captions({"demo": candidate}, {"demo": references})
    print(format_table(demo))
    print("(a one-item corpus scores CIDEr 0: its document frequencies make every n-gram weightless)")
    print("usage: python metrics.py PREDICTIONS.json --references FILE [--as coco|rsicc|rscama|chg2cap] [--json]")
