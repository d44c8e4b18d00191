"""How far meteor.snowball_stem and meteor.meteor_normalize agree with the meteor-1.5.jar code they stand in for.

Run by hand (never by the tests); it needs Java (javac and java) and pycocoevalcap 1.2, whose meteor-1.5.jar and
data/paraphrase-en.gz it uses (or $METEOR_DATA, as scoring/meteor.py finds them):

    python tests/metrics_vectors/make_stemmer_normaliser_agreement.py

Words: every distinct word of METEOR 1.5's English data as the jar ships it: the words of the synonym dictionary
(the word lines of synonym/english.synsets, WordNet lemmas with "_" for spaces), every form in
synonym/english.exceptions, the function words (function/english.words), and every space-separated word of both
phrases of data/paraphrase-en.gz. All of them are lower case. Each goes to org.tartarus.snowball.ext.englishStemmer
through edu.cmu.meteor.aligner.SnowballStemmerWrapper, as the jar's stem matcher calls it.

Lines: every distinct candidate and reference of the corpora edge_cases, clevr_style_public, spot_public and
clevr_size_timing in this folder, as written (<name>.json.gz) and, for the first three, as the toolkit's PTB
tokenizer left them (candidate_tok, references_tok of <name>.coco.json.gz), which is the text METEOR reads. Each
goes through what `-norm` makes MeteorScorer do: Normalizer.normalizeLine(line, LANG_EN, keepPunctuation=true),
then String.toLowerCase(), then the Aligner's java.util.StringTokenizer.

Printed with pycocoevalcap 1.2 and OpenJDK 17: words 173,767 checked, all agree (the jar changes 91,279); lines
48,425 checked, all agree (the jar changes 795). Both Java runs are one process each (a small class compiled with javac into a temporary folder). It prints the
counts checked, the agreements, how many the jar changes at all (a stem other than the word; tokens other
than the lower-cased line split at white space), and the first 20 disagreements of each.
"""
import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))            # the repository root, for scoring/meteor.py
from scoring import meteor  # noqa: E402

CORPORA = ("edge_cases", "clevr_style_public", "spot_public", "clevr_size_timing")

# Reads hex-encoded UTF-8 lines on stdin (so any character survives), writes one hex-encoded answer a line.
# stem: the stem of each word; norm: the tokens of each normalised, lower-cased line, joined by tabs (a tab is one
# of StringTokenizer's delimiters, so no token holds one).
JAVA = """
import java.io.*;
import java.nio.charset.StandardCharsets;
import java.util.*;
public class Agree {
    public static void main(String[] args) throws IOException {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        PrintStream out = new PrintStream(new BufferedOutputStream(System.out), false, "US-ASCII");
        edu.cmu.meteor.aligner.SnowballStemmerWrapper stemmer =
            new edu.cmu.meteor.aligner.SnowballStemmerWrapper(new org.tartarus.snowball.ext.englishStemmer());
        HexFormat hex = HexFormat.of();
        for (String h; (h = in.readLine()) != null; ) {
            String text = new String(hex.parseHex(h), StandardCharsets.UTF_8), answer;
            if (args[0].equals("stem")) {
                answer = stemmer.stem(text);
            } else {
                String line = edu.cmu.meteor.util.Normalizer.normalizeLine(
                    text, edu.cmu.meteor.util.Constants.LANG_EN, true).toLowerCase();
                StringJoiner tokens = new StringJoiner("\\t");
                for (StringTokenizer t = new StringTokenizer(line); t.hasMoreTokens(); ) tokens.add(t.nextToken());
                answer = tokens.toString();
            }
            out.println(hex.formatHex(answer.getBytes(StandardCharsets.UTF_8)));
        }
        out.flush();
    }
}
"""


def distinct(items):
    return list(dict.fromkeys(items))                  # first-seen order


def meteor_words(jar, paraphrase_gz):
    with zipfile.ZipFile(jar) as archive:
        read = lambda name: archive.read(name).decode("utf-8").split("\n")  # noqa: E731
        synsets, exceptions, function = read("synonym/english.synsets"), read("synonym/english.exceptions"), \
            read("function/english.words")
    words = synsets[0:-1:2]                            # word line, synset line, word line, ...
    words += [w for line in exceptions for w in line.split()]
    words += [w for line in function for w in line.split()]
    with gzip.open(paraphrase_gz, "rt", encoding="utf-8", newline="\n") as f:
        for _, phrase, paraphrase in zip(f, f, f):     # probability, phrase, paraphrase
            words += phrase.split() + paraphrase.split()
    return distinct(w for w in words if w)


def corpus_lines():
    lines = []
    for name in CORPORA:
        for item in json.loads(gzip.decompress((HERE / f"{name}.json.gz").read_bytes()))["items"]:
            lines += [item["candidate"], *item["references"]]
        coco = HERE / f"{name}.coco.json.gz"
        if coco.is_file():
            for item in json.loads(gzip.decompress(coco.read_bytes()))["items"]:
                lines += [item["candidate_tok"], *item["references_tok"]]
    return distinct(lines)


def run_java(jar, classes, mode, texts):
    stdin = "".join(t.encode("utf-8").hex() + "\n" for t in texts)
    done = subprocess.run(["java", "-cp", f"{jar}:{classes}", "Agree", mode], input=stdin, capture_output=True,
                          text=True, check=True)
    return [bytes.fromhex(h).decode("utf-8") for h in done.stdout.split("\n")[:-1]]


def report(what, inputs, java, python, unchanged):
    """unchanged(x): the answer that does nothing to x, to count the inputs the jar actually changes."""
    assert len(java) == len(inputs), f"Java answered {len(java)} of {len(inputs)} {what}"
    wrong = [(x, j, p) for x, j, p in zip(inputs, java, python) if j != p]
    changed = sum(j != unchanged(x) for x, j in zip(inputs, java))
    print(f"{what}: {len(inputs):,} checked, {len(inputs) - len(wrong):,} agree, {len(wrong):,} disagree "
          f"(the jar changes {changed:,} of them)")
    for x, j, p in wrong[:20]:
        print(f"  {x!r}: jar {j!r}, scoring/meteor.py {p!r}")


def main():
    found = meteor._find_meteor_files()
    if found is None:
        sys.exit("no meteor-1.5.jar: pip install --no-deps pycocoevalcap==1.2, or set " + meteor.METEOR_DATA_ENV)
    jar, paraphrase_gz = found
    print(f"jar: {jar}")
    with tempfile.TemporaryDirectory() as classes:
        (Path(classes) / "Agree.java").write_text(JAVA)
        subprocess.run(["javac", "-cp", str(jar), "-d", classes, str(Path(classes) / "Agree.java")], check=True)

        words = meteor_words(jar, paraphrase_gz)
        report("words", words, run_java(jar, classes, "stem", words), [meteor.snowball_stem(w) for w in words],
               unchanged=lambda w: w)

        lines = corpus_lines()
        java = [j.split("\t") if j else [] for j in run_java(jar, classes, "norm", lines)]
        report("lines", lines, java, [meteor.meteor_normalize(line) for line in lines],
               unchanged=lambda line: line.lower().split())   # beyond lower-casing and splitting


if __name__ == "__main__":
    main()
