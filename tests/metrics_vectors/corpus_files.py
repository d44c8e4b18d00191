"""What the builders of this folder's corpora share with make_toolkit_scores.py: which items of a full corpus the
tests read (CUTS), the gzipped JSON those cuts are kept in, and a builder's last step (--check: compare with the
file kept here; else write the full corpus to OUT_DIR, for `make_toolkit_scores.py --cut-from OUT_DIR`)."""
import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CUTS = {"edge_cases": None, "clevr_style_public": 1200, "spot_public": 600}  # the first n items (None: all)


def gz_json_bytes(data) -> bytes:
    """data as kept here: compact JSON, gzipped without a time stamp, so that the same data gives the same bytes."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return gzip.compress(text.encode("utf-8"), mtime=0)


def cut(name: str, full: dict) -> dict:
    """The first CUTS[name] items of a full corpus, its meta saying so."""
    n, total = CUTS[name], len(full["items"])
    return {"meta": full["meta"] | {"cut": f"the first {n or total} of {total} items"}, "items": full["items"][:n]}


def check_or_write(name: str, full: dict, out_dir: Path | None, check: bool, parser) -> int:
    """A builder's end: with check, whether the cut of `full` is <name>.json.gz here (bytes and content; exit
    status 0 when the content is the same); else `full` written to out_dir/<name>.json."""
    if check:
        shipped, made = (HERE / f"{name}.json.gz").read_bytes(), gz_json_bytes(cut(name, full))
        same_content = json.loads(gzip.decompress(shipped)) == json.loads(gzip.decompress(made))
        print(f"{name}.json.gz: {'the same bytes' if made == shipped else 'DIFFERENT bytes'}, "
              f"{'the same content' if same_content else 'DIFFERENT content'}")
        return 0 if same_content else 1
    if out_dir is None:
        parser.error("give OUT_DIR, or --check")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(full, indent=1) + "\n", encoding="utf-8")
    print(f"{out_dir / f'{name}.json'}: {len(full['items'])} items", full["meta"])
    return 0
