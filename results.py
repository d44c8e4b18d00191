"""Looking at the results: one page, results.html, with a test split's scores, both stages' training and every pair.

Evaluating a change captioner means looking: which pairs fail, of what kind, where the model looked, how training
went. `caption.py --eval` (and the end of training) writes results.html beside test_predictions.json: one file that
opens offline from file://, with no download and no framework. It shows
  1. the score table as caption.py prints it (test_scores.json: overall, per change type, distractors, the kind of
     change said, the pointing game; LEVIR-CC's two scorings), and the printed text itself;
  2. both stages' training curves from their log.jsonl (loss, learning rate, the validation metric per epoch with
     the chosen epoch marked), as inline SVG;
  3. every test pair: before and after as small embedded thumbnails, the prediction, the references, the pair's own
     CIDEr-D, METEOR and BLEU-4, the kind of change it says against the true type, and, where the pointing game
     read one, the attention map with the changed object's box.
The pairs can be filtered by change type and by "kind wrong", sorted by CIDEr-D, searched, and paged, by a little
vanilla JavaScript; without it the page shows the tables, the curves and the first page of pairs.

Each pair's scores are the scorer's own (metrics.py, the class caption.py scores the table with): the whole test
split scored once, so that a pair's CIDEr-D uses the document frequencies of all the split's references, as the
table's "total" row, whose CIDEr-D is their mean; the page checks that this scoring gives the file's total row.

Run:  python caption.py --data synth --eval     writes runs/caption_synth/results.html among the test files
      python results.py --data synth            the page again from a run's files, without the model: the same page
                                                but for the attention maps, which only --eval reads out

It is a diagnostic, off the reading path. Shape letters: N patches per image (49).
"""
import base64
import html
import io
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, features

import data
import metrics
import plumbing
from plumbing import flag
from plumbing.files import write_text_atomically

PAGE_NAME = "results.html"  # beside test_predictions.json
PER_PAGE = 50               # pairs per page: the first page is in the HTML, the others are drawn by the script
THUMB_BOX = (192, 160)      # a thumbnail fits in this box (CLEVR's 480 x 320 -> 192 x 128), aspect kept
THUMB_FORMATS = (("WEBP", "image/webp", 70), ("JPEG", "image/jpeg", 80))  # WebP is a third of JPEG's size; JPEG
#                                                                         where Pillow was built without WebP
SHOWN_SCORES = (("CIDEr", "CIDEr-D"), ("METEOR", "METEOR"), ("BLEU_4", "BLEU-4"))  # each pair's, on its card
TABLE_COLUMNS = ("BLEU_1", "BLEU_2", "BLEU_3", "BLEU_4", "METEOR", "ROUGE_L", "CIDEr")  # caption.format_table's
ROW_NAMES = {"material": "material (texture)", data.DISTRACTOR: "distractor (no change)"}  # as caption.py prints
TABLE_VIEWS = ("intra", "inter", "decoder")  # explain.VIEWS, the pointing game's columns
MAP_VIEWS = ("inter", "decoder", "intra")  # the attention map a card shows: the first of these that was read
# the validation metrics of each stage's log.jsonl: the first one present picks the epoch (adapt.py: text->pair
# R@1; caption.py: CIDEr-D), the others are drawn beside it
VALIDATION = (("text_to_pair_R1", "R@1 text → pair", "R@1 (%)"), ("pair_to_text_R1", "R@1 pair → text", "R@1 (%)"),
              ("CIDEr", "CIDEr-D", "CIDEr-D"))
COLOURS = ("#1f77b4", "#d62728", "#2ca02c")


# -----------------------------------------------------------------------------
# 1. Each pair: its prediction, references, own scores and the kind of change it says


