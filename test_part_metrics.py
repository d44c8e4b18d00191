"""Tests of metrics.py: the coco-caption toolkit's numbers without Java, and stage-1 retrieval metrics.

Known answers come from ../shared/metrics_vectors (the toolkit's output on three corpora). The full METEOR tests need
the METEOR 1.5 data of the PyPI package pycocoevalcap (CI installs it with `pip install --no-deps pycocoevalcap==1.2`);
elsewhere they skip when it is missing. The first full METEOR run builds the paraphrase index (about 15-40 s, once).

Run:  python -m pytest test_part_metrics.py -q
"""
import gzip
import json
import os

import numpy as np
import pytest

import metrics
from test_all import shared

CORPORA = ["edge_cases", "clevr_style_public", "spot_public"]


def load_corpus(name):
    """(raw items, the toolkit's output) of one corpus in ../shared/metrics_vectors."""
    raw = json.loads(shared("metrics_vectors", f"{name}.json").read_text(encoding="utf-8"))
    coco = json.loads(shared("metrics_vectors", f"{name}.coco.json").read_text(encoding="utf-8"))
    return raw["items"], coco


def tokenized(coco):
    """Predictions and references exactly as every toolkit scorer saw them (after its PTB tokenizer)."""
    return ({item["id"]: item["candidate_tok"] for item in coco["items"]},
            {item["id"]: item["references_tok"] for item in coco["items"]})


def needs_meteor_data():
    if metrics.load_meteor_resources() is None:
        message = "the METEOR 1.5 data is missing: pip install --no-deps pycocoevalcap==1.2"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def scored():
    """Each corpus scored from the toolkit's tokens with BLEU, ROUGE-L and CIDEr, once for all tests."""
    cache = {}

    def get(name):
        if name not in cache:
            _, coco = load_corpus(name)
            cache[name] = (metrics.score_captions(*tokenized(coco), metrics=("BLEU", "ROUGE_L", "CIDEr"),
                                                  tokenize=False), coco)
        return cache[name]
    return get


# --- the PTB tokenizer ---

@pytest.mark.parametrize("name", CORPORA)
def test_ptb_tokenizer_gives_the_toolkits_tokens_for_every_raw_caption(name):
    items, coco = load_corpus(name)
    for item, expected in zip(items, coco["items"]):
        assert metrics.ptb_tokenize(item["candidate"]) == expected["candidate_tok"], item["id"]
        assert [metrics.ptb_tokenize(r) for r in item["references"]] == expected["references_tok"], item["id"]


def test_ptb_tokenizer_splits_contractions_keeps_brackets_and_drops_punctuation():
    assert metrics.ptb_tokenize("It's the car's door, can't you see?") == "it 's the car 's door ca n't you see"
    assert metrics.ptb_tokenize("The cube cannot move!!!") == "the cube can not move !!!"
    assert metrics.ptb_tokenize("the (big) cube [red]") == "the -lrb- big -rrb- cube -lsb- red -rsb-"
    assert metrics.ptb_tokenize("10% of $5 costs #1 \u2014 a*b") == "10 % of $ 5 costs # 1 a * b"
    assert metrics.ptb_tokenize("the U.S. cube, e.g. the red one\u2026") == "the u.s. cube e.g. the red one"
    assert metrics.ptb_tokenize("the cube \U0001F642 moved") == "the cube moved"          # emoji are dropped
    assert metrics.ptb_tokenize("the small red cube\r\nmoved") == "the small red cube moved"
    assert metrics.ptb_tokenize("   \t ") == ""


# --- BLEU, ROUGE-L and CIDEr-D, from the toolkit's tokens ---

@pytest.mark.parametrize("name", CORPORA)
def test_bleu_rouge_and_cider_equal_the_toolkit_per_item_and_per_corpus(name, scored):
    result, coco = scored(name)
    for metric, value in result["corpus"].items():
        assert value == pytest.approx(coco["corpus"][metric], abs=1e-6), metric
    for expected in coco["items"]:
        mine = result["items"][expected["id"]]
        for metric, value in mine.items():
            assert value == pytest.approx(expected[metric], abs=1e-6), (expected["id"], metric)


