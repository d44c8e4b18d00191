"""Check a downloaded dataset, and draw its pairs: what to run after a download, before hours of training.

- `check_dataset` (`python check.py --data clevr`, or spot, ier, levir, pairs, synth; `--data_root DIR`): reads
  every split, decodes every image whole (in parallel when there are many), compares the counts with the published
  ones (LEVIR-CC's change and no-change pairs too), and prints what is there and what is not; exit status 1 when
  something is missing or unreadable.
- `contact_sheet` (`python check.py --show [--data synth] [--split test] [--n 6] [--model-view] [--out sheet.png]`):
  a PNG with one row per pair, its images and captions; caption.py draws its test grid with it, the predicted
  captions above the references.
"""
import argparse
import multiprocessing
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

import clip
from data import (CHANGE_TYPES, CHANGED, DISTRACTOR, LEVIR_NO_CHANGE, MAX_WORDS, SOURCES, SPLITS, UNCHANGED,
                  DataError, ImagePair, bpe_path, dataset_root, load_split, read_clevr_change, read_json, repair,
                  rgb_view, training_captions, usable_cpus)
from explain import contact_sheet
from plumbing import clip_files
from plumbing.progress import Progress

# -----------------------------------------------------------------------------
# Checking a download

PUBLISHED = {  # (pairs, references) per split as the datasets publish them; None where no count is published
    "clevr": {"train": (33_830, None), "val": (1_988, None), "test": (3_985, None)},  # RCC's splits.json
    "spot": {"train": (8_566, 17_676), "val": (1_493, 3_310), "test": (1_270, 2_107)},  # spot-the-diff's, unique img_ids
    "ier": {"train": (3_061, 3_061), "val": (383, 1_149), "test": (495, 1_485)},        # VisualRelationships' adobe
    # LEVIR-CC: Liu et al., TGRS 2022, Table I (github.com/Chen-Yang-Liu/RSICC Example/num.png), 5 sentences a pair
    "levir": {"train": (6_815, 34_075), "val": (1_333, 6_665), "test": (1_929, 9_645)},
}
PUBLISHED_KINDS = {  # (changed, unchanged) pairs per split, where a dataset publishes them (the same Table I)
    "levir": {"train": (3_407, 3_408), "val": (667, 666), "test": (964, 965)},
}

CLEVR_IDS_IN_NO_SPLIT = 197     # CLEVR-Change's captioned ids that its splits.json leaves out (597, 857, ...)
SHOWN = 5                       # problems named one by one before the rest are only counted
EXIF_ORIENTATION = 0x0112       # the EXIF tag that tells a viewer to turn or mirror a photo; 1: as stored
CHECK_PARALLEL_MIN = 256        # the check decodes at least this many images in several processes


def image_problem(path: Path) -> str | None:
    """What is wrong with an image file ("missing", or why it cannot be decoded), or None when every pixel decodes.

    The file is decoded whole, as training reads it: a file damaged in the middle fails here (PNG's zlib stream
    carries a checksum), not only one cut short."""
    return image_check(path)[0]


def image_check(path: Path) -> tuple[str | None, bool]:
    """image_problem's answer, and whether the image carries an EXIF orientation other than "as stored" (which
    training ignores, as the reference does)."""
    try:
        with warnings.catch_warnings():  # past Pillow's size limit is a problem, as in load_image
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()
                turned = image.getexif().get(EXIF_ORIENTATION, 1) not in (1, None)
                rgb_view(image, path)  # as training reads it: a float image past 0..255 is refused there too
    except FileNotFoundError:
        return "missing", False
    except DataError as error:
        return str(error).removeprefix(f"image {path} "), False
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as error:
        return str(error) or type(error).__name__, False
    return None, turned


