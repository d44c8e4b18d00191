"""How the LEVIR-CC papers score: each paper's own evaluation, reproduced exactly, beside ours. A side trip of
metrics.py (its section 7 points here).

The remote-sensing change-captioning papers (RSICCformer, PSNet, PromptCC, Chg2Cap, SEN, RSCaMa, ...) score with a
copy of coco-caption called as github.com/Chen-Yang-Liu/RSICC utils.py `get_eval_score` does: each caption becomes
the string of its words' vocabulary ids ("12 40 7"), a word outside the vocabulary <unk>'s id in the references too,
no PTB tokenizer, and the same four scorers on those strings. METEOR (the jar with its four modules) then matches
almost only exactly: no id is one of its function words, and ids have no stems or synonyms; its paraphrase table
alone still joins a few phrases of numbers, so METEOR, and METEOR alone, depends a little on which number a word
gets. So the vocabulary, and the order of its ids, are part of the score, and the papers build theirs differently:

    paper     test script      vocabulary (counted over all three splits)           ids                 pairs
    rsicc     RSICC eval.py    words of `tokens` seen more than 5 times              in order of first   split
                               (utils.py create_input_files)                         appearance, from 1
    rscama    RSCaMa test.py   words of `raw` tokenized its way, more than 5 times   sorted, after       file-name
                               (preprocess_data.py; its shipped vocab.json is the    <NULL> <UNK>        prefix
                               at-least-5 one: give it with vocabulary=)             <START> <END>
    chg2cap   Chg2Cap test.py  the same, seen at least 5 times                       the same            the same

Then each script's own rules: RSICC shuffles each pair's references (random.sample, seed 123, over all splits in
turn) and calls a pair unchanged when its second reference is a no-change sentence; Chg2Cap, when its first is;
RSCaMa scores the whole test split only. All three score a subset on its own, with the copy's CIDEr-D, which sets
log N to 1 for a one-item set (cider_scorer.py `if len(self.crefs) == 1: self.ref_len = 1`), where the toolkit's
gives 0. They report S*m = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4, x100.

This file holds, top to bottom:
    1. the papers' words: preprocess_data.py's tokenizer; a prediction's words
    2. the papers' vocabularies (PAPERS: the rules), or a paper's own vocab.json / WORDMAP file
    3. a split as a paper's test script sees it: the pairs, their references as ids, the unchanged pairs
    4. scoring as a paper does (score_as), printed as its script prints (format_as)
    5. the --eval table of caption.py: ours beside the field's (score_both_ways, format_both_ways)
A prediction is text; a paper's model writes ids. A word of the paper's vocabulary is its id; any other word is
<unk>'s, as the paper's own model could only have said <unk>; start, end and padding words are dropped, as the
scripts drop their ids. So a paper's own decoded captions score exactly as its script scored them.

The scorer is passed in (metrics.CaptionScorer or metrics.FastCaptionScorer): this file does not import metrics.py.
"""
import dataclasses
import random
from collections import Counter
from dataclasses import dataclass

from scoring.meteor import CaptionInputError

MIN_COUNT = 5                 # every paper's word_count_threshold / min_word_freq
# The five sentences of every unchanged LEVIR-CC pair, as the scripts list them (RSICC eval.py `nochange_list`),
# each followed by the space their decoding leaves after every word.
NO_CHANGE_LIST = ("the scene is the same as before ", "there is no difference ", "the two scenes seem identical ",
                  "no change has occurred ", "almost nothing has changed ")
SUBSETS = ("whole", "change", "no change")
METRICS = ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr")
FIELD_METRICS = (*METRICS, "S*m")
CIDER_LOG_N_OF_ONE = 1.0      # the copy's CIDEr-D: log N of a one-item set (`self.ref_len = 1`)