def test_bleu_counts_equal_the_toolkits_summed_statistics():
    _, coco = load_corpus("clevr_style_public")
    scorer = metrics.CaptionScorer(*tokenized(coco), metrics=("BLEU",), tokenize=False)
    total = coco["corpus_bleu_stats"]
    assert sum(s["testlen"] for s in scorer.bleu_stats.values()) == total["testlen"]
    assert sum(s["reflen"] for s in scorer.bleu_stats.values()) == total["reflen"]
    assert [sum(s["correct"][k] for s in scorer.bleu_stats.values()) for k in range(4)] == total["correct"]
    assert [sum(s["guess"][k] for s in scorer.bleu_stats.values()) for k in range(4)] == total["guess"]


def test_bleu_of_an_exact_match_is_not_quite_one_because_of_the_toolkits_epsilons():
    result = metrics.score_captions({1: "the red cube moved", 2: "a blue ball"},
                                    {1: ["the red cube moved"], 2: ["a blue ball"]}, metrics=("BLEU",))
    assert result["items"][1]["BLEU_1"] == pytest.approx(0.9999999995, abs=1e-12)
    assert result["items"][2]["BLEU_4"] == pytest.approx(0.0316, abs=1e-4)     # three words: no 4-gram at all


def test_bleu_takes_the_closest_reference_length_and_the_shorter_on_a_tie():
    stats = metrics.bleu_item_stats(metrics._ngram_counts("a b c d e", 4), 5,
                                    [metrics._ngram_counts("a b c d", 4), metrics._ngram_counts("a b c d e f", 4)],
                                    [4, 6])
    assert stats["reflen"] == 4


def test_rouge_takes_best_precision_and_best_recall_from_different_references():
    # "a b" against ["a b c d" (P 1, R 0.5), "a" (P 0.5, R 1)]: P = 1 and R = 1 although no reference gives both.
    assert metrics.rouge_l("a b", ["a b c d", "a"]) == pytest.approx(1.0)
    assert metrics.rouge_l("", ["", "the cube moved"]) == 1.0       # split(" ") makes "" one empty token


def test_bit_parallel_lcs_equals_dynamic_programming():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = list(rng.integers(0, 5, rng.integers(0, 12)))
        b = list(rng.integers(0, 5, rng.integers(0, 12)))
        table = np.zeros((len(a) + 1, len(b) + 1), int)
        for i in range(len(a)):
            for j in range(len(b)):
                table[i + 1, j + 1] = table[i, j] + 1 if a[i] == b[j] else max(table[i, j + 1], table[i + 1, j])
        assert metrics.lcs_length(a, b) == table[-1, -1]


def test_cider_is_ten_for_a_perfect_match_and_zero_for_a_one_item_corpus():
    result = metrics.score_captions({1: "the red cube moved", 2: "a ball appeared"},
                                    {1: ["the red cube moved"] * 3, 2: ["the blue sphere is gone"]}, metrics=("CIDEr",))
    assert result["items"][1]["CIDEr"] == pytest.approx(10.0)
    alone = metrics.score_captions({1: "the red cube moved"}, {1: ["the red cube moved"]}, metrics=("CIDEr",))
    assert alone["corpus"]["CIDEr"] == 0.0


def test_a_subset_is_rescored_on_its_own_so_its_cider_differs_from_its_items_inside_the_full_set():
    _, coco = load_corpus("clevr_style_public")
    predictions, references = tokenized(coco)
    first_100 = list(predictions)[:100]
    result = metrics.score_subsets(predictions, references, {"first 100": first_100, "all": list(predictions)},
                                   metrics=("CIDEr", "BLEU"), tokenize=False)
    assert result["first 100"]["corpus"]["CIDEr"] == pytest.approx(1.535, abs=5e-4)        # README of the vectors
    assert np.mean([result["all"]["items"][i]["CIDEr"] for i in first_100]) == pytest.approx(1.567, abs=5e-4)
    assert result["all"]["corpus"]["CIDEr"] == pytest.approx(coco["corpus"]["CIDEr"], abs=1e-6)


# --- METEOR ---

def test_snowball_stemmer_gives_the_english_stems():
    # Checked against org.tartarus.snowball.ext.englishStemmer of meteor-1.5.jar, which agrees on 168,703 words.
    examples = {"generously": "generous", "running": "run", "skies": "sky", "cubes": "cube", "moved": "move",
                "dying": "die", "hopped": "hop", "hoping": "hope", "agreed": "agre", "feed": "feed", "bus": "bus",
                "gaps": "gap", "communication": "communic", "spheres": "sphere", "metallic": "metal",
                "shiny": "shini", "largest": "largest", "disappeared": "disappear"}
    assert {word: metrics.snowball_stem(word) for word in examples} == examples