def pair_rows(predictions: dict[str, str], table: dict, pairs: list[data.ImagePair], scorer) -> list[dict]:
    """One row per evaluation pair (the order of pairs): id, type, prediction, references, scores, said kind.

    predictions {evaluation id: caption} and table (test_scores.json) must be one run's on this split: ids that are
    not the split's, or a table that is not these predictions' scores, are refused in one line.
    """
    ids = [pair.id for pair in pairs]
    known = set(ids)
    strangers = [i for i in predictions if i not in known]
    if strangers:
        raise data.DataError(f"results page: {len(strangers)} of the {len(predictions)} predicted ids are not pairs "
                             f"of the test split read (first: {strangers[0]!r}): the predictions are another split's "
                             f"or another dataset's; give the dataset the run was tested on (--data, --data_root)")
    if len(predictions) != len(ids):
        raise data.DataError(f"results page: {len(predictions)} predictions for the {len(ids)} pairs of the test "
                             f"split (first without one: {next(i for i in ids if i not in predictions)!r}): they "
                             f"are another split's or an unfinished run's; evaluate again (caption.py --eval)")
    total = table.get("scores", {}).get("total") if isinstance(table, dict) else None
    if not isinstance(total, dict):
        raise data.DataError("results page: the score table has no total row: it is not caption.py's test_scores.json")
    scored = metrics.score_captions({i: predictions[i] for i in ids}, data.references(pairs), scorer=scorer)
    for name, value in total.items():
        if not math.isclose(scored["corpus"][name], value, rel_tol=1e-9, abs_tol=1e-12):
            raise data.DataError(f"results page: the score table is not these predictions' ({name} {value:.4f} in the "
                                 f"table, {scored['corpus'][name]:.4f} scored now): the predictions and the table come "
                                 f"from different runs; evaluate again (caption.py --eval) to write both")
    kinds = "kinds" in table  # CLEVR-Change's types: the kind of change each caption says, by keywords
    rows = []
    for pair in pairs:
        said = metrics.said_kind(predictions[pair.id]) if kinds else None
        rows.append({"id": pair.id, "type": pair.change_type, "prediction": predictions[pair.id],
                     "references": pair.captions, "scores": scored["items"][pair.id], "said": said,
                     "wrong": kinds and said != pair.change_type})
    return rows


# -----------------------------------------------------------------------------
# 2. Images: thumbnails and attention maps, embedded as data URIs


def data_uri(image: Image.Image, kind: tuple[str, str, int]) -> str:
    """The image as a data: URI of this kind (format, MIME type, quality; PNG has no quality)."""
    buffer = io.BytesIO()
    if kind[0] == "PNG":
        image.save(buffer, "PNG")
    else:
        image.save(buffer, kind[0], quality=kind[2])
    return f"data:{kind[1]};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def thumbnail(path: Path) -> dict:
    """{"uri", "size": the image's (width, height)}, or {"problem": why it cannot be shown}."""
    try:
        image = data.load_image(path)
    except data.DataError as error:
        return {"problem": str(error).split(";")[0]}
    size = image.size
    image.thumbnail(THUMB_BOX, Image.Resampling.BICUBIC)
    return {"uri": data_uri(image, THUMB_FORMATS[0] if features.check("webp") else THUMB_FORMATS[1]), "size": size}


def thumbnails(paths: list[Path]) -> dict[Path, dict]:
    """thumbnail() of each path, on as many threads as this process may use (Pillow decodes without the GIL)."""
    long = len(paths) >= 1000  # a progress line for CLEVR-Change's 11,955 images, none for the synthetic 600
    progress = plumbing.Progress(len(paths), what="results page, thumbnails") if long else None
    out = {}
    with ThreadPoolExecutor(max(1, data.usable_cpus())) as pool:
        for path, thumb in zip(paths, pool.map(thumbnail, paths)):
            out[path] = thumb
            if progress:
                progress.show(len(out))
    return out


