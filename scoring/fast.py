"""Speed variants of the scorer: the same numbers as scoring/meteor.py and metrics.py, faster.

Each stands in for a plain step of the lesson, says what it buys of the whole scoring process (BENCHMARKS.md
section 6, `python -m bench metrics`: with and without it, beside the Java toolkit), and a test checks that it gives
exactly what the plain code gives. metrics.FastCaptionScorer is the one place that selects them; the training
scripts score with it (caption.SCORER). It holds, top to bottom:

    1. the paraphrase index: METEOR's paraphrase table turned once into a word-id index cached on disk, for
       meteor.read_paraphrases;
    2. FastMeteor: many items at once, every pair's steps as numpy arrays over word ids, and a batched beam search;
    3. the garbage collector paused around scoring;
    4. MeteorWorker: METEOR's items shared with a forked process while this one computes BLEU and ROUGE-L;
    5. ROUGE-L's longest common subsequence, bit-parallel;
    6. NgramTable: BLEU's statistics and CIDEr-D of every item (or any subset) at once, from numbered n-grams.

This file imports scoring/meteor.py alone.
"""
import concurrent.futures
import contextlib
import gc
import gzip
import itertools
import math
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from scoring.meteor import METEOR_CACHE_ENV, METEOR_FUNCTION_WORDS, PARAPHRASE_INDEX_VERSION, Meteor, MeteorStats

# 1. The paraphrase index, for meteor.read_paraphrases. Unzipping the table alone takes seconds, so it is turned
# once into a word-id index cached on disk. The index files each pair under its rarest word: a run reads only the
# pairs filed under its own vocabulary, then keeps those whose words it all has. What it buys of the whole scoring
# process: BENCHMARKS.md section 6 (`python -m bench metrics`).
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


# 2. Many items at once, for meteor.Meteor.item_stats_many. Meteor scores each (hypothesis, reference) pair in
# Python, word by word and match by match. FastMeteor.item_stats_many takes each of its steps for all the pairs of
# many items at once, with numpy over word ids, and gives that step's exact numbers: each pair's candidate matches
# in the order Meteor._candidates lists them and their coverage, the fixed matches (_fixed_matches), the statistics
# (Meteor._stats), the scores (Meteor.score) and each item's best reference. The alignments left with an open
# choice go to the beam search, each distinct one once, and that search too runs on all of them together
# (_resolve_batch), step for step, so that every tie is broken the same way. What it buys of the whole scoring
# process: BENCHMARKS.md section 6 (`python -m bench metrics`).
# Shape letters: V words of the run's vocabulary, S distinct sentences of one call, T their words one after the
# other, P distinct (hypothesis, reference) pairs, Q the pairs' reference positions, C candidate matches, M the
# chosen matches, K the stages (Meteor.modules).
_PLAIN_LINE = re.compile(r"[a-z0-9 ]*")     # lower-case words and spaces: no normaliser rule changes them
_WORD_MASK_BITS = 64                        # _resolve_batch's used-word masks: a word a bit
_DENSE_KEYS = 1 << 22                       # the vocabulary's trie is an array up to this many (node, word) keys


class _Vocabulary(NamedTuple):
    """The run's words as ids, and what each matching stage needs of them as arrays (FastMeteor._vocabulary)."""
    ids: dict                   # word -> id, 0..V-1
    functional: np.ndarray      # (V,) bool: in METEOR_FUNCTION_WORDS
    stem: np.ndarray            # (V,) the id of the word's Snowball stem
    stem_shared: np.ndarray     # (V,) bool: another word of the vocabulary has the same stem
    synonym_lo: np.ndarray      # (V,) where the word's synonyms (Meteor.synonyms) start in `synonym`
    synonym_count: np.ndarray   # (V,)
    synonym: np.ndarray         # the synonyms' word ids, word after word
    edges: "_Index"             # the paraphrase table's phrases as a trie: parent node * V + word -> child node
    node_phrase: np.ndarray     # per trie node, the phrase that ends there, or -1
    phrase_length: np.ndarray   # (phrases,) words of each phrase: the table's phrases and paraphrases
    target_lo: np.ndarray       # (phrases,) where the phrase's paraphrases start in `target`: its rank-th is
    target_count: np.ndarray    # target[target_lo + rank], in the table's order
    target: np.ndarray          # the paraphrases' phrase ids


class _Sentences(NamedTuple):
    """The distinct sentences of one call, their words one after the other."""
    word: np.ndarray            # (T,) word ids
    lo: np.ndarray              # (S,) where each sentence starts in `word`
    length: np.ndarray          # (S,)
    of: np.ndarray              # (T,) the sentence of each word


class _Matches(NamedTuple):
    """Matches of many pairs, one entry each: Meteor's tuple (start, length, m_start, m_length, stage) and its pair."""
    pair: np.ndarray
    start: np.ndarray           # first reference word
    length: np.ndarray          # reference words
    m_start: np.ndarray         # first hypothesis word
    m_length: np.ndarray        # hypothesis words
    stage: np.ndarray           # index in Meteor.modules


def _ranges(lo, count):
    """Entries lo[r] to lo[r] + count[r] - 1 of every row r: (the row of each entry, the entry), both (sum(count),)."""
    row = np.repeat(np.arange(len(count)), count)
    return row, np.arange(len(row)) + np.repeat(lo - np.cumsum(count) + count, count)


def _stable_sort(keys):
    """(np.argsort(keys, kind="stable"), keys in that order) of non-negative int64 keys: where a key and its index
    fit in 63 bits together, one np.sort of key * 2^bits + index (several times faster than a stable argsort)."""
    bits = max(1, (len(keys) - 1).bit_length())
    if len(keys) == 0 or int(keys.max()) >= 1 << (63 - bits):
        order = np.argsort(keys, kind="stable")
        return order, keys[order]
    packed = np.sort((keys << bits) | np.arange(len(keys)))
    return packed & ((1 << bits) - 1), packed >> bits


def _order(*columns):
    """The order that sorts by the first column, then by the second, ... (np.lexsort's, primary first): one stable
    sort of their mixed-radix number where it fits in 63 bits, ten times faster. Columns >= 0."""
    radix = [int(column.max(initial=0)) + 1 for column in columns]
    if math.prod(radix) >= 1 << 63:
        return np.lexsort(columns[::-1])
    key = np.zeros(len(columns[0]), np.int64)
    for column, r in zip(columns, radix):
        key = key * r + column
    return _stable_sort(key)[0]


class _Index:
    """Values grouped by key: lookup(queries) tells where each query's values lie in self.values, in their order.
    Given `size`, the keys' range, it reads each key's run from arrays of that size: worth their making and memory
    where the lookups are many (a search of the sorted keys, else, costs some 20 cache-missing steps a query)."""

    def __init__(self, keys, values, size=None):
        order = np.argsort(keys, kind="stable")
        self.keys, self.values, self.size = keys[order], values[order], size
        if size is not None:
            self.count = np.bincount(keys, minlength=size)
            self.first = np.cumsum(self.count) - self.count
        else:
            last = np.flatnonzero(np.r_[self.keys[1:] != self.keys[:-1], True])   # the last entry of each key
            self.end = np.repeat(last + 1, np.diff(np.r_[-1, last]))              # per entry, its key's run's end

    def lookup(self, queries):
        """(where each query's run of values starts, its length: 0 for a key not there)."""
        if self.size is not None:
            return self.first[queries], self.count[queries]
        if len(self.keys) == 0:
            return np.zeros(len(queries), np.int64), np.zeros(len(queries), np.int64)
        lo = np.searchsorted(self.keys, queries)
        at = np.minimum(lo, len(self.keys) - 1)
        return lo, np.where(self.keys[at] == queries, self.end[at] - lo, 0)