# ---------------------------------------------------------------------------------------------------------------
# 1. The papers' words
# ---------------------------------------------------------------------------------------------------------------
def raw_tokens(raw):
    """A `raw` sentence as github.com/Chen-Yang-Liu/RSCaMa and ShizhenChang/Chg2Cap preprocess_data.py `tokenize`
    it: "," and ";" split off as tokens, "." and "?" dropped, split on single spaces, <START> and <END> added.
    " a road is built, near 0.5km ." -> ['<START>', 'a', 'road', 'is', 'built', ',', 'near', '05km', '<END>']."""
    for mark in (";", ","):
        raw = raw.replace(mark, " " + mark)
    for mark in ("?", "."):
        raw = raw.replace(mark, "")
    tokens = raw.split(" ")
    for token in tokens:    # as there: removing while iterating skips the next token: "a   b" keeps one ""
        if token == "":
            tokens.remove(token)
    if not tokens:          # there an IndexError on tokens[0]
        raise CaptionInputError(f"the sentence {raw!r} has no words; preprocess_data.py cannot read it")
    if tokens[0] == "":
        tokens.remove(tokens[0])
    if tokens and tokens[-1] == "":
        tokens.remove(tokens[-1])
    return ["<START>", *tokens, "<END>"]


def field_words(text):
    """A caption as the field's words. CLIP's tokenizer decodes a hyphenated word with spaces around the hyphen
    ("lower - right"); the field's captions keep it one word ("lower-right")."""
    return text.replace(" - ", "-").split()


def prediction_words(text, paper):
    """The words of a predicted caption, as the paper's references are made: hyphens joined (field_words), and
    for the papers that tokenize `raw`, its tokenizer's marks (a final "." dropped, "," split off)."""
    text = " ".join(field_words(text))
    return raw_tokens(text)[1:-1] if paper.text == "raw" and text else text.split()


# ---------------------------------------------------------------------------------------------------------------
# 2. The papers' vocabularies
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Paper:
    """One paper's evaluation: where its numbers come from and the rules its code follows."""
    name: str
    script: str               # the test script whose printout format_as repeats
    text: str                 # "tokens" or "raw": the field of a sentence its preprocessing reads
    more_than: bool           # a word needs more than MIN_COUNT occurrences (else at least MIN_COUNT)
    sorted_ids: bool          # ids in sorted word order after the specials (else in order of first appearance)
    split_by_name: bool       # a pair's split is its file name's prefix, "test_000001.png" (else its "split")
    no_change_reference: int | None   # which reference says a pair is unchanged; None: the whole split only
    shuffled: bool            # references in create_input_files's random.sample order, seed 123
    specials: tuple           # (unknown, start, end, padding) as the word map names them


RSICC_SPECIALS = ("<unk>", "<start>", "<end>", "<pad>")
RSCAMA_SPECIALS = ("<UNK>", "<START>", "<END>", "<NULL>")   # ids 1, 2, 3, 0 (preprocess_data.py SPECIAL_TOKENS)
PAPERS = {
    "rsicc": Paper("rsicc", "github.com/Chen-Yang-Liu/RSICC eval.py", "tokens", True, False, False, 1, True,
                   RSICC_SPECIALS),
    "rscama": Paper("rscama", "github.com/Chen-Yang-Liu/RSCaMa test.py", "raw", True, True, True, None, False,
                    RSCAMA_SPECIALS),
    "chg2cap": Paper("chg2cap", "github.com/ShizhenChang/Chg2Cap test.py", "raw", False, True, True, 0, False,
                     RSCAMA_SPECIALS),
}
RSICC_MAX_LEN = 50            # create_input_files(max_len=50): a longer sentence is not a reference (but counted)
RSICC_SEED = 123              # create_input_files: seed(123) before sampling every pair's references
CAPTIONS_PER_IMAGE = 5