def heat_uris(patch_map: np.ndarray) -> list[str]:
    """A map over both images' patches (2N,) as two tiny PNGs (grid x grid, one pixel per patch): red to yellow,
    clear at 0, as explain.heat draws it; stretched over both images together, as explain_pairs does."""
    level = (patch_map - patch_map.min()) / max(float(patch_map.max() - patch_map.min()), 1e-12)  # (2N,) in [0, 1]
    grid = math.isqrt(len(level) // 2)
    uris = []
    for half in level.reshape(2, grid, grid):  # before, after
        rgba = np.stack([np.full_like(half, 255), 255 * half, np.zeros_like(half), 255 * 0.7 * half], axis=-1)
        uris.append(data_uri(Image.fromarray(np.uint8(np.round(rgba)), "RGBA"), ("PNG", "image/png", 0)))
    return uris


# -----------------------------------------------------------------------------
# 3. Training curves from log.jsonl, as inline SVG


def training_logs(config, out_dir: Path) -> dict[str, Path]:
    """Where each stage's log.jsonl is: beside stage 1's checkpoint (--encoder_ckpt, else runs/adapt_<data>) and
    beside the captioner's (--checkpoint, else out_dir). config: caption.py's, or this file's."""
    stage1 = Path(config.encoder_ckpt).parent if config.encoder_ckpt else Path(f"runs/adapt_{config.data}")
    stage2 = Path(config.checkpoint).parent if config.checkpoint else out_dir
    return {"stage 1, adaptation": stage1 / plumbing.LOG_NAME, "stage 2, captioning": stage2 / plumbing.LOG_NAME}


def read_log(path: Path) -> tuple[list[dict], str | None]:
    """The records of a log.jsonl, and what is wrong with it (None: nothing); a torn last line is skipped."""
    if not path.is_file():
        return [], f"no curves: {path} is {data.absence(path)}"
    records, torn = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            record, torn = None, torn + 1
        if isinstance(record, dict):
            records.append(record)
    if not records:
        return [], f"no curves: {path} is empty" + (f" ({torn} unreadable lines)" if torn else "")
    return records, f"{path}: {torn} unreadable lines skipped" if torn else None


def ticks(low: float, high: float, count: int = 5, whole: bool = False) -> tuple[list[float], int]:
    """About count round values from low to high (1, 2 or 5 times a power of ten apart; whole numbers only with
    whole), and the decimals that tell them apart."""
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    step = max(step, 1) if whole else step
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return [k * step for k in range(math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9) + 1)], decimals


def chart(title: str, x_label: str, y_label: str, series: list[tuple[str, list[tuple[float, float]]]],
          chosen: float | None = None, dots: bool = False, width: int = 360, height: int = 220) -> str:
    """An inline SVG line chart with axes, round ticks and labels; one polyline per series (name, [(x, y)]), with a
    dot at each point (dots), and a dashed line at x = chosen. A diverged run's non-finite values are left out."""
    left, right, top, bottom = 62, 12, 28 + 10 * (len(series) > 1), 40
    series = [(name, [(x, y) for x, y in points if math.isfinite(y)]) for name, points in series]
    if not any(points for _, points in series):
        return ""
    xs = [x for _, points in series for x, _ in points]
    ys = [y for _, points in series for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) / 2, y1 + (abs(y1) or 1) / 2
    y0, y1 = y0 - 0.04 * (y1 - y0), y1 + 0.04 * (y1 - y0)

    def at(x, y):
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                top + (y1 - y) / (y1 - y0) * (height - top - bottom))
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(title)}"><text x="{width / 2}" y="14" class="title">{html.escape(title)}</text>',
           f'<line class="axis" x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}"/>'
           f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}"/>']
    x_ticks, x_decimals = ticks(x0, x1, 6, whole=True)
    for x in x_ticks:
        px = at(x, y0)[0]
        out.append(f'<line class="tick" x1="{px:.1f}" y1="{height - bottom}" x2="{px:.1f}" y2="{height - bottom + 4}"/>'
                   f'<text x="{px:.1f}" y="{height - bottom + 15}" class="tx">{x:.{x_decimals}f}</text>')
    y_ticks, y_decimals = ticks(y0, y1)
    for y in y_ticks:
        py = at(x0, y)[1]
        label = f"{y:.{y_decimals}f}" if y_decimals <= 4 else f"{y:.1e}"  # a learning rate: 2.0e-05
        out.append(f'<line class="grid" x1="{left}" y1="{py:.1f}" x2="{width - right}" y2="{py:.1f}"/>'
                   f'<text x="{left - 4}" y="{py + 4:.1f}" class="ty">{label}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" class="label">{html.escape(x_label)}</text>'
               f'<text class="label" transform="translate(13 {(top + height - bottom) / 2}) rotate(-90)">'
               f'{html.escape(y_label)}</text>')
    if chosen is not None:
        px = at(chosen, y0)[0]
        side = 'x="{:.1f}"'.format(px + 3) if px < width / 2 else 'x="{:.1f}" text-anchor="end"'.format(px - 3)
        out.append(f'<line class="chosen" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{height - bottom}"/>'
                   f'<text {side} y="{height - bottom - 6}" class="chosen-label">chosen: {x_label} {chosen:g}</text>')
    for k, (name, points) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        coordinates = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in points))
        out.append(f'<polyline class="curve" data-series="{html.escape(name)}" data-n="{len(points)}" '
                   f'points="{coordinates}" stroke="{colour}"/>')
        if dots or len(points) == 1:
            out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"><title>{html.escape(name)} {x:g}: '
                    f'{y:.4g}</title></circle>' for px, py, (x, y) in ((*at(x, y), (x, y)) for x, y in points)]
        if len(series) > 1:  # a legend above the plot, one entry after another
            out.append(f'<text x="{left + 130 * k}" y="{top - 4}" fill="{colour}">— {html.escape(name)}</text>')
    return "".join(out) + "</svg>"