def _phrase_occurrences(vocab, sent):
    """Where each phrase of the table occurs: (first word in sent.word, phrase id) of each occurrence, found by walking
    the trie of the table's phrases from every word, one word deeper at a time (as ParaphraseTransducer walks it)."""
    first = np.arange(len(sent.word))
    node = np.zeros(len(first), np.int64)                       # the root
    end = (sent.lo + sent.length)[sent.of]                      # (T,) end of each word's sentence
    found_at, found_phrase = [], []
    for depth in range(len(sent.word) + 1):
        inside = first + depth < end[first]
        first, node = first[inside], node[inside]
        at, on = vocab.edges.lookup(node * len(vocab.ids) + sent.word[first + depth])
        first, node = first[on == 1], vocab.edges.values[at[on == 1]]
        if len(first) == 0:
            break
        phrase = vocab.node_phrase[node]
        found_at.append(first[phrase >= 0])
        found_phrase.append(phrase[phrase >= 0])
    return np.concatenate(found_at or [first]), np.concatenate(found_phrase or [first])


def _same_words(sent, pair_h, pair_r):
    """(P,) whether a pair's hypothesis and reference have the same words (their texts may still differ)."""
    same = sent.length[pair_h] == sent.length[pair_r]
    check = np.flatnonzero(same)
    row, at = _ranges(np.zeros(len(check), np.int64), sent.length[pair_r[check]])
    differ = sent.word[sent.lo[pair_h[check]][row] + at] != sent.word[sent.lo[pair_r[check]][row] + at]
    same[check[row[differ]]] = False
    return same


def _one_word_matches(vocab, sent, pair_h, pair_r, identical, stages):
    """The exact, stem and synonym matches of every pair, as Meteor._candidates finds them: (matches, order within
    their reference position: the stage's block, then the hypothesis position)."""
    n_ref = sent.length[pair_r]
    q_pair, q_pos = _ranges(np.zeros(len(pair_r), np.int64), n_ref)        # (Q,) every reference position
    q_word = sent.word[sent.lo[pair_r][q_pair] + q_pos]
    q_hyp = pair_h[q_pair]
    hyps = np.unique(pair_h)
    local = np.zeros(len(sent.lo), np.int64)
    local[hyps] = np.arange(len(hyps))                                      # the hypotheses numbered 0..H-1
    hyp_word = np.flatnonzero(np.isin(sent.of, hyps))                       # the words of the hypotheses
    position = hyp_word - sent.lo[sent.of[hyp_word]]
    size = len(hyps) * len(vocab.ids)                   # arrays of (hypothesis, word) where not larger than the lookups
    by_word = _Index(local[sent.of[hyp_word]] * len(vocab.ids) + sent.word[hyp_word], position,
                     size if size <= 4 * len(q_pair) else None)
    q_local = local[q_hyp]
    differ = ~identical[q_pair]                           # identical sentences need exact matches only
    found = []                                            # (query, hypothesis position, stage) of each stage

    def add(query, index, keys, stage, keep=None):
        row, at = _ranges(*index.lookup(keys))
        query, j = query[row], index.values[at]
        if keep is not None:
            kept = keep(query, j)
            query, j = query[kept], j[kept]
        found.append((query, j, np.full(len(j), stage)))

    add(np.arange(len(q_pair)), by_word, q_local * len(vocab.ids) + q_word, 0)
    if "stem" in stages:
        n_stems = int(vocab.stem.max(initial=0)) + 1
        by_stem = _Index(local[sent.of[hyp_word]] * n_stems + vocab.stem[sent.word[hyp_word]], position)
        query = np.flatnonzero(differ & vocab.stem_shared[q_word])
        add(query, by_stem, q_local[query] * n_stems + vocab.stem[q_word[query]], stages.index("stem"),
            lambda q, j: sent.word[sent.lo[q_hyp[q]] + j] != q_word[q])     # the same stem, another word
    if "synonym" in stages:
        query = np.flatnonzero(differ & (vocab.synonym_count[q_word] > 0))
        row, at = _ranges(vocab.synonym_lo[q_word[query]], vocab.synonym_count[q_word[query]])
        add(query[row], by_word, q_local[query[row]] * len(vocab.ids) + vocab.synonym[at], stages.index("synonym"))
    query, j, stage = (np.concatenate(column) for column in zip(*found))
    ones = np.ones(len(j), np.int64)
    return _Matches(q_pair[query], q_pos[query], ones, j, ones, stage), np.stack([stage, j], axis=1)


def _paraphrase_matches(vocab, sent, pair_h, pair_r, identical, stage):
    """The paraphrase matches of every pair, as Meteor._candidates finds them: reference phrases first, then
    hypothesis phrases. (matches, order within their reference position, as (block, four keys) rows)."""
    occurrence, phrase = _phrase_occurrences(vocab, sent)
    where = sent.of[occurrence]
    n_phrases = len(vocab.phrase_length)
    found_in = _Index(where * n_phrases + phrase, occurrence - sent.lo[where])     # (sentence, phrase) -> position
    where, phrase, position = found_in.keys // n_phrases, found_in.keys % n_phrases, found_in.values   # so sorted
    # Per sentence, its phrases' paraphrases: (sentence, position, phrase length, rank, paraphrase), by sentence.
    row, at = _ranges(vocab.target_lo[phrase], vocab.target_count[phrase])
    wanted = np.stack([where[row], position[row], vocab.phrase_length[phrase[row]], at - vocab.target_lo[phrase[row]],
                       vocab.target[at]], axis=1)
    wanted_bounds = np.searchsorted(wanted[:, 0], np.arange(len(sent.lo) + 1))
    wanted_lo, wanted_count = wanted_bounds[:-1], np.diff(wanted_bounds)
    differ = ~identical                                   # identical sentences need exact matches only
    found = []
    for phrase_side, other_side, block in ((pair_r, pair_h, 3), (pair_h, pair_r, 4)):
        by_other = np.argsort(other_side, kind="stable")  # pairs by the sentence searched: 3 times faster lookups
        pair, at = _ranges(wanted_lo[phrase_side[by_other]], np.where(differ, wanted_count[phrase_side], 0)[by_other])
        pair = by_other[pair]
        _, i, n, rank, target = wanted[at].T
        row, hit = _ranges(*found_in.lookup(other_side[pair] * n_phrases + target))
        pair, i, n, rank, target, j = pair[row], i[row], n[row], rank[row], target[row], found_in.values[hit]
        m = vocab.phrase_length[target]
        if block == 3:                                    # the reference's phrase i:i+n, the hypothesis's j:j+m
            found.append((_Matches(pair, i, n, j, m, np.full(len(j), stage)), np.stack([n, rank, j, m], axis=1)))
        else:                                             # the hypothesis's phrase i:i+n, the reference's j:j+m
            found.append((_Matches(pair, j, m, i, n, np.full(len(j), stage)), np.stack([i, n, rank, m], axis=1)))
    return found


