"""METEOR 1.5, as the coco-caption toolkit runs it, in plain Python: the same numbers as the Java jar, to the bit.

METEOR (Metric for Evaluation of Translation with Explicit ORdering: Banerjee and Lavie 2005; version 1.5, Denkowski
and Lavie 2014) aligns a candidate caption (the hypothesis) with each reference word by word: first identical words,
then words with the same stem, then WordNet synonyms, then phrases the paraphrase table lists as equivalent. The
alignment with the most matches and the fewest chunks (runs of neighbouring matched words) gives precision, recall,
their harmonic mean weighted towards recall, and a penalty for fragmentation. pycocoevalcap runs it as
`java -jar meteor-1.5.jar - - -stdio -l en -norm` (English, normalised); this file computes the same. The lesson
comes first, in one stretch; what it leans on and the speed variants come after it:

    1. METEOR's score  the statistics an alignment leaves (MeteorStats); the four matching stages; the alignment
                       (Aligner's beam search over reference positions); precision, recall, Fmean and the
                       fragmentation penalty; per item the best single reference, a corpus from summed statistics
    2. resources       the word lists, the synonym tables and the paraphrase table of the METEOR 1.5 release
    3. the text        the toolkit's input line, then edu.cmu.meteor.util.Normalizer (English, punctuation kept),
                       after the Penn Treebank (PTB) tokenizer of metrics.py
    4. the stemmer     Snowball English ("Porter2")
    5. speed variants  the same numbers, faster: a paraphrase index, a batched beam search, a paused garbage
                       collector; each tested equal to the plain code it stands in for

METEOR's synonym (WordNet) and paraphrase resources are data files of the METEOR 1.5 release. They are read with
the standard library from the jar (a zip archive) and `data/paraphrase-en.gz` of an installed pycocoevalcap
package, or from the folder named by METEOR_DATA. Without them METEOR runs with exact + stem matching only.
The Java names cited below (Aligner, MeteorScorer, MeteorStats, SynonymDictionary, ...) are classes of the
jar's edu.cmu.meteor packages.

Differences from the toolkit (each is marked `# differs from reference:` below):
  - METEOR compares words as strings, where Java compares String.hashCode values (a collision would count as a match).

metrics.py runs this inside its scorer, after its PTB tokenizer; this file imports nothing of the project.
Run:   python meteor.py        # demo: one candidate aligned with one reference, and its score
"""
import contextlib
import functools
import gc
import gzip
import importlib.util
import itertools
import math
import operator
import os
import re
import shutil
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np


@dataclass
class MeteorConfig:                                 # the toolkit's settings: -l en, task "rank"
    alpha: float = 0.85                             # Fmean = P R / (alpha P + (1 - alpha) R)
    beta: float = 0.2                               # fragmentation penalty exponent
    gamma: float = 0.6                              # fragmentation penalty weight
    delta: float = 0.75                             # weight of content words against function words
    weights: tuple = (1.0, 0.6, 0.8, 0.6)           # per module: exact, stem, synonym, paraphrase
    beam: int = 40                                  # alignment beam size (Constants.DEFAULT_BEAM_SIZE)


METEOR_MODULES = ("exact", "stem", "synonym", "paraphrase")


class CaptionInputError(ValueError):
    """Bad input to the scorers: says what, where, and how to fix it (metrics.py raises it too)."""


# ---------------------------------------------------------------------------------------------------------------
# 1. METEOR's score: matching, alignment, and the score of the statistics they leave
# ---------------------------------------------------------------------------------------------------------------
# A hypothesis (the candidate caption) is scored against each reference alone (edu.cmu.meteor.aligner.Aligner,
# edu.cmu.meteor.scorer.MeteorScorer). Each stage (module) proposes matches of words or phrases: exact, same stem,
# WordNet synonyms, paraphrases, each a tuple (ref start, ref length, hyp start, hyp length, stage). A match whose
# words no other match touches is fixed; the rest are chosen by a beam search over reference positions, left to
# right. The chosen alignment is counted into MeteorStats, and the score is computed from those counts; the best
# reference gives the item's statistics, and a corpus scores the sum of its items' statistics.
class MeteorStats(NamedTuple):
    """What METEOR keeps of one alignment, or of a corpus's summed alignments (Java's MeteorStats). "hyp" is the
    hypothesis (Java's "test"), "ref" the reference; a per-stage count is a tuple in the order of Meteor.modules."""
    hyp_len: int                    # words of the hypothesis
    ref_len: int                    # words of the reference
    hyp_function_words: int         # of them, function words (METEOR_FUNCTION_WORDS: "the", "of", "is", ...)
    ref_function_words: int
    hyp_content_matches: tuple      # per stage, the hypothesis's matched content words (the words not functional)
    ref_content_matches: tuple
    hyp_function_matches: tuple     # per stage, the hypothesis's matched function words
    ref_function_matches: tuple
    chunks: int                     # runs of matches that are neighbours, in the same order, in both sentences
    hyp_matched: int                # matched words of the hypothesis (a phrase match counts each of its words)
    ref_matched: int


class _MeteorSentence:
    """One normalised sentence and what each matching stage needs of it, computed once per distinct sentence."""
    __slots__ = ("words", "positions", "functional", "stems", "stem_positions", "synonyms", "paths")

    def __init__(self, words, meteor):
        self.words = tuple(words)
        self.positions = _positions(self.words)              # word -> its positions, ascending: exact matches
        self.functional = tuple(word in METEOR_FUNCTION_WORDS for word in words)
        self.stems = self.stem_positions = self.synonyms = self.paths = None
        if "stem" in meteor.modules:
            self.stems = tuple(meteor.stem(word) for word in words)          # Snowball stems (section 4)
            self.stem_positions = _positions(self.stems)
        if "synonym" in meteor.modules:
            self.synonyms = tuple(meteor.synonyms(word) for word in words)   # the words sharing a WordNet synset
        if "paraphrase" in meteor.modules:
            # Per position, the table's phrases starting there and their paraphrases (Meteor.paraphrase_paths):
            # [(phrase length, {first word of a paraphrase: [(its rank in the table, paraphrase)]})].
            self.paths = meteor.paraphrase_paths(self.words)

    def paraphrase_matches(self, other):
        """(i, n, rank, j, m): the phrase words[i:i+n] has as its rank-th paraphrase other.words[j:j+m].

        Sorted, this is the order in which ParaphraseMatcher proposes them (position, length, table order, j).
        """
        found, other_words = [], other.words
        for i, paths in enumerate(self.paths):
            for n, by_first in paths:
                for first in by_first.keys() & other.positions.keys():
                    for rank, target in by_first[first]:
                        m = len(target)
                        for j in other.positions[first]:
                            if other_words[j:j + m] == target:
                                found.append((i, n, rank, j, m))
        found.sort()
        return found


def _fixed_matches(cands, cover1, cover2):
    """Aligner.align: a position's only match is definite when no other match touches its words."""
    fixed, used1, used2, open_choice = {}, 0, 0, False
    for i, options in enumerate(cands):
        if len(options) == 1 and all(cover2[k] == 1 for k in range(i, i + options[0][1])) and \
                (cover1[options[0][2]] == 1 if options[0][3] == 1 else
                 all(cover1[k] == 1 for k in range(options[0][2], options[0][2] + options[0][3]))):
            start, length, m_start, m_length, _ = fixed[i] = options[0]
            used1 |= ((1 << m_length) - 1) << m_start
            used2 |= ((1 << length) - 1) << start
        elif options:
            open_choice = True
    return fixed, used1, used2, open_choice


class _Path(NamedTuple):
    """A partial alignment of Meteor._resolve's beam search (Java's PartialAlignment)."""
    rank: int            # -(matches1 + matches2): more weighted matches rank first
    chunks: int          # chunks closed so far
    distance: int        # summed |reference start - hypothesis start| of its matches
    matches1: int        # weighted hypothesis words matched (a Java int: truncated at every addition)
    matches2: int        # weighted reference words matched
    ref_end: int         # end of its last match in the reference
    last: int            # end of its last match in the hypothesis, or -1 once a skip closed the chunk
    used1: int           # bit mask of the hypothesis words used
    used2: int           # bit mask of the reference words used
    chosen: tuple | None  # the chosen matches, newest first, as a linked list (match, earlier)


_PATH_RANK = operator.attrgetter("rank", "chunks", "distance")    # Java's PARTIAL_COMPARE_TOTAL
METEOR_SEARCH_WEIGHTS = {"exact": 1.0, "stem": 0.5, "synonym": 0.5, "paraphrase": 0.5}   # MeteorScorer: "best
# weights for evaluation", used only to rank partial alignments; the score uses MeteorConfig.weights.