def stage_charts(records: list[dict]) -> tuple[str, str]:
    """A stage's charts (loss and learning rate per logged step, validation per epoch) and a line on the epoch
    chosen: the best of the first VALIDATION metric logged, the later of a tie, as adapt.py and caption.py choose."""
    steps = [r for r in records if "loss" in r and "step" in r and "split" not in r]
    validation = [r for r in records if r.get("split") == "val"]
    charts = []
    if steps:
        charts.append(chart("training loss", "step", "loss (cross-entropy, nats)",
                            [("loss", [(r["step"], r["loss"]) for r in steps])]))
    if any("lr" in r for r in steps):
        charts.append(chart("learning rate", "step", "learning rate (base)",
                            [("lr", [(r["step"], r["lr"]) for r in steps if "lr" in r])]))
    shown = [(key, name, axis) for key, name, axis in VALIDATION if any(key in r for r in validation)]
    note = "no validation records"
    if shown:
        key, name, axis = shown[0]
        scored = [r for r in validation if key in r]
        best = max(range(len(scored)), key=lambda k: (scored[k][key], k))  # a tie keeps the later epoch
        chosen = scored[best]["epoch"] + 1
        charts.append(chart("validation, per epoch", "epoch", axis,
                            [(n, [(r["epoch"] + 1, r[k]) for r in validation if k in r]) for k, n, a in shown
                             if a == axis], chosen=chosen, dots=True))
        note = f"chosen: epoch {chosen}, the best {name} ({scored[best][key]:.4g}) on the validation split"
    return "".join(charts), note


# -----------------------------------------------------------------------------
# 4. The page: the score tables, the pairs, the controls


def cell(value, digits: int) -> str:
    """A number as caption.py prints it, with the exact value beside it for a reader (and a test)."""
    return f'<td data-value="{value!r}">{value:.{digits}f}</td>'


def html_table(name: str, heading: str, header: list[str], rows: list[str]) -> str:
    """A table of the page: its heading, its column names and its rows, scrolled sideways where it is too wide."""
    return (f"{heading}<div class=\"wide\"><table id=\"{name}\"><thead><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in header) + f"</tr></thead><tbody>{''.join(rows)}"
            "</tbody></table></div>")


def row_html(name: str, label: str, cells: list[str], **attributes) -> str:
    """One row: data-subset (or another attribute) names it for a reader and a test, then its label and cells."""
    named = "".join(f' data-{k}="{html.escape(v)}"' for k, v in {"subset": name, **attributes}.items())
    return f"<tr{named}><th>{html.escape(label)}</th>{''.join(cells)}</tr>"


def score_tables(table: dict, printed: str | None) -> str:
    """test_scores.json as tables: the scores per subset, LEVIR-CC's two scorings, the kind of change said, the
    pointing game; then the table as printed, test_scores.txt."""
    names = {"BLEU_1": "BLEU-1", "BLEU_2": "BLEU-2", "BLEU_3": "BLEU-3", "BLEU_4": "BLEU-4", "ROUGE_L": "ROUGE-L",
             "CIDEr": "CIDEr-D"}
    out = [html_table("scores", "", ["", "pairs", *(names.get(c, c) for c in TABLE_COLUMNS)],
                      [row_html(name, ROW_NAMES.get(name, name), [f"<td>{table['sizes'][name]}</td>",
                                                                   *(cell(scores[c], 4) for c in TABLE_COLUMNS)])
                       for name, scores in table["scores"].items()])]
    if "field" in table:  # LEVIR-CC: every score x100, ours and the field's way
        field = table["field"]
        out.append(html_table("field", "<h3>As the LEVIR-CC papers score, beside ours (x100)</h3>",
                              ["", "pairs", *(names.get(m, m) for m in metrics.field.FIELD_METRICS)],
                              [row_html(name, f"{name}, {label}", [f"<td>{size}</td>", *(
                                  cell(field[way][name][m], 2) for m in metrics.field.FIELD_METRICS)], way=way)
                               for name, size in field["sizes"].items()
                               for way, label in (("project", "ours"), ("field", "field's"))]))
    if "kinds" in table:
        kinds = table["kinds"]
        said = sorted({s for row in kinds["confusion"].values() for s in row})
        out.append(html_table("kinds", "<h3>The kind of change said, by keywords (metrics.said_kind)</h3>",
                              ["true type", "right", "of", *(f"said {s}" for s in said)],
                              [row_html(kind, kind, [f"<td>{right}</td><td>{kinds['total'][kind]}</td>", *(
                                  f"<td>{kinds['confusion'][kind].get(s, '')}</td>" for s in said)])
                               for kind, right in kinds["right"].items()]))
    if "localisation" in table:
        located = table["localisation"]
        views = [v for v in TABLE_VIEWS if v in next(iter(located.values()))]
        out.append(html_table("localisation", "<h3>The pointing game: % of change pairs whose highest-attention "
                              "patch is on the changed object</h3>", ["", "pairs", "chance", *views],
                              [row_html(name, name, [f"<td>{row['pairs']}</td>", cell(row["chance"], 1),
                                                     *(cell(row[v], 1) for v in views)])
                               for name, row in located.items()]))
        out.append("<p>intra: the encoder's last intra-image block (each CLS over its own image); inter: its last "
                   "inter-image block (both CLS over both images); decoder: cross-attention, mean over words and "
                   "layers (explain.py).</p>")
    if printed:
        out.append(f"<details><summary>The table as printed (test_scores.txt)</summary><pre>{html.escape(printed)}"
                   "</pre></details>")
    return "".join(out)


