"""The records behind BENCHMARKS.md and the README's figures: one JSON file per measurement, as its command wrote it.

Each file bench/records/NAME.json holds
    "title"    what was measured, in a few words
    "command"  the command that made it (its output is "values", kept as written, or as summed up by `record`)
    "commit", "date", "machine"   where and when: the checkout, the day, the CPU flags or the GPU model
    "measures" the code it measures: files, and folders/ standing for their .py files
    "files"    {path: sha256} of those files as they were at "commit"
    "values"   the figures, nested as the command wrote them
    "stale"    only when the files above have changed since: what changed, and whether that moves the figures
    "shown"    optionally, the keys BENCHMARKS.md's block shows (the file keeps everything the command wrote)
A README figure carries a marker naming its record and key, `42.7%<!--first_x:retrieval.t2p_r1-->` (a dotted key
into "values"; a last word `min`, `%`, `MB` or `GB` converts seconds, fractions and bytes), and a test checks the figure
equals the value at the README's precision. BENCHMARKS.md shows each record as a block rendered from it (`python -m
bench records --write`), which a test checks too.

    python -m bench records                  every record: its commit, and whether the code it measures changed since
    python -m bench records --write          render each record's block into BENCHMARKS.md
    python -m bench records --make NAME --title T --command C --files F [F ...] --values FILE
                                             a new record from a command's JSON output, at this checkout

A record is stale when a file it names hashes differently now: run `python -m bench records` before every
submission; a stale record is measured again, or says in "stale" what changed since.
"""
import argparse
import datetime
import hashlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = Path(__file__).resolve().parent / "records"
CONVERSIONS = {"min": lambda s: s / 60, "%": lambda f: 100 * f, "MB": lambda b: b / 1e6, "GB": lambda b: b / 1e9}
MARKER = re.compile(r"<!--(\w+):([\w.]+)(?: (min|%|MB|GB))?-->")
BLOCK = re.compile(r"<!-- record (\w+) -->\n.*?<!-- /record -->", re.S)


def code_files(names) -> list[Path]:
    """The files a record measures: each name a file, or a folder/ standing for its .py files."""
    paths = []
    for name in names:
        path = REPO / name
        paths.extend(sorted(path.glob("*.py")) if name.endswith("/") else [path])
    return paths


def file_hashes(names) -> dict[str, str]:
    """{path: sha256} of the files as they are now, each folder/ expanded to its .py files."""
    return {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "missing"
            for p in code_files(names)}


def load(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


def all_records() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(FOLDER.glob("*.json"))}


def changed_files(record: dict) -> list[str]:
    """The files of a record whose content differs from what was measured (or that appeared or went since)."""
    now = file_hashes(record["measures"])
    return sorted(path for path in set(now) | set(record["files"]) if now.get(path) != record["files"].get(path))


def value(record: dict, key: str, conversion: str | None = None) -> float:
    """A record's figure by its dotted key, converted (min, %, GB) when asked."""
    found = record["values"]
    for part in key.split("."):
        found = found[part]
    return CONVERSIONS[conversion](found) if conversion else found


def render(name: str, record: dict) -> str:
    """The block BENCHMARKS.md shows for a record: where it comes from, whether it is stale, then its values."""
    shown = record.get("shown")  # the keys the block shows, where the command wrote more than a reader needs
    values = "; ".join(f"`{key}` {number}" for key, number in flatten(record["values"]) if shown is None or key in shown)
    stale = f" **Stale:** {record['stale']}." if record.get("stale") else ""
    text = (f"*Record `bench/records/{name}.json`: {record['title']}; `{record['command']}`, {record['machine']}, "
            f"{record['date']}, commit {record['commit'][:7]}.*{stale} Values: {values}.")
    return f"<!-- record {name} -->\n" + "\n".join(textwrap.wrap(text, 120, break_on_hyphens=False, break_long_words=False)) \
        + "\n<!-- /record -->"


def flatten(values: dict, prefix: str = ""):
    for key, number in values.items():
        if isinstance(number, dict):
            yield from flatten(number, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", number


def write_blocks(path: Path = REPO / "BENCHMARKS.md") -> None:
    """Each record's block in BENCHMARKS.md rendered again from its file."""
    records = all_records()
    missing = sorted(set(BLOCK.findall(path.read_text())) - set(records))
    if missing:
        raise SystemExit(f"records: {path.name} has blocks for {missing}, which bench/records/ does not hold: make "
                         f"them (--make) or remove their blocks")
    text = BLOCK.sub(lambda m: render(m.group(1), records[m.group(1)]), path.read_text())
    path.write_text(text)


def git_commits_since(commit: str, paths: list[str]) -> list[str]:
    """The commits since `commit` that touched paths, as git tells (empty where git or the commit is not there)."""
    found = subprocess.run(["git", "-C", str(REPO), "log", "--format=%h %s", f"{commit}..HEAD", "--", *paths],
                           capture_output=True, text=True)
    return [line[:100] for line in found.stdout.splitlines()] if found.returncode == 0 else []


def report() -> int:
    """Print every record and whether its code changed since; 1 when a changed record does not say so."""
    unsaid = 0
    for name, record in all_records().items():
        changed = changed_files(record)
        state = "current" if not changed else ("stale, says so" if record.get("stale") else "STALE, NOT SAID")
        unsaid += bool(changed and not record.get("stale"))
        print(f"{name:<24} {record['commit'][:7]} {record['date']}  {state}")
        if changed:
            print(f"    changed since: {', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}")
            for line in git_commits_since(record["commit"], changed)[:5]:
                print(f"      {line}")
    return 1 if unsaid else 0


def make(name: str, title: str, command: str, measures: list[str], values_file: str, machine: str,
         shown: list[str] | None = None) -> Path:
    """A new record at this checkout (whose code must be committed: the record names its commit)."""
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", *measures], capture_output=True,
                           text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"records: commit the measured files first ({dirty.splitlines()[0]} ...)")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = {"title": title, "command": command, "commit": commit.strip(), "date": str(datetime.date.today()),
              "machine": machine, "measures": measures, "files": file_hashes(measures),
              "values": json.loads(Path(values_file).read_text()), **({"shown": shown} if shown else {})}
    path = FOLDER / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench records", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="render each record's block into BENCHMARKS.md")
    parser.add_argument("--make", metavar="NAME", help="a new record from --values at this checkout")
    parser.add_argument("--title", default="")
    parser.add_argument("--command", default="")
    parser.add_argument("--machine", default="")
    parser.add_argument("--files", nargs="*", default=[], help="the code the record measures (files, folder/)")
    parser.add_argument("--values", help="the JSON file the measuring command wrote")
    parser.add_argument("--shown", nargs="*", help="the keys BENCHMARKS.md's block shows (default: all)")
    args = parser.parse_args(argv)
    if args.make:
        print(make(args.make, args.title, args.command, args.files, args.values, args.machine, args.shown))
        return 0
    if args.write:
        write_blocks()
    return report()


if __name__ == "__main__":
    sys.exit(main())