def sentence_tokens(sentence, paper, where):
    """The tokens a paper's preprocessing reads from one sentence record (with <START> and <END> for `raw`)."""
    value = sentence.get(paper.text) if isinstance(sentence, dict) else None
    if paper.text == "tokens":
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise CaptionInputError(f"{where}: no 'tokens' list; {paper.script.split()[0]} reads each sentence's "
                                    f"'tokens' (use --as rscama or chg2cap, which read 'raw')")
        return value
    if not isinstance(value, str) or not value:
        raise CaptionInputError(f"{where}: no 'raw' text; preprocess_data.py reads each sentence's 'raw' "
                                f"(use --as rsicc, which reads 'tokens')")
    return raw_tokens(value)


def paper_vocabulary(records, paper):
    """{word: id}: the word map the paper's preprocessing writes from these LevirCCcaptions.json records."""
    counts = Counter()    # insertion order: the order of first appearance
    for r, record in enumerate(records):
        for s, sentence in enumerate(record["sentences"]):
            counts.update(sentence_tokens(sentence, paper, f"record {r}, sentence {s}"))
    if paper.name == "rsicc":   # utils.py: word_freq[w] > min_word_freq; ids from 1; <unk> <start> <end> next
        words = [w for w in counts if counts[w] > MIN_COUNT]
        word_map = {w: k + 1 for k, w in enumerate(words)}
        for special in RSICC_SPECIALS[:3]:
            word_map[special] = len(word_map) + 1
        word_map["<pad>"] = 0
        return word_map
    word_map = {"<NULL>": 0, "<UNK>": 1, "<START>": 2, "<END>": 3}    # preprocess_data.py build_vocab
    for word, count in sorted(counts.items()):
        if word not in word_map and (count > MIN_COUNT if paper.more_than else count >= MIN_COUNT):
            word_map[word] = len(word_map)
    return word_map


def checked_word_map(data, paper, path):
    """A paper's own word map ({word: id}: RSCaMa's data/LEVIR_CC/vocab.json, RSICC's WORDMAP_*.json), checked."""
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in data.items()):
        raise CaptionInputError(f"{path}: a word map is a JSON object {{word: id}}, such as RSCaMa's vocab.json")
    missing = [s for s in paper.specials if s not in data]
    if missing:
        raise CaptionInputError(f"{path}: no {missing} in it; --as {paper.name} needs a word map with "
                                f"{list(paper.specials)} (RSICC's WORDMAP has <unk>..., RSCaMa's vocab.json <UNK>...)")
    if len(set(data.values())) < len(data):
        raise CaptionInputError(f"{path}: two words share an id; a word map gives each word its own")
    return data


# ---------------------------------------------------------------------------------------------------------------
# 3. A split as a paper's test script sees it
# ---------------------------------------------------------------------------------------------------------------
def checked_records(data, path):
    """The "images" records of a LevirCCcaptions.json, each with filename, split and sentences."""
    if not is_levir(data):
        raise CaptionInputError(f"{path}: not a LevirCCcaptions.json ({{\"images\": [{{\"filename\", \"split\", "
                                f"\"sentences\"}}, ...]}})")
    for n, record in enumerate(data["images"]):
        if not isinstance(record, dict) or not all(k in record for k in ("filename", "split", "sentences")):
            raise CaptionInputError(f"{path}: record {n} needs 'filename', 'split' and 'sentences'")
        if not isinstance(record["sentences"], list) or not isinstance(record["filename"], str):
            raise CaptionInputError(f"{path}: record {n} ({record['filename']!r}): 'sentences' should be a list")
    return data["images"]


def is_levir(data):
    """Whether parsed JSON is in LevirCCcaptions.json's form."""
    return isinstance(data, dict) and isinstance(data.get("images"), list) and "annotations" not in data and \
        all(isinstance(r, dict) and "sentences" in r for r in data["images"][:1])


def record_split(record, paper):
    """The split a paper puts a record in: its file name's prefix (preprocess_data.py `i.split('_')[0]`), or its
    "split" (create_input_files, where "restval" is train)."""
    if paper is not None and paper.split_by_name:
        return record["filename"].split(".")[0].split("_")[0]
    return "train" if record["split"] == "restval" else record["split"]