class Meteor:
    """METEOR 1.5 statistics and scores, with the toolkit's settings (-l en -norm, task rank)."""

    # The plain steps. FastMeteor (section 5) puts faster ones with the same results in their place.
    sentence_type = _MeteorSentence       # what sentence() builds (FastMeteor's: _FastSentence)

    def __init__(self, config=None, modules=None, resources=None):
        self.config = config or MeteorConfig()
        self.modules = _checked_modules(modules, resources)    # the stages, in METEOR_MODULES' order
        self.resources = resources
        self.weights = tuple(self.config.weights[METEOR_MODULES.index(m)] for m in self.modules)
        self.search_weights = tuple(METEOR_SEARCH_WEIGHTS[m] for m in self.modules)
        self.vocabulary, self.paraphrases, self.paraphrase_index, self.extendable = set(), {}, {}, set()
        self._words, self._sentences, self._pairs, self._structures = {}, {}, {}, {}
        self._stems, self._synsets, self._synonyms, self._synset_words, self._single = {}, {}, {}, {}, {}

    # Matching -----------------------------------------------------------------------------------------------
    def _candidates(self, hyp, ref):
        """Stage.matches: per reference position the candidate matches of every stage, and word coverage."""
        h, r = hyp.words, ref.words
        cands = [[] for _ in r]
        cover1, cover2 = [0] * len(h), [0] * len(r)
        # Identical sentences need exact matches only ("this prevents beam search errors").
        stages = self.modules[:1] if h == r else self.modules
        stem = stages.index("stem") if "stem" in stages else None
        synonym = stages.index("synonym") if "synonym" in stages else None
        # One-word matches. Each stage appends to every position after the previous stages did, so trying the
        # stages in order at each reference position gives the same lists as the stage-by-stage matchers.
        # differs from reference: words are compared as strings; Java compares their String.hashCode values.
        for i, word in enumerate(r):
            options = cands[i]
            for j in hyp.positions.get(word, ()):                         # exact
                options.append((i, 1, j, 1, 0))
                cover1[j] += 1
            if stem is not None:
                for j in hyp.stem_positions.get(ref.stems[i], ()):        # same Snowball stem
                    if h[j] != word:
                        options.append((i, 1, j, 1, stem))
                        cover1[j] += 1
            if synonym is not None and ref.synonyms[i]:
                common = ref.synonyms[i].intersection(hyp.positions)    # sharing a WordNet synset
                if common:
                    for j in sorted(j for other in common for j in hyp.positions[other]):
                        options.append((i, 1, j, 1, synonym))
                        cover1[j] += 1
            cover2[i] = len(options)
        if "paraphrase" in stages:                                       # phrases, possibly of several words
            stage = stages.index("paraphrase")
            matches = [(i, n, j, m) for i, n, _, j, m in ref.paraphrase_matches(hyp)]   # reference phrase first
            matches += [(j, m, i, n) for i, n, _, j, m in hyp.paraphrase_matches(ref)]  # then hypothesis phrase
            for start, length, m_start, m_length in matches:
                cands[start].append((start, length, m_start, m_length, stage))
                for k in range(m_start, m_start + m_length):
                    cover1[k] += 1
                for k in range(start, start + length):
                    cover2[k] += 1
        return cands, cover1, cover2

    # Alignment ----------------------------------------------------------------------------------------------
    def _resolve(self, cands, cover1, cover2, n_ref):
        """The chosen matches, by reference start, reproducing Aligner.resolve and its quirks exactly."""
        fixed, used1, used2, open_choice = _fixed_matches(cands, cover1, cover2)
        if not open_choice:
            return fixed                                  # nothing to choose: the beam would keep one path
        structure = (n_ref, tuple(map(tuple, cands)))     # the search depends on nothing else
        if structure in self._structures:
            return self._structures[structure]
        weights, beam = self.search_weights, self.config.beam
        options_at = [[(m, ((1 << m[3]) - 1) << m[2], ((1 << m[1]) - 1) << m[0], abs(m[0] - m[2]),
                        m[3] * weights[m[4]], m[1] * weights[m[4]]) for m in options] for options in cands]
        # Partial alignments (_Path). matches1/2 are Java ints and `matches1 += length * weight` truncates: a
        # one-word stem, synonym or paraphrase match (search weight 0.5) adds nothing. Java's idx is max(end in the
        # reference, current): a skip only advances it, so it is not stored.
        paths = [_Path(0, 0, 0, 0, 0, 0, -1, used1, used2, None)]
        for current in range(n_ref):
            if len(paths) > 1:
                paths.sort(key=_PATH_RANK)                # stable, as Collections.sort
                del paths[beam:]
            following, bit, options = [], 1 << current, options_at[current]
            for path in paths:
                _, chunks, distance, m1, m2, ref_end, last, u1, u2, chosen = path
                if u2 & bit:                              # this reference word is already used
                    if current < ref_end:                 # inside the previous match
                        following.append(path)
                    elif current in fixed:                # a fixed match starts here
                        start, length, m_start, m_length, stage = fixed[current]
                        m1, m2 = int(m1 + m_length * weights[stage]), int(m2 + length * weights[stage])
                        following.append(_Path(-(m1 + m2), chunks + (last != -1 and m_start != last), distance
                                               + abs(start - m_start), m1, m2, start + length, m_start + m_length,
                                               u1, u2, chosen))
                    continue
                for match, mask1, mask2, dist, w1, w2 in options:
                    if u1 & mask1 or u2 & mask2:
                        continue
                    n1, n2 = int(m1 + w1), int(m2 + w2)
                    following.append(_Path(-(n1 + n2), chunks + (last != -1 and match[2] != last), distance, n1,
                                           n2, match[0] + match[1], match[2] + match[3], u1 | mask1, u2 | mask2,
                                           (match, chosen)))
                    # Java adds the distance to the path being extended, not to the new one: the skip path and
                    # the later alternatives inherit it. Reproduced, since it decides ties.
                    distance += dist
                if last == -1 and distance == path.distance:    # skip this reference word: an open chunk ends
                    following.append(path)
                else:
                    following.append(_Path(path.rank, chunks + (last != -1), distance, m1, m2, ref_end, -1, u1, u2,
                                           chosen))
            paths = following or [paths[0]]               # "unexpected conditions": keep the best path
        if len(paths) > 1:
            paths.sort(key=_PATH_RANK)
            del paths[beam:]
        # the best path once its last chunk is closed; the first of equals, as Java's scan
        best = min(paths, key=lambda p: (p.rank, p.chunks + (p.last != -1), p.distance))
        chosen, link = dict(fixed), best.chosen
        while link is not None:
            chosen[link[0][0]] = link[0]
            link = link[1]
        self._structures[structure] = chosen
        return chosen

    def _stats(self, hyp, ref, chosen):
        """MeteorStats of one alignment: word counts, per-stage content/function matches, chunks, matched words."""
        n_stages = len(self.modules)
        content1, content2, function1, function2 = [0] * n_stages, [0] * n_stages, [0] * n_stages, [0] * n_stages
        chunks, matched1, matched2, last_end, idx = 0, 0, 0, -1, 0
        while idx < len(ref.words):                      # Aligner.getCountAndChunks over the final matches
            match = chosen.get(idx)
            if match is None:
                if last_end != -1:
                    chunks += 1
                    last_end = -1
                idx += 1
                continue
            start, length, m_start, m_length, stage = match
            for k in range(m_start, m_start + m_length):
                if hyp.functional[k]:
                    function1[stage] += 1
                else:
                    content1[stage] += 1
            for k in range(start, start + length):
                if ref.functional[k]:
                    function2[stage] += 1
                else:
                    content2[stage] += 1
            matched1 += m_length
            matched2 += length
            if last_end != -1 and m_start != last_end:
                chunks += 1
            idx, last_end = start + length, m_start + m_length
        if last_end != -1:
            chunks += 1
        return MeteorStats(len(hyp.words), len(ref.words), sum(hyp.functional), sum(ref.functional),
                           tuple(content1), tuple(content2), tuple(function1), tuple(function2), chunks, matched1,
                           matched2)

    # The score ----------------------------------------------------------------------------------------------
    def score(self, stats):
        """MeteorScorer.computeMetrics: the score of one set of (possibly summed) statistics.

        A match counts delta for a content word, 1 - delta for a function word, times its stage's weight; precision
        P and recall R divide the matches by the lengths weighted the same way; Fmean = P R / (alpha P + (1 - alpha)
        R); the penalty gamma (chunks / mean matched words)^beta shrinks it when the matches are scattered."""
        alpha, beta, gamma, delta = (self.config.alpha, self.config.beta, self.config.gamma, self.config.delta)
        hyp_len, hyp_fun, hyp_content, hyp_function = (stats.hyp_len, stats.hyp_function_words,
                                                       stats.hyp_content_matches, stats.hyp_function_matches)
        ref_len, ref_fun, ref_content, ref_function = (stats.ref_len, stats.ref_function_words,
                                                       stats.ref_content_matches, stats.ref_function_matches)
        hyp_weighted_len = delta * (hyp_len - hyp_fun) + (1.0 - delta) * hyp_fun
        ref_weighted_len = delta * (ref_len - ref_fun) + (1.0 - delta) * ref_fun
        hyp_matches = ref_matches = 0.0
        for i, w in enumerate(self.weights):
            hyp_matches += hyp_content[i] * w * delta
        for i, w in enumerate(self.weights):
            ref_matches += ref_content[i] * w * delta
        for i, w in enumerate(self.weights):
            hyp_matches += hyp_function[i] * w * (1.0 - delta)
        for i, w in enumerate(self.weights):
            ref_matches += ref_function[i] * w * (1.0 - delta)
        precision = _java_div(hyp_matches, hyp_weighted_len)
        recall = _java_div(ref_matches, ref_weighted_len)
        f_mean = _java_div(1.0, _java_div(1.0 - alpha, precision) + _java_div(alpha, recall))
        if sum(hyp_content) + sum(hyp_function) == hyp_len and sum(ref_content) + sum(ref_function) == ref_len \
                and stats.chunks == 1:
            fragmentation = 0.0                           # identical: no penalty
        else:
            fragmentation = _java_div(float(stats.chunks), (stats.hyp_matched + stats.ref_matched) / 2.0)
        penalty = gamma * fragmentation ** beta
        score = f_mean * (1.0 - penalty)
        return 0.0 if score != score else max(score, 0.0)

    def item_stats(self, hypothesis, references):
        """The statistics of the best-scoring single reference (first wins a tie), as getMeteorStats(test, refs)."""
        [(hypothesis, references)] = self.prepare_items([(hypothesis, references)])
        hyp, best, best_score = self.sentence(hypothesis), None, -1.0
        for reference in references:
            ref = self.sentence(reference)
            stats = self._stats(hyp, ref, self._resolve(*self._candidates(hyp, ref), len(ref.words)))
            if self.score(stats) > best_score:
                best, best_score = stats, self.score(stats)
        return best

    @staticmethod
    def add(total, stats):
        """MeteorStats.addStats: sums, except that a perfect item (all matched, one chunk) adds no chunk."""
        perfect = (sum(stats.hyp_content_matches) + sum(stats.hyp_function_matches) == stats.hyp_len
                   and sum(stats.ref_content_matches) + sum(stats.ref_function_matches) == stats.ref_len
                   and stats.chunks == 1)
        return MeteorStats(total.hyp_len + stats.hyp_len, total.ref_len + stats.ref_len,
                           total.hyp_function_words + stats.hyp_function_words,
                           total.ref_function_words + stats.ref_function_words,
                           *(tuple(a + b for a, b in zip(mine, theirs)) for mine, theirs in (
                               (total.hyp_content_matches, stats.hyp_content_matches),
                               (total.ref_content_matches, stats.ref_content_matches),
                               (total.hyp_function_matches, stats.hyp_function_matches),
                               (total.ref_function_matches, stats.ref_function_matches))),
                           total.chunks + (0 if perfect else stats.chunks), total.hyp_matched + stats.hyp_matched,
                           total.ref_matched + stats.ref_matched)

    # What the lesson leans on (off the reading path): many items, the text's words, stems, synonyms, paraphrases
    def item_stats_many(self, items):
        """[item_stats(hypothesis, references) for each (hypothesis, references) item]."""
        self.prepare_items(items)          # every word registered at once: the paraphrase table is read once
        return [self.item_stats(hypothesis, references) for hypothesis, references in items]

    def zero_stats(self):
        """The statistics of no item: where a corpus sum starts."""
        zeros = (0,) * len(self.modules)
        return MeteorStats(0, 0, 0, 0, zeros, zeros, zeros, zeros, 0, 0, 0)

    def prepare_items(self, items):
        """prepare() the texts of (hypothesis, references) items as Meteor reads them; returns those texts."""
        fields = [_meteor_fields(hypothesis, references) for hypothesis, references in items]
        self.prepare([text for hypothesis, references in fields for text in [hypothesis, *references]])
        return fields

    def words(self, text):
        """The normalised, lower-cased words Meteor aligns."""
        if text not in self._words:
            self._words[text] = meteor_normalize(text)
        return self._words[text]

    def stem(self, word):
        if word not in self._stems:
            self._stems[word] = snowball_stem(word)
        return self._stems[word]

    _MORPH = (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
              ("ies", "y"), ("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""),
              ("ing", "e"), ("ing", ""), ("er", ""), ("est", ""), ("er", "e"), ("est", "e"))

    def _morph(self, word):
        """SynonymDictionary.morph: WordNet's detachment rules; the first that gives a known word wins."""
        if word.endswith("ss") or len(word) <= 2:
            return word
        for suffix, replacement in self._MORPH:
            if word.endswith(suffix):
                candidate = word[:len(word) - len(suffix)] + replacement
                if candidate in self.resources.synsets:
                    return candidate
        return ""

    def synsets(self, word):
        """Synsets of the word and of its base form (an irregular form's bases, or the morph() guess)."""
        if word not in self._synsets:
            synsets = self.resources.synsets
            ids = set(synsets.get(word, "").split())
            bases = self.resources.exceptions.get(word)
            for base in (bases if bases is not None else [self._morph(word)]):
                ids.update(synsets.get(base, "").split())
            self._synsets[word] = frozenset(ids)
        return self._synsets[word]

    def synonyms(self, word):
        """The other known words sharing a synset with `word` (kept up to date as words are added)."""
        return self._synonyms[word]

    def single_word_paths(self, word):
        """([(1, paraphrases of the word)] or [], whether a longer phrase of the table starts with the word)."""
        if word not in self._single:
            phrase = (word,)
            self._single[word] = ([(1, self.paraphrase_index[phrase])] if phrase in self.paraphrase_index else [],
                                  phrase in self.extendable)
        return self._single[word]

    def paraphrase_paths(self, words):
        """_MeteorSentence.paths: per position of the words, the table's phrases starting there, shortest first, as
        ParaphraseTransducer.getReferencePaths walks its trie: each with its paraphrases grouped by first word, in
        the table's order within a group."""
        index, extendable, single = self.paraphrase_index, self.extendable, self.single_word_paths
        out = []
        for i, word in enumerate(words):
            paths, longer = single(word)
            if longer:                               # a longer phrase may start here
                paths = list(paths)
                for n in range(2, len(words) - i + 1):
                    phrase = words[i:i + n]
                    if phrase in index:
                        paths.append((n, index[phrase]))
                    if phrase not in extendable:
                        break
            out.append(paths)
        return out

    def read_paraphrases(self, resources, vocabulary):
        """The paraphrase pairs that can match these words, read plainly (section 2's read_paraphrases)."""
        return read_paraphrases(resources, vocabulary)

    def prepare(self, texts):
        """Register the words of these texts: synonym neighbours and the paraphrase pairs that can match them."""
        new = set()
        for text in texts:
            new.update(self.words(text))
        new -= self.vocabulary
        if not new:
            return
        self.vocabulary |= new
        if "synonym" in self.modules:
            for word in sorted(new):
                self._synonyms[word] = neighbours = set()
                for synset in self.synsets(word):
                    others = self._synset_words.setdefault(synset, set())
                    for other in others:
                        neighbours.add(other)
                        self._synonyms[other].add(word)
                    others.add(word)
        if "paraphrase" in self.modules:
            self.paraphrases = self.read_paraphrases(self.resources, self.vocabulary)
            self.paraphrase_index = {}
            for phrase, targets in self.paraphrases.items():
                by_first = self.paraphrase_index[phrase] = {}
                for rank, target in enumerate(targets):
                    by_first.setdefault(target[0], []).append((rank, target))
            self.extendable = {phrase[:k] for phrase in self.paraphrases for k in range(1, len(phrase))}
            self._sentences.clear()                # their paraphrase paths may grow
            self._single.clear()
            self._pairs.clear()
            self._structures.clear()

    def forget(self):
        """Drop the per-sentence and per-pair caches (hundreds of MB on a large corpus)."""
        self._words, self._sentences, self._pairs, self._structures, self._single = {}, {}, {}, {}, {}
        self.vocabulary, self.paraphrases, self.paraphrase_index, self.extendable = set(), {}, {}, set()

    def sentence(self, text):
        if text not in self._sentences:
            if not self.vocabulary.issuperset(self.words(text)):
                self.prepare([text])
            self._sentences[text] = self.sentence_type(self.words(text), self)
        return self._sentences[text]


def _positions(items):
    """item -> its positions in items, ascending."""
    positions = {}
    for i, item in enumerate(items):
        positions.setdefault(item, []).append(i)
    return positions


def _java_div(a, b):
    """a / b with Java's double semantics: x/0 is +-Infinity, 0/0 is NaN."""
    if b == 0.0:
        return math.nan if a == 0.0 or a != a else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


# ---------------------------------------------------------------------------------------------------------------
# 2. Resources
# ---------------------------------------------------------------------------------------------------------------
# Two short lists are copied here so that exact + stem scoring needs no download; the test suite
# checks them against the jar's function/english.words and nonbreaking/english.prefixes whenever the jar is present.
METEOR_FUNCTION_WORDS = frozenset((
    "the , . to of and a in that for \" is on 's it with was as said at he by be from have has are his but an this "
    "not i will \u2019 they ) -rrb- ( -lrb- who their had we which were been more or s its would about new one "
    "after you : also up when there than $ all out her people she year two - can if last first \u201c over other "
    "\u201d into some what so -- no time years could ? 't \u2014 '").split(" "))
# Nonbreaking prefixes: a token "prefix." keeps its period (1), or keeps it only before a number (2).
METEOR_NONBREAKING = dict({letter: 1 for letter in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}, **{
    prefix: 1 for prefix in ("Adj Adm Adv Asst Bart Bldg Brig Bros Capt Cmdr Col Comdr Con Corp Cpl DR Dr Drs Ens "
                             "Gen Gov Hon Hr Hosp Insp Lt MM MR MRS MS Maj Messrs Mlle Mme Mr Mrs Ms Msgr Op Ord Pfc "
                             "Ph Prof Pvt Rep Reps Res Rev Rt Sen Sens Sfc Sgt Sr St Supt Surg v vs i.e rev e.g Nos "
                             "Nr").split()}, No=2, Art=2, pp=2)
METEOR_DATA_ENV = "METEOR_DATA"     # a folder holding meteor-1.5.jar and paraphrase-en.gz (or data/paraphrase-en.gz)
METEOR_CACHE_ENV = "METEOR_CACHE"   # folder for the paraphrase index (default ~/.cache/clip4idc/meteor)
PARAPHRASE_INDEX_VERSION = 1


@dataclass
class MeteorResources:
    synsets: dict       # word -> its WordNet synset ids, one space-separated string (english.synsets)
    exceptions: dict    # irregular form -> list of base forms (english.exceptions)
    paraphrase_gz: Path  # paraphrase-en.gz: triples of lines (probability, phrase, paraphrase)
    where: str          # where they were found, for the output


def _find_meteor_files():
    """(jar, paraphrase-en.gz) from $METEOR_DATA, else from an installed pycocoevalcap; None when absent."""
    folders = []
    if os.environ.get(METEOR_DATA_ENV):
        folders.append(Path(os.environ[METEOR_DATA_ENV]))
    else:
        # pycocoevalcap is a namespace package: find_spec locates it without running any of its code.
        spec = importlib.util.find_spec("pycocoevalcap")
        if spec is not None and spec.submodule_search_locations:
            folders += [Path(p) / "meteor" for p in spec.submodule_search_locations]
    for folder in folders:
        jar = folder / "meteor-1.5.jar"
        for gz in (folder / "data" / "paraphrase-en.gz", folder / "paraphrase-en.gz"):
            if jar.is_file() and gz.is_file():
                return jar, gz
    return None


@functools.lru_cache(maxsize=None)
def load_meteor_resources():
    """The synonym tables (read from the jar, a zip archive) and the paraphrase table's path, or None."""
    found = _find_meteor_files()
    if found is None:
        return None
    jar, gz = found
    with zipfile.ZipFile(jar) as archive:
        synset_lines = archive.read("synonym/english.synsets").decode("utf-8").split("\n")
        exception_lines = archive.read("synonym/english.exceptions").decode("utf-8").split("\n")
    # Both files alternate a word line and a data line (SynonymDictionary's constructor).
    synsets = dict(zip(synset_lines[0:-1:2], synset_lines[1::2]))
    exceptions = {}
    for base, forms in zip(exception_lines[0:-1:2], exception_lines[1::2]):
        for form in forms.split():
            exceptions.setdefault(form, []).append(base)
    return MeteorResources(synsets, exceptions, gz, str(jar.parent))


def _checked_modules(modules, resources):
    """The METEOR modules asked for (all four by default), refused unless they are in METEOR_MODULES' order and
    start with "exact", or when synonym or paraphrase matching is asked for without the data."""
    modules = tuple(modules or METEOR_MODULES)
    if list(modules) != [m for m in METEOR_MODULES if m in modules] or "exact" not in modules:
        raise CaptionInputError(f"METEOR modules {modules}: choose, in this order, 'exact' and any of "
                                f"{METEOR_MODULES[1:]}")
    needs_data = [m for m in modules if m in ("synonym", "paraphrase")]
    if needs_data and resources is None:
        raise CaptionInputError(f"METEOR modules {needs_data} need the METEOR 1.5 data: `pip install --no-deps "
                                f"pycocoevalcap==1.2`, or set {METEOR_DATA_ENV} to a folder holding "
                                f"meteor-1.5.jar and paraphrase-en.gz; or ask for modules ('exact', 'stem')")
    return modules


# The paraphrase table: 5.3 million (phrase, paraphrase) pairs over 17,811 words, 272 MB unzipped, in triples of
# lines: probability, phrase, paraphrase (words separated by single spaces). A pair can only ever match when every
# word of both phrases occurs in the corpus being scored, so Meteor keeps only those pairs. Reading them this way
# takes seconds; a run reads the same pairs from an index instead (load_paraphrases, section 5; BENCHMARKS.md
# section 6).
def read_paraphrases(resources, vocabulary):
    """{phrase (tuple of words): [paraphrases in file order]} for the pairs whose words are all in the set
    `vocabulary`."""
    table = {}
    with gzip.open(resources.paraphrase_gz, "rt", encoding="utf-8", newline="\n") as f:
        for _, phrase, paraphrase in zip(f, f, f):                  # the probability is not used
            phrase, paraphrase = tuple(phrase.rstrip("\n").split(" ")), tuple(paraphrase.rstrip("\n").split(" "))
            if vocabulary.issuperset(phrase) and vocabulary.issuperset(paraphrase):
                table.setdefault(phrase, []).append(paraphrase)
    return table


# ---------------------------------------------------------------------------------------------------------------
# 3. The text METEOR reads: the toolkit's input line, then the normaliser
# ---------------------------------------------------------------------------------------------------------------
# Meteor's own normaliser (edu.cmu.meteor.util.Normalizer, English, keeping punctuation), applied to the
# already PTB-tokenized text. Java regex classes: \p{Digit} is [0-9], \p{Lower} is [a-z], \s is [ \t\n\x0b\f\r].
_ALPHA = "A-Za-z\u0160\u017d\u0161\u017e\u0178\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u017e\u0400-\u0527" \
         "\ua640-\ua66e\ua67e-\ua697\u1d00-\u1d7f"
_NORM_RULES = (   # (pattern, replacement), applied in this order with Java's replaceAll semantics
    (rf"([^0-9{_ALPHA}\t\n\x0b\x0c\r .'`,\-\u2018\u2019])", r" \1 "),    # separate other symbols
    (r"\.([.]+)", r" DOTMULTI\1"),                                      # protect runs of periods
)
_NORM_COMMAS = (r"([^0-9])[,]([^0-9])", r"([0-9])[,]([^0-9])", r"([^0-9])[,]([0-9])")
_NORM_CONTRACTIONS = (  # English: split apostrophes (the last two keep it on the following part)
    (rf"([^{_ALPHA}])[']([^{_ALPHA}])", r"\1 ' \2"),
    (rf"([^{_ALPHA}0-9])[']([{_ALPHA}])", r"\1 ' \2"),
    (rf"([{_ALPHA}])[']([^{_ALPHA}])", r"\1 ' \2"),
    (rf"([{_ALPHA}])[']([{_ALPHA}])", r"\1 '\2"),
    (r"([0-9])[']([s])", r"\1 '\2"),
)
_JAVA_WHITESPACE = "".join(chr(c) for c in range(33))          # what Java's String.trim() strips
_JAVA_TOKENS = re.compile(r"[^ \t\n\r\f]+")                    # java.util.StringTokenizer's default delimiters


@functools.lru_cache(maxsize=None)
def _norm_patterns():
    return ([(re.compile(p), r) for p, r in _NORM_RULES], re.compile(r"DOTMULTI\.([^.])"),
            [re.compile(p) for p in _NORM_COMMAS], [(re.compile(p), r) for p, r in _NORM_CONTRACTIONS],
            re.compile(rf"([0-9{_ALPHA}.])[\-]([0-9{_ALPHA}])"), re.compile(rf"[{_ALPHA}]"),
            re.compile(r"[ \u2000-\u200a\u202f\u205f\u3000\u00a0]+"))


def meteor_normalize(line):
    """Normalizer.normalizeLine(line, English, keepPunctuation=true), then lower-cased; returns the words."""
    sep, multi_dot, commas, contractions, dash, has_alpha, white = _norm_patterns()
    s = " " + line + " "
    for rx, rep in sep:
        s = rx.sub(rep, s)
    while "DOTMULTI." in s:
        s = multi_dot.sub(r"DOTDOTMULTI \1", s)
        s = s.replace("DOTMULTI.", "DOTDOTMULTI")
    for rx in commas:
        s = rx.sub(r"\1 , \2", s)
    s = re.sub("[`\u2018\u2019]", "'", s)
    s = re.sub("([\u201c\u201d]|'')", ' " ', s)
    s = s.replace("\u2013", "-").replace("--", "-")
    s = dash.sub(r"\1 \2", s)                   # a hyphen between letters or digits becomes a space
    for rx, rep in contractions:
        s = rx.sub(rep, s)
    words = _JAVA_TOKENS.findall(s)
    out = []
    for i, word in enumerate(words):           # a final period stays only on abbreviations
        if len(word) > 1 and word.endswith("."):
            prefix = word[:-1]
            kind = METEOR_NONBREAKING.get(prefix)
            if "." in prefix and has_alpha.search(prefix):
                out.append(word.replace(".", ""))
            elif kind == 1 or (i < len(words) - 1 and words[i + 1][:1] in "abcdefghijklmnopqrstuvwxyz"
                               and words[i + 1][:1] != ""):
                out.append(word)
            elif kind == 2 and i < len(words) - 1 and words[i + 1][:1] in "0123456789" and words[i + 1][:1]:
                out.append(word)
            else:
                out.append(prefix + " .")
        else:
            out.append(word)
    s = " ".join(out) + " "
    while "DOTDOTMULTI" in s:
        s = s.replace("DOTDOTMULTI", "DOTMULTI.")
    s = s.replace("DOTMULTI", ".")
    s = white.sub(" ", s).strip(_JAVA_WHITESPACE)
    return _JAVA_TOKENS.findall(s.lower())


def _meteor_fields(hypothesis, references):
    """The hypothesis and references Meteor reads from the wrapper's `SCORE ||| ref ||| ... ||| hyp` line."""
    hypothesis = hypothesis.replace("|||", "").replace("  ", " ")        # meteor.py cleans the hypothesis only
    fields = " ||| ".join(("SCORE", " ||| ".join(references), hypothesis)).split("|||")
    while fields and fields[-1] == "":                                  # Java's split drops trailing empties
        fields.pop()
    return fields[-1].strip(_JAVA_WHITESPACE), [f.strip(_JAVA_WHITESPACE) for f in fields[1:-1]]


# ---------------------------------------------------------------------------------------------------------------
# 4. The stemmer
# ---------------------------------------------------------------------------------------------------------------
# The Snowball English ("Porter2") stemmer, org.tartarus.snowball.ext.englishStemmer, written from the
# published algorithm (snowballstem.org/algorithms/english/stemmer.html). R1 is the region after the first
# non-vowel following a vowel, R2 the same within R1; "Y" marks a y that acts as a consonant.
_VOWELS = frozenset("aeiouy")
_DOUBLES = ("bb", "dd", "ff", "gg", "mm", "nn", "pp", "rr", "tt")
_LI_ENDINGS = frozenset("cdeghkmnrt")
_STEM_EXCEPTIONS = {"skis": "ski", "skies": "sky", "dying": "die", "lying": "lie", "tying": "tie", "idly": "idl",
                    "gently": "gentl", "ugly": "ugli", "early": "earli", "only": "onli", "singly": "singl",
                    "sky": "sky", "news": "news", "howe": "howe", "atlas": "atlas", "cosmos": "cosmos",
                    "bias": "bias", "andes": "andes"}
_STEM_INVARIANT_AFTER_1A = frozenset(["inning", "outing", "canning", "herring", "earring",
                                      "proceed", "exceed", "succeed"])
_STEP2 = (("ization", "ize"), ("ational", "ate"), ("fulness", "ful"), ("ousness", "ous"), ("iveness", "ive"),
          ("tional", "tion"), ("biliti", "ble"), ("lessli", "less"), ("entli", "ent"), ("ation", "ate"),
          ("alism", "al"), ("aliti", "al"), ("ousli", "ous"), ("iviti", "ive"), ("fulli", "ful"), ("enci", "ence"),
          ("anci", "ance"), ("abli", "able"), ("izer", "ize"), ("ator", "ate"), ("alli", "al"), ("bli", "ble"),
          ("ogi", "og"), ("li", ""))
_STEP3 = (("ational", "ate"), ("tional", "tion"), ("alize", "al"), ("icate", "ic"), ("iciti", "ic"),
          ("ative", ""), ("ical", "ic"), ("ness", ""), ("ful", ""))
_STEP4 = ("ement", "ance", "ence", "able", "ible", "ment", "ant", "ent", "ism", "ate", "iti", "ous", "ive", "ize",
          "ion", "al", "er", "ic")


def _ends_short_syllable(w):
    """A vowel between non-vowels (the last not w, x or Y), or a word of a vowel then a non-vowel."""
    if len(w) >= 3:
        return w[-3] not in _VOWELS and w[-2] in _VOWELS and w[-1] not in _VOWELS and w[-1] not in "wxY"
    return len(w) == 2 and w[0] in _VOWELS and w[1] not in _VOWELS


def snowball_stem(word):
    """The English Snowball stem of a lower-case word: snowball_stem("generously") == "generous"."""
    if word in _STEM_EXCEPTIONS:
        return _STEM_EXCEPTIONS[word]
    if len(word) < 3:
        return word
    w = word[1:] if word.startswith("'") else word
    w = list(w)
    for i, ch in enumerate(w):                  # y at the start or after a vowel is a consonant: Y
        if ch == "y" and (i == 0 or w[i - 1] in _VOWELS):
            w[i] = "Y"
    w = "".join(w)
    p1 = p2 = len(w)
    prefix = next((p for p in ("gener", "commun", "arsen") if w.startswith(p)), None)
    i = len(prefix) if prefix else None
    if i is None:
        i = next((k + 1 for k in range(1, len(w)) if w[k] not in _VOWELS and w[k - 1] in _VOWELS), None)
    if i is not None:
        p1 = i
        p2 = next((k + 1 for k in range(p1 + 1, len(w)) if w[k] not in _VOWELS and w[k - 1] in _VOWELS), len(w))

    # Step 0 and 1a: apostrophes, then plurals.
    for suffix in ("'s'", "'s", "'"):
        if w.endswith(suffix):
            w = w[:-len(suffix)]
            break
    if w.endswith("sses"):
        w = w[:-2]
    elif w.endswith("ied") or w.endswith("ies"):
        w = w[:-2] if len(w) > 4 else w[:-1]
    elif w.endswith("us") or w.endswith("ss"):
        pass
    elif w.endswith("s"):
        if any(ch in _VOWELS for ch in w[:-2]):
            w = w[:-1]
    if w in _STEM_INVARIANT_AFTER_1A:
        return w.replace("Y", "y")

    # Step 1b: -eed, -ed, -ing.
    for suffix in ("eedly", "ingly", "edly", "eed", "ing", "ed"):
        if w.endswith(suffix):
            stem = w[:-len(suffix)]
            if suffix in ("eed", "eedly"):
                if len(stem) >= p1:
                    w = stem + "ee"
            elif any(ch in _VOWELS for ch in stem):
                w = stem
                if w.endswith(("at", "bl", "iz")):
                    w += "e"
                elif w.endswith(_DOUBLES):
                    w = w[:-1]
                elif p1 == len(w) and _ends_short_syllable(w):
                    w += "e"
            break

    # Step 1c: final y after a non-vowel (not the first letter) becomes i.
    if len(w) > 2 and w[-1] in "yY" and w[-2] not in _VOWELS:
        w = w[:-1] + "i"

    # Steps 2 and 3: the longest matching suffix, replaced when it lies in R1.
    for table in (_STEP2, _STEP3):
        for suffix, replacement in table:
            if w.endswith(suffix):
                start = len(w) - len(suffix)
                if start >= p1:
                    if suffix == "ogi" and not w[:start].endswith("l"):
                        pass
                    elif suffix == "li" and not (start > 0 and w[start - 1] in _LI_ENDINGS):
                        pass
                    elif suffix == "ative" and start < p2:
                        pass
                    else:
                        w = w[:start] + replacement
                break

    # Step 4: the longest matching suffix, deleted when it lies in R2 (-ion only after s or t).
    for suffix in _STEP4:
        if w.endswith(suffix):
            start = len(w) - len(suffix)
            if start >= p2 and (suffix != "ion" or (start > 0 and w[start - 1] in "st")):
                w = w[:start]
            break

    # Step 5: final e (in R2, or in R1 after no short syllable) and the second l of -ll in R2.
    if w.endswith("e"):
        start = len(w) - 1
        if start >= p2 or (start >= p1 and not _ends_short_syllable(w[:start])):
            w = w[:start]
    elif w.endswith("l"):
        start = len(w) - 1
        if start >= p2 and w[:start].endswith("l"):
            w = w[:start]
    return w.replace("Y", "y")


# ---------------------------------------------------------------------------------------------------------------
# 5. Speed variants: the same numbers, faster. Each says what it stands in for and what it buys, and a test checks
#    that it gives exactly what the plain code gives.
# ---------------------------------------------------------------------------------------------------------------
# 5.1 The paraphrase index, for read_paraphrases (section 2). Unzipping the table alone takes seconds, so it is turned
# once into a word-id index cached on disk. The index files each pair under its rarest word: a run reads only the
# pairs filed under its own vocabulary, then keeps those whose words it all has. What it buys of the whole scoring
# process: BENCHMARKS.md section 6 (`python bench.py metrics`).
def _paraphrase_cache_dir(gz):
    with open(gz, "rb") as f:
        head = f.read(1 << 16)
        f.seek(max(0, gz.stat().st_size - (1 << 16)))
        tail = f.read()
    fingerprint = f"{gz.stat().st_size}-{zlib.crc32(head + tail):08x}"
    root = os.environ.get(METEOR_CACHE_ENV) or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clip4idc" / "meteor"
    return Path(root) / f"paraphrase-en-v{PARAPHRASE_INDEX_VERSION}-{fingerprint}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or a system that cannot tell
        return True
    return True


def _build_paraphrase_index(gz, out):
    """Parse paraphrase-en.gz into numpy arrays: entries sorted by (rarest word, file position)."""
    vocab, lengths, ids = {}, ([], []), ([], [])        # per side: phrase (0) and paraphrase (1)
    with gzip.open(gz, "rb") as f:
        leftover = []
        while True:                                      # about 32 MB of text at a time, whole triples of lines
            lines = leftover + f.readlines(1 << 25)
            if len(lines) == len(leftover):
                break
            whole = len(lines) - len(lines) % 3
            lines, leftover = lines[:whole], lines[whole:]
            for side in (0, 1):
                phrases = lines[1 + side::3]             # each still ends in "\n"
                lengths[side].append(np.fromiter((p.count(b" ") + 1 for p in phrases), np.int32, len(phrases)))
                words = b"".join(phrases).replace(b"\n", b" ").split(b" ")[:-1]
                for word in dict.fromkeys(words):
                    vocab.setdefault(word, len(vocab))
                ids[side].append(np.fromiter(map(vocab.__getitem__, words), np.int32, len(words)))
    assert len(vocab) < 1 << 16, "word ids are stored as uint16"
    n_src, n_tgt = np.concatenate(lengths[0]), np.concatenate(lengths[1])
    src_ids, tgt_ids = np.concatenate(ids[0]), np.concatenate(ids[1])
    del lengths, ids
    # Each entry's words, phrase then paraphrase, in one flat array.
    sizes = n_src + n_tgt
    starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    words = np.empty(starts[-1], np.int32)
    for side_ids, n, first in ((src_ids, n_src, starts[:-1]), (tgt_ids, n_tgt, starts[:-1] + n_src)):
        side_starts = np.concatenate(([0], np.cumsum(n, dtype=np.int64)))[:-1]
        words[np.repeat(first - side_starts, n) + np.arange(len(side_ids))] = side_ids
    del src_ids, tgt_ids
    # The key of an entry: its rarest word (frequency * V + id, so the minimum also names the word).
    frequency = np.bincount(words, minlength=len(vocab)).astype(np.int64)
    key = np.minimum.reduceat(frequency[words] * len(vocab) + words, starts[:-1]) % len(vocab)
    order = np.argsort(key, kind="stable")          # stable: file order within a key
    new_sizes = sizes[order]
    new_starts = np.concatenate(([0], np.cumsum(new_sizes, dtype=np.int64)))
    gather = np.repeat(starts[:-1][order] - new_starts[:-1], new_sizes) + np.arange(new_starts[-1])
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    for stale in out.parent.glob(out.name + ".tmp*"):  # the folders of killed builds: their process runs no more
        pid = stale.name.rpartition(".tmp")[2]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        np.save(tmp / "words.npy", words[gather].astype(np.uint16))
        np.save(tmp / "starts.npy", new_starts)
        np.save(tmp / "entry.npy", order.astype(np.int32))             # position in the file: the Java trie's order
        np.save(tmp / "n_src.npy", n_src[order].astype(np.uint8))
        np.save(tmp / "key_starts.npy", np.searchsorted(key[order], np.arange(len(vocab) + 1)))
        (tmp / "vocab.txt").write_bytes(b"\n".join(vocab))
    except BaseException:                         # a full disk, an interrupt: no half-written index left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, out)                      # atomic: a concurrent run sees the whole index or none of it
    except OSError:                               # another process finished first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def load_paraphrases(resources, vocabulary):
    """{phrase (tuple of words): [paraphrases in file order]} for the pairs whose words are all in `vocabulary`."""
    out = _paraphrase_cache_dir(resources.paraphrase_gz)
    if (out / "vocab.txt").is_file():
        return _read_paraphrase_index(out, vocabulary)
    print(f"metrics.py: building the METEOR paraphrase index in {out} (once, 15-40 s)", file=sys.stderr)
    try:
        _build_paraphrase_index(resources.paraphrase_gz, out)
    except OSError as error:  # an unwritable or full cache folder: the same index, built for this run only
        print(f"metrics.py: note: cannot keep the METEOR paraphrase index in {out} ({error.strerror or error}); "
              f"built for this run only (set {METEOR_CACHE_ENV} or XDG_CACHE_HOME to a writable folder to keep it)",
              file=sys.stderr)
        with tempfile.TemporaryDirectory() as folder:
            _build_paraphrase_index(resources.paraphrase_gz, Path(folder) / out.name)
            return _read_paraphrase_index(Path(folder) / out.name, vocabulary)
    return _read_paraphrase_index(out, vocabulary)


def _read_paraphrase_index(out, vocabulary):
    """load_paraphrases' table, from the index in the folder out."""
    vocab = (out / "vocab.txt").read_bytes().decode("utf-8").split("\n")
    word_id = {word: i for i, word in enumerate(vocab)}
    ids = np.array(sorted(word_id[w] for w in vocabulary if w in word_id), np.int64)
    key_starts = np.load(out / "key_starts.npy")
    starts = np.load(out / "starts.npy", mmap_mode="r")
    words = np.load(out / "words.npy", mmap_mode="r")
    lo, hi = key_starts[ids], key_starts[ids + 1]
    entries = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)] or [np.zeros(0, np.int64)])
    if len(entries) == 0:
        return {}
    known = np.zeros(len(vocab), bool)
    known[ids] = True
    first, last = np.asarray(starts[entries]), np.asarray(starts[entries + 1])
    flat = np.repeat(first - np.concatenate(([0], np.cumsum(last - first)))[:-1], last - first)
    flat += np.arange(len(flat))
    entry_words = np.asarray(words[flat]).astype(np.int64)
    keep = np.logical_and.reduceat(known[entry_words], np.concatenate(([0], np.cumsum(last - first)))[:-1])
    positions = np.load(out / "entry.npy", mmap_mode="r")[entries[keep]]
    n_src = np.load(out / "n_src.npy", mmap_mode="r")[entries[keep]]
    bounds = np.concatenate(([0], np.cumsum(last - first)))
    table = {}
    for (entry_pos, split, a, b) in sorted(zip(positions.tolist(), n_src.tolist(), bounds[:-1][keep].tolist(),
                                               bounds[1:][keep].tolist())):
        phrase = [vocab[i] for i in entry_words[a:b].tolist()]
        table.setdefault(tuple(phrase[:split]), []).append(tuple(phrase[split:]))
    return table