def figure(label: str, thumb: dict | None, image_id: int | None, heat: tuple[int, str] | None, box, eager: bool) -> str:
    """One image of a card: the thumbnail, the attention map over it, the changed object's box."""
    if thumb is None or "problem" in thumb:
        note = "no image" if thumb is None else thumb["problem"]
        return f'<figure><div class="missing">{html.escape(note)}</div><figcaption>{label}</figcaption></figure>'

    def img(k, uri, cls):  # the first page's images are in the HTML; the others the script sets from the list
        return f'<img class="{cls}" alt="{label}{" attention" if cls == "heat" else ""}" data-i="{k}"' + \
            (f' src="{uri}">' if eager else ">")
    width, height = thumb["size"]
    parts = [img(image_id, thumb["uri"], "thumb")]
    if heat is not None:
        parts.append(img(heat[0], heat[1], "heat"))
    if box:
        x, y, w, h = box
        parts.append(f'<div class="box" style="left:{100 * x / width:.1f}%;top:{100 * y / height:.1f}%;'
                     f'width:{100 * w / width:.1f}%;height:{100 * h / height:.1f}%"></div>')
    return f'<figure><div class="frame">{"".join(parts)}</div><figcaption>{label}</figcaption></figure>'


def card(row: dict, number: int, figures: str, hidden: bool) -> str:
    """One evaluation pair: images, id and type, what it says against the truth, prediction, references, scores."""
    scores = row["scores"]
    said = ""
    if row["said"] is not None:
        said = (f'<span class="said {"wrong" if row["wrong"] else "right"}">says {html.escape(row["said"])}'
                f'{" ✗" if row["wrong"] else " ✓"}</span>')
    references = "".join(f"<li>{html.escape(r)}</li>" for r in row["references"])
    attributes = "".join(f' data-{name.lower().replace("_", "")}="{scores[name]!r}"' for name, _ in SHOWN_SCORES)
    return (f'<article id="pair-{html.escape(row["id"])}" data-row="{number}" '
            f'data-type="{html.escape(row["type"] or "")}" data-wrong="{int(bool(row["wrong"]))}"{attributes}'
            f'{" hidden" if hidden else ""}>'
            f'<div class="images">{figures}</div><div class="text"><h3>{html.escape(row["id"])} '
            f'<span class="type">{html.escape(row["type"] or "")}</span> {said}</h3>'
            f'<p class="prediction"><b>predicted:</b> {html.escape(row["prediction"])}</p>'
            f'<p class="scores">' + " · ".join(f"{label} <b>{scores[name]:.3f}</b>" for name, label in SHOWN_SCORES)
            + f'</p><details><summary>{len(row["references"])} references</summary><ol>{references}</ol></details>'
            "</div></article>")