def prediction_keys(predictions, records, paper=None, every_pair=True):
    """{prediction id: record index}, a prediction named by its pair's filename ("test_000001.png"), the name without
    its extension, or its "imgid"; every prediction of one split, and (every_pair) every pair of that split
    predicted, as the papers score."""
    names = {}
    for n, record in enumerate(records):
        for key in (record["filename"], record["filename"].rsplit(".", 1)[0], record.get("imgid")):
            if key is not None:
                names.setdefault(key, n)
    unknown = [i for i in predictions if i not in names]
    if unknown:
        raise CaptionInputError(f"{len(unknown)} prediction id(s) name no pair of the LevirCCcaptions.json, e.g. "
                                f"{unknown[:3]}; name a pair by its filename (\"test_000001.png\") or imgid")
    index = {i: names[i] for i in predictions}
    if len(set(index.values())) < len(index):
        seen = set()
        twice = next(n for n in index.values() if n in seen or seen.add(n))
        raise CaptionInputError(f"two predictions name the pair {records[twice]['filename']} (by filename, name or "
                                f"imgid); keep one caption per pair")
    splits = sorted({record_split(records[n], paper) for n in index.values()})
    if len(splits) > 1:
        named = " (by their file names' prefix, as preprocess_data.py reads them: test_000001.png)" \
            if paper is not None and paper.split_by_name else ""
        raise CaptionInputError(f"the predictions name pairs of {len(splits)} splits{named}: {splits[:5]}; score "
                                f"one split")
    ordered = [n for n, r in enumerate(records) if record_split(r, paper) == splits[0]]
    missing = sorted(set(ordered) - set(index.values()))
    if missing and every_pair:
        raise CaptionInputError(f"{len(missing)} of the {len(ordered)} {splits[0]} pairs have no prediction, e.g. "
                                f"{[records[n]['filename'] for n in missing[:3]]}; the papers score every pair of "
                                f"the split")
    return index, splits[0]


def rsicc_references(records, paper):
    """{record index: five token lists} as create_input_files writes them: the sentences of at most 50 tokens, five
    drawn with random.sample (or padded with random.choice), pair after pair, train then val then test."""
    rng, drawn = random.Random(RSICC_SEED), {}
    for split in ("train", "val", "test"):
        for n, record in enumerate(records):
            if record_split(record, None) != split:
                continue
            tokens = [sentence_tokens(s, paper, f"{record['filename']}, sentence {k}")
                      for k, s in enumerate(record["sentences"])]
            captions = [t for t in tokens if len(t) <= RSICC_MAX_LEN]
            if not captions:
                continue     # create_input_files: `continue`, the pair is in no split
            if len(captions) < CAPTIONS_PER_IMAGE:
                drawn[n] = captions + [rng.choice(captions) for _ in range(CAPTIONS_PER_IMAGE - len(captions))]
            else:
                drawn[n] = rng.sample(captions, k=CAPTIONS_PER_IMAGE)
    return drawn


def encode(tokens, word_map, paper):
    """Token ids as the paper's test script keeps them: unknown words <unk>'s id, start/end/padding dropped."""
    unknown, start, end, pad = (word_map[s] for s in paper.specials)
    ids = [word_map.get(token, unknown) for token in tokens]
    return [i for i in ids if i not in (start, end, pad)]


def decode(ids, word_map, paper):
    """Ids back to words, each followed by a space, as the scripts print a caption to compare with NO_CHANGE_LIST:
    RSICC eval.py's get_key (the first word with that id), the others' list(word_vocab.keys())[id]."""
    if paper.name == "rsicc":
        words = {v: k for k, v in reversed(list(word_map.items()))}
        return "".join(words[i] + " " for i in ids)
    keys = list(word_map)
    return "".join(keys[i] + " " for i in ids)