# 5.2 Many items at once, for Meteor.item_stats_many (section 1). The beam search of Meteor._resolve, one alignment
# at a time in Python, is about half of METEOR's time. FastMeteor.item_stats_many collects the alignments of many
# items that need a search (each distinct one once) and runs that same search on all of them together with numpy,
# step for step, so that every tie is broken the same way. What it buys of the whole scoring process: BENCHMARKS.md
# section 6 (`python bench.py metrics`).
# Its sentences (_FastSentence) are built from per-word records, computed once per word, and hold each phrase's
# paraphrases grouped by first word as lists made once per phrase (a pair's paraphrase matches then need no set),
# the longer phrases found down a trie of the table's phrases.
_PLAIN_LINE = re.compile(r"[a-z0-9 ]*")     # lower-case words and spaces: no normaliser rule changes them


class _FastSentence(_MeteorSentence):
    """_MeteorSentence built from per-word records (FastMeteor._word_record). Its paths hold each phrase's
    paraphrases as FastMeteor._by_first lists them, found by walking the table's phrases as a trie
    (FastMeteor._trie), one word at a time, as ParaphraseTransducer does."""
    __slots__ = ()

    def __init__(self, words, meteor):
        records = meteor._records
        rows = [records.get(word) or meteor._word_record(word) for word in words]
        self.words = words = tuple(words)
        self.positions = _positions(words)
        functional, stems, synonyms, paths, nodes = zip(*rows) if rows else ((),) * 5
        self.functional, self.stems, self.synonyms = functional, stems, synonyms
        self.stem_positions = self.paths = None
        if "stem" in meteor.modules:
            self.stem_positions = _positions(stems)
        else:
            self.stems = None
        if "synonym" not in meteor.modules:
            self.synonyms = None
        if "paraphrase" in meteor.modules:
            self.paths = list(paths)
            for i, node in enumerate(nodes):              # as _MeteorSentence: longer phrases too, down the trie
                if node is not None and node[1]:
                    self.paths[i] = grown = list(paths[i])
                    for n in range(2, len(words) - i + 1):
                        node = node[1].get(words[i + n - 1])
                        if node is None:
                            break
                        if node[0]:
                            grown.append((n, node[0]))

    def paraphrase_matches(self, other):
        """_MeteorSentence.paraphrase_matches: the same list."""
        found, other_words, other_positions = [], other.words, other.positions
        for i, paths in enumerate(self.paths):
            for n, firsts in paths:
                for first, options in firsts:
                    if first in other_positions:
                        for rank, target, m in options:
                            for j in other_positions[first]:
                                if m == 1 or other_words[j:j + m] == target:
                                    found.append((i, n, rank, j, m))
        found.sort()
        return found