def _candidates(vocab, sent, pair_h, pair_r, stages):
    """Meteor._candidates of every pair: its candidate matches, in the order of its lists (by reference position,
    within one as Meteor._candidates appends them)."""
    identical = _same_words(sent, pair_h, pair_r)
    one_word, order = _one_word_matches(vocab, sent, pair_h, pair_r, identical, stages)
    parts = [(one_word, np.pad(order, ((0, 0), (0, 3))))]           # block (the stage), j, 0, 0, 0
    if "paraphrase" in stages and len(vocab.phrase_length):
        parts += [(matches, np.concatenate([np.full((len(keys), 1), block), keys], axis=1))
                  for (matches, keys), block in zip(_paraphrase_matches(vocab, sent, pair_h, pair_r, identical,
                                                                         stages.index("paraphrase")), (3, 4))]
    matches = _Matches(*(np.concatenate(column) for column in zip(*(m for m, _ in parts))))
    keys = np.concatenate([k for _, k in parts])                    # (C, 5): block, then four keys
    order = _order(matches.pair, matches.start, *keys.T)
    return _Matches(*(column[order] for column in matches))


def _all_once(cover, first, length):
    """(C,) whether cover is 1 at every one of the words first to first + length - 1 (flat word indices)."""
    others = np.concatenate(([0], np.cumsum(cover != 1)))
    return others[first + length] == others[first]


def _fixed(cands, n_hyp, n_ref):
    """_fixed_matches of every pair: (C,) whether a candidate is fixed, (P,) whether its pair has an open choice.
    A candidate is fixed when it is the only one at its reference position and no other covers its words."""
    hyp_first = (np.cumsum(n_hyp) - n_hyp)[cands.pair] + cands.m_start      # (C,) flat word indices
    ref_first = (np.cumsum(n_ref) - n_ref)[cands.pair] + cands.start
    covers = [np.bincount(_ranges(first, length)[1], minlength=int(n.sum()))     # cover1, cover2
              for first, length, n in ((hyp_first, cands.m_length, n_hyp), (ref_first, cands.length, n_ref))]
    fixed = (np.bincount(ref_first, minlength=int(n_ref.sum()))[ref_first] == 1) & \
        _all_once(covers[0], hyp_first, cands.m_length) & _all_once(covers[1], ref_first, cands.length)
    return fixed, np.bincount(cands.pair[~fixed], minlength=len(n_ref)) > 0, covers


def _pair_stats(chosen, sent, functional, pair_h, pair_r, n_stages):
    """Meteor._stats of every pair from its chosen matches (sorted by pair, then start) and whether each word is a
    function word ((T,) bool): (P, 7 + 4 K) int64, a row per pair holding MeteorStats' fields in order, the
    per-stage tuples spread out."""
    n_pairs = len(pair_h)
    functional = np.concatenate(([0], np.cumsum(functional)))                  # (T + 1,) function words before
    out = [sent.length[pair_h], sent.length[pair_r]]
    out += [functional[sent.lo[s] + sent.length[s]] - functional[sent.lo[s]] for s in (pair_h, pair_r)]
    function_matched = [functional[sent.lo[s][chosen.pair] + first + length] - functional[sent.lo[s][chosen.pair]
                                                                                         + first]
                        for s, first, length in ((pair_h, chosen.m_start, chosen.m_length),
                                                 (pair_r, chosen.start, chosen.length))]
    per_stage = chosen.pair * n_stages + chosen.stage
    for counts in (chosen.m_length - function_matched[0], chosen.length - function_matched[1], *function_matched):
        out += list(np.bincount(per_stage, counts, n_pairs * n_stages).astype(np.int64).reshape(n_pairs, n_stages).T)
    # Aligner.getCountAndChunks: a match starts a new chunk unless it follows the previous one in both sentences.
    follows = (chosen.pair[1:] == chosen.pair[:-1]) & (chosen.start[1:] == chosen.start[:-1] + chosen.length[:-1]) \
        & (chosen.m_start[1:] == chosen.m_start[:-1] + chosen.m_length[:-1])
    out.append(np.bincount(chosen.pair, minlength=n_pairs) - np.bincount(chosen.pair[1:][follows], minlength=n_pairs))
    out += [np.bincount(chosen.pair, chosen.m_length, n_pairs).astype(np.int64),
            np.bincount(chosen.pair, chosen.length, n_pairs).astype(np.int64)]
    return np.stack(out, axis=1)


