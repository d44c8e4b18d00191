"""METEOR 1.5, as the coco-caption toolkit runs it, in plain Python: the same numbers as the Java jar, to the bit.

METEOR (Metric for Evaluation of Translation with Explicit ORdering: Banerjee and Lavie 2005; version 1.5, Denkowski
and Lavie 2014) aligns a candidate caption (the hypothesis) with each reference word by word: first identical words,
then words with the same stem, then WordNet synonyms, then phrases the paraphrase table lists as equivalent. The
alignment with the most matches and the fewest chunks (runs of neighbouring matched words) gives precision, recall,
their harmonic mean weighted towards recall, and a penalty for fragmentation. pycocoevalcap runs it as
`java -jar meteor-1.5.jar - - -stdio -l en -norm` (English, normalised); this file computes the same. The lesson
comes first, in one stretch; what it leans on comes after it, and its speed variants live in scoring/fast.py:

    1. METEOR's score  the statistics an alignment leaves (MeteorStats); the four matching stages; the alignment
                       (Aligner's beam search over reference positions); precision, recall, Fmean and the
                       fragmentation penalty; per item the best single reference, a corpus from summed statistics
    2. resources       the word lists, the synonym tables and the paraphrase table of the METEOR 1.5 release
    3. the text        the toolkit's input line, then edu.cmu.meteor.util.Normalizer (English, punctuation kept),
                       after the Penn Treebank (PTB) tokenizer (scoring/ptb.py)
    4. the stemmer     Snowball English ("Porter2")

METEOR's synonym (WordNet) and paraphrase resources are data files of the METEOR 1.5 release. They are read with
the standard library from the jar (a zip archive) and `data/paraphrase-en.gz` of an installed pycocoevalcap
package, or from the folder named by METEOR_DATA. Without them METEOR runs with exact + stem matching only.
The Java names cited below (Aligner, MeteorScorer, MeteorStats, SynonymDictionary, ...) are classes of the
jar's edu.cmu.meteor packages.

Differences from the toolkit (each is marked `# differs from reference:` below):
  - METEOR compares words as strings, where Java compares String.hashCode values (a collision would count as a match).

metrics.py runs this inside its scorer, after the PTB tokenizer (scoring/ptb.py); this file imports nothing of the
project.

Run:   python -m scoring.meteor        # demo: one candidate aligned with one reference, and its score
"""
import functools
import gzip
import importlib.util
import math
import operator
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


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
            self._sentences[text] = _MeteorSentence(self.words(text), self)
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
# takes seconds; a run reads the same pairs from an index instead (fast.load_paraphrases; BENCHMARKS.md
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


if __name__ == "__main__":
    hypothesis, reference = "a red metal cube has been added", "someone added a red shiny cube"
    resources = load_meteor_resources()
    meteor = Meteor(modules=None if resources is not None else ("exact", "stem"), resources=resources)
    stats = meteor.item_stats(hypothesis, [reference])
    print(f"hypothesis: {hypothesis!r}\nreference:  {reference!r}\nmodules:    {'+'.join(meteor.modules)}")
    print(f"matched words {stats.hyp_matched} of {stats.hyp_len} and {stats.ref_matched} of {stats.ref_len}, in "
          f"{stats.chunks} chunks: METEOR {meteor.score(stats):.4f}")