def image_checks(images: list[Path], progress) -> list[tuple[str | None, bool]]:
    """image_check of every image, in order; decoded by one process per usable CPU when there are many. A decoding
    process that dies (killed by the out-of-memory killer) is said on stderr, and this process checks the images
    it had not done (a process pool's lost task would otherwise be waited for, for ever)."""
    results = []
    workers = min(usable_cpus(), len(images) // CHECK_PARALLEL_MIN)
    if workers >= 2 and "fork" in multiprocessing.get_all_start_methods():
        # forked: Pillow's limits as set here
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        try:
            for result in pool.map(image_check, images, chunksize=16):
                results.append(result)
                progress.show(len(results))
        except BrokenProcessPool:
            print(f"\ncheck.py: note: a decoding process died (killed: out of memory?) after {len(results):,} of "
                  f"{len(images):,} images; this process checks the rest", file=sys.stderr, flush=True)
        finally:
            pool.shutdown(cancel_futures=True)
    for path in images[len(results):]:
        results.append(image_check(path))
        progress.show(len(results))
    return results


def named(problems: list[str]) -> str:
    more = f", and {len(problems) - SHOWN:,} more" if len(problems) > SHOWN else ""
    return ", ".join(problems[:SHOWN]) + more


def caption_lengths(pairs: list[ImagePair], tokenizer: clip.SimpleTokenizer | None, max_words: int) -> str:
    """Length statistics of a split's non-empty captions, in tokens with SOT and EOT (in words without a tokenizer)."""
    captions = [c for pair in pairs for c in training_captions(pair.captions)]
    if not captions:
        return "no non-empty captions"
    if tokenizer is None:
        lengths = np.array([len(c.split()) for c in captions])
        return (f"caption length in words (no BPE vocabulary for tokens): min {lengths.min()}, "
                f"median {np.median(lengths):g}, mean {lengths.mean():.1f}, max {lengths.max()}")
    lengths = np.array([len(tokenizer.encode(c)) + 2 for c in captions])  # + SOT and EOT, as text_tokens counts
    return (f"caption length in tokens with SOT and EOT: min {lengths.min()}, median {np.median(lengths):g}, "
            f"mean {lengths.mean():.1f}, max {lengths.max()}; {(lengths > max_words).sum():,} longer than "
            f"max_words {max_words} (cut there in training)")


def beside_published(found: int, published: int | None, problems: list[str], what: str, split: str) -> str:
    """'8,566 pairs (published: 8,566)'; a different count is also added to problems."""
    if published is None:
        return f"{found:,} {what}"
    if found != published:
        problems.append(f"{split}: {found:,} {what}, {published:,} published")
        return f"{found:,} {what} (published: {published:,}; DIFFERENT)"
    return f"{found:,} {what} (published: {published:,})"


def kinds_line(data: str, split: str, pairs: list[ImagePair], problems: list[str]) -> str:
    """'3,407 change pairs (published: 3,407), 3,408 no-change pairs (published: 3,408)', and the pairs whose
    changeflag says otherwise than their captions (the papers' scripts go by the captions)."""
    published = PUBLISHED_KINDS.get(data, {}).get(split, (None, None))
    counts = [sum(pair.change_type == kind for pair in pairs) for kind in (CHANGED, UNCHANGED)]
    line = ", ".join(beside_published(n, p, problems, what, split)
                     for n, p, what in zip(counts, published, ("change pairs", "no-change pairs")))
    disagree = [pair.id for pair in pairs if (pair.change_type == UNCHANGED)
                != all(caption in LEVIR_NO_CHANGE for caption in pair.captions)]
    if disagree:
        line += (f"; {len(disagree):,} pairs whose changeflag disagrees with their captions (the no-change "
                 f"sentences or not): {named(disagree)}")
    return line


def check_dataset(data: str, root: Path, tokenizer: clip.SimpleTokenizer | None, max_words: int = MAX_WORDS) -> bool:
    """Read every split of a downloaded dataset, open every image, print what is there and what is not.

    True when nothing is missing: every split reads, every image opens, the published counts are met.
    """
    source = SOURCES[data]
    print(f"{source.name} in {root}", flush=True)  # before the progress line on stderr
    if not root.is_dir():
        print(f"  no folder {root}; {source.get_it}")
        return False
    problems: list[str] = []
    splits: dict[str, list[ImagePair]] = {}
    for split in SPLITS:
        try:
            splits[split] = source.reader(root, split)
        except DataError as error:
            problems.append(f"{split}: {error}")
            print(f"  {split}: cannot be read: {error}")
    images = list(dict.fromkeys(path for pairs in splits.values() for pair in pairs
                                for path in (pair.before, pair.after, pair.distractor) if path is not None))
    checks = image_checks(images, Progress(len(images), what="images (decoded whole)"))
    bad = {path: problem for path, (problem, _) in zip(images, checks) if problem}  # path -> what is wrong with it
    turned = [str(path) for path, (_, exif) in zip(images, checks) if exif]
    for split, pairs in splits.items():
        published = PUBLISHED.get(data, {}).get(split, (None, None))
        references = sum(len(pair.captions) for pair in pairs)
        print(f"  {split}: {beside_published(len(pairs), published[0], problems, 'pairs', split)}, "
              f"{beside_published(references, published[1], problems, 'references', split)}")
        if any(pair.change_type in (CHANGED, UNCHANGED) for pair in pairs):  # LEVIR-CC's two kinds of pair
            print("    " + kinds_line(data, split, pairs, problems))
            if not any(pair.change_type == CHANGED for pair in pairs):
                problems.append(f"{split}: no change pairs")
                print("    no change pairs: stage 1 (adapt.py) adapts to the change pairs alone, and needs one in "
                      "every split")
        if not pairs and published[0] is None:  # a published count is compared above
            problems.append(f"{split}: 0 pairs")
            print("    no pairs: training and evaluation need at least one in every split")
        empty = references - sum(len(training_captions(pair.captions)) for pair in pairs)
        if empty:
            without = sum(not training_captions(pair.captions) for pair in pairs)
            print(f"    {empty:,} empty captions ({without:,} pairs without any other): "
                  f"evaluation references, never training targets")
        paths = list(dict.fromkeys(p for pair in pairs for p in (pair.before, pair.after, pair.distractor) if p))
        missing = [str(p) for p in paths if bad.get(p) == "missing"]
        unreadable = [f"{p} ({bad[p]})" for p in paths if p in bad and bad[p] != "missing"]
        print(f"    images: {len(paths):,}, {len(missing):,} missing, {len(unreadable):,} unreadable")
        for kind, listed in (("missing", missing), ("unreadable", unreadable)):
            if listed:
                problems.append(f"{split}: {len(listed):,} image(s) {kind}")
                print(f"      {kind}: {named(listed)}")
        if missing or unreadable:
            print(f"      to fix: {repair(data, root, split)}")
        print(f"    {caption_lengths(pairs, tokenizer, max_words)}")
    for note in split_notes(splits):
        print(f"  note: {note}")
    if source.reader is read_clevr_change and len(splits) == len(SPLITS):  # every split read: the files are sound
        in_splits = {int(pair.id.removesuffix(".png")) for pairs in splits.values() for pair in pairs}
        numbers = [key.removesuffix(".png").rsplit("_", 1)[-1] for key in read_json(root / "change_captions.json", "captions")]
        unused = [n for n in numbers if not n.isdigit() or int(n) not in in_splits]
        expected = f" (the published files have {CLEVR_IDS_IN_NO_SPLIT})" if data == "clevr" else ""
        print(f"  {len(unused):,} captioned ids are in no split and never used{expected}")
    if turned:
        print(f"  {len(turned):,} image(s) carry an EXIF orientation, which is ignored, as in the reference: the model "
              f"sees them as stored, not turned as a viewer shows them ({named(turned)})")
    if problems:
        print(f"INCOMPLETE: {'; '.join(problems)}")
    else:
        met = ", the published counts are met" if data in PUBLISHED else ""
        print(f"complete: every split reads, every image opens{met}")
    return not problems


def split_notes(splits: dict[str, list[ImagePair]]) -> list[str]:
    """What a user's splits may not mean to hold: a pair (the same before and after images) in the training split
    and in an evaluation split; change types that the score table does not know (neither CLEVR-Change's nor
    LEVIR-CC's change / no change), each scored as its own row."""
    notes = []
    trained = {(pair.before, pair.after) for pair in splits.get("train", [])}
    for split in ("val", "test"):
        both = [pair.id for pair in splits.get(split, []) if (pair.before, pair.after) in trained]
        if both:
            notes.append(f"{len(both):,} {split} pair(s) are also in train (the same before and after images): "
                         f"{named(both)}; their scores measure what was memorised, not captioning")
    known = (*CHANGE_TYPES, DISTRACTOR)  # and LEVIR-CC's two kinds, which its table scores (metrics.py)
    other = sorted({p.change_type for pairs in splits.values() for p in pairs} - {None, *known, CHANGED, UNCHANGED})
    if other:
        notes.append(f"change types {other} are not CLEVR-Change's {list(known)}: the score table gives each its "
                     f"own row")
    return notes


# -----------------------------------------------------------------------------
# Command line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="synth", choices=sorted(SOURCES))
    parser.add_argument("--root", "--data_root", help="dataset folder (default: data/<name>)")
    parser.add_argument("--max_words", type=int, default=MAX_WORDS,
                        help="count the captions longer than this many tokens (the training scripts' flag)")
    parser.add_argument("--show", action="store_true",
                        help="instead of the check, write a contact sheet of a few pairs")
    parser.add_argument("--split", default="test", choices=SPLITS, help="--show: the split to draw from")
    parser.add_argument("--n", type=int, default=6, help="--show: pairs on the contact sheet")
    parser.add_argument("--model-view", action="store_true", help="--show: the 224 x 224 images the model sees")
    parser.add_argument("--out", help="--show: contact sheet PNG (default: <root>/contact_sheet.png)")
    args = parser.parse_args()
    try:
        run_command(args)
    except DataError as error:  # a user's mistake: one line, no traceback
        parser.exit(1, f"{parser.prog}: error: {error}\n")


def run_command(args: argparse.Namespace) -> None:
    root = dataset_root(args.data, args.root)
    if args.show:
        pairs = load_split(args.data, args.split, root)[:args.n]
        out = contact_sheet(pairs, Path(args.out) if args.out else root / "contact_sheet.png", args.model_view)
        print(f"contact sheet of {len(pairs)} {args.split} pairs: {out}")
        return
    tokenizer = None
    try:
        tokenizer = clip_files.get_tokenizer(bpe_path(args.data, root)) if root.is_dir() else None
    except FileNotFoundError as error:
        print(f"{error}\nCaption lengths are counted in words instead of tokens until then.")
    sys.exit(0 if check_dataset(args.data, root, tokenizer, args.max_words) else 1)


if __name__ == "__main__":
    main()