def test_meteor_normaliser_joins_hyphens_splits_apostrophes_and_keeps_abbreviations():
    # Checked against edu.cmu.meteor.util.Normalizer of meteor-1.5.jar, which agrees on 25,470 lines.
    assert metrics.meteor_normalize("the café-coloured cube") == ["the", "café", "coloured", "cube"]
    assert metrics.meteor_normalize("it 's red") == ["it", "'", "s", "red"]
    assert metrics.meteor_normalize("the u.s. cube") == ["the", "us", "cube"]
    assert metrics.meteor_normalize("mr. smith moved") == ["mr.", "smith", "moved"]
    assert metrics.meteor_normalize("the end .") == ["the", "end", "."]


@pytest.mark.parametrize("name", CORPORA)
def test_meteor_with_its_data_equals_the_toolkit(name):
    needs_meteor_data()
    _, coco = load_corpus(name)
    result = metrics.score_captions(*tokenized(coco), metrics=("METEOR",), tokenize=False)
    assert result["info"]["meteor_modules"] == "exact+stem+synonym+paraphrase"
    assert result["corpus"]["METEOR"] == pytest.approx(coco["corpus"]["METEOR"], abs=1e-3)
    close = [abs(result["items"][e["id"]]["METEOR"] - e["METEOR"]) <= 0.01 for e in coco["items"]]
    assert np.mean(close) >= 0.99
    assert all(result["items"][e["id"]]["METEOR"] == pytest.approx(e["METEOR"], abs=1e-12) for e in coco["items"])


@pytest.mark.parametrize("name, modules, toolkit", [
    ("clevr_style_public", ("exact",), 0.3379), ("clevr_style_public", ("exact", "stem"), 0.3414),
    ("spot_public", ("exact",), 0.1663), ("spot_public", ("exact", "stem"), 0.1685)])
def test_meteor_without_its_data_lands_on_the_toolkits_own_exact_and_stem_scores(name, modules, toolkit):
    # The vectors' README gives the toolkit's corpus METEOR run with `-m exact` and `-m "exact stem"`.
    _, coco = load_corpus(name)
    result = metrics.score_captions(*tokenized(coco), metrics=("METEOR",), tokenize=False, meteor_modules=modules)
    assert round(result["corpus"]["METEOR"], 4) == toolkit
    assert result["info"]["meteor_modules"] == "+".join(modules)
    assert "meteor_note" in result["info"]


@pytest.fixture
def no_meteor_data(monkeypatch, tmp_path):
    monkeypatch.setenv(metrics.METEOR_DATA_ENV, str(tmp_path))        # a folder without the jar
    metrics.load_meteor_resources.cache_clear()
    yield
    metrics.load_meteor_resources.cache_clear()


def test_without_the_meteor_data_scoring_falls_back_to_exact_and_stem_and_says_so(no_meteor_data):
    result = metrics.score_captions({1: "the cubes moved"}, {1: ["the cube has moved"]}, metrics=("METEOR",))
    assert result["info"]["meteor_modules"] == "exact+stem"
    assert "the METEOR 1.5 data was not found" in result["info"]["meteor_note"]
    with pytest.raises(metrics.CaptionInputError, match="pip install --no-deps pycocoevalcap"):
        metrics.score_captions({1: "a"}, {1: ["a"]}, metrics=("METEOR",), meteor_modules=metrics.METEOR_MODULES)


def test_meteor_builtin_word_lists_equal_the_jars_files():
    needs_meteor_data()
    import zipfile
    jar = metrics._find_meteor_files()[0]
    with zipfile.ZipFile(jar) as archive:
        words = archive.read("function/english.words").decode("utf-8").split("\n")
        prefixes = archive.read("nonbreaking/english.prefixes").decode("utf-8").split("\n")
    assert metrics.METEOR_FUNCTION_WORDS == {w for w in words if w}
    table = {}
    for line in prefixes:
        parts = line.split()
        if parts and not parts[0].startswith("#"):
            table[parts[0]] = 2 if parts[1:2] == ["#NUMERIC_ONLY#"] else 1
    assert metrics.METEOR_NONBREAKING == table