class FastMeteor(Meteor):
    """Meteor with every speed variant of this section in place of the plain step it stands in for."""
    read_paraphrases = staticmethod(load_paraphrases)
    sentence_type = _FastSentence

    def words(self, text):
        """Meteor.words, with a shortcut for lines of lower-case letters, digits and spaces (most PTB-tokenized
        captions): no rule of the normaliser changes them, so their words are the line split on spaces. What it
        buys: BENCHMARKS.md section 6 (`python bench.py metrics`)."""
        if text not in self._words and _PLAIN_LINE.fullmatch(text):
            self._words[text] = text.split()
        return super().words(text)

    def __init__(self, config=None, modules=None, resources=None):
        super().__init__(config, modules, resources)
        self._records = {}              # word -> (functional, stem, synonyms, paths, trie node): see _word_record
        self._firsts = {}               # phrase -> its paraphrases by first word: see _by_first
        self._trie = {}                 # word -> [paraphrases by first word, {next word -> node}]: see prepare

    def prepare(self, texts):
        known = len(self.vocabulary)
        super().prepare(texts)
        if len(self.vocabulary) != known:
            self._records.clear()       # paraphrase paths may grow
            self._firsts.clear()
            self._trie = {}             # every phrase of the table read, word by word
            for phrase in self.paraphrase_index:
                children = self._trie
                for word in phrase:
                    node = children.setdefault(word, [[], {}])
                    children = node[1]
                node[0] = self._by_first(phrase)

    def forget(self):
        super().forget()
        self._records, self._firsts, self._trie = {}, {}, {}

    def _by_first(self, phrase):
        """The phrase's paraphrases, [(first word, [(rank, paraphrase, its length)])], in paraphrase_index's
        order; [] when it has none."""
        if phrase not in self._firsts:
            self._firsts[phrase] = [(first, [(rank, target, len(target)) for rank, target in targets])
                                    for first, targets in self.paraphrase_index.get(phrase, {}).items()]
        return self._firsts[phrase]

    def _word_record(self, word):
        """What _MeteorSentence computes of one word, computed once per word."""
        node = self._trie.get(word)
        paths = [(1, node[0])] if node is not None and node[0] else []
        self._records[word] = record = (word in METEOR_FUNCTION_WORDS, self.stem(word) if "stem" in self.modules
                                        else None, self.synonyms(word) if "synonym" in self.modules else None,
                                        paths, node)
        return record

    def item_stats_many(self, items):
        """item_stats for many (hypothesis, references) at once: the alignments that need a search are solved
        together by _resolve_batch (same result as _resolve, much faster)."""
        fields = self.prepare_items(items)
        pending, problems = {}, {}
        for hypothesis, references in fields:
            hyp = self.sentence(hypothesis)
            for reference in references:
                key = (hypothesis, reference)             # texts: their hashes are kept, a tuple's are not
                if key in self._pairs or key in pending:
                    continue
                ref = self.sentence(reference)
                cands, cover1, cover2 = self._candidates(hyp, ref)
                fixed, used1, used2, open_choice = _fixed_matches(cands, cover1, cover2)
                if not open_choice:
                    self._pairs[key] = self._stats(hyp, ref, fixed)
                    continue
                structure = (len(ref.words), tuple(map(tuple, cands)))
                if structure in self._structures:
                    self._pairs[key] = self._stats(hyp, ref, self._structures[structure])
                elif len(hyp.words) > 64 or len(ref.words) > 64:    # beyond 64-bit word masks
                    self._pairs[key] = self._stats(hyp, ref, self._resolve(cands, cover1, cover2, len(ref.words)))
                else:
                    pending[key] = (hyp, ref, structure)
                    problems.setdefault(structure, (cands, fixed, used1, used2))
        solved = dict(zip(problems, self._resolve_batch(list(problems.values())))) if problems else {}
        self._structures.update(solved)
        for key, (hyp, ref, structure) in pending.items():
            self._pairs[key] = self._stats(hyp, ref, solved[structure])
        out, scores = [], {}
        for hypothesis, references in fields:           # the best single reference, the first on a tie
            best, best_score = None, -1.0
            for reference in references:
                stats = self._pairs[(hypothesis, reference)]
                if stats not in scores:
                    scores[stats] = self.score(stats)
                if scores[stats] > best_score:
                    best, best_score = stats, scores[stats]
            out.append(best)
        return out

    def _resolve_batch(self, problems, batch_size=1 << 15):
        """_resolve for many alignments at once, identical results: the same beam search, one reference position
        at a time, with every partial alignment of every problem a row of numpy arrays. Words <= 64 a side.

        problems: [(cands, fixed, used1, used2)]. Returns the chosen matches of each, by reference start.
        """
        out = []
        for first in range(0, len(problems), batch_size):
            out.extend(self._resolve_some(problems[first:first + batch_size]))
        return out

    def _resolve_some(self, problems):
        beam, weights = self.config.beam, self.search_weights
        # Number problems by decreasing reference length: those that finish first are then the last rows.
        by_length = sorted(range(len(problems)), key=lambda p: -len(problems[p][0]))
        problems = [problems[p] for p in by_length]
        n_ref = np.array([len(cands) for cands, _, _, _ in problems], np.int64)
        base = np.concatenate(([0], np.cumsum(n_ref)))                   # (problem, position) -> base[p] + i
        # Every position's candidate options in one table (a fixed position's are never read: its word is used).
        options = list(itertools.chain.from_iterable(itertools.chain.from_iterable(c for c, _, _, _ in problems)))
        bounds = np.cumsum([0] + [len(matches) for cands, _, _, _ in problems for matches in cands])
        opt_lo, opt_hi = bounds[:-1], bounds[1:]
        fixed_at = np.zeros((base[-1], 5), np.int64)                     # ref end, hyp start, hyp end, key step, has
        fixed_flat = [int(base[p]) + i for p, (_, fixed, _, _) in enumerate(problems) for i in fixed]
        fixed_rows = [(start + length, m_start, m_start + m_length, self._key_step(match, weights)
                       + abs(start - m_start), 1) for _, fixed, _, _ in problems
                      for match in fixed.values() for start, length, m_start, m_length, _ in [match]]
        if fixed_flat:
            fixed_at[fixed_flat] = np.array(fixed_rows, np.int64)
        o = np.array(options, np.int64).reshape(-1, 5)                   # start, length, m_start, m_length, stage
        o_mask1 = (((np.uint64(1) << o[:, 3].astype(np.uint64)) - np.uint64(1)) << o[:, 2].astype(np.uint64))
        o_mask2 = (((np.uint64(1) << o[:, 1].astype(np.uint64)) - np.uint64(1)) << o[:, 0].astype(np.uint64))
        o_mask1, o_mask2 = o_mask1.view(np.int64), o_mask2.view(np.int64)
        stage_weight = np.array(weights)[o[:, 4]]                         # Java: int += length * weight
        o_step = -(np.floor(o[:, 3] * stage_weight) + np.floor(o[:, 1] * stage_weight)).astype(np.int64) << 32
        o_dist = np.abs(o[:, 0] - o[:, 2])
        # A row per partial alignment: the sort key packs (problem, -(matches1 + matches2) + 128, chunks,
        # distance) into one int64 whose fields are updated by addition; then the reference end of its last match,
        # the hypothesis end of its last match (-1 after a skip), the used-word masks (raw 64-bit patterns) and
        # its entry in the history of choices. Rows of a problem stay together, in _resolve's list order.
        KEY, REF_END, LAST, U1, U2, HIST = range(6)
        rows = np.zeros((len(problems), 6), np.int64)
        rows[:, KEY] = (np.arange(len(problems)) << 40) | (128 << 32)
        rows[:, LAST] = rows[:, HIST] = -1
        rows[:, U1] = np.array([u1 for _, _, u1, _ in problems], np.uint64).view(np.int64)
        rows[:, U2] = np.array([u2 for _, _, _, u2 in problems], np.uint64).view(np.int64)
        history_parent, history_option, n_history = [], [], 0
        best_hist = np.full(len(problems), -1, np.int64)
        for current in range(int(n_ref.max()) + 1):
            # Sort (stable) by the key; keep the first `beam` rows of each problem.
            assert (rows[:, KEY] & ((1 << 24) - 1)).max(initial=0) < (1 << 24) - 4096, "distance field overflow"
            order = np.argsort(rows[:, KEY], kind="stable")
            prob = rows[order, KEY] >> 40
            first = np.flatnonzero(np.r_[True, prob[1:] != prob[:-1]])
            rank = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
            rows = rows.take(order[rank < beam], axis=0)
            # Problems whose reference ends here (the last rows): close the last chunk, take the first best path.
            n_done = int(np.count_nonzero(n_ref[rows[:, KEY] >> 40] == current))
            if n_done:
                done, rows = rows[len(rows) - n_done:], rows[:len(rows) - n_done]
                final = done[:, KEY] + ((done[:, LAST] != -1).astype(np.int64) << 24)
                order = np.argsort(final, kind="stable")
                prob = final[order] >> 40
                firsts = order[np.r_[True, prob[1:] != prob[:-1]]]
                best_hist[done[firsts, KEY] >> 40] = done[firsts, HIST]
            if len(rows) == 0:
                break
            flat = base[rows[:, KEY] >> 40] + current
            used = (rows[:, U2] >> current) & 1 == 1
            at_fixed = used & (current >= rows[:, REF_END])          # a fixed match starts here
            assert fixed_at[flat[at_fixed], 4].all(), "a used word outside any match"
            free = ~used                                              # (used rows not at_fixed are inside a match)
            # Candidate options of the free rows, each checked against the row's used words.
            count = np.where(free, opt_hi[flat] - opt_lo[flat], 0)
            parent = np.repeat(np.arange(len(flat)), count)
            option = np.repeat(opt_lo[flat] - np.cumsum(count) + count, count) + np.arange(count.sum())
            valid = ((rows[parent, U1] & o_mask1[option]) == 0) & ((rows[parent, U2] & o_mask2[option]) == 0)
            # Java adds each tried option's distance to the extended path: a child inherits the distances of the
            # valid options before it, the skip path all of them (see _resolve).
            tried = np.where(valid, o_dist[option], 0)
            per_row = np.bincount(parent, weights=tried, minlength=len(flat)).astype(np.int64)
            before = np.cumsum(tried) - tried - np.repeat(np.cumsum(per_row) - per_row, count)
            n_valid = np.bincount(parent, weights=valid, minlength=len(flat)).astype(np.int64)
            out_count = np.where(free, n_valid + 1, 1)
            out_start = np.cumsum(out_count) - out_count
            new = np.empty((out_count.sum(), 6), np.int64)
            # Used rows carry on (inside a match) or take the fixed match; free rows end with their skip path. Each
            # block is a copy of its rows, changed column by column, then put in its place in `new` at once.
            inside = used & ~at_fixed
            new[out_start[inside]] = rows[inside]
            r, fx = rows[at_fixed], fixed_at[flat[at_fixed]]
            r[:, KEY] += fx[:, 3] + (((r[:, LAST] != -1) & (fx[:, 1] != r[:, LAST])).astype(np.int64) << 24)
            r[:, REF_END], r[:, LAST] = fx[:, 0], fx[:, 2]
            new[out_start[at_fixed]] = r
            r = rows[free]
            r[:, KEY] += ((r[:, LAST] != -1).astype(np.int64) << 24) + per_row[free]
            r[:, LAST] = -1
            new[out_start[free] + n_valid[free]] = r
            # Children: one per valid option, in option order, before the skip path.
            parent, option, before = parent[valid], option[valid], before[valid]
            at = out_start[parent] + np.arange(len(parent)) - np.repeat(np.cumsum(n_valid) - n_valid, n_valid)
            r, op = rows.take(parent, axis=0), o.take(option, axis=0)
            history_parent.append(r[:, HIST].copy())
            r[:, KEY] += o_step[option] + before + (((r[:, LAST] != -1) & (op[:, 2] != r[:, LAST]))
                                                    .astype(np.int64) << 24)
            r[:, REF_END], r[:, LAST] = op[:, 0] + op[:, 1], op[:, 2] + op[:, 3]
            r[:, U1] |= o_mask1[option]
            r[:, U2] |= o_mask2[option]
            r[:, HIST] = np.arange(n_history, n_history + len(parent))
            new[at] = r
            history_option.append(option)
            n_history += len(parent)
            rows = new
        # Follow each problem's best path back through the matches it chose.
        history_parent = np.concatenate(history_parent or [np.zeros(0, np.int64)])
        history_option = np.concatenate(history_option or [np.zeros(0, np.int64)])
        chosen = [dict(fixed) for _, fixed, _, _ in problems]
        link, problem = best_hist, np.arange(len(problems))
        while len(link):
            keep = link != -1
            link, problem = link[keep], problem[keep]
            for p, k in zip(problem.tolist(), history_option[link].tolist()):
                chosen[p][options[k][0]] = options[k]
            link = history_parent[link]
        out = [None] * len(problems)
        for p, original in enumerate(by_length):
            out[original] = chosen[p]
        return out

    @staticmethod
    def _key_step(match, weights):
        """What taking a match adds to the packed key: -(matches1 + matches2) in bits 32-39. Java's int matches1
        += length * weight adds exactly floor(length * weight) to an integer."""
        _, length, _, m_length, stage = match
        return -(math.floor(m_length * weights[stage]) + math.floor(length * weights[stage])) << 32


