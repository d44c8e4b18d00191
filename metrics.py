"""Caption metrics (BLEU-1..4, METEOR 1.5, ROUGE-L, CIDEr-D) and retrieval metrics, in plain Python.

This is how both stages of CLIP4IDC (CLIP, Contrastive Language-Image Pre-training, adapted to image difference
captioning) are evaluated. Stage 2 (captioning) reports BLEU-4, METEOR, ROUGE-L and CIDEr as computed by the
Java-based coco-caption toolkit (pycocoevalcap 1.2: a Stanford Penn Treebank (PTB) tokenizer, then four scorers), like
every image-difference-captioning paper and the reference implementation (github.com/sushizixin/CLIP4IDC at commit
ca49461, main_task_caption.py `EvalCap`); stage 1 (adaptation) reports retrieval recall. This file computes the same
numbers without Java and without torch (METEOR, the long one, has its own file, meteor.py). The lesson comes first,
each metric a function of tokenized text:

    1. BLEU-1..4 (BiLingual Evaluation Understudy)   n-gram precisions, closest reference length, summed statistics,
                                  the toolkit's epsilons
    2. ROUGE-L (Recall-Oriented Understudy for Gisting Evaluation, by the longest common subsequence, LCS)
                                  word LCS, beta 1.2, best precision and best recall taken separately
    3. CIDEr-D (Consensus-based Image Description Evaluation; D: the variant hardened against gaming)
                                  tf-idf (term frequency times inverse document frequency) n-grams, document frequency
                                  over the evaluated set, clipped counts, Gaussian length penalty; the metric that
                                  picks the best epoch
    4. retrieval_metrics          stage-1 R@1/5/10 (recall at 1, 5, 10), median and mean rank, text->pair and
                                  pair->text
    5. CaptionScorer, score_captions, score_subsets   the toolkit's pipeline: PTB tokens, then the scorers; a subset
                                  is re-scored on its own, as Robust Change Captioning's (RCC) utils/eval_utils.py
                                  `score_generation_by_type` does (CIDEr's document frequencies change with it)
Then what the lesson leans on, and the speed variants:
    6. the PTB tokenizer          Stanford PTBTokenizer 3.4.1 -preserveLines -lowerCase, then 17 tokens dropped
    7. reading predictions and references (COCO, Common Objects in Context, results and ground truth), checking
       them, and the printed table
    8. speed variants             the same numbers, faster: the PTB shortcut for plain captions, a forked METEOR
                                  worker, and FastCaptionScorer, which selects every speed variant; score_captions
                                  runs the plain CaptionScorer unless asked for it, as the scripts ask in one line
    9. the field's scoring        how the LEVIR-CC papers score (vocabulary-id strings, no tokenizer, S*m), beside
                                  ours, in one table
   10. the kind of change a caption says, by keywords (CLEVR-Change-style captions; no toolkit has it)
   11. the command line, and the demo

On the toolkit's own output for the corpora in tests/metrics_vectors every score agrees to the last bit, METEOR
included.

Differences from the toolkit (each is marked `# differs from reference:` below):
  - Line-break characters other than \\n (carriage return, vertical tab, form feed, U+2028, U+2029) are spaces.
    The toolkit's tokenizer starts a new line at them and silently gives every later caption the wrong item's text.
  - A caption is tokenized on its own. The Java tokenizer reads the next caption after a newline as trailing
    context, which matters only for a caption ending in an abbreviation ("etc.", "a.", "No.") when the next starts
    with a capital, a listed word or a number.
  - A corpus whose references are all empty scores CIDEr 0; the toolkit crashes.
  - Ties in retrieval ranks count against the true match (see retrieval_metrics); the reference implementation
    leaves them to torch.argsort's unspecified order.
  - METEOR's own differences are listed in meteor.py.

Run:   python metrics.py                                   # demo: one candidate against two references
       python metrics.py PREDICTIONS.json REFERENCES.json  # a table; --json for machines
       python metrics.py tests/metrics_vectors/edge_cases.json.gz   # items with candidate and references

Shape letters: T texts (captions), P image pairs.
"""
import argparse
import concurrent.futures
import functools
import gzip
import json
import math
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scoring.meteor import (METEOR_DATA_ENV, METEOR_MODULES, CaptionInputError, FastMeteor, Meteor, MeteorConfig,
                    collector_paused, load_meteor_resources)


@dataclass
class MetricsConfig:
    bleu_n: int = 4                                 # BLEU-1..4
    cider_n: int = 4                                # CIDEr uses 1- to 4-grams
    cider_sigma: float = 6.0                        # width of CIDEr-D's Gaussian length penalty
    rouge_beta: float = 1.2                         # ROUGE-L F-measure: recall weighs beta^2 times precision
    meteor: MeteorConfig = field(default_factory=MeteorConfig)   # alpha, beta, gamma, delta, weights, beam


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
def cider_scores(candidate_counts, reference_counts, n=4, sigma=6.0):
    """Per-item CIDEr-D of a corpus: lists of n-gram counts per candidate, and per item one list per reference.

    Document frequency of an n-gram = number of items whose references hold it; weight = tf * (log N - log df);
    one cosine per n with the candidate clipped to the reference, times exp(-(l_c - l_r)^2 / (2 sigma^2));
    averaged over n, divided by the number of references, times 10.
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
# 4. Retrieval metrics for stage 1 (the reference's main_task_retrieval.py `eval_epoch`, and its metrics.py, from
#    CLIP4Clip, CLIP for video clip retrieval: `tensor_text_to_video_metrics`, `tensor_video_to_text_sim`,
#    `compute_metrics`)
# ---------------------------------------------------------------------------------------------------------------
def _ranks(scores, true_scores, ties):
    """0-based rank of each row's true entry: how many entries score higher (ties counted as higher if pessimistic)."""
    higher = (scores > true_scores[:, None]).sum(axis=1)
    if ties == "pessimistic":
        higher += (scores == true_scores[:, None]).sum(axis=1) - 1
    return higher


