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
    5. ROUGE-L's longest common subsequence, bit-parallel.

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