class FastMeteor(Meteor):
    """Meteor with every speed variant of this section in place of the plain step it stands in for."""
    read_paraphrases = staticmethod(load_paraphrases)

    def __init__(self, config=None, modules=None, resources=None):
        super().__init__(config, modules, resources)
        self._vocab = None              # _Vocabulary of self.vocabulary, made when first needed
        self._prepared = set()          # the texts prepare() has seen

    def words(self, text):
        """Meteor.words, with a shortcut for lines of lower-case letters, digits and spaces (most PTB-tokenized
        captions): no rule of the normaliser changes them, so their words are the line split on spaces. What it
        buys: BENCHMARKS.md section 6 (`python -m bench metrics`)."""
        if text not in self._words and _PLAIN_LINE.fullmatch(text):
            self._words[text] = text.split()
        return super().words(text)

    def prepare(self, texts):
        """Meteor.prepare of the texts it has not seen: item_stats_many's items were mostly prepared before it
        (MeteorWorker and FastCaptionScorer prepare all the items first, then score them a chunk at a time)."""
        texts = [text for text in texts if text not in self._prepared]
        known = len(self.vocabulary)
        super().prepare(texts)
        self._prepared.update(texts)
        if len(self.vocabulary) != known:
            self._vocab = None          # new words: new synonyms and paraphrases

    def forget(self):
        super().forget()
        self._vocab, self._prepared = None, set()

    def _vocabulary(self):
        """self.vocabulary as a _Vocabulary."""
        if self._vocab is None:
            words = sorted(self.vocabulary)
            ids = {word: i for i, word in enumerate(words)}
            stems = [self.stem(word) if "stem" in self.modules else word for word in words]
            stem_ids = {stem: i for i, stem in enumerate(dict.fromkeys(stems))}
            stem = np.array([stem_ids[s] for s in stems], np.int64)
            synonyms = [sorted(ids[w] for w in self.synonyms(word)) if "synonym" in self.modules else []
                        for word in words]
            count = np.array([len(s) for s in synonyms], np.int64)
            self._vocab = _Vocabulary(
                ids, np.array([word in METEOR_FUNCTION_WORDS for word in words], bool), stem,
                np.bincount(stem, minlength=len(words))[stem] > 1, np.cumsum(count) - count, count,
                np.array([w for s in synonyms for w in s], np.int64), *self._phrase_trie(ids))
        return self._vocab

    def _phrase_trie(self, ids):
        """The paraphrase table over word ids (_Vocabulary's fields from edges on): its phrases and their
        paraphrases numbered, in a trie."""
        phrases = {}                                     # phrase -> id, phrases and paraphrases alike
        for phrase, targets in self.paraphrases.items():
            for p in (phrase, *targets):
                phrases.setdefault(p, len(phrases))
        nodes, edges, node_phrase = {(): 0}, [], [-1]
        for phrase, pid in phrases.items():
            for k in range(1, len(phrase) + 1):
                if phrase[:k] not in nodes:
                    nodes[phrase[:k]] = len(nodes)
                    edges.append((nodes[phrase[:k - 1]] * len(ids) + ids[phrase[k - 1]], nodes[phrase[:k]]))
                    node_phrase.append(-1)
            node_phrase[nodes[phrase]] = pid
        edges = np.array(edges, np.int64).reshape(-1, 2)
        targets = [[phrases[t] for t in self.paraphrases.get(p, ())] for p in phrases]
        count = np.array([len(t) for t in targets], np.int64)
        size = len(nodes) * len(ids)                     # looked up about T times a call: an array if not too large
        return (_Index(edges[:, 0], edges[:, 1], size if size <= _DENSE_KEYS else None),
                np.array(node_phrase, np.int64),
                np.array([len(p) for p in phrases], np.int64), np.cumsum(count) - count, count,
                np.array([t for ts in targets for t in ts], np.int64))

    def item_stats_many(self, items):
        """item_stats of many (hypothesis, references) items: the same statistics, each step taken for all their
        pairs at once (see the section's comment)."""
        fields = self.prepare_items(items)
        vocab = self._vocabulary()
        # Distinct texts (sentences) and distinct (hypothesis, reference) pairs.
        texts = list(dict.fromkeys(itertools.chain((h for h, _ in fields), *(r for _, r in fields))))
        of_text = dict(zip(texts, itertools.count()))
        sentences = list(map(self._words.__getitem__, texts))      # prepared: every text's words are known
        length = np.fromiter(map(len, sentences), np.int64, len(sentences))
        word = np.fromiter(map(vocab.ids.__getitem__, itertools.chain.from_iterable(sentences)), np.int64,
                           int(length.sum()))
        sent = _Sentences(word, np.cumsum(length) - length, length, np.repeat(np.arange(len(length)), length))
        n_refs = np.array([len(references) for _, references in fields], np.int64)          # per item
        entry = np.repeat(np.array([of_text[h] for h, _ in fields], np.int64), n_refs) * len(length) + \
            np.fromiter(map(of_text.__getitem__, itertools.chain.from_iterable(r for _, r in fields)), np.int64,
                        int(n_refs.sum()))
        pairs, entry_pair = np.unique(entry, return_inverse=True)
        pair_h, pair_r = pairs // len(length), pairs % len(length)
        # Candidates, fixed matches, the chosen alignment, the statistics and scores of every pair.
        cands = _candidates(vocab, sent, pair_h, pair_r, self.modules)
        n_hyp, n_ref = length[pair_h], length[pair_r]
        fixed, open_choice, covers = _fixed(cands, n_hyp, n_ref)
        chosen = self._chosen(cands, fixed, open_choice, covers, n_hyp, n_ref)
        stats = _pair_stats(chosen, sent, vocab.functional[word], pair_h, pair_r, len(self.modules))
        score = self._scores(stats)[entry_pair]
        # The best single reference of each item, the first on a tie (its scores are >= 0: never NaN).
        item_lo = np.cumsum(n_refs) - n_refs
        has = n_refs > 0
        best = np.repeat(np.maximum.reduceat(score, item_lo[has]), n_refs[has]) if has.any() else score
        best_entry = np.minimum.reduceat(np.where(score == best, np.arange(len(score)), len(score)), item_lo[has])
        out, k = [None] * len(fields), len(self.modules)
        for item, row in zip(np.flatnonzero(has).tolist(), stats[entry_pair[best_entry]].tolist()):
            out[item] = MeteorStats(*row[:4], *(tuple(row[4 + k * s:4 + k * (s + 1)]) for s in range(4)),
                                    *row[4 + 4 * k:])
        return out

    def _chosen(self, cands, fixed, open_choice, covers, n_hyp, n_ref):
        """Meteor._resolve of every pair: its fixed matches where it has no open choice, else the beam search's
        alignment, each distinct alignment searched once (the same (n_ref, cands) key as Meteor._resolve's) by
        _resolve_batch, or by Meteor._resolve beyond 64 words a side. The chosen matches, sorted by pair and start."""
        rows = np.stack(cands[1:], axis=1)                                       # (C, 5) Meteor's match tuples
        bounds = np.searchsorted(cands.pair, np.arange(len(n_ref) + 1))         # a pair's candidates: its slice
        searched = np.flatnonzero(open_choice)
        packed = rows.astype(np.uint8).tobytes()          # within 64 words a side, each number fits a byte
        keys = list(zip(n_ref[searched].tolist(), map(packed.__getitem__, map(
            slice, (5 * bounds[searched]).tolist(), (5 * bounds[searched + 1]).tolist()))))
        alignment = {}                                    # key -> the chosen matches {start: match}
        for k in np.flatnonzero((n_hyp[searched] > _WORD_MASK_BITS) | (n_ref[searched] > _WORD_MASK_BITS)).tolist():
            keys[k] = p = int(searched[k])                # beyond the 64-bit masks: this pair alone, in Python
            alignment[p] = self._resolve_one(p, rows, bounds, covers, n_hyp, n_ref)
        first = dict(zip(reversed(keys), reversed(searched.tolist())))          # key -> its first pair
        new = [key for key in first if key not in alignment and key not in self._structures]
        if new:
            self._structures.update(zip(new, self._resolve_batch(self._problems(
                np.array([first[key] for key in new], np.int64), rows, bounds, fixed, n_ref))))
        alignment.update((key, self._structures[key]) for key in first if key not in alignment)
        # Each distinct alignment's matches as rows, then each pair's.
        distinct = list(first)
        count = np.fromiter(map(len, map(alignment.__getitem__, distinct)), np.int64, len(distinct))
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(
            map(dict.values, map(alignment.__getitem__, distinct)))), np.int64, 5 * int(count.sum())).reshape(-1, 5)
        which = np.fromiter(map(dict(zip(distinct, itertools.count())).__getitem__, keys), np.int64, len(keys))
        row, at = _ranges((np.cumsum(count) - count)[which], count[which])
        plain = ~open_choice[cands.pair]                  # a pair without an open choice: all its matches fixed
        pair = np.concatenate([cands.pair[plain], searched[row]])
        picked = np.concatenate([rows[plain], flat[at]])
        order = _order(pair, picked[:, 0])
        return _Matches(pair[order], *picked[order].T)

    @staticmethod
    def _problems(pairs, rows, bounds, fixed, n_ref):
        """_resolve_batch's problems of these pairs: (cands, fixed, used1, used2) each, as Meteor._resolve makes them:
        per reference position the list of its candidate tuples, {start: match} of the fixed ones, and the used-word
        bit masks of the fixed ones."""
        row, at = _ranges(bounds[pairs], bounds[pairs + 1] - bounds[pairs])    # these pairs' candidates
        mine = rows[at]
        # Their tuples, each distinct one made once (the same tuple object in every list that holds it).
        code = np.zeros(len(at), np.int64)
        for column in mine.T:
            code = code * (int(column.max(initial=0)) + 1) + column
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        matches = list(map(list(map(tuple, mine[first].tolist())).__getitem__, inverse.tolist()))
        n = n_ref[pairs]
        base = np.cumsum(n) - n                                               # each pair's first position
        slot_end = np.cumsum(np.bincount(base[row] + mine[:, 0], minlength=int(n.sum())))
        lists = list(map(matches.__getitem__, map(slice, np.r_[0, slot_end[:-1]].tolist(), slot_end.tolist())))
        cands = list(map(lists.__getitem__, map(slice, base.tolist(), (base + n).tolist())))
        # The fixed matches: {start: match} and the words they use, a bit each (disjoint: their sum is their or).
        f = np.flatnonzero(fixed[at])
        per_pair = np.bincount(row[f], minlength=len(pairs))
        starts_matches = zip(mine[f, 0].tolist(), map(matches.__getitem__, f.tolist()))
        fixed_at = [dict(itertools.islice(starts_matches, k)) for k in per_pair.tolist()]
        f_end = np.r_[0, np.cumsum(per_pair)]
        start, length, m_start, m_length = mine[f, :4].astype(np.uint64).T
        used = []
        for lo, size in ((m_start, m_length), (start, length)):
            mask = ((np.uint64(2) << (size - np.uint64(1))) - np.uint64(1)) << lo        # 2 << 63 wraps to 0: 64 ones
            total = np.concatenate((np.zeros(1, np.uint64), np.cumsum(mask, dtype=np.uint64)))
            used.append((total[f_end[1:]] - total[f_end[:-1]]).tolist())
        return list(zip(cands, fixed_at, *used))

    def _resolve_one(self, p, rows, bounds, covers, n_hyp, n_ref):
        """Meteor._resolve of pair p, from the arrays."""
        n = int(n_ref[p])
        cands = [[] for _ in range(n)]
        for match in map(tuple, rows[bounds[p]:bounds[p + 1]].tolist()):
            cands[match[0]].append(match)
        hyp_first, ref_first = int(np.sum(n_hyp[:p])), int(np.sum(n_ref[:p]))
        return self._resolve(cands, covers[0][hyp_first:hyp_first + int(n_hyp[p])].tolist(),
                             covers[1][ref_first:ref_first + n].tolist(), n)

    def _scores(self, stats):
        """Meteor.score of every row of _pair_stats, the same operations in the same order (float64 throughout,
        as Python's floats); the power through Python, once per distinct value."""
        alpha, beta, gamma, delta = (self.config.alpha, self.config.beta, self.config.gamma, self.config.delta)
        k = len(self.modules)
        hyp_len, ref_len, hyp_fun, ref_fun = stats[:, :4].T
        hyp_content, ref_content, hyp_function, ref_function = (stats[:, 4 + k * s:4 + k * (s + 1)].T
                                                                for s in range(4))
        chunks, hyp_matched, ref_matched = stats[:, 4 + 4 * k:].T
        with np.errstate(divide="ignore", invalid="ignore"):         # Java's x / 0: Infinity or NaN, as numpy's
            hyp_weighted_len = delta * (hyp_len - hyp_fun) + (1.0 - delta) * hyp_fun
            ref_weighted_len = delta * (ref_len - ref_fun) + (1.0 - delta) * ref_fun
            hyp_matches = ref_matches = 0.0
            for i, w in enumerate(self.weights):
                hyp_matches = hyp_matches + hyp_content[i] * w * delta
            for i, w in enumerate(self.weights):
                ref_matches = ref_matches + ref_content[i] * w * delta
            for i, w in enumerate(self.weights):
                hyp_matches = hyp_matches + hyp_function[i] * w * (1.0 - delta)
            for i, w in enumerate(self.weights):
                ref_matches = ref_matches + ref_function[i] * w * (1.0 - delta)
            precision = hyp_matches / hyp_weighted_len
            recall = ref_matches / ref_weighted_len
            f_mean = 1.0 / ((1.0 - alpha) / precision + alpha / recall)
            perfect = (hyp_content.sum(0) + hyp_function.sum(0) == hyp_len) & \
                (ref_content.sum(0) + ref_function.sum(0) == ref_len) & (chunks == 1)         # no penalty
            fragmentation = np.where(perfect, 0.0, chunks / ((hyp_matched + ref_matched) / 2.0))
            distinct, inverse = np.unique(fragmentation, return_inverse=True)
            penalty = np.array([gamma * f ** beta for f in distinct.tolist()], np.float64)[inverse]
            score = f_mean * (1.0 - penalty)
        return np.where((score != score) | (0.0 > score), 0.0, score)   # max(score, 0.0), NaN as 0

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
        n_ref = np.fromiter((len(cands) for cands, _, _, _ in problems), np.int64, len(problems))
        by_length = np.argsort(-n_ref, kind="stable").tolist()
        problems, n_ref = [problems[p] for p in by_length], n_ref[by_length]
        base = np.concatenate(([0], np.cumsum(n_ref)))                   # (problem, position) -> base[p] + i
        ending = np.searchsorted(-n_ref, -np.arange(int(n_ref.max()) + 1))  # first problem that ends at i or before
        # Every position's candidate options in one table, a position's options at opt_lo:opt_hi. A fixed match is
        # its position's only option (_fixed_matches).
        positions = list(itertools.chain.from_iterable(cands for cands, _, _, _ in problems))
        bounds = np.zeros(len(positions) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, positions), np.int64, len(positions)), out=bounds[1:])
        opt_lo, opt_hi = bounds[:-1], bounds[1:]
        options = list(itertools.chain.from_iterable(positions))
        o = np.fromiter(itertools.chain.from_iterable(options), np.int64, 5 * len(options)).reshape(-1, 5)
        o_mask1 = (((np.uint64(1) << o[:, 3].astype(np.uint64)) - np.uint64(1)) << o[:, 2].astype(np.uint64))
        o_mask2 = (((np.uint64(1) << o[:, 1].astype(np.uint64)) - np.uint64(1)) << o[:, 0].astype(np.uint64))
        o_mask1, o_mask2 = o_mask1.view(np.int64), o_mask2.view(np.int64)
        stage_weight = np.array(weights)[o[:, 4]]                         # Java: int += length * weight
        o_step = -(np.floor(o[:, 3] * stage_weight) + np.floor(o[:, 1] * stage_weight)).astype(np.int64) << 32
        o_dist = np.abs(o[:, 0] - o[:, 2])
        o_start, o_ref_end, o_hyp_end = o[:, 2].copy(), o[:, 0] + o[:, 1], o[:, 2] + o[:, 3]
        # A path's distance is at most the sum of its problem's option distances: it stays in its 24 bits.
        summed = np.concatenate(([0], np.cumsum(o_dist)))[bounds[base]]
        assert np.diff(summed).max(initial=0) < (1 << 24) - 4096, "distance field overflow"
        # A row per partial alignment: the sort key packs (problem, -(matches1 + matches2) + 128, chunks,
        # distance) into one int64 whose fields are updated by addition; then the reference end of its last match,
        # the hypothesis end of its last match (-1 after a skip), the used-word masks (raw 64-bit patterns) and
        # its entry in the history of choices. Rows of a problem stay together, in _resolve's list order.
        KEY, REF_END, LAST, U1, U2, HIST = range(6)
        rows = np.zeros((len(problems), 6), np.int64)
        rows[:, KEY] = (np.arange(len(problems)) << 40) | (128 << 32)
        rows[:, LAST] = rows[:, HIST] = -1
        rows[:, U1] = np.fromiter((u1 for _, _, u1, _ in problems), np.uint64, len(problems)).view(np.int64)
        rows[:, U2] = np.fromiter((u2 for _, _, _, u2 in problems), np.uint64, len(problems)).view(np.int64)
        history_parent, history_option, n_history = [], [], 0
        best_hist = np.full(len(problems), -1, np.int64)
        table, layout = rows, np.arange(len(problems))          # the rows, in _resolve's order: table[layout]
        for current in range(int(n_ref.max()) + 1):
            # Sort (stable) by the key; keep the first `beam` rows of each problem: a row `beam` places after
            # one of its own problem is beyond the beam.
            key = table[:, KEY][layout]
            order = np.argsort(key, kind="stable")
            prob = key[order] >> 40
            if len(order) > beam:
                keep = np.ones(len(order), bool)
                np.not_equal(prob[beam:], prob[:-beam], out=keep[beam:])
                order, prob = order[keep], prob[keep]
            kept = layout[order]
            # Problems whose reference ends here (the last rows): close the last chunk, take the first best path.
            split = int(np.searchsorted(prob, ending[current]))
            if split < len(kept):
                done, kept, prob = table.take(kept[split:], axis=0), kept[:split], prob[:split]
                final = done[:, KEY] + ((done[:, LAST] != -1).astype(np.int64) << 24)
                order = np.argsort(final, kind="stable")
                finished = final[order] >> 40
                firsts = order[np.r_[True, finished[1:] != finished[:-1]]]
                best_hist[done[firsts, KEY] >> 40] = done[firsts, HIST]
            if len(kept) == 0:
                break
            # The rows, gathered into a buffer with room for their children (mode "wrap": no buffered copy).
            flat = base[prob] + current
            rows = np.empty((len(kept) + int((opt_hi[flat] - opt_lo[flat]).sum()), 6), np.int64)
            np.take(table, kept, axis=0, out=rows[:len(kept)], mode="wrap")
            table, layout, history = self._beam_step(rows, len(kept), flat, current, opt_lo, opt_hi, o_mask1,
                                                     o_mask2, o_step, o_dist, o_start, o_ref_end, o_hyp_end,
                                                     n_history)
            history_parent.append(history[0])
            history_option.append(history[1])
            n_history += len(history[1])
        # Follow each problem's best path back through the matches it chose.
        history_parent = np.concatenate(history_parent or [np.zeros(0, np.int64)])
        history_option = np.concatenate(history_option or [np.zeros(0, np.int64)])
        chosen = [dict(fixed) for _, fixed, _, _ in problems]
        link, problem, taken = best_hist, np.arange(len(problems)), []
        while len(link):
            keep = link != -1
            link, problem = link[keep], problem[keep]
            taken.append((problem, history_option[link]))
            link = history_parent[link]
        if taken:
            problem, option = (np.concatenate(column) for column in zip(*taken))
            matches = [options[k] for k in option.tolist()]
            for p, start, match in zip(problem.tolist(), o[option, 0].tolist(), matches):
                chosen[p][start] = match
        out = [None] * len(problems)
        for p, original in enumerate(by_length):
            out[original] = chosen[p]
        return out

    @staticmethod
    def _beam_step(buffer, n, flat, current, opt_lo, opt_hi, o_mask1, o_mask2, o_step, o_dist, o_start, o_ref_end,
                   o_hyp_end, n_history):
        """One reference position of _resolve_some's search. buffer[:n]: the rows (sorted, within the beam), the
        rest of the buffer room for their children; flat: their positions in the option table.

        Returns the table of the following rows, in the same buffer (the n rows carried on, then the children);
        the order of its rows in _resolve's list (each row's children, in option order, then the row itself),
        applied by the next sort's gather, so that no row is moved twice; and the children's history entries
        (parent entry, option)."""
        KEY, REF_END, LAST, U1, U2, HIST = range(6)
        rows = buffer[:n]
        u2, last = rows[:, U2], rows[:, LAST]
        used = (u2 & np.uint64(1 << current).view(np.int64)) != 0
        at_fixed = np.flatnonzero(used & (current >= rows[:, REF_END]))    # a fixed match starts here
        free = ~used                                                      # (other used rows are inside a match)
        # Candidate options of the free rows, each checked against the row's used words. Row i's are entries
        # starts[i]:ends[i] of the flat lists.
        lo = opt_lo[flat]
        count = np.where(free, opt_hi[flat] - lo, 0)
        ends = np.cumsum(count)
        starts = ends - count
        parent = np.repeat(np.arange(len(rows)), count)
        option = np.repeat(lo - starts, count) + np.arange(int(ends[-1]))
        valid = ((rows[parent, U1] & o_mask1[option]) == 0) & ((u2[parent] & o_mask2[option]) == 0)
        # Java adds each tried option's distance to the extended path: a child inherits the distances of the
        # valid options before it, the skip path all of them (see _resolve). Prefix sums, with a leading 0.
        tried = np.zeros(len(option) + 1, np.int64)
        np.cumsum(np.where(valid, o_dist[option], 0), out=tried[1:])
        n_valid = np.zeros(len(option) + 1, np.int64)
        np.cumsum(valid, out=n_valid[1:])
        carried_at = np.arange(len(rows)) + n_valid[ends]                 # after the row's children
        # Children: one per valid option, in option order, before the carried row.
        child = np.flatnonzero(valid)
        parent, option = parent[child], option[child]
        first = starts[parent]
        at = parent + n_valid[child]                                      # rows and valid options before it
        table = buffer[:n + len(parent)]
        r = table[n:]
        np.take(rows, parent, axis=0, out=r, mode="wrap")
        history = (r[:, HIST].copy(), option)
        r_last = r[:, LAST]
        r[:, KEY] += o_step[option] + tried[child] - tried[first] + (((r_last != -1) & (o_start[option] != r_last))
                                                                    .astype(np.int64) << 24)
        r[:, REF_END], r[:, LAST] = o_ref_end[option], o_hyp_end[option]
        r[:, U1] |= o_mask1[option]
        r[:, U2] |= o_mask2[option]
        r[:, HIST] = np.arange(n_history, n_history + len(parent))
        # Carried rows: a fixed match taken; a free row's skip path (its chunk closed, the tried distances added);
        # rows inside a match unchanged.
        fixed = lo[at_fixed]
        assert (opt_hi[flat[at_fixed]] - fixed == 1).all(), "a used word outside any match"
        f_last = last[at_fixed]
        step = tried[ends] - tried[starts]
        step[at_fixed] = o_step[fixed] + o_dist[fixed] + (((f_last != -1) & (o_start[fixed] != f_last))
                                                          .astype(np.int64) << 24)
        step += (free & (last != -1)).astype(np.int64) << 24
        rows[:, KEY] += step
        rows[at_fixed, REF_END] = o_ref_end[fixed]
        last[free] = -1
        last[at_fixed] = o_hyp_end[fixed]
        layout = np.empty(len(table), np.int64)
        layout[carried_at] = np.arange(len(rows))
        layout[at] = np.arange(len(rows), len(table))
        return table, layout, history