def test_batched_beam_search_chooses_the_same_alignments_as_the_readable_one():
    needs_meteor_data()
    items, _ = load_corpus("clevr_style_public")
    meteor = metrics.Meteor(resources=metrics.load_meteor_resources())
    pairs = [(metrics.ptb_tokenize(it["candidate"]), metrics.ptb_tokenize(r)) for it in items[:300]
             for r in it["references"]]
    meteor.prepare([text for pair in pairs for text in pair])
    problems, readable = [], []
    for hypothesis, reference in pairs:
        cands, cover1, cover2 = meteor._candidates(meteor.sentence(hypothesis), meteor.sentence(reference))
        fixed, used1, used2, open_choice = metrics._fixed_matches(cands, cover1, cover2)
        if open_choice:
            problems.append((cands, fixed, used1, used2))
            readable.append(meteor._resolve(cands, cover1, cover2, len(cands)))
            meteor._structures.clear()
    assert len(problems) > 100
    assert meteor._resolve_batch(problems) == readable


def test_paraphrase_index_is_built_once_and_keeps_the_tables_order(tmp_path, monkeypatch):
    table = tmp_path / "paraphrase-en.gz"
    triples = [("0.1", "the cube", "the block"), ("0.2", "cube", "block"), ("0.3", "cube", "dice"),
               ("0.4", "red", "crimson"), ("0.5", "the cube", "this cube")]
    table.write_bytes(gzip.compress("".join(f"{p}\n{a}\n{b}\n" for p, a, b in triples).encode()))
    monkeypatch.setenv(metrics.METEOR_CACHE_ENV, str(tmp_path / "cache"))
    resources = metrics.MeteorResources({}, {}, table, str(tmp_path))
    vocabulary = {"the", "cube", "block", "dice", "this"}
    expected = {("the", "cube"): [("the", "block"), ("this", "cube")], ("cube",): [("block",), ("dice",)]}
    assert metrics.load_paraphrases(resources, vocabulary) == expected         # "red" -> "crimson" cannot match
    assert any((tmp_path / "cache").iterdir())
    assert metrics.load_paraphrases(resources, vocabulary) == expected         # now read from the cache


def test_a_forked_meteor_worker_gives_the_same_numbers():
    needs_meteor_data()
    _, coco = load_corpus("clevr_style_public")                               # 2,000 items: above the threshold
    one = metrics.score_captions(*tokenized(coco), tokenize=False, processes=1)
    two = metrics.score_captions(*tokenized(coco), tokenize=False, processes=2)
    assert one["corpus"] == two["corpus"] and one["items"] == two["items"]


def test_end_to_end_from_raw_text_gives_the_toolkits_numbers():
    needs_meteor_data()
    items, coco = load_corpus("edge_cases")
    result = metrics.score_captions({it["id"]: it["candidate"] for it in items},
                                    {it["id"]: it["references"] for it in items})
    for metric, value in coco["corpus"].items():
        assert result["corpus"][metric] == pytest.approx(value, abs=1e-6), metric


# --- retrieval metrics ---

def test_retrieval_ranks_each_caption_against_all_pairs_and_each_pair_against_caption_groups():
    # 3 pairs, 5 captions (2, 2 and 1 per pair). Text ranks: 0, 1, 2, 0, 1.
    sim = np.array([[0.9, 0.1, 0.2],
                    [0.3, 0.8, 0.1],
                    [0.5, 0.4, 0.6],
                    [0.1, 0.7, 0.2],
                    [0.2, 0.3, 0.25]])
    result = metrics.retrieval_metrics(sim, [0, 0, 1, 1, 2])
    assert result["text_to_pair"] == {"R1": 40.0, "R5": 100.0, "R10": 100.0, "MedianR": 2.0, "MeanR": 1.8}
    # A group scores by its best caption: pair 0 -> [0.9, 0.5, 0.2], pair 1 -> [0.8, 0.7, 0.3], pair 2 ->
    # [0.2, 0.6, 0.25]. Pair ranks: 0, 1, 1.
    assert result["pair_to_text"]["R1"] == pytest.approx(100 / 3)
    assert result["pair_to_text"]["MedianR"] == 2.0
    assert result["pair_to_text"]["MeanR"] == pytest.approx(5 / 3)


