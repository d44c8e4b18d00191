"""Speed variants of the scorer: the same numbers as scoring/meteor.py and metrics.py, faster.

Each stands in for a plain step of the lesson, says what it buys of the whole scoring process (BENCHMARKS.md
section 6, `python -m bench metrics`: with and without it, beside the Java toolkit), and a test checks that it gives
exactly what the plain code gives. metrics.FastCaptionScorer is the one place that selects them; the training
scripts score with it (caption.SCORER). It holds, top to bottom:

    1. the paraphrase index: METEOR's paraphrase table turned once into a word-id index cached on disk, for
       meteor.read_paraphrases;
    2. FastMeteor: many items at once (a batched beam search), from per-word records;
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

import numpy as np

from scoring.meteor import (METEOR_CACHE_ENV, METEOR_FUNCTION_WORDS, PARAPHRASE_INDEX_VERSION, Meteor,
                            _fixed_matches, _MeteorSentence, _positions)

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


# 2. Many items at once, for meteor.Meteor.item_stats_many. The beam search of Meteor._resolve, one alignment
# at a time in Python, is about half of METEOR's time. FastMeteor.item_stats_many collects the alignments of many
# items that need a search (each distinct one once) and runs that same search on all of them together with numpy,
# step for step, so that every tie is broken the same way. What it buys of the whole scoring process: BENCHMARKS.md
# section 6 (`python -m bench metrics`).
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
        buys: BENCHMARKS.md section 6 (`python -m bench metrics`)."""
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
def _stable_sort(keys):
    """(np.argsort(keys, kind="stable"), keys in that order) of non-negative int64 keys: where a key and its index
    fit in 63 bits together, one np.sort of key * 2^bits + index (several times faster than a stable argsort)."""
    bits = max(1, (len(keys) - 1).bit_length())
    if len(keys) == 0 or int(keys.max()) >= 1 << (63 - bits):
        order = np.argsort(keys, kind="stable")
        return order, keys[order]
    packed = np.sort((keys << bits) | np.arange(len(keys)))
    return packed & ((1 << bits) - 1), packed >> bits


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


def _ranges(starts, ends):
    """The indices start..end - 1 of each range, one range after the other."""
    sizes = ends - starts
    return np.repeat(starts - np.cumsum(sizes) + sizes, sizes) + np.arange(sizes.sum())


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
        c_entry = _ranges(self.e_first[self.cand].ravel(), self.e_end[self.cand].ravel())                  # C
        c_item = np.repeat(np.arange(len(self.cand)), entries)                                              # C
        c_first = np.cumsum(refs[c_item]) - refs[c_item]     # each candidate entry's first triple           # C
        pair = _ranges(self.pair_start[c_item], self.pair_start[c_item + 1])                                # X
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
        grams = self.e_gram[_ranges(self.e_first[self.ref].ravel(), self.e_end[self.ref].ravel())]
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
        df = np.bincount(self.ig_gram[_ranges(self.ig_start[items], self.ig_start[items + 1])],
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
        x = _ranges(self.x_start[items], self.x_start[items + 1])
        shift = np.repeat(np.cumsum(refs) - refs - self.pair_start[items], np.diff(self.x_start)[items])
        keep = used[self.x_entry[x]]
        x, pair = x[keep], (self.x_pair[x] + shift)[keep]    # pairs numbered among these items' pairs
        entry, count = self.x_entry[x], self.x_count[x]
        cand_w, ref_w = weight[entry], count * idf[self.e_gram[entry]]
        value = _sums(pair * n + self.e_order[entry], np.minimum(cand_w, ref_w) * ref_w,
                      refs.sum() * n).reshape(-1, n)                                                        # P x n
        pairs = _ranges(self.pair_start[items], self.pair_start[items + 1])
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