# 3. The garbage collector paused, for scoring with it running: around all of metrics.py's scoring (its
# FastCaptionScorer and command line), where METEOR's tuples are most of what it would scan. What it buys of the
# whole scoring process: BENCHMARKS.md section 6 (`python -m bench metrics`).
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


# 4. METEOR beside BLEU and ROUGE-L: a forked worker, for metrics.FastCaptionScorer's command line.
PARALLEL_MIN_ITEMS = 1000     # below this a second process costs more than it saves
METEOR_CHUNK_ITEMS = (250, 50)   # METEOR's items are shared between the processes in chunks of this many, the last
# quarter in small ones: the processes meet there, and the one that finishes first waits at most for a small chunk
_FORKED = {}                  # the worker process's copy of the parent's FastMeteor (set by its initializer)


def _prepare_forked(meteor, items):
    """The worker's initializer: METEOR's items (items() tokenizes them) and the meteor that scores them."""
    _FORKED["items"] = items = items()
    meteor.prepare_items(items)     # every word registered at once: the worker never prepares again
    _FORKED["meteor"] = meteor


def _meteor_chunk(first, end):
    """METEOR statistics of the items first to end - 1, in the worker process."""
    return _FORKED["meteor"].item_stats_many(_FORKED["items"][first:end])


class MeteorWorker:
    """meteor.item_stats_many(items), shared with a forked process, which starts on the items chunk by chunk while
    this process computes BLEU and ROUGE-L; finish() then computes here, from the last chunk back, those the worker
    has not begun, so that both end together whatever the machine's load. The worker is forked before the captions
    are tokenized: it makes the items itself (items(), the same as this process's) and prepares its copy of the
    meteor, so that little is done before it starts. What it buys: BENCHMARKS.md section 6 (`python -m bench
    metrics`); the command line uses it, the training scripts do not (they may hold CUDA)."""

    def __init__(self, meteor, n_items, items):
        large, small = METEOR_CHUNK_ITEMS
        cut = n_items * 3 // 4
        self.chunks = [(k, min(k + large, cut)) for k in range(0, cut, large)] + \
                      [(k, min(k + small, n_items)) for k in range(cut, n_items, small)]
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                                           initializer=_prepare_forked, initargs=(meteor, items))
        self.futures = [self.pool.submit(_meteor_chunk, *chunk) for chunk in self.chunks]

    def finish(self, meteor, items):
        """The statistics of every item, in order: meteor and items are this process's."""
        meteor.prepare_items(items)
        per_chunk = [None] * len(self.chunks)
        for k in reversed(range(len(self.chunks))):          # from the last chunk back, those the worker has not
            if self.futures[k].cancel():                      # begun (cancel() fails once it has)
                first, end = self.chunks[k]
                per_chunk[k] = meteor.item_stats_many(items[first:end])
        per_chunk = [stats if stats is not None else future.result() for stats, future in zip(per_chunk, self.futures)]
        self.pool.shutdown()
        return [stats for chunk in per_chunk for stats in chunk]

    def abandon(self):
        """Stop the worker (the scorer failed before it needed it)."""
        self.pool.shutdown(wait=True, cancel_futures=True)