def test_retrieval_medians_are_torch_lower_median_for_texts_and_numpy_median_for_pairs():
    sim = np.array([[0.9, 0.1, 0.1, 0.1],         # symmetric: both directions have ranks 0, 1, 2, 3
                    [0.1, 0.5, 0.8, 0.2],
                    [0.1, 0.8, 0.3, 0.6],
                    [0.1, 0.2, 0.6, 0.05]])
    result = metrics.retrieval_metrics(sim, [0, 1, 2, 3])
    assert result["text_to_pair"]["MedianR"] == 2.0      # lower of 2 and 3
    assert result["pair_to_text"]["MedianR"] == 2.5      # mean of 2 and 3
    assert result["text_to_pair"]["MeanR"] == result["pair_to_text"]["MeanR"] == 2.5
    assert result["text_to_pair"]["R1"] == 25.0


def test_retrieval_ties_count_against_the_true_match_unless_asked_otherwise():
    constant = np.full((4, 4), 0.5)
    pessimistic = metrics.retrieval_metrics(constant, [0, 1, 2, 3])
    assert pessimistic["text_to_pair"] == {"R1": 0.0, "R5": 100.0, "R10": 100.0, "MedianR": 4.0, "MeanR": 4.0}
    optimistic = metrics.retrieval_metrics(constant, [0, 1, 2, 3], ties="optimistic")
    assert optimistic["text_to_pair"]["R1"] == 100.0 and optimistic["pair_to_text"]["MedianR"] == 1.0
    one_tie = metrics.retrieval_metrics(np.array([[0.5, 0.5, 0.2], [0.1, 0.9, 0.3], [0.0, 0.1, 0.7]]), [0, 1, 2])
    assert one_tie["text_to_pair"]["R1"] == pytest.approx(200 / 3)


def test_retrieval_refuses_a_pair_without_captions():
    with pytest.raises(metrics.CaptionInputError, match="no caption"):
        metrics.retrieval_metrics(np.eye(3), [0, 1, 1])


# --- inputs and the command line ---

def write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return str(path)


def test_command_line_reads_coco_results_and_ground_truth(tmp_path, capsys):
    results = write(tmp_path / "res.json", [{"image_id": 7, "caption": "the red cube moved"},
                                            {"image_id": 8, "caption": "nothing changed"}])
    truth = write(tmp_path / "gt.json", {"images": [{"id": 7}, {"id": 8}], "annotations": [
        {"image_id": 7, "caption": "the red cube has moved", "id": 0},
        {"image_id": 8, "caption": "there is no change", "id": 1},
        {"image_id": 8, "caption": "nothing has changed", "id": 2}]})
    assert metrics.main([results, truth, "--json", "--meteor-modules", "exact,stem", "--processes", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = metrics.score_captions({7: "the red cube moved", 8: "nothing changed"},
                                      {7: ["the red cube has moved"], 8: ["there is no change", "nothing has changed"]},
                                      meteor_modules=("exact", "stem"))
    assert printed["corpus"] == pytest.approx(expected["corpus"])
    assert set(printed["items"]) == {"7", "8"}


def test_command_line_reports_malformed_json_with_file_and_position(tmp_path, capsys):
    broken = write(tmp_path / "broken.json", '[{"image_id": 1, "caption": "a cube"},\n {"image_id": 2 "caption"}]')
    assert metrics.main([broken, broken]) == 2
    error = capsys.readouterr().err
    assert "broken.json" in error and "line 2, column 17" in error


def test_duplicate_prediction_ids_are_refused():
    with pytest.raises(metrics.CaptionInputError, match="duplicate prediction for image_id 3"):
        metrics.read_predictions([{"image_id": 3, "caption": "a"}, {"image_id": 3, "caption": "b"}], "res.json")


def test_a_prediction_without_references_is_refused_with_a_hint_about_id_types():
    with pytest.raises(metrics.CaptionInputError, match="have no references.*same type"):
        metrics.score_captions({5: "a cube"}, {"5": ["a cube"]})


def test_an_empty_reference_list_is_refused():
    with pytest.raises(metrics.CaptionInputError, match="empty list of references"):
        metrics.score_captions({"a": "a cube"}, {"a": []})
