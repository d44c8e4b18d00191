"""Remake tokenizer_public.json: OpenAI's tokenizer output on 412 strings, by running OpenAI's own CLIP code.

Run by hand, never by the tests (see README.md beside this file). It needs openai/CLIP at commit
d05afc436d78f1c48dc0dbf8e5980a9d471f35f6, in a checkout outside the repository (CLIP_DIR is a placeholder
for a folder of your choice), and ftfy and regex:

    git clone https://github.com/openai/CLIP CLIP_DIR
    git -C CLIP_DIR checkout d05afc436d78f1c48dc0dbf8e5980a9d471f35f6
    python tests/clip_vectors/make_tokenizer_vectors.py CLIP_DIR            # writes tokenizer_public.json
    python tests/clip_vectors/make_tokenizer_vectors.py CLIP_DIR --check    # compares, writes nothing

The inputs are the 412 strings themselves (each case's `id`, `category` and `text`), read from the
shipped file: they were written earlier for this project (hand-written and templated captions, edge cases),
by a process that was not kept, so they cannot be remade, only carried over. Everything else in a case is
OpenAI's output on that text and is remade here. `meta.versions` records the versions this script ran with;
the file here was made with Python 3.11.7, ftfy 6.3.1, regex 2026.11.15 and torch 2.13.0+cpu, and this
script remakes it byte for byte with them (RX_DIR: a folder of your choice, for that regex alone):

    pip install --no-deps --target RX_DIR regex==2026.11.15
    PYTHONPATH=RX_DIR python tests/clip_vectors/make_tokenizer_vectors.py CLIP_DIR --check

With regex 2026.5.9 instead, only `meta.versions` differs: every case is the same.
"""
import argparse
import json
import platform
import sys
import types
import unicodedata
from pathlib import Path

import ftfy
import regex
import torch

from make_tiny_clip import import_openai_clip  # the same import of OpenAI's package, beside this file

HERE = Path(__file__).resolve().parent
COMMIT = "d05afc436d78f1c48dc0dbf8e5980a9d471f35f6"
CONTEXT_LENGTH = 77
FIELDS = {  # each case's fields, as the file describes them
    "text": "input string (JSON escapes; file is pure ASCII)",
    "normalized": "whitespace_clean(basic_clean(text)).lower() as done inside SimpleTokenizer.encode (ftfy.fix_text, "
                  "html.unescape twice, strip, collapse \\s+ to one space, lower)",
    "encode": "SimpleTokenizer().encode(text) -- no start/end tokens",
    "decode": "SimpleTokenizer().decode(encode) -- note each '</w>' becomes a space, so it usually ends with ' '",
    "tokenize": "clip.tokenize([text], context_length=77, truncate=True)[0] with the trailing zero padding stripped: "
                "pad with zeros to length 77 to get the real row. It always starts with 49406 and its last element "
                "is 49407 (EOT; when truncated the 77th token is overwritten by EOT). dtype of the real output is "
                "torch.int32.",
    "n_tokens_before_truncation": "len(encode)+2",
    "truncated": "n_tokens_before_truncation > 77",
    "depends_on_ftfy": "True when encode() differs if ftfy.fix_text is replaced by identity (i.e. an implementation "
                       "must replicate ftfy to match this case)",
}


def make(openai_clip, simple_tokenizer, inputs: list[dict]) -> dict:
    tokenizer = simple_tokenizer.SimpleTokenizer()  # OpenAI's full vocabulary, from the checkout
    without_ftfy = simple_tokenizer.SimpleTokenizer()
    cases = []
    for case in inputs:
        text = case["text"]
        encode = tokenizer.encode(text)
        row = openai_clip.tokenize([text], context_length=CONTEXT_LENGTH, truncate=True)[0].tolist()
        while row and row[-1] == 0:  # the zero padding after EOT (EOT is never 0)
            row.pop()
        real_ftfy, simple_tokenizer.ftfy = simple_tokenizer.ftfy, types.SimpleNamespace(fix_text=lambda t: t)
        try:
            depends_on_ftfy = without_ftfy.encode(text) != encode
        finally:
            simple_tokenizer.ftfy = real_ftfy
        cases.append({"id": case["id"], "category": case["category"], "text": text,
                      "normalized": simple_tokenizer.whitespace_clean(simple_tokenizer.basic_clean(text)).lower(),
                      "encode": encode, "decode": tokenizer.decode(encode), "tokenize": row,
                      "n_tokens_before_truncation": len(encode) + 2, "truncated": len(encode) + 2 > CONTEXT_LENGTH,
                      "depends_on_ftfy": depends_on_ftfy})
    meta = {"description": "Outputs of OpenAI CLIP's own tokenizer code (clip/simple_tokenizer.py, clip/clip.py) "
                           f"on {len(cases)} strings (public set).",
            "openai_clip_commit": COMMIT, "fields": FIELDS,
            "sot_token": tokenizer.encoder["<|startoftext|>"], "eot_token": tokenizer.encoder["<|endoftext|>"],
            "context_length": CONTEXT_LENGTH, "truncate": True,
            "versions": {"python": platform.python_version(), "ftfy": ftfy.__version__, "regex": regex.__version__,
                         "torch": torch.__version__, "unicodedata_unidata_version": unicodedata.unidata_version}}
    return {"meta": meta, "cases": cases}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help=f"a checkout of openai/CLIP at {COMMIT[:7]}")
    parser.add_argument("--check", action="store_true", help="compare with tokenizer_public.json; write nothing")
    args = parser.parse_args(argv)
    openai_clip, _, _ = import_openai_clip(args.checkout)
    simple_tokenizer = sys.modules["clip.simple_tokenizer"]
    path = HERE / "tokenizer_public.json"
    shipped = path.read_text(encoding="utf-8")
    inputs = [{key: case[key] for key in ("id", "category", "text")} for case in json.loads(shipped)["cases"]]
    made = make(openai_clip, simple_tokenizer, inputs)
    text = json.dumps(made, indent=1) + "\n"
    if not args.check:
        path.write_text(text, encoding="utf-8")
        print(f"{path.name}: {len(made['cases'])} cases, {len(text.encode()):,} bytes")
        return 0
    old = json.loads(shipped)
    same_cases = made["cases"] == old["cases"]
    other_meta = [key for key in old["meta"] if made["meta"].get(key) != old["meta"][key]]
    print(f"{path.name}: {'the same bytes' if text == shipped else 'DIFFERENT bytes'}; "
          f"{'the same cases' if same_cases else 'DIFFERENT cases'}; meta differs in {other_meta or 'nothing'}")
    return 0 if same_cases else 1


if __name__ == "__main__":
    sys.exit(main())