# 5. ROUGE-L, for metrics.FastCaptionScorer: metrics.rouge_l (section 2) with less Python per word; the same
# numbers, bit for bit (a test compares them). What it buys of the whole scoring process: BENCHMARKS.md section 6
# (`python -m bench metrics`).
def rouge_l(candidate, references, beta=1.2):
    """metrics.rouge_l with the LCS computed bit-parallel (Allison and Dix 1986, Hyyrö 2004): a bit per candidate
    word, one reference word at a time, V = (V + U) | (V - U) with U = V & (the word's positions); the LCS is the
    number of 0 bits. The same integers, so the same scores."""
    cand = candidate.split(" ")
    positions = {}
    for k, word in enumerate(cand):
        positions[word] = positions.get(word, 0) | (1 << k)
    full, precision, recall = (1 << len(cand)) - 1, 0.0, 0.0
    for reference in references:
        ref = reference.split(" ")
        v = full
        for word in ref:
            mask = positions.get(word)
            if mask is not None:
                u = v & mask
                v = (v + u) | (v - u)
        common = len(cand) - (v & full).bit_count()
        precision = max(precision, common / float(len(cand)))
        recall = max(recall, common / float(len(ref)))
    if precision != 0 and recall != 0:
        return ((1 + beta ** 2) * precision * recall) / float(recall + beta ** 2 * precision)
    return 0.0