def controls(rows: list[dict]) -> str:
    """The search form (shown only when the script runs): type, kind wrong, order, words; the page buttons."""
    types = {}
    for row in rows:
        types[row["type"]] = types.get(row["type"], 0) + 1
    choice = ""
    if len(types) > 1 and None not in types:
        options = "".join(f'<option value="{html.escape(t)}">{html.escape(t)} ({n})</option>' for t, n in types.items())
        choice = f'<label>type <select name="type"><option value="">all types</option>{options}</select></label>'
    wrong = sum(bool(row["wrong"]) for row in rows)
    if rows and rows[0]["said"] is not None:
        choice += f'<label><input type="checkbox" name="wrong"> kind wrong only ({wrong})</label>'
    return ('<form id="find" class="needs-js">' + choice +
            '<label>order <select name="sort"><option value="test">test order</option><option value="worst">'
            'CIDEr-D, worst first</option><option value="best">CIDEr-D, best first</option></select></label>'
            '<label>search <input type="search" name="query" placeholder="words of the captions or the id"></label>'
            '<label><input type="checkbox" name="heat" checked> attention maps</label></form>')


def page_html(title: str, tables: str, curves: str, rows: list[dict], cards: list[str], thumbs_json: str,
              notes: list[str], per_page: int) -> str:
    first = min(per_page, len(rows))
    notes_html = "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    pager = ('<div class="pager needs-js"><button type="button" data-step="-1">previous</button><button type="button" '
             'data-step="1">next</button></div>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-'
            f'width, initial-scale=1"><title>{html.escape(title)}</title><style>{CSS}</style></head><body>'
            f'<h1>{html.escape(title)}</h1>{notes_html}<nav><a href="#scores-section">scores</a> · <a '
            f'href="#training">training</a> · <a href="#pairs">pairs</a></nav>'
            f'<section id="scores-section"><h2>Scores on the test split</h2>{tables}</section>'
            f'<section id="training"><h2>Training</h2>{curves}</section>'
            f'<section id="pairs"><h2>Every test pair</h2><p>A pair\'s CIDEr-D is scored against the document '
            f'frequencies of the whole test split ({len(rows)} items), as the table\'s total row, whose CIDEr-D is '
            f'their mean; METEOR and BLEU-4 are the pair\'s own (the table\'s come from summed statistics). '
            f'Attention: where the pointing game read it, red to yellow, stretched over both images; green box: the '
            f'changed object.</p>{controls(rows)}<noscript><p>Without JavaScript: the first {first} of {len(rows)} '
            f'pairs, in test order.</p></noscript><p id="count" data-matching="{len(rows)}">pairs 1–{first} of '
            f'{len(rows)}</p>{pager}<div id="cards" data-per-page="{per_page}">{"".join(cards)}</div>{pager}</section>'
            f'<script type="application/json" id="thumbs">{thumbs_json}</script><script>{SCRIPT}</script>'
            "</body></html>\n")


CSS = """
body{font:14px/1.4 system-ui,sans-serif;color:#222;max-width:1280px;margin:0 auto;padding:0 12px 40px}
h1{font-size:20px;margin:14px 0 4px}h2{font-size:17px;border-bottom:1px solid #ddd;margin-top:26px}h3{font-size:14px}
nav{margin:6px 0}.note{color:#8a4b00;margin:2px 0}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;margin:6px 0}
th,td{padding:2px 9px;text-align:right;border-bottom:1px solid #eee}tbody th{text-align:left;font-weight:normal}
.wide{overflow-x:auto}th,td{white-space:nowrap}.stage{margin:6px 0 14px}.charts{display:flex;flex-wrap:wrap;gap:10px}
svg.chart{max-width:100%;height:auto;background:#fcfcfc;border:1px solid #eee;font-size:10px}
svg .axis{stroke:#444}svg .tick{stroke:#444}svg .grid{stroke:#e4e4e4}svg .curve{fill:none;stroke-width:1.5}
svg .chosen{stroke:#888;stroke-dasharray:4 3}svg .chosen-label{fill:#555}svg .title{text-anchor:middle;font-size:12px}
svg .tx{text-anchor:middle}svg .ty{text-anchor:end}svg .label{text-anchor:middle;font-size:11px}
#find{display:flex;flex-wrap:wrap;gap:6px 16px;margin:8px 0}#find input[type=search]{width:16em}
body:not(.js) .needs-js{display:none!important}.pager button{margin-right:6px}
#cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:10px;margin:8px 0}
article{border:1px solid #ccc;border-radius:5px;padding:6px;background:#fff}article h3{margin:4px 0}
.images{display:flex;gap:4px}figure{margin:0;flex:1 1 0;min-width:0;max-width:192px}
figcaption{font-size:11px;color:#666}.frame{position:relative;line-height:0}
.frame img{width:100%;height:auto}.frame .heat{position:absolute;left:0;top:0;height:100%;image-rendering:pixelated}
body.no-heat .heat{display:none}.box{position:absolute;border:2px solid #0c0;box-sizing:border-box}
.missing{background:#f3f3f3;color:#a00;font-size:11px;padding:8px;line-height:1.3;word-break:break-all}
.type{color:#555;font-weight:normal}.said{font-weight:normal}.wrong{color:#b00}.right{color:#070}
.prediction,.scores{margin:3px 0}details ol{margin:2px 0;padding-left:22px}
@media (max-width:520px){#cards{grid-template-columns:1fr}article{padding:4px}}
"""