def paper_split(predictions, records, paper, word_map):
    """The paper's test set: {"ids", "hypotheses", "references" (id strings), "unchanged" (set of ids)}."""
    index, split = prediction_keys(predictions, records, paper)
    order = sorted(index, key=index.get)           # the file's order: the scripts' test order
    drawn = rsicc_references(records, paper) if paper.shuffled else None
    if drawn is not None:                          # a pair without a sentence of at most 50 tokens: in no split
        order = [i for i in order if index[i] in drawn]
    hypotheses, references, unchanged = {}, {}, set()
    for i in order:
        n = index[i]
        where = f"{records[n]['filename']}"
        if drawn is not None:
            tokens = drawn[n]
        else:
            tokens = [sentence_tokens(s, paper, f"{where}, sentence {k}")
                      for k, s in enumerate(records[n]["sentences"])]
        if not tokens:
            raise CaptionInputError(f"{where}: no sentences")
        reference_ids = [encode(t, word_map, paper) for t in tokens]
        hypothesis_ids = encode(prediction_words(predictions[i], paper), word_map, paper)
        hypotheses[i] = " ".join(map(str, hypothesis_ids))
        references[i] = [" ".join(map(str, ids)) for ids in reference_ids]
        if paper.no_change_reference is not None and len(reference_ids) > paper.no_change_reference and \
                decode(reference_ids[paper.no_change_reference], word_map, paper) in NO_CHANGE_LIST:
            unchanged.add(i)
    said = {i: decode([int(x) for x in hypotheses[i].split()], word_map, paper) in NO_CHANGE_LIST
            for i in order}
    return {"ids": order, "split": split, "hypotheses": hypotheses, "references": references,
            "unchanged": unchanged, "said_no_change": said}


def levir_captions(predictions, records):
    """{prediction id: [captions]} of the predicted split's pairs, for scoring them our way: each sentence's
    "tokens" joined by spaces, or its "raw" tokenized as preprocess_data.py does (data.py's levir_caption)."""
    index, _ = prediction_keys(predictions, records, every_pair=False)
    out = {}
    for i, n in index.items():
        out[i] = [" ".join(s["tokens"]) if isinstance(s, dict) and isinstance(s.get("tokens"), list) and s["tokens"]
                  else " ".join(raw_tokens(str(s.get("raw", "")) if isinstance(s, dict) else "")[1:-1])
                  for s in records[n]["sentences"]]
    return out


# ---------------------------------------------------------------------------------------------------------------
# 4. Scoring as a paper does, printed as its script prints
# ---------------------------------------------------------------------------------------------------------------
def score_each(scorer, hypotheses, references, subsets):
    """{subset: result} of id strings, each subset scored on its own by the scorer class passed in, with the copy's
    CIDEr-D (log N = 1 for a one-item set)."""
    scored = scorer(hypotheses, references, tokenize=False)
    # CIDEr-D is computed in score(), from this config (a one-item set never starts FastCaptionScorer's worker, which
    # computes the whole set's CIDEr-D early)
    scored.config = dataclasses.replace(scored.config, cider_log_n_of_one=CIDER_LOG_N_OF_ONE)
    return {name: scored.score(ids) for name, ids in subsets.items() if ids}


def s_star_m(corpus):
    """The papers' S*m of a corpus's scores, x100 like theirs."""
    return 100 * (corpus["BLEU_4"] + corpus["METEOR"] + corpus["ROUGE_L"] + corpus["CIDEr"]) / 4