# 6. BLEU's and CIDEr-D's n-grams as arrays, for metrics.FastCaptionScorer: metrics.bleu_item_stats and
# metrics.cider_scores over every item at once with numpy, in place of a dict of n-gram strings per caption and
# Python loops over them; the same integers, and the same floats bit for bit (every float is made by the same
# operation on the same operands, and every sum adds the same terms in the same order). What it buys of the whole
# scoring process: BENCHMARKS.md section 6 (`python -m bench metrics`).
# Shape letters: S distinct captions, W their words, E entries (a distinct n-gram of a caption, with its count),
# I items, P (item, reference) pairs, X (item, candidate entry, reference) triples, G distinct n-grams.
def _runs(sorted_keys):
    """The start of each run of equal values in a sorted array (R), and each value's run (the array's size)."""
    new = np.empty(len(sorted_keys), bool)
    new[:1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=new[1:])
    return np.flatnonzero(new), np.cumsum(new) - 1


def _sums(bins, weights, size):
    """np.bincount(bins, weights, size): each bin's weights added one after the other in input order (the order of
    a Python loop's sum), as float64 even when there are none (bincount then gives int64)."""
    return np.bincount(bins, weights=weights, minlength=size).astype(np.float64, copy=False)


def _spans(starts, ends):
    """The indices start..end - 1 of each range, one range after the other (section 2's _ranges)."""
    return _ranges(starts, ends - starts)[1]