# The script: filter, sort, search and page the cards the HTML holds (all of them, those past the first page
# hidden); the images of a card are set from the list in #thumbs when it is first shown.
SCRIPT = """
"use strict";
(() => {
  const box = document.getElementById("cards"), form = document.getElementById("find");
  const count = document.getElementById("count"), perPage = Number(box.dataset.perPage);
  const cards = Array.from(box.children), words = cards.map((card) => card.textContent.toLowerCase());
  const thumbs = JSON.parse(document.getElementById("thumbs").textContent);
  let shown = cards, visible = cards.filter((card) => !card.hidden), page = 0;
  document.body.classList.add("js");
  function choose() {
    const type = form.type ? form.type.value : "", wrong = form.wrong ? form.wrong.checked : false;
    const query = form.query.value.trim().toLowerCase(), order = form.sort.value;
    shown = cards.filter((card, k) => (!type || card.dataset.type === type) && (!wrong || card.dataset.wrong === "1")
                                      && (!query || words[k].includes(query)));
    if (order !== "test") {
      const sign = order === "worst" ? 1 : -1;
      shown.sort((a, b) => sign * (a.dataset.cider - b.dataset.cider) || a.dataset.row - b.dataset.row);
    }
    page = 0;
    draw();
  }
  function draw() {
    const pages = Math.max(1, Math.ceil(shown.length / perPage));
    page = Math.min(Math.max(page, 0), pages - 1);
    for (const card of visible) card.hidden = true;
    visible = shown.slice(page * perPage, (page + 1) * perPage);
    for (const card of visible) {
      for (const img of card.querySelectorAll("img[data-i]")) {
        if (!img.getAttribute("src")) img.src = thumbs[img.dataset.i];
      }
      card.hidden = false;
    }
    box.append(...visible);
    const first = shown.length ? page * perPage + 1 : 0;
    count.dataset.matching = shown.length;
    count.textContent = `pairs ${first}–${page * perPage + visible.length} of ${shown.length}` +
      (shown.length < cards.length ? ` (of ${cards.length})` : "") + `; page ${page + 1} of ${pages}`;
    for (const button of document.querySelectorAll(".pager button")) {
      button.disabled = button.dataset.step < 0 ? page === 0 : page >= pages - 1;
    }
  }
  form.addEventListener("input", (event) => {
    if (event.target.name === "heat") document.body.classList.toggle("no-heat", !event.target.checked);
    else choose();
  });
  form.addEventListener("submit", (event) => event.preventDefault());
  for (const button of document.querySelectorAll(".pager button")) {
    button.addEventListener("click", () => {
      page += Number(button.dataset.step);
      draw();
      document.getElementById("count").scrollIntoView();
    });
  }
  choose();
})();
"""


# -----------------------------------------------------------------------------
# 5. Writing it