def _rank_summary(ranks, median):
    return {"R1": 100.0 * float(np.mean(ranks < 1)), "R5": 100.0 * float(np.mean(ranks < 5)),
            "R10": 100.0 * float(np.mean(ranks < 10)), "MedianR": median(ranks + 1),
            "MeanR": float(np.mean(ranks + 1))}


def retrieval_metrics(sim, text_to_pair, ties="pessimistic"):
    """R@1/5/10 (%), median and mean rank (1 = best), text->pair and pair->text.

    sim: (T, P) similarities of every caption with every image pair; text_to_pair[t] is caption t's pair, and a pair
    may have several captions. text->pair ranks each caption against all pairs. pair->text scores a pair against a
    pair's caption group by the group's best caption, then ranks the true group among the P groups.
    Medians as in the reference: torch.median (the lower middle value) for text->pair, np.median (the mean of the
    two middle values) for pair->text.
    # differs from reference: torch.argsort leaves the order of tied similarities unspecified (and CLIP4Clip's
    # compute_metrics counts a tied row several times); here a tie counts against the true match ("pessimistic",
    # so a constant matrix scores R@1 = 0), or for it with ties="optimistic".
    """
    sim = np.asarray(sim, dtype=np.float64)
    text_to_pair = np.asarray(text_to_pair)
    assert sim.ndim == 2, f"sim must be (texts, pairs), got shape {sim.shape}"
    n_texts, n_pairs = sim.shape                                            # (T, P)
    assert text_to_pair.shape == (n_texts,), f"text_to_pair must have {n_texts} entries, got {text_to_pair.shape}"
    assert ties in ("pessimistic", "optimistic"), f"ties must be 'pessimistic' or 'optimistic', got {ties!r}"
    if n_texts and (text_to_pair.min() < 0 or text_to_pair.max() >= n_pairs):
        raise CaptionInputError(f"text_to_pair values must be pair indices in [0, {n_pairs})")
    if not np.isfinite(sim).all():
        raise CaptionInputError("sim holds NaN or infinite values; drop padded rows before ranking")
    captioned = np.bincount(text_to_pair, minlength=n_pairs) > 0
    if not captioned.all():
        raise CaptionInputError(f"pairs {np.flatnonzero(~captioned)[:5].tolist()} have no caption: every pair "
                                f"needs at least one for pair->text ranking")
    text_ranks = _ranks(sim, sim[np.arange(n_texts), text_to_pair], ties)  # (T,)
    group_best = np.full((n_pairs, n_pairs), -np.inf)                       # (P groups, P pairs)
    np.maximum.at(group_best, text_to_pair, sim)
    pair_scores = group_best.T                                              # (P pairs, P groups): truth on diagonal
    pair_ranks = _ranks(pair_scores, np.diag(pair_scores), ties)            # (P,)
    lower_median = lambda r: float(np.sort(r)[(len(r) - 1) // 2])          # noqa: E731
    return {"text_to_pair": _rank_summary(text_ranks, lower_median),
            "pair_to_text": _rank_summary(pair_ranks, lambda r: float(np.median(r)))}


# ---------------------------------------------------------------------------------------------------------------
# 5. Scoring a corpus, and subsets of it, the way the toolkit does
# ---------------------------------------------------------------------------------------------------------------
class CaptionScorer:
    """Tokenizes once and keeps per-item statistics, so that any subset of ids is scored without recomputing them.

    BLEU and METEOR per item do not depend on the other items, but their corpus values come from summed statistics;
    ROUGE-L per item is independent; CIDEr depends on the whole evaluated set through its document frequencies.
    """
    # The plain steps. FastCaptionScorer (section 8) puts faster ones with the same results in their place.
    meteor_class = Meteor

    def tokenizer(self, text):
        """The text every coco-caption scorer sees: the Penn Treebank tokens of ptb_tokenize (section 6)."""
        return ptb_tokenize(text)

    def __init__(self, predictions, references, metrics=METRICS, tokenize=True, meteor_modules=None, config=None):
        _check_inputs(predictions, references)
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise CaptionInputError(f"unknown metrics {unknown}; choose from {METRICS}")
        self.config, self.metrics = config or MetricsConfig(), tuple(metrics)
        tokens = {}
        for text in [*predictions.values(), *(r for i in predictions for r in references[i])]:
            if text not in tokens:
                tokens[text] = self.tokenizer(text) if tokenize else text
        self.ids = list(predictions)
        self.candidates = {i: tokens[predictions[i]] for i in self.ids}
        self.references = {i: [tokens[r] for r in references[i]] for i in self.ids}
        self.items = {i: {} for i in self.ids}
        self._counts = {}
        self.meteor_modules = None
        if "METEOR" in self.metrics:
            resources = load_meteor_resources()
            if meteor_modules is None:
                meteor_modules = METEOR_MODULES if resources is not None else ("exact", "stem")
            self.meteor_modules = tuple(meteor_modules)
            self.meteor = self.meteor_class(self.config.meteor, self.meteor_modules, resources)
            meteor_stats = self.start_meteor([(self.candidates[i], self.references[i]) for i in self.ids])
        if "BLEU" in self.metrics:
            self.bleu_stats = {}
            for i in self.ids:
                cand, cand_len = self._ngrams(self.candidates[i])
                refs = [self._ngrams(r) for r in self.references[i]]
                stats = bleu_item_stats(cand, cand_len, [c for c, _ in refs], [length for _, length in refs],
                                        self.config.bleu_n)
                self.bleu_stats[i] = stats
                for k, value in enumerate(bleu_from_stats(**stats)):
                    self.items[i][f"BLEU_{k + 1}"] = value
        if "ROUGE_L" in self.metrics:
            for i in self.ids:
                self.items[i]["ROUGE_L"] = rouge_l(self.candidates[i], self.references[i], self.config.rouge_beta)
        if "METEOR" in self.metrics:
            self.meteor_stats = dict(zip(self.ids, meteor_stats()))
            self.meteor.forget()                              # the per-item statistics are all we keep
            for i, stats in self.meteor_stats.items():
                self.items[i]["METEOR"] = self.meteor.score(stats)

    def start_meteor(self, items):
        """A function that returns METEOR's statistics of each (candidate, references) item. Here they are
        computed when it is called; FastCaptionScorer starts on them at once, in a second process."""
        return lambda: self.meteor.item_stats_many(items)

    def _cider(self, ids):
        """CIDEr-D of these items, with document frequencies over their references only."""
        cands = [self._ngrams(self.candidates[i])[0] for i in ids]
        refs = [[self._ngrams(r)[0] for r in self.references[i]] for i in ids]
        return cider_scores(cands, refs, self.config.cider_n, self.config.cider_sigma)

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
    FastCaptionScorer (section 8), which gives the same numbers faster and is what the scripts ask for.
    """
    return scorer(predictions, references, metrics, tokenize, meteor_modules, config).score()


def score_subsets(predictions, references, subsets, metrics=METRICS, tokenize=True, meteor_modules=None,
                  config=None, scorer=CaptionScorer):
    """{name: result} for named subsets of ids, e.g. per change type; each subset is re-scored on its own."""
    scored = scorer(predictions, references, metrics, tokenize, meteor_modules, config)
    return {name: scored.score(ids) for name, ids in subsets.items()}


# ---------------------------------------------------------------------------------------------------------------
# 6. The PTB tokenizer (pycocoevalcap tokenizer/ptbtokenizer.py around Stanford CoreNLP 3.4.1's PTBTokenizer)
# ---------------------------------------------------------------------------------------------------------------
# The wrapper replaces "\n" by a space, runs `PTBTokenizer -preserveLines -lowerCase` (a JFlex lexer: at each
# position the longest match of any rule wins, the earlier rule on a tie), splits each output line on " " and drops
# these 17 tokens. Bracket tokens (-LRB- for a left round bracket, -RSB- for a right square one, ...) survive: the
# list is upper case but the tokens were lower-cased first.
PTB_DROPPED = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                         ".", "?", "!", ",", ":", "-", "--", "...", ";"])
LINE_BREAKS = "\r\n\x0b\x0c\u2028\u2029"      # PTBTokenizer's line ends (U+0085, next line, is an ellipsis to it)
_CURRENCY = {"\u00a2": "cents", "\u00a3": "#", "\u0080": "$", "\u00a4": "$", "\u20a0": "$", "\u20ac": "$"}
_FRACTIONS = {"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3"}   # U+2154 is missed, as in 3.4.1
_LATEX_QUOTES = str.maketrans({"\u0091": "`", "\u2018": "`", "\u201b": "`", "\u2039": "`", "\u0092": "'",
                               "\u2019": "'", "\u203a": "'", "\u0093": "``", "\u201c": "``", "\u00ab": "``",
                               "\u0094": "''", "\u201d": "''", "\u00bb": "''"})
_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-",
             "&lt;": "<", "&gt;": ">"}


def _quote(text, left):
    """The lexer's handleQuotes with LaTeX quotes: ' and " become ` `` on the left, ' '' on the right."""
    if left:
        text = text.replace("&apos;", "`").replace("'", "`").replace("&quot;", "``").replace('"', "``")
    else:
        text = text.replace("&apos;", "'").replace("&quot;", "''").replace('"', "''")
    return text.translate(_LATEX_QUOTES)


@functools.lru_cache(maxsize=None)
def _ptb_rules():
    """The lexer's rules as (regex, action), in the order of PTBLexer.flex, built on first use.

    Written from the rule definitions of older and newer PTBLexer.flex versions (CoreNLP's GitHub history) and
    checked against the 3.4.1 jar itself: identical output on every caption of tests/metrics_vectors and on
    5,994 of 6,000 random caption-like lines of tricky fragments (the other 6 depend on the next line, which a
    per-caption tokenizer cannot see); 16 of 3,000 lines of fragments glued without spaces differ.

    A regex may hold a group `tok`: then only that much is the token and the rest is JFlex trailing context, which
    counts for the longest match but is read again. An action is "keep", "drop", a fixed output string, or a function
    of the token text returning (output or None, characters consumed).
    """
    # JFlex's [:letter:] is Java's Character.isLetter over the Basic Multilingual Plane: Python's str.isalpha(), that
    # is \w but for digits, "_" and the other numeric characters (superscripts, roman numerals, ...). Written so, as
    # a negated class: a class listing the 49,000 letters is slow to compile.
    numeric = "".join(ch for ch in map(chr, range(0x10000)) if ch.isalnum() and not (ch.isalpha() or ch.isdecimal()))
    L = rf"[^\W\d_{numeric}\U00010000-\U0010ffff]"
    LD = rf"(?:{L}|\d)"
    letter = rf"(?:{L}|[\u00ad\u0300-\u036f\u0483-\u0487])"
    word = rf"{letter}(?:{letter}|\d)*(?:[.!?]{letter}(?:{letter}|\d)*)*"      # "cube.red", "red!blue" stay whole
    apos = r"(?:['\u0092\u2019]|&apos;)"
    apos_etc = r"(?:['\u0092\u2019\u0091\u2018\u201b]|&apos;)"
    space = r"[ \t\u00a0\u2000-\u200a\u3000]"
    spacenl = r"[ \t\u00a0\u2000-\u200a\u3000\r\n\u2028\u2029\x0b\x0c\u0085]"
    sgml = r"<\/?[A-Za-z!?][^>\r\n]*>"
    acro = r"(?:[A-Za-z](?:\.[A-Za-z])+|(?:Canada|Sino|Korean|EU|Japan|non)-U\.S|U\.S\.-(?:U\.K|U\.S\.S\.R))"
    ab_month = r"Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
    ab_days = r"Mon|Tue|Tues|Wed|Thu|Thurs|Fri"
    ab_state = (r"Ala|Ariz|[A](?i:rk)|Calif|Colo|Conn|Dak|Del|Fla|Ga|[I](?i:ll)|Ind|Kans?|Ky|La|[M](?i:ass)|Md|Mich|"
                r"Minn|[M](?i:iss)|Mo|Mont|Neb|Nev|Okla|[O](?i:re)|Pa|Penn|Tenn|Tex|Va|Vt|[W](?i:ash)|Wisc?|Wyo")
    ab_comp = r"Inc|Cos?|Corp|Pp?tys?|Ltd|Plc|Bancorp|Dept|Bhd|Assn|Univ|Intl|Sys"
    ab_num = r"Prop|Ph|tel|est|ext|sq|ft"              # "No." and "Nos." count only before a number (below)
    ab_ptit = r"Jr|Sr|Bros|(?:Ed|Ph)\.D|Blvd|Rd|Esq"
    ab_title = (r"Mr|Mrs|Ms|[M](?i:iss)|Drs?|Profs?|Sens?|Reps?|Attys?|Lt|Col|Gen|Messrs|Govs?|Adm|Rev|Maj|Sgt|"
                r"Cpl|Pvt|Mt|Capt|Ste?|Ave|Pres|Lieut|Hon|Brig|Co?mdr|Pfc|Spc|Supts?|Det")
    abbrev1 = rf"(?i:(?:{ab_month}|{ab_days}|{ab_comp}|{ab_num}|{ab_ptit}|etc|al|seq)|(?:{ab_state}))\."
    # JFlex takes the longest match of a rule, Python's re the first alternative that succeeds: alternatives that
    # can succeed at different lengths are therefore separate rules below (same action, so ties do not matter).
    abbrev4s = (acro, r"(?i:a\.k\.a)", rf"(?i:{ab_title}|vs|Alex|Wm|Jos|Cie|cf|TREAS|Invt|Elec|Natl|M[ft]g)",
                "[A-Za-z]")
    acronym_next = ("About|According|Additionally|After|An|A|As|At|But|Earlier|He|Her|Here|However|If|In|It|Last|"
                    "Many|More|Mr\\.|Ms\\.|Now|Once|One|Other|Our|She|Since|So|Some|Such|That|The|Then|There|These|"
                    "They|This|We|When|While|What|Yet|You")
    acronym_next = "|".join(w[0] + "(?i:" + w[1:] + ")" for w in acronym_next.split("|"))
    thing = rf"(?:[dDoOlL]{apos_etc}{LD})?{LD}+(?:[-_\u058a\u2010\u2011](?:[dDoOlL]{apos_etc}{LD})?{LD}+)*"
    hthing = rf"[A-Za-z0-9][A-Za-z0-9.,\u00ad]*(?:-(?:{acro}\.|[A-Za-z0-9\u00ad]+))+"
    misc = ("[+%&~^|\\\\\u00a6\u00a7\u00a8\u00a9\u00ac\u00ae\u00af\u00b0-\u00ba\u00d7\u00f7\u0387\u05be\u05c0"
            "\u05c3\u05c6\u05f3\u05f4\u0600-\u0603\u0606-\u060a\u060c\u0614\u061b\u061e\u066a\u066d\u0703-\u070d"
            "\u07f6-\u07f8\u0964\u0965\u0e4f\u1fbd\u2016\u2017\u2020-\u2023\u2030-\u2038\u203b\u203e-\u2042"
            "\u2044\u207a-\u207f\u208a-\u208e\u2100-\u214f\u2190-\u21ff\u2200-\u2bff\u3012\u30fb\uff01-\uff0f"
            "\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65]")

    def unsoft(text):
        return (text.replace("\u00ad", "") or "-", len(text))

    def sentence_final(text):                     # abbreviation at a sentence end: the period is read again
        return (text, len(text) - 1)

    def split_off(text):                          # "cannot" -> "can" + "not", "gonna" -> "gon" + "na", "'tis"
        return (text, len(text))

    def spaces_to_nbsp(text):
        return (text.replace(" ", "\u00a0"), len(text))

    rules = [
        (r"(?P<tok>(?i:can))(?i:not)", split_off),
        (r"(?P<tok>(?i:gon|wan))(?i:na)|(?P<tok2>(?i:got))(?i:ta)|(?P<tok3>(?i:lem|gim))(?i:me)", split_off),
        (rf"(?P<tok>{apos}[tT])(?i:is|was)", split_off),
        (sgml, spaces_to_nbsp),
        (r"&(?:MD|mdash|ndash);|[\u0096\u0097\u2013\u2014\u2015]", "--"),
        (r"(?i:&amp;)", "&"),
        (r"&(?:HT|TL|UR|LR|QC|QL|QR|odq|cdq|#[0-9]+);", "keep"),
        (rf"(?P<tok>{word}){apos}(?:[msdMSD]|(?i:re|ve|ll))", unsoft),
        (rf"(?P<tok>[A-Za-z\u00ad]*[A-MO-Za-mo-z]\u00ad*)(?i:n){apos_etc}(?i:t)", unsoft),
        (word, unsoft),
        *[(pattern, "keep") for pattern in (
            rf"{apos}(?i:n){apos}?", rf"[lLdDjJ]{apos}", rf"(?i:dunkin|somethin|ol){apos}", rf"{apos}(?i:em)",
            rf"[A-HJ-XZn]{apos_etc}{L}{{2}}{L}*", rf"{apos}[2-9]0s", rf"{apos}(?i:till?)",
            rf"{L}+[aeiouyAEIOUY]{apos_etc}[aeiouA-Z]{L}*", rf"{apos}(?i:cause)",
            r"(?i:cont'd\.?|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)")],
        (rf"(?P<tok>[yY]{apos}){L}", "keep"),
        (r"https?://[^ \t\n\f\r\"<>|()]+[^ \t\n\f\r\"<>|.!?(){},-]", "keep"),
        *[(site + r"(?:/[^ \t\n\f\r\"<>|()]+[^ \t\n\f\r\"<>|.!?(){},-])?", "keep") for site in (
            r"www\.(?:[^ \t\n\f\r\"<>|.!?(){},]+\.)+[a-zA-Z]{2,4}",
            r"(?:[^ \t\n\f\r\"`'<>|.!?(){},-_$]+\.)+(?:com|net|org|edu)")],
        (r"[a-zA-Z0-9][^ \t\n\f\r\"<>|()\u00a0]*@(?:[^ \t\n\f\r\"<>|().\u00a0]+\.)*[^ \t\n\f\r\"<>|().\u00a0]+",
         "keep"),
        (rf"@[a-zA-Z_][a-zA-Z_0-9]*|#{word}", "keep"),
        (rf"(?P<tok>{apos}(?:[msdMSD]|(?i:re|ve|ll)))[^A-Za-z]", lambda t: (_quote(t, False), len(t))),
        (rf"(?i:n){apos_etc}(?i:t)", lambda t: (_quote(t, False), len(t))),
        (r"\d{1,2}[\-/]\d{1,2}[\-/]\d{2,4}", "keep"),
        (r"[\-+]?(?:\d*(?:[.:,\u00ad\u066b\u066c]\d+)+|\d+)", unsoft),
        (r"[\u207a\u207b\u208a\u208b]?(?:[\u2070\u00b9\u00b2\u00b3\u2074-\u2079]+|[\u2080-\u2089]+)", "keep"),
        (r"(?:\d{1,4}[- \u00a0])?\d{1,4}(?:\\?/|\u2044)\d{1,4}", spaces_to_nbsp),
        (r"[\u00bc\u00bd\u00be\u2153-\u215e]", lambda t: (_FRACTIONS.get(t, t), 1)),
        (rf"(?i:-(?:RRB|LRB|RCB|LCB|RSB|LSB)-|C\.D\.s|pro-|anti-|S(?:&|&amp;)P-500|S(?:&|&amp;)Ls|Cap{apos}n|"
         rf"c{apos}est)", lambda t: (t.replace("&amp;", "&").replace("&AMP;", "&"), len(t))),
        (r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}", "keep"),
        (r"[A-Z]*\$|#", "keep"),
        (r"[\u00a2\u00a3\u00a4\u00a5\u0080\u20a0\u20ac\u060b\u0e3f\u20a4\uffe0\uffe1\uffe5\uffe6]",
         lambda t: (_CURRENCY.get(t, t), 1)),
        # An acronym before a word that usually starts a sentence ends it: "U.S. The" -> "U.S." "." "The"; a
        # single letter gives the letter and the period: "a. The" -> "a" "." "The".
        (rf"(?P<tok>{acro}\.){space}+(?:(?:{acronym_next}){spacenl}|{sgml})", sentence_final),
        (rf"(?P<tok>[A-Za-z])\.{space}+(?:(?:{acronym_next}){spacenl}|{sgml})", "keep"),
        (rf"(?P<tok>(?i:nos?)\.){space}?[0-9]", "keep"),
        (rf"(?P<tok>{abbrev1}){spacenl}(?:{spacenl}|[A-Z]|{sgml})", sentence_final),
        (abbrev1, "keep"),
        *[(rf"{abbrev}\.", "keep") for abbrev in abbrev4s],
        *[(rf"(?P<tok>{abbrev}){space}", "keep") for abbrev in abbrev4s],
        (rf"(?P<tok>{acro}){spacenl}", "keep"),
        (rf"(?P<tok>{apos}[0-9][0-9]){spacenl}", "keep"),
        (rf"(?P<tok>{word}\.)[,;:\u3001]", unsoft),
        (r"(?:\([0-9]{2,3}\)[ \u00a0]?|(?:\+\+?)?(?:[0-9]{2,4}[\- \u00a0])?[0-9]{2,4}[\- \u00a0])[0-9]{3,4}"
         r"[\- \u00a0]?[0-9]{3,5}|(?:(?:\+\+?)?[0-9]{2,4}\.)?[0-9]{2,4}\.[0-9]{3,4}\.[0-9]{3,5}",
         lambda t: (t.replace(" ", "\u00a0").replace("(", "-LRB-").replace(")", "-RRB-"), len(t))),
        (r"(?P<tok>\"|&quot;)[A-Za-z0-9$]", lambda t: (_quote(t, True), len(t))),
        (r"\"|&quot;", lambda t: (_quote(t, False), len(t))),
        (r"(?i:0x7f)", "drop"),
        (r"[<\[]|&lt;|[>\]]|&gt;|[{}()]", lambda t: (_BRACKETS.get(t, t), len(t))),
        (r"-+", lambda t: ("--" if 3 <= len(t) <= 4 else t, len(t))),
        (r"\.{3,5}|(?:\.[ \u00a0]){2,4}\.|[\u0085\u2026]", "..."),
        (r"@+|#+|_+", "keep"),
        (r"\*+|(?:\\\*){1,3}", "keep"),
        (r"[,;:\u3001]", "keep"),
        (r"[?!]+", "keep"),
        (r"[.\u00a1\u00bf\u037e\u0589\u061f\u06d4\u0700-\u0702\u07fa\u3002]", "keep"),
        (r"=", "keep"),
        (r"/", "keep"),
        (rf"(?P<tok>{hthing}\.)[,;:\u3001]", unsoft),
        (hthing, unsoft),
        (rf"(?P<tok>{thing}\.)[,;:\u3001]", "keep"),
        (thing, "keep"),
        (r"(?P<tok>[A-Z]+(?:(?:[+&]|&amp;)[A-Z]+)+\.)[,;:\u3001]|[A-Z]+(?:(?:[+&]|&amp;)[A-Z]+)+",
         lambda t: (t.replace("&amp;", "&"), len(t))),
        (r"(?P<tok>')[A-Za-z][^ \t\n\r\u00a0]", lambda t: (_quote(t, True), len(t))),
        (rf"{apos}(?:[msdMSD]|(?i:re|ve|ll))", lambda t: (_quote(t, False), len(t))),
        *[(pattern, lambda t: (_quote(t, False), len(t))) for pattern in (
            apos, "''", "[`\u2018\u2019\u201a\u201b\u201c\u201d\u0091\u0092\u0093\u0094\u201e\u201f\u2039\u203a"
                        "\u00ab\u00bb]{1,2}")],
        (r"<<|>>", "keep"),
        (misc, "keep"),
        (r"\x00|[ \t\u00a0\u2000-\u200a\u3000]+|[\u200b\u200e\u200f\ufeff]|[\r\n\u2028\u2029\x0b\x0c]|&nbsp;",
         "drop"),
    ]
    return [(re.compile(pattern), action) for pattern, action in rules]


def _ptb_step(text, pos):
    """(the tokens of the longest rule match at pos, where the next match starts); no rule: the character is
    deleted, as -untokenizable firstDelete does."""
    best, best_len = None, 0
    for rx, action in _ptb_rules():
        m = rx.match(text, pos)
        if m is not None and m.end() - pos > best_len:
            best, best_len = (m, action), m.end() - pos
    if best is None:
        return [], pos + 1
    m, action = best
    groups = [g for g in ("tok", "tok2", "tok3") if g in m.re.groupindex and m.group(g) is not None]
    tok = m.group(groups[0] if groups else 0)            # the token; the rest of the match is trailing context
    if action == "drop":
        return [], pos + len(tok)
    if action == "keep":
        return [tok], pos + len(tok)
    if isinstance(action, str):
        return [action], pos + len(tok)
    out, consumed = action(tok)
    return [out], pos + consumed


def _ptb_lex(text):
    """Tokens of one line, by the lexer's longest-match rule, one match after the other."""
    tokens, pos = [], 0
    while pos < len(text):
        found, pos = _ptb_step(text, pos)
        tokens.extend(found)
    return tokens


def ptb_tokenize(text):
    """The text every coco-caption scorer sees: PTB tokens, lower-cased, 17 punctuation tokens dropped.

    >>> ptb_tokenize("The cube can't move, it's RED!")
    "the cube ca n't move it 's red"
    """
    # differs from reference: line breaks other than "\n" are spaces here; the toolkit starts a new output line at
    # them and shifts every later caption onto the wrong item.
    for ch in LINE_BREAKS:
        text = text.replace(ch, " ")
    # Characters outside the Basic Multilingual Plane (emoji) reach JFlex as two surrogates no rule covers.
    text = "".join(ch if ord(ch) < 0x10000 else " " for ch in text)
    # differs from reference: a caption is lexed alone, followed by "\n" as in the toolkit's input file; there the
    # next caption follows too, which a few abbreviation rules read as trailing context.
    tokens = [tok.lower() for tok in _ptb_lex(text + "\n")]
    return " ".join(tok for tok in " ".join(tokens).split(" ") if tok not in PTB_DROPPED)


# ---------------------------------------------------------------------------------------------------------------
# 7. Reading predictions and references, checking them, and printing the table
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
    if isinstance(data, dict) and "annotations" in data:
        raise CaptionInputError(f"{path}: this is a ground-truth file (it has 'annotations'); give predictions first")
    if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
        return data
    raise CaptionInputError(f"{path}: expected a COCO results list [{{image_id, caption}}], {{id: caption}}, or "
                            f"{{\"items\": [...]}}")


def read_references(data, path="references"):
    """{id: [captions]} from a COCO ground truth {images, annotations}, an items file, or {id: [captions]}."""
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
    if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        return data
    raise CaptionInputError(f"{path}: expected a COCO ground truth {{images, annotations}}, {{id: [captions]}}, or "
                            f"{{\"items\": [...]}}")


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
# 8. Speed variants: the same numbers, faster. Each says what it stands in for and what it buys of the whole
#    scoring process (`python bench.py metrics`: with and without it, beside the Java toolkit), and a test checks
#    that it gives exactly what the plain code gives. FastCaptionScorer is the one place that selects them, with
#    meteor.py's own (its section 5).
# ---------------------------------------------------------------------------------------------------------------
_PLAIN_CAPTION = re.compile(r"(?:[A-Za-z0-9 ]*[A-Za-z0-9 ][,;!?.](?= |\Z))*[A-Za-z0-9 ]*")   # most captions: words,
# spaces and lone punctuation marks the lexer splits off and the wrapper drops (each before a space or the end)
_LOWER_WORDS = re.compile(r"[a-z0-9 ]*")       # the commonest of them: lower-case words and spaces
_DIGITS_SPACED = re.compile(r"\d \d")          # "555 123 4567" is one (phone number) token
_BEFORE_PERIOD = re.compile(r"[A-Za-z0-9]+(?=\.)")   # "etc.", "No.", "a.": maybe an abbreviation, ask the lexer
_WORD = re.compile(r"[a-z0-9]+")
# Words the lexer splits although they hold only letters: its "cannot" rule and the assimilations.
_PTB_SPLIT_WORDS = {"cannot": "can not", "gonna": "gon na", "gotta": "got ta", "wanna": "wan na", "lemme": "lem me",
                    "gimme": "gim me"}


def ptb_tokenize_fast(text):
    """ptb_tokenize(text), with a shortcut for captions of words, spaces and lone , ; ! ? . marks (most captions):
    the lexer's tokens are then the words, but for the few it splits, and the marks, which the wrapper drops. A word
    before a period is asked of the lexer (one step: an abbreviation keeps its period). Trying each of the lexer's
    80 rules at every position is slow in Python; what this shortcut buys of the whole process: BENCHMARKS.md
    section 6 (`python bench.py metrics`)."""
    if _DIGITS_SPACED.search(text):
        return ptb_tokenize(text)
    if _LOWER_WORDS.fullmatch(text):              # lower-case words and spaces: nothing to lower or drop
        words = text.split()
    elif _PLAIN_CAPTION.fullmatch(text) and ("." not in text or all(
            _ptb_step(text + "\n", m.start()) == ([m.group()], m.end()) for m in _BEFORE_PERIOD.finditer(text))):
        words = _WORD.findall(text.lower())
    else:
        return ptb_tokenize(text)
    return " ".join([_PTB_SPLIT_WORDS.get(word, word) for word in words])


PARALLEL_MIN_ITEMS = 1000     # below this a second process costs more than it saves
METEOR_CHUNK_ITEMS = (250, 50)   # METEOR's items are shared between the processes in chunks of this many, the last
# quarter in small ones: the processes meet there, and the one that finishes first waits at most for a small chunk
_FORKED = {}                  # the worker process's copy of the parent's FastMeteor (set by its initializer)


def _meteor_chunk(items):
    """METEOR statistics of a chunk of (candidate, references) items, in the worker process."""
    return _FORKED["meteor"].item_stats_many(items)


class MeteorWorker:
    """meteor.item_stats_many(items), shared with a forked process, which starts on the items chunk by chunk while
    this process computes BLEU and ROUGE-L; finish() then computes here, from the last chunk back, those the worker
    has not begun, so that both end together whatever the machine's load. The worker is forked, so it has the
    parent's METEOR tables without pickling them. What it buys: BENCHMARKS.md section 6 (`python bench.py
    metrics`); the command line uses it, the training scripts do not (they may hold CUDA)."""

    def __init__(self, meteor, items):
        meteor.prepare_items(items)     # every word registered before the fork: the worker never prepares again
        self.meteor = meteor
        large, small = METEOR_CHUNK_ITEMS
        cut = len(items) * 3 // 4
        self.chunks = [items[k:min(k + large, cut)] for k in range(0, cut, large)] + \
                      [items[k:k + small] for k in range(cut, len(items), small)]
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                                           initializer=_FORKED.update, initargs=({"meteor": meteor},))
        self.futures = [self.pool.submit(_meteor_chunk, chunk) for chunk in self.chunks]

    def finish(self):
        """The statistics of every item, in order."""
        per_chunk = [None] * len(self.chunks)
        for k in reversed(range(len(self.chunks))):          # from the last chunk back, those the worker has not
            if self.futures[k].cancel():                      # begun (cancel() fails once it has)
                per_chunk[k] = self.meteor.item_stats_many(self.chunks[k])
        per_chunk = [stats if stats is not None else future.result() for stats, future in zip(per_chunk, self.futures)]
        self.pool.shutdown()
        return [stats for chunk in per_chunk for stats in chunk]


class FastCaptionScorer(CaptionScorer):
    """CaptionScorer with every speed variant in place of the plain step it stands in for: the same numbers.
    The garbage collector is paused around its work (meteor.collector_paused). processes=2 shares METEOR with a
    forked process (MeteorWorker). The scripts ask for it in one line: score_captions(..., scorer=FastCaptionScorer).
    """
    tokenizer = staticmethod(ptb_tokenize_fast)
    meteor_class = FastMeteor
    whole_set_cider = None    # CIDEr-D of all the items, computed while a METEOR worker runs

    def __init__(self, *args, processes=1, **kwargs):
        self.processes = processes
        with collector_paused():
            super().__init__(*args, **kwargs)

    def start_meteor(self, items):
        if self.processes < 2 or len(items) < PARALLEL_MIN_ITEMS or \
                "fork" not in multiprocessing.get_all_start_methods():
            return super().start_meteor(items)
        worker = MeteorWorker(self.meteor, items)

        def finish():
            self.whole_set_cider = self._cider(self.ids)    # while the worker is still on METEOR
            return worker.finish()
        return finish

    def _cider(self, ids):
        if ids == self.ids and self.whole_set_cider is not None:
            return self.whole_set_cider
        return super()._cider(ids)

    def score(self, ids=None):
        with collector_paused():
            return super().score(ids)


# ---------------------------------------------------------------------------------------------------------------
# 9. The field's scoring: how the LEVIR-CC papers score, beside ours
# ---------------------------------------------------------------------------------------------------------------
# The remote-sensing change-captioning papers (RSICCformer, PSNet, PromptCC, Chg2Cap, SEN, RSCaMa, ...) score with
# a copy of coco-caption called as github.com/Chen-Yang-Liu/RSICC utils.py `get_eval_score` does: each caption
# becomes the string of its words' vocabulary ids ("12 40 7"), references keep <unk> for a word outside the
# vocabulary, there is no PTB tokenizer, and the same four scorers run on those strings. METEOR (the jar with its
# four modules, as they run it) then matches almost only exactly: no id is one of its function words, and ids have
# no stems or synonyms; its paraphrase table alone still joins a few phrases of numbers (it moves the METEOR of 14
# of the 240 items of tests/metrics_vectors/levir_field.json.gz), so METEOR, and METEOR alone, depends a little on
# which number a word gets. The vocabulary is the words seen at least 5 times in the captions, counted over all three splits as the
# papers' preprocessing counts them, and numbered as github.com/Chen-Yang-Liu/RSCaMa preprocess_data.py numbers
# them (its vocab.json: <NULL> 0, <UNK> 1, <START> 2, <END> 3, then the words in sorted order). They report
# S*m = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4, x100.
FIELD_MIN_COUNT = 5           # a word seen fewer times is <unk>
FIELD_SPECIALS = ("<NULL>", "<UNK>", "<START>", "<END>")   # ids 0..3, as RSCaMa's vocab.json
FIELD_METRICS = ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr", "S*m")


def field_words(text):
    """A caption as the field's words. CLIP's tokenizer decodes a hyphenated word with spaces around the hyphen
    ("lower - right"); the field's captions keep it one word ("lower-right")."""
    return text.replace(" - ", "-").split()


def field_vocabulary(captions, min_count=FIELD_MIN_COUNT):
    """{word: id} of the words seen at least min_count times in captions, numbered after FIELD_SPECIALS in sorted
    order."""
    counts = Counter(word for caption in captions for word in field_words(caption))
    words = sorted(word for word, n in counts.items() if n >= min_count)
    return {word: len(FIELD_SPECIALS) + k for k, word in enumerate(words)}


def field_ids(text, vocabulary):
    """The string the field's scorers see: each word's id, <UNK>'s (1) for a word outside the vocabulary."""
    unknown = FIELD_SPECIALS.index("<UNK>")
    return " ".join(str(vocabulary.get(word, unknown)) for word in field_words(text))


def s_star_m(corpus):
    """The papers' S*m of a corpus's scores, x100 like theirs."""
    return 100 * (corpus["BLEU_4"] + corpus["METEOR"] + corpus["ROUGE_L"] + corpus["CIDEr"]) / 4


def score_both_ways(predictions, references, subsets, vocabulary, scorer=CaptionScorer):
    """{"project": {subset: scores}, "field": {subset: scores}, ...}, every score x100 with S*m, each subset
    re-scored on its own: the project's way (words, PTB tokens) and the field's (vocabulary ids, no tokenizer),
    METEOR with all four modules where its data is found, as the jar runs. Both score the same words: hyphens
    joined as in the field's captions."""
    # differs from reference: its captions are scored as decoded; here "lower - right" is "lower-right" again
    predictions = {i: " ".join(field_words(c)) for i, c in predictions.items()}
    references = {i: [" ".join(field_words(r)) for r in references[i]] for i in predictions}
    ids = {i: field_ids(c, vocabulary) for i, c in predictions.items()}
    id_references = {i: [field_ids(r, vocabulary) for r in references[i]] for i in predictions}
    ways = {"project": score_subsets(predictions, references, subsets, scorer=scorer),
            "field": score_subsets(ids, id_references, subsets, tokenize=False, scorer=scorer)}
    table = {way: {name: {**{k: 100 * v for k, v in result["corpus"].items()}, "S*m": s_star_m(result["corpus"])}
                   for name, result in results.items()} for way, results in ways.items()}
    table["sizes"] = {name: len(ids) for name, ids in subsets.items()}
    table["meteor_modules"] = next(iter(ways["project"].values()))["info"].get("meteor_modules")
    table["vocabulary"] = len(vocabulary)
    return table


def format_both_ways(table):
    """The papers' table, x100: each subset scored the project's way and the field's, one line each."""
    names = {"CIDEr": "CIDEr-D", "ROUGE_L": "ROUGE-L"}
    lines = [f"{'x100':<22}{'pairs':>6}  " + " ".join(f"{names.get(m, m.replace('_', '-')):>7}" for m in FIELD_METRICS)]
    for name, size in table["sizes"].items():
        for way, label in (("project", "ours"), ("field", "field's")):
            scores = table[way][name]
            lines.append(f"{name + ', ' + label:<22}{size:>6,}  "
                         + " ".join(f"{scores[m]:7.2f}" for m in FIELD_METRICS))
    lines.append(f"ours: words, PTB tokens, METEOR {table['meteor_modules']}")
    lines.append(f"field's: vocabulary-id strings (the {table['vocabulary']:,} words seen >= {FIELD_MIN_COUNT} times "
                 f"in the captions, others <unk>, kept in references), no PTB tokenizer, METEOR on the ids (exact "
                 f"matches but for a few number phrases), as the LEVIR-CC papers score (RSICC utils.py get_eval_score)")
    lines.append("S*m = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# 10. The kind of change a caption says, by keywords, for CLEVR-Change-style captions (synthetic set, CLEVR-Change)
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
# 11. The command line, and a demo
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description="Score captions as the coco-caption toolkit does (BLEU-1..4, "
                                                 "METEOR, ROUGE-L, CIDEr), without Java.")
    parser.add_argument("predictions", help="COCO results [{image_id, caption}], {id: caption}, or {items: [...]}")
    parser.add_argument("references", nargs="?", help="COCO ground truth {images, annotations} or {id: [captions]}; "
                                                      "leave out when predictions is an {items: [...]} file")
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
        data = load_json(args.predictions)
        predictions = read_predictions(data, args.predictions)
        references = read_references(load_json(args.references) if args.references else data,
                                     args.references or args.predictions)
        modules = tuple(args.meteor_modules.split(",")) if args.meteor_modules else None
        with collector_paused():      # until the table is written: then the process ends, nothing left to scan
            result = score_captions(predictions, references, tuple(args.metrics.split(",")),
                                    tokenize=not args.pretokenized, meteor_modules=modules,
                                    # the speed variant (section 8): the same numbers as the plain scorer (tested)
                                    scorer=functools.partial(FastCaptionScorer, processes=args.processes))
            result["info"]["seconds"] = round(time.perf_counter() - started, 3)
            print(json.dumps(result, ensure_ascii=False) if args.json else format_table(result))
    except CaptionInputError as e:
        print(f"metrics.py: error: {e}", file=sys.stderr)
        return 2
    return 0


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
    print("usage: python metrics.py PREDICTIONS.json [REFERENCES.json] [--json]")