# 5.3 The garbage collector paused, for scoring with it running: around all of metrics.py's scoring (its
# FastCaptionScorer and command line), where METEOR's tuples are most of what it would scan. What it buys of the
# whole scoring process: BENCHMARKS.md section 6 (`python bench.py metrics`).
@contextlib.contextmanager
def collector_paused():
    """Scoring allocates millions of small tuples and dicts and leaves no reference cycles. Python's cyclic garbage
    collector would scan them again and again, so it is paused meanwhile. Its first pass after the pause still
    scans all the survivors once: metrics.py's
    FastCaptionScorer and command line therefore hold one pause around all their steps (an inner pause changes
    nothing)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


if __name__ == "__main__":
    hypothesis, reference = "a red metal cube has been added", "someone added a red shiny cube"
    resources = load_meteor_resources()
    meteor = Meteor(modules=None if resources is not None else ("exact", "stem"), resources=resources)
    stats = meteor.item_stats(hypothesis, [reference])
    print(f"hypothesis: {hypothesis!r}\nreference:  {reference!r}\nmodules:    {'+'.join(meteor.modules)}")
    print(f"matched words {stats.hyp_matched} of {stats.hyp_len} and {stats.ref_matched} of {stats.ref_len}, in "
          f"{stats.chunks} chunks: METEOR {meteor.score(stats):.4f}")