def results_page(out_dir: Path, predictions: dict[str, str], table: dict, pairs: list[data.ImagePair], scorer,
                 maps: dict | None = None, logs: dict[str, Path] | None = None, per_page: int = PER_PAGE) -> Path:
    """Write out_dir/results.html for a test split's evaluation pairs (data.evaluation_pairs), their predictions and
    score table (caption.py's); scorer: the class that scored the table (caption.SCORER). maps: {id: {view: (2N,)}},
    each change pair's attention maps (explain.localisation), None when not read; logs: each stage's log.jsonl
    (training_logs). What cannot be shown (a missing image, an empty log) is said on the page and in one line."""
    rows = pair_rows(predictions, table, pairs, scorer)
    notes = []
    paths = list(dict.fromkeys(p for pair in pairs for p in (pair.before, pair.after)))
    thumbs = thumbnails(paths)
    lost = [thumbs[p]["problem"] for p in paths if "problem" in thumbs[p]]
    if lost:
        notes.append(f"{len(lost)} of the {len(paths)} images cannot be shown (first: {lost[0]})")
    uris = [thumbs[p].get("uri", "") for p in paths]
    number = {p: k for k, p in enumerate(paths)}
    cards = []
    for k, (pair, row) in enumerate(zip(pairs, rows)):
        views = (maps or {}).get(pair.id, {})
        view = next((v for v in MAP_VIEWS if v in views), None)
        heats = [None, None]
        if view is not None:
            for side, uri in enumerate(heat_uris(np.asarray(views[view], np.float32))):
                heats[side] = (len(uris), uri)
                uris.append(uri)
        boxes = pair.change_boxes or {}  # a change pair's; a distractor pair has none
        after = "distractor view" if pair.change_type == data.DISTRACTOR else "after"  # the before scene, moved
        figures = "".join(figure(label, thumbs[path], number[path], heat, boxes.get(side), k < per_page)
                          for label, path, heat, side in (("before", pair.before, heats[0], "before"),
                                                          (after, pair.after, heats[1], "after")))
        cards.append(card(row, k, figures, hidden=k >= per_page))
    if not maps:
        notes.append("no attention maps: " + ("caption.py --eval reads them out" if maps is None else
                                              "the pointing game reads them, and it needs the changed objects' boxes"))
    curves = []
    for stage, path in (logs or {}).items():
        records, problem = read_log(path)
        charts, chosen = stage_charts(records) if records else ("", "")
        if problem:
            notes.append(f"{stage}: {problem}")
        curves.append(f'<div class="stage"><h3>{html.escape(stage)}</h3><p>{html.escape(problem or chosen)} '
                      f'<small>({html.escape(str(path))})</small></p><div class="charts">{charts}</div></div>')
    printed = out_dir / "test_scores.txt"
    tables = score_tables(table, printed.read_text() if printed.is_file() else None)
    title = f"Results of {out_dir}: {len(rows)} test pairs"
    page = page_html(title, tables, "".join(curves), rows, cards, json.dumps(uris), notes, per_page)
    for note in notes:
        print(f"results page: {note}")
    write_text_atomically(page, out_dir / PAGE_NAME)
    return out_dir / PAGE_NAME


@dataclass
class Config:
    data: str = flag("clevr", "the dataset the run was tested on: clevr, spot, ier, levir, pairs or synth")
    data_root: str = flag("", "the dataset's folder (\"\" = data/<dataset>, see data.py)")
    out_dir: str = flag("", 'the run\'s folder, with test_predictions.json and test_scores.json ("" = '
                            "runs/caption_<dataset>)")
    encoder_ckpt: str = flag("", 'stage 1\'s checkpoint, whose folder holds its log.jsonl ("" = runs/adapt_<dataset>)')
    checkpoint: str = flag("", 'the captioner\'s checkpoint, whose folder holds its log.jsonl ("" = out_dir)')
    per_page: int = flag(PER_PAGE, "pairs per page")

    def __post_init__(self):
        plumbing.check_settings(self, positive=("per_page",))


def main(argv=None) -> None:
    """The page again from a run's files (test_predictions.json, test_scores.json, the logs) and its dataset."""
    config = plumbing.parse_config(Config, {}, argv, description=__doc__.split("\n")[0])
    out_dir = Path(config.out_dir or f"runs/caption_{config.data}")
    try:
        predictions = metrics.read_predictions(metrics.load_json(out_dir / "test_predictions.json"),
                                               out_dir / "test_predictions.json")
        table = metrics.load_json(out_dir / "test_scores.json")
    except metrics.CaptionInputError as error:  # a missing or malformed file, in one line
        raise data.DataError(f"{error}; evaluate first (caption.py --data {config.data} --eval)") from None
    test = data.load_split(config.data, "test", config.data_root or None)
    pairs = data.evaluation_pairs(test, any(i.endswith(data.NO_CHANGE_SUFFIX) for i in predictions))
    page = results_page(out_dir, predictions, table, pairs, metrics.FastCaptionScorer, None,
                        training_logs(config, out_dir), config.per_page)
    print(f"results page {page}")


if __name__ == "__main__":
    plumbing.run_main(main, "results.py")