class NgramTable:
    """The n-grams (orders 1..n) of every item's candidate and references, numbered: what metrics.bleu_item_stats
    and metrics.cider_scores read of the per-caption dicts of metrics._ngram_counts, as arrays.

    An n-gram is numbered from its (n-1)-gram prefix's number and its last word's. A caption's entries are its
    distinct n-grams, order by order, each in order of first occurrence (the dicts' order), with their counts. The
    candidate's entries are matched once against each of its item's references (the triples X); BLEU's clipped
    counts follow, and CIDEr-D of any subset of the items reads the same matches with that subset's weights.
    """

    def __init__(self, candidates, references, n):
        """candidates: [tokenized caption] per item; references: [[tokenized caption]] per item."""
        index = {}                                           # distinct caption -> its number
        self.cand = np.array([index.setdefault(t, len(index)) for t in candidates], np.int64)               # I
        ref = [index.setdefault(t, len(index)) for refs in references for t in refs]
        self.ref = np.array(ref, np.int64)                                                                   # P
        self.pair_start = np.cumsum([0] + [len(refs) for refs in references])                              # I + 1
        self.n = n
        words = [text.split() for text in index]             # str.split(), as metrics._ngram_counts
        self.length = np.fromiter(map(len, words), np.int64, len(words))                                    # S
        self._entries(words)
        self._match()
        self._item_grams()

    def _entries(self, words):
        """The entries of every caption, order after order; within an order caption after caption, each caption's
        in order of first occurrence: e_sent, e_gram, e_count, e_order (E); e_first and e_end (S x n): where each
        caption's entries of each order lie."""
        vocabulary = dict(zip(dict.fromkeys(itertools.chain.from_iterable(words)), itertools.count()))
        word = np.fromiter(map(vocabulary.__getitem__, itertools.chain.from_iterable(words)), np.int64,
                           int(self.length.sum()))                                                          # W
        n_sent = len(self.length)
        sent = np.repeat(np.arange(n_sent), self.length)                                                   # W
        room = np.repeat(np.cumsum(self.length), self.length) - np.arange(len(word))   # words left, this one too
        gram, parts, bounds = np.empty_like(word), [], []    # gram: the number of the n-gram starting at a word
        offset, placed, prefixes = 0, 0, 1                   # n-grams and entries of the orders before; prefixes
        for order in range(self.n):
            at = np.flatnonzero(room > order)                # where an n-gram of this order starts
            assert prefixes * len(vocabulary) * n_sent < 1 << 63, "too many n-grams to number in int64"
            name = gram[at] * len(vocabulary) + word[at + order] if order else word   # (prefix's number, word)
            # One stable sort by (n-gram, caption): its runs of equal n-grams number them; its runs of equal
            # (n-gram, caption) are a caption's repeats of one n-gram, the first occurrence first.
            rank, key = _stable_sort(name * n_sent + sent[at])
            repeats, _ = _runs(key)
            named, number = _runs(key // n_sent)
            gram[at[rank]] = number
            count = np.zeros(len(at), np.int64)
            count[rank[repeats]] = np.diff(np.r_[repeats, len(key)])
            first = np.flatnonzero(count)                    # caption after caption, each in its words' order
            parts.append((sent[at[first]], offset + gram[at[first]], count[first]))
            bounds.append(placed + np.searchsorted(parts[-1][0], np.arange(n_sent + 1)))
            offset, placed, prefixes = offset + len(named), placed + len(first), len(named)
        self.n_grams = offset
        self.e_sent, self.e_gram, self.e_count = (np.concatenate(c) for c in zip(*parts))                 # E
        self.e_order = np.repeat(np.arange(self.n), [len(p[0]) for p in parts])                           # E
        bounds = np.stack(bounds, axis=1)                                                                  # S+1 x n
        self.e_first, self.e_end = bounds[:-1], bounds[1:]

    def _match(self):
        """Each candidate entry against each reference of its item: the triples X, in (item, candidate entry,
        reference) order. Those whose reference holds the entry's n-gram: x_pair, x_entry, x_count (its count in
        the reference), in that order, x_start (I + 1) each item's first; BLEU's clipped counts (correct: I x n)."""
        refs = np.diff(self.pair_start)                                                                     # I
        entries = (self.e_end - self.e_first)[self.cand].sum(axis=1)                                        # I
        c_entry = _spans(self.e_first[self.cand].ravel(), self.e_end[self.cand].ravel())                  # C
        c_item = np.repeat(np.arange(len(self.cand)), entries)                                              # C
        c_first = np.cumsum(refs[c_item]) - refs[c_item]     # each candidate entry's first triple           # C
        pair = _spans(self.pair_start[c_item], self.pair_start[c_item + 1])                                # X
        # The entries of the candidates' n-grams and the triples sorted together by (caption, n-gram), entries
        # first on a tie (the sort is stable): a run of equal keys starts with the reference's entry, if it has one.
        wanted = np.zeros(self.n_grams, bool)
        wanted[self.e_gram[c_entry]] = True
        side = np.flatnonzero(wanted[self.e_gram])
        rank, key = _stable_sort(np.concatenate((self.e_sent[side] * self.n_grams + self.e_gram[side],
                                                 self.ref[pair] * self.n_grams +
                                                 np.repeat(self.e_gram[c_entry], refs[c_item]))))
        starts, run = _runs(key)
        found = np.flatnonzero((rank[starts] < len(side))[run] & (rank >= len(side)))   # triples with an entry
        by_triple, triple = _stable_sort(rank[found] - len(side))                        # back in triple order
        head = side[rank[starts[run[found[by_triple]]]]]     # the reference's entry of each
        group = np.searchsorted(c_first, triple, side="right") - 1                       # its candidate entry
        self.x_pair, self.x_entry, self.x_count = pair[triple], c_entry[group], self.e_count[head]
        self.x_start = np.searchsorted(c_item[group], np.arange(len(self.cand) + 1))
        # BLEU: a candidate n-gram's count clipped to its largest count in any one reference, summed per order
        # (integers: exact in any order).
        groups, _ = _runs(group)
        most = np.maximum.reduceat(self.x_count, groups) if len(groups) else groups
        entry = c_entry[group[groups]]
        correct = _sums(c_item[group[groups]] * self.n + self.e_order[entry], np.minimum(self.e_count[entry], most),
                        len(self.cand) * self.n)
        self.correct = correct.astype(np.int64).reshape(len(self.cand), self.n)

    def _item_grams(self):
        """The distinct n-grams of each item's references (document frequencies count them): ig_gram, item after
        item, and ig_start (I + 1)."""
        per_pair = (self.e_end - self.e_first)[self.ref].sum(axis=1)                                        # P
        item = np.repeat(np.arange(len(self.cand)), np.diff(self.pair_start))                             # P
        grams = self.e_gram[_spans(self.e_first[self.ref].ravel(), self.e_end[self.ref].ravel())]
        key = np.sort(np.repeat(item, per_pair) * self.n_grams + grams)
        key = key[_runs(key)[0]]
        self.ig_gram = key % self.n_grams
        self.ig_start = np.searchsorted(key, np.arange(len(self.cand) + 1) * self.n_grams)

    def bleu_stats(self, n):
        """metrics.bleu_item_stats of every item, in order: testlen, reflen (the closest reference length, the
        shorter on a tie), guess and correct, as Python ints."""
        testlen = self.length[self.cand]                                                                    # I
        ref_len = self.length[self.ref]                                                                     # P
        item = np.repeat(np.arange(len(self.cand)), np.diff(self.pair_start))                             # P
        wide = int(self.length.max(initial=0)) + 1           # the least (distance, length), as one number
        closest = np.abs(ref_len - testlen[item]) * wide + ref_len
        reflen = np.minimum.reduceat(closest, self.pair_start[:-1]) % wide if len(testlen) else testlen
        guess = np.maximum(0, testlen[:, None] - np.arange(n))
        return [{"testlen": t, "reflen": r, "guess": g, "correct": c} for t, r, g, c in
                zip(testlen.tolist(), reflen.tolist(), guess.tolist(), self.correct[:, :n].tolist())]

    def cider(self, items, n=4, sigma=6.0, log_n_of_one=None):
        """metrics.cider_scores of these items (their numbers, in order; a repeat counts twice, as there), with
        document frequencies over them alone. Returns [score] per item."""
        items = np.asarray(items, np.int64)
        refs = np.diff(self.pair_start)[items]                                                              # I
        # Weights tf * (log N - log df): the logarithm of each distinct df by math.log, as the plain code.
        df = np.bincount(self.ig_gram[_spans(self.ig_start[items], self.ig_start[items + 1])],
                         minlength=self.n_grams)                                                            # G
        log_n = log_n_of_one if len(items) == 1 and log_n_of_one is not None else math.log(float(len(items)))
        values, which = np.unique(df, return_inverse=True)
        idf = np.array([log_n - math.log(float(d)) if d else log_n for d in values.tolist()])[which]    # G
        weight = self.e_count * idf[self.e_gram]             # E: int * float, as the plain code
        used = self.e_order < n
        # Each caption's norm per order: the squares summed in the dicts' order (bincount adds in input order).
        norm = np.sqrt(_sums(self.e_sent[used] * n + self.e_order[used], (weight * weight)[used],
                             len(self.length) * n)).reshape(-1, n)                                          # S x n
        # Each pair's numerator per order: min(w, r) * r over the candidate's n-grams that the reference holds,
        # summed in the candidate's order; divided by the norms where both are non-zero.
        x = _spans(self.x_start[items], self.x_start[items + 1])
        shift = np.repeat(np.cumsum(refs) - refs - self.pair_start[items], np.diff(self.x_start)[items])
        keep = used[self.x_entry[x]]
        x, pair = x[keep], (self.x_pair[x] + shift)[keep]    # pairs numbered among these items' pairs
        entry, count = self.x_entry[x], self.x_count[x]
        cand_w, ref_w = weight[entry], count * idf[self.e_gram[entry]]
        value = _sums(pair * n + self.e_order[entry], np.minimum(cand_w, ref_w) * ref_w,
                      refs.sum() * n).reshape(-1, n)                                                        # P x n
        pairs = _spans(self.pair_start[items], self.pair_start[items + 1])
        cand, ref = np.repeat(self.cand[items], refs), self.ref[pairs]                                      # P
        np.divide(value, norm[cand] * norm[ref], out=value, where=(norm[cand] != 0) & (norm[ref] != 0))
        # The Gaussian length penalty of each pair, lengths in bigrams (as the toolkit), each distinct difference's
        # by Python's float power, as the plain code.
        bigrams = np.maximum(self.length - 1, 0) if n > 1 else np.zeros_like(self.length)
        values, which = np.unique(bigrams[cand] - bigrams[ref], return_inverse=True)
        penalty = np.array([math.e ** (-(float(d) ** 2) / (2 * sigma ** 2)) for d in values.tolist()])[which]
        # Summed over the item's references in order, per order (bincount adds in input order), then over the
        # orders in order; averaged.
        bins = np.repeat(np.arange(len(items)), refs)[:, None] * n + np.arange(n)                         # P x n
        total = _sums(bins.ravel(), (value * penalty[:, None]).ravel(), len(items) * n).reshape(-1, n)      # I x n
        mean = np.zeros(len(items))
        for k in range(n):
            mean = mean + total[:, k]
        return (mean / n / refs * 10.0).tolist()