def score_as(paper, predictions, records, scorer, word_map=None):
    """The paper's scores of {id: caption} against LevirCCcaptions.json's records: {"paper", "script", "split",
    "subsets": {name: {metric: score (0-1, as the script prints), "S*m": x100}}, "sizes", "accuracy" (of saying
    no change, or a change, as the script counts it), "items" (the whole split's per-pair scores), "info"}.
    word_map: the paper's own file ({word: id}); by default the one its preprocessing builds from the records."""
    word_map = word_map if word_map is not None else paper_vocabulary(records, paper)
    seen = paper_split(predictions, records, paper, word_map)
    subsets = {"whole": seen["ids"]}
    if paper.no_change_reference is not None:
        subsets["change"] = [i for i in seen["ids"] if i not in seen["unchanged"]]
        subsets["no change"] = [i for i in seen["ids"] if i in seen["unchanged"]]
    results = score_each(scorer, seen["hypotheses"], seen["references"], subsets)
    accuracy = {"change": [not seen["said_no_change"][i] for i in subsets.get("change", [])],
                "no change": [seen["said_no_change"][i] for i in subsets.get("no change", [])]}
    whole = results["whole"]
    return {"paper": paper.name, "script": paper.script, "split": seen["split"], "vocabulary": len(word_map),
            "subsets": {name: {**r["corpus"], "S*m": s_star_m(r["corpus"])} for name, r in results.items()},
            "sizes": {name: len(ids) for name, ids in subsets.items()},
            "accuracy": {name: sum(hits) / len(hits) for name, hits in accuracy.items() if hits},
            "items": {i: {"hypothesis": seen["hypotheses"][i], **whole["items"][i]} for i in seen["ids"]},
            "info": whole["info"]}


def _scores_line(scores, digits):
    """Chg2Cap's and RSCaMa's line: 'BLEU-1: 0.8123\\tBLEU-2: ...\\tCider: 1.3456\\t'."""
    names = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "Meteor", "Rouge", "Cider")
    return "".join(f"{name}: {scores[m]:.{digits}f}\t" for name, m in zip(names, METRICS))


def _rsicc_eval_score(scores):
    """RSICC utils.py get_eval_score prints each scorer's result: print("{} {}".format(method_i, score_i))."""
    bleu = [scores[f"BLEU_{k}"] for k in range(1, 5)]
    return [f"{['Bleu_1', 'Bleu_2', 'Bleu_3', 'Bleu_4']} {bleu}",
            *(f"{name} {scores[name]}" for name in ("METEOR", "ROUGE_L", "CIDEr"))]


