"""The coco-caption toolkit's other parts, in plain Python, beside metrics.py's lesson: side trips, not the method.

metrics.py holds BLEU, ROUGE-L, CIDEr-D and the scorer that runs them as the toolkit does; this folder holds what the
scorer leans on, each equal to the Java toolkit (field.py: to the papers' code run with it) on the corpora in
tests/metrics_vectors:

  ptb.py     the Penn Treebank tokenizer every scorer reads captions through (Stanford PTBTokenizer 3.4.1, as
             pycocoevalcap runs it), and its shortcut for plain captions.
             test_ptb_tokenizer_gives_the_toolkits_tokens_for_every_raw_caption
  meteor.py  METEOR 1.5: exact, stem, synonym and paraphrase matching, the alignment, the score; its resources,
             normaliser and stemmer.  test_meteor_with_its_data_equals_the_toolkit
  fast.py    the speed variants metrics.FastCaptionScorer selects: METEOR's paraphrase index, its pairs as arrays and
             batched beam search, the paused garbage collector, a forked METEOR worker; each gives the plain code's
             numbers.
             test_batched_beam_search_chooses_the_same_alignments_as_the_readable_one
  field.py   how the LEVIR-CC papers score: each paper's evaluation (RSICC, RSCaMa, Chg2Cap) exactly, its vocabulary
             rule and id order, its unchanged pairs, its one-item CIDEr-D, its printout; caption.py's table of both
             ways. metrics.py passes it the scorer class (this folder never imports metrics.py).
             test_each_levir_cc_papers_evaluation_gives_what_its_own_code_gave_every_subset_to_the_last_bit

Nothing here imports torch or a file above this folder.
"""