def format_as(result, seconds=0.0):
    """The lines the paper's test script prints (Time: the scoring's seconds here, its decoding's there), then
    what it does not print: S*m and which rules were followed."""
    subsets, sizes, accuracy = result["subsets"], result["sizes"], result["accuracy"]
    lines = []
    if result["paper"] in ("rsicc", "chg2cap"):
        lines += [f"len(nochange_references): {sizes['no change']}", f"len(change_references): {sizes['change']}"]
        for name, label in (("no change", "nochange"), ("change", "change")):
            if sizes[name]:
                lines.append(f"{label}_metric:")
                lines += _rsicc_eval_score(subsets[name]) if result["paper"] == "rsicc" else \
                    [_scores_line(subsets[name], 4)]
                lines.append(f"{label}_acc: {accuracy[name]}")
    whole = subsets["whole"]
    if result["paper"] == "rsicc":
        lines.append("." * 55)
        lines += _rsicc_eval_score(whole)
        lines.append("trans - beam size 1: " + " ".join(
            f"{name} {whole[m]}" for name, m in zip(("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE_L",
                                                     "CIDEr"), METRICS)))
    else:
        lines += ["Testing:", f"Time: {seconds:.3f}\t" + _scores_line(whole, 5 if result["paper"] == "rscama" else 4)]
    lines.append(f"S*m {whole['S*m']:.2f} = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4 x 100, on the "
                 f"{sizes['whole']:,} {result['split']} pairs; as {result['script']} scores them: vocabulary of "
                 f"{result['vocabulary']:,} ids, METEOR {result['info'].get('meteor_modules')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# 5. caption.py --eval's table: ours beside the field's
# ---------------------------------------------------------------------------------------------------------------
def field_vocabulary(captions, min_count=MIN_COUNT):
    """{word: id} of the words seen at least min_count times in captions (words as field_words splits them),
    numbered after <NULL> <UNK> <START> <END> in sorted order: Chg2Cap's preprocess_data.py rule (RSCaMa's script
    counts more than 5 times, though the vocab.json it ships is this one)."""
    counts = Counter(word for caption in captions for word in field_words(caption))
    words = sorted(word for word, n in counts.items() if n >= min_count)
    return {word: len(RSCAMA_SPECIALS) + k for k, word in enumerate(words)}


def field_ids(text, vocabulary):
    """The string the field's scorers see: each word's id, <UNK>'s (1) for a word outside the vocabulary."""
    unknown = 1
    return " ".join(str(vocabulary.get(word, unknown)) for word in field_words(text))


def score_both_ways(predictions, references, subsets, vocabulary, scorer):
    """{"project": {subset: scores}, "field": {subset: scores}, ...}, every score x100 with S*m, each subset
    re-scored on its own: the project's way (words, PTB tokens) and the field's (vocabulary ids, no tokenizer, the
    copy's one-item CIDEr-D), METEOR with all four modules where its data is found, as the jar runs. Both score the
    same words: hyphens joined as in the field's captions."""
    # differs from reference: its captions are scored as decoded; here "lower - right" is "lower-right" again
    predictions = {i: " ".join(field_words(c)) for i, c in predictions.items()}
    references = {i: [" ".join(field_words(r)) for r in references[i]] for i in predictions}
    ids = {i: field_ids(c, vocabulary) for i, c in predictions.items()}
    id_references = {i: [field_ids(r, vocabulary) for r in references[i]] for i in predictions}
    ours = scorer(predictions, references)
    ways = {"project": {name: ours.score(members) for name, members in subsets.items()},
            "field": score_each(scorer, ids, id_references, subsets)}
    table = {way: {name: {**{k: 100 * v for k, v in result["corpus"].items()}, "S*m": s_star_m(result["corpus"])}
                   for name, result in results.items()} for way, results in ways.items()}
    table["sizes"] = {name: len(ids) for name, ids in subsets.items()}
    table["meteor_modules"] = next(iter(ways["project"].values()))["info"].get("meteor_modules")
    table["vocabulary"] = len(vocabulary)
    return table


def format_both_ways(table):
    """The papers' table, x100: each subset scored the project's way and the field's, one line each; what the field's
    numbers mean under it."""
    names = {"CIDEr": "CIDEr-D", "ROUGE_L": "ROUGE-L"}
    lines = [f"{'x100':<22}{'pairs':>6}  " + " ".join(f"{names.get(m, m.replace('_', '-')):>7}" for m in FIELD_METRICS)]
    for name, size in table["sizes"].items():
        for way, label in (("project", "ours"), ("field", "field's")):
            scores = table[way][name]
            lines.append(f"{name + ', ' + label:<22}{size:>6,}  "
                         + " ".join(f"{scores[m]:7.2f}" for m in FIELD_METRICS))
    lines.append(f"ours: words, PTB tokens, METEOR {table['meteor_modules']}")
    lines.append(f"field's: vocabulary-id strings (the {table['vocabulary']:,} words seen >= {MIN_COUNT} times "
                 f"in the captions, others <unk>, kept in references), no PTB tokenizer, METEOR on the ids (exact "
                 f"matches but for a few number phrases), as Chg2Cap's test.py scores (RSICC utils.py get_eval_score); "
                 f"python metrics.py --as rsicc|rscama|chg2cap scores as each paper's code")
    lines.append("no change: every unchanged pair has the same five references, so each n-gram of them is in every "
                 "item and weighs log(N/N) = 0 in CIDEr-D: 0 for any caption (a one-item subset: the field's copy "
                 "sets log N = 1)")
    lines.append("<unk>: a word outside the vocabulary is <unk> in a reference and in a caption alike, so an unknown "
                 "word said matches any unknown word of the references in the field's scores")
    lines.append("S*m = (BLEU-4 + METEOR + ROUGE-L + CIDEr-D) / 4")
    return "\n".join(lines)
