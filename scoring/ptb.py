"""The Penn Treebank (PTB) tokenizer as the coco-caption toolkit runs it, in plain Python: the same tokens.

Every coco-caption scorer (BLEU, METEOR, ROUGE-L, CIDEr-D) reads captions through pycocoevalcap's
tokenizer/ptbtokenizer.py, a wrapper around Stanford CoreNLP 3.4.1's PTBTokenizer run as
`PTBTokenizer -preserveLines -lowerCase`: a JFlex lexer (at each position the longest match of any rule wins, the
earlier rule on a tie), whose output lines the wrapper splits on " " before it drops 17 punctuation tokens. This file
is that lexer's rules and the wrapper (ptb_tokenize), then a shortcut for plain captions (ptb_tokenize_fast) that
gives the same tokens faster. metrics.py's scorer calls it; it imports nothing of the project.

Differences from the toolkit (each is marked `# differs from reference:` below): line breaks other than \\n are
spaces; a caption is lexed alone (metrics.py's docstring says what either changes).

Run:   python -m scoring.ptb "The cube can't move, it's RED!"
"""
import functools
import re
import sys

# The wrapper replaces "\n" by a space, runs `PTBTokenizer -preserveLines -lowerCase` (a JFlex lexer: at each
# position the longest match of any rule wins, the earlier rule on a tie), splits each output line on " " and drops
# these 17 tokens. Bracket tokens (-LRB- for a left round bracket, -RSB- for a right square one, ...) survive: the
# list is upper case but the tokens were lower-cased first.
PTB_DROPPED = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                         ".", "?", "!", ",", ":", "-", "--", "...", ";"])
LINE_BREAKS = "\r\n\x0b\x0c\u2028\u2029"      # PTBTokenizer's line ends (U+0085, next line, is an ellipsis to it)
_CURRENCY = {"\u00a2": "cents", "\u00a3": "#", "\u0080": "$", "\u00a4": "$", "\u20a0": "$", "\u20ac": "$"}
_FRACTIONS = {"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3"}   # U+2154 is missed, as in 3.4.1
_LATEX_QUOTES = str.maketrans({"\u0091": "`", "\u2018": "`", "\u201b": "`", "\u2039": "`", "\u0092": "'",
                               "\u2019": "'", "\u203a": "'", "\u0093": "``", "\u201c": "``", "\u00ab": "``",
                               "\u0094": "''", "\u201d": "''", "\u00bb": "''"})
_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-",
             "&lt;": "<", "&gt;": ">"}


def _quote(text, left):
    """The lexer's handleQuotes with LaTeX quotes: ' and " become ` `` on the left, ' '' on the right."""
    if left:
        text = text.replace("&apos;", "`").replace("'", "`").replace("&quot;", "``").replace('"', "``")
    else:
        text = text.replace("&apos;", "'").replace("&quot;", "''").replace('"', "''")
    return text.translate(_LATEX_QUOTES)


@functools.lru_cache(maxsize=None)
def _ptb_rules():
    """The lexer's rules as (regex, action), in the order of PTBLexer.flex, built on first use.

    Written from the rule definitions of older and newer PTBLexer.flex versions (CoreNLP's GitHub history) and
    checked against the 3.4.1 jar itself: identical output on every caption of tests/metrics_vectors and on
    5,994 of 6,000 random caption-like lines of tricky fragments (the other 6 depend on the next line, which a
    per-caption tokenizer cannot see); 16 of 3,000 lines of fragments glued without spaces differ.

    A regex may hold a group `tok`: then only that much is the token and the rest is JFlex trailing context, which
    counts for the longest match but is read again. An action is "keep", "drop", a fixed output string, or a function
    of the token text returning (output or None, characters consumed).
    """
    # JFlex's [:letter:] is Java's Character.isLetter over the Basic Multilingual Plane: Python's str.isalpha(), that
    # is \w but for digits, "_" and the other numeric characters (superscripts, roman numerals, ...). Written so, as
    # a negated class: a class listing the 49,000 letters is slow to compile.
    numeric = "".join(ch for ch in map(chr, range(0x10000)) if ch.isalnum() and not (ch.isalpha() or ch.isdecimal()))
    L = rf"[^\W\d_{numeric}\U00010000-\U0010ffff]"
    LD = rf"(?:{L}|\d)"
    letter = rf"(?:{L}|[\u00ad\u0300-\u036f\u0483-\u0487])"
    word = rf"{letter}(?:{letter}|\d)*(?:[.!?]{letter}(?:{letter}|\d)*)*"      # "cube.red", "red!blue" stay whole
    apos = r"(?:['\u0092\u2019]|&apos;)"
    apos_etc = r"(?:['\u0092\u2019\u0091\u2018\u201b]|&apos;)"
    space = r"[ \t\u00a0\u2000-\u200a\u3000]"
    spacenl = r"[ \t\u00a0\u2000-\u200a\u3000\r\n\u2028\u2029\x0b\x0c\u0085]"
    sgml = r"<\/?[A-Za-z!?][^>\r\n]*>"
    acro = r"(?:[A-Za-z](?:\.[A-Za-z])+|(?:Canada|Sino|Korean|EU|Japan|non)-U\.S|U\.S\.-(?:U\.K|U\.S\.S\.R))"
    ab_month = r"Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
    ab_days = r"Mon|Tue|Tues|Wed|Thu|Thurs|Fri"
    ab_state = (r"Ala|Ariz|[A](?i:rk)|Calif|Colo|Conn|Dak|Del|Fla|Ga|[I](?i:ll)|Ind|Kans?|Ky|La|[M](?i:ass)|Md|Mich|"
                r"Minn|[M](?i:iss)|Mo|Mont|Neb|Nev|Okla|[O](?i:re)|Pa|Penn|Tenn|Tex|Va|Vt|[W](?i:ash)|Wisc?|Wyo")
    ab_comp = r"Inc|Cos?|Corp|Pp?tys?|Ltd|Plc|Bancorp|Dept|Bhd|Assn|Univ|Intl|Sys"
    ab_num = r"Prop|Ph|tel|est|ext|sq|ft"              # "No." and "Nos." count only before a number (below)
    ab_ptit = r"Jr|Sr|Bros|(?:Ed|Ph)\.D|Blvd|Rd|Esq"
    ab_title = (r"Mr|Mrs|Ms|[M](?i:iss)|Drs?|Profs?|Sens?|Reps?|Attys?|Lt|Col|Gen|Messrs|Govs?|Adm|Rev|Maj|Sgt|"
                r"Cpl|Pvt|Mt|Capt|Ste?|Ave|Pres|Lieut|Hon|Brig|Co?mdr|Pfc|Spc|Supts?|Det")
    abbrev1 = rf"(?i:(?:{ab_month}|{ab_days}|{ab_comp}|{ab_num}|{ab_ptit}|etc|al|seq)|(?:{ab_state}))\."
    # JFlex takes the longest match of a rule, Python's re the first alternative that succeeds: alternatives that
    # can succeed at different lengths are therefore separate rules below (same action, so ties do not matter).
    abbrev4s = (acro, r"(?i:a\.k\.a)", rf"(?i:{ab_title}|vs|Alex|Wm|Jos|Cie|cf|TREAS|Invt|Elec|Natl|M[ft]g)",
                "[A-Za-z]")
    acronym_next = ("About|According|Additionally|After|An|A|As|At|But|Earlier|He|Her|Here|However|If|In|It|Last|"
                    "Many|More|Mr\\.|Ms\\.|Now|Once|One|Other|Our|She|Since|So|Some|Such|That|The|Then|There|These|"
                    "They|This|We|When|While|What|Yet|You")
    acronym_next = "|".join(w[0] + "(?i:" + w[1:] + ")" for w in acronym_next.split("|"))
    thing = rf"(?:[dDoOlL]{apos_etc}{LD})?{LD}+(?:[-_\u058a\u2010\u2011](?:[dDoOlL]{apos_etc}{LD})?{LD}+)*"
    hthing = rf"[A-Za-z0-9][A-Za-z0-9.,\u00ad]*(?:-(?:{acro}\.|[A-Za-z0-9\u00ad]+))+"
    misc = ("[+%&~^|\\\\\u00a6\u00a7\u00a8\u00a9\u00ac\u00ae\u00af\u00b0-\u00ba\u00d7\u00f7\u0387\u05be\u05c0"
            "\u05c3\u05c6\u05f3\u05f4\u0600-\u0603\u0606-\u060a\u060c\u0614\u061b\u061e\u066a\u066d\u0703-\u070d"
            "\u07f6-\u07f8\u0964\u0965\u0e4f\u1fbd\u2016\u2017\u2020-\u2023\u2030-\u2038\u203b\u203e-\u2042"
            "\u2044\u207a-\u207f\u208a-\u208e\u2100-\u214f\u2190-\u21ff\u2200-\u2bff\u3012\u30fb\uff01-\uff0f"
            "\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65]")

    def unsoft(text):
        return (text.replace("\u00ad", "") or "-", len(text))

    def sentence_final(text):                     # abbreviation at a sentence end: the period is read again
        return (text, len(text) - 1)

    def split_off(text):                          # "cannot" -> "can" + "not", "gonna" -> "gon" + "na", "'tis"
        return (text, len(text))

    def spaces_to_nbsp(text):
        return (text.replace(" ", "\u00a0"), len(text))

    rules = [
        (r"(?P<tok>(?i:can))(?i:not)", split_off),
        (r"(?P<tok>(?i:gon|wan))(?i:na)|(?P<tok2>(?i:got))(?i:ta)|(?P<tok3>(?i:lem|gim))(?i:me)", split_off),
        (rf"(?P<tok>{apos}[tT])(?i:is|was)", split_off),
        (sgml, spaces_to_nbsp),
        (r"&(?:MD|mdash|ndash);|[\u0096\u0097\u2013\u2014\u2015]", "--"),
        (r"(?i:&amp;)", "&"),
        (r"&(?:HT|TL|UR|LR|QC|QL|QR|odq|cdq|#[0-9]+);", "keep"),
        (rf"(?P<tok>{word}){apos}(?:[msdMSD]|(?i:re|ve|ll))", unsoft),
        (rf"(?P<tok>[A-Za-z\u00ad]*[A-MO-Za-mo-z]\u00ad*)(?i:n){apos_etc}(?i:t)", unsoft),
        (word, unsoft),
        *[(pattern, "keep") for pattern in (
            rf"{apos}(?i:n){apos}?", rf"[lLdDjJ]{apos}", rf"(?i:dunkin|somethin|ol){apos}", rf"{apos}(?i:em)",
            rf"[A-HJ-XZn]{apos_etc}{L}{{2}}{L}*", rf"{apos}[2-9]0s", rf"{apos}(?i:till?)",
            rf"{L}+[aeiouyAEIOUY]{apos_etc}[aeiouA-Z]{L}*", rf"{apos}(?i:cause)",
            r"(?i:cont'd\.?|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)")],
        (rf"(?P<tok>[yY]{apos}){L}", "keep"),
        (r"https?://[^ \t\n\f\r\"<>|()]+[^ \t\n\f\r\"<>|.!?(){},-]", "keep"),
        *[(site + r"(?:/[^ \t\n\f\r\"<>|()]+[^ \t\n\f\r\"<>|.!?(){},-])?", "keep") for site in (
            r"www\.(?:[^ \t\n\f\r\"<>|.!?(){},]+\.)+[a-zA-Z]{2,4}",
            r"(?:[^ \t\n\f\r\"`'<>|.!?(){},-_$]+\.)+(?:com|net|org|edu)")],
        (r"[a-zA-Z0-9][^ \t\n\f\r\"<>|()\u00a0]*@(?:[^ \t\n\f\r\"<>|().\u00a0]+\.)*[^ \t\n\f\r\"<>|().\u00a0]+",
         "keep"),
        (rf"@[a-zA-Z_][a-zA-Z_0-9]*|#{word}", "keep"),
        (rf"(?P<tok>{apos}(?:[msdMSD]|(?i:re|ve|ll)))[^A-Za-z]", lambda t: (_quote(t, False), len(t))),
        (rf"(?i:n){apos_etc}(?i:t)", lambda t: (_quote(t, False), len(t))),
        (r"\d{1,2}[\-/]\d{1,2}[\-/]\d{2,4}", "keep"),
        (r"[\-+]?(?:\d*(?:[.:,\u00ad\u066b\u066c]\d+)+|\d+)", unsoft),
        (r"[\u207a\u207b\u208a\u208b]?(?:[\u2070\u00b9\u00b2\u00b3\u2074-\u2079]+|[\u2080-\u2089]+)", "keep"),
        (r"(?:\d{1,4}[- \u00a0])?\d{1,4}(?:\\?/|\u2044)\d{1,4}", spaces_to_nbsp),
        (r"[\u00bc\u00bd\u00be\u2153-\u215e]", lambda t: (_FRACTIONS.get(t, t), 1)),
        (rf"(?i:-(?:RRB|LRB|RCB|LCB|RSB|LSB)-|C\.D\.s|pro-|anti-|S(?:&|&amp;)P-500|S(?:&|&amp;)Ls|Cap{apos}n|"
         rf"c{apos}est)", lambda t: (t.replace("&amp;", "&").replace("&AMP;", "&"), len(t))),
        (r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}", "keep"),
        (r"[A-Z]*\$|#", "keep"),
        (r"[\u00a2\u00a3\u00a4\u00a5\u0080\u20a0\u20ac\u060b\u0e3f\u20a4\uffe0\uffe1\uffe5\uffe6]",
         lambda t: (_CURRENCY.get(t, t), 1)),
        # An acronym before a word that usually starts a sentence ends it: "U.S. The" -> "U.S." "." "The"; a
        # single letter gives the letter and the period: "a. The" -> "a" "." "The".
        (rf"(?P<tok>{acro}\.){space}+(?:(?:{acronym_next}){spacenl}|{sgml})", sentence_final),
        (rf"(?P<tok>[A-Za-z])\.{space}+(?:(?:{acronym_next}){spacenl}|{sgml})", "keep"),
        (rf"(?P<tok>(?i:nos?)\.){space}?[0-9]", "keep"),
        (rf"(?P<tok>{abbrev1}){spacenl}(?:{spacenl}|[A-Z]|{sgml})", sentence_final),
        (abbrev1, "keep"),
        *[(rf"{abbrev}\.", "keep") for abbrev in abbrev4s],
        *[(rf"(?P<tok>{abbrev}){space}", "keep") for abbrev in abbrev4s],
        (rf"(?P<tok>{acro}){spacenl}", "keep"),
        (rf"(?P<tok>{apos}[0-9][0-9]){spacenl}", "keep"),
        (rf"(?P<tok>{word}\.)[,;:\u3001]", unsoft),
        (r"(?:\([0-9]{2,3}\)[ \u00a0]?|(?:\+\+?)?(?:[0-9]{2,4}[\- \u00a0])?[0-9]{2,4}[\- \u00a0])[0-9]{3,4}"
         r"[\- \u00a0]?[0-9]{3,5}|(?:(?:\+\+?)?[0-9]{2,4}\.)?[0-9]{2,4}\.[0-9]{3,4}\.[0-9]{3,5}",
         lambda t: (t.replace(" ", "\u00a0").replace("(", "-LRB-").replace(")", "-RRB-"), len(t))),
        (r"(?P<tok>\"|&quot;)[A-Za-z0-9$]", lambda t: (_quote(t, True), len(t))),
        (r"\"|&quot;", lambda t: (_quote(t, False), len(t))),
        (r"(?i:0x7f)", "drop"),
        (r"[<\[]|&lt;|[>\]]|&gt;|[{}()]", lambda t: (_BRACKETS.get(t, t), len(t))),
        (r"-+", lambda t: ("--" if 3 <= len(t) <= 4 else t, len(t))),
        (r"\.{3,5}|(?:\.[ \u00a0]){2,4}\.|[\u0085\u2026]", "..."),
        (r"@+|#+|_+", "keep"),
        (r"\*+|(?:\\\*){1,3}", "keep"),
        (r"[,;:\u3001]", "keep"),
        (r"[?!]+", "keep"),
        (r"[.\u00a1\u00bf\u037e\u0589\u061f\u06d4\u0700-\u0702\u07fa\u3002]", "keep"),
        (r"=", "keep"),
        (r"/", "keep"),
        (rf"(?P<tok>{hthing}\.)[,;:\u3001]", unsoft),
        (hthing, unsoft),
        (rf"(?P<tok>{thing}\.)[,;:\u3001]", "keep"),
        (thing, "keep"),
        (r"(?P<tok>[A-Z]+(?:(?:[+&]|&amp;)[A-Z]+)+\.)[,;:\u3001]|[A-Z]+(?:(?:[+&]|&amp;)[A-Z]+)+",
         lambda t: (t.replace("&amp;", "&"), len(t))),
        (r"(?P<tok>')[A-Za-z][^ \t\n\r\u00a0]", lambda t: (_quote(t, True), len(t))),
        (rf"{apos}(?:[msdMSD]|(?i:re|ve|ll))", lambda t: (_quote(t, False), len(t))),
        *[(pattern, lambda t: (_quote(t, False), len(t))) for pattern in (
            apos, "''", "[`\u2018\u2019\u201a\u201b\u201c\u201d\u0091\u0092\u0093\u0094\u201e\u201f\u2039\u203a"
                        "\u00ab\u00bb]{1,2}")],
        (r"<<|>>", "keep"),
        (misc, "keep"),
        (r"\x00|[ \t\u00a0\u2000-\u200a\u3000]+|[\u200b\u200e\u200f\ufeff]|[\r\n\u2028\u2029\x0b\x0c]|&nbsp;",
         "drop"),
    ]
    return [(re.compile(pattern), action) for pattern, action in rules]


def _ptb_step(text, pos):
    """(the tokens of the longest rule match at pos, where the next match starts); no rule: the character is
    deleted, as -untokenizable firstDelete does."""
    best, best_len = None, 0
    for rx, action in _ptb_rules():
        m = rx.match(text, pos)
        if m is not None and m.end() - pos > best_len:
            best, best_len = (m, action), m.end() - pos
    if best is None:
        return [], pos + 1
    m, action = best
    groups = [g for g in ("tok", "tok2", "tok3") if g in m.re.groupindex and m.group(g) is not None]
    tok = m.group(groups[0] if groups else 0)            # the token; the rest of the match is trailing context
    if action == "drop":
        return [], pos + len(tok)
    if action == "keep":
        return [tok], pos + len(tok)
    if isinstance(action, str):
        return [action], pos + len(tok)
    out, consumed = action(tok)
    return [out], pos + consumed


def _ptb_lex(text):
    """Tokens of one line, by the lexer's longest-match rule, one match after the other."""
    tokens, pos = [], 0
    while pos < len(text):
        found, pos = _ptb_step(text, pos)
        tokens.extend(found)
    return tokens


def ptb_tokenize(text):
    """The text every coco-caption scorer sees: PTB tokens, lower-cased, 17 punctuation tokens dropped.

    >>> ptb_tokenize("The cube can't move, it's RED!")
    "the cube ca n't move it 's red"
    """
    # differs from reference: line breaks other than "\n" are spaces here; the toolkit starts a new output line at
    # them and shifts every later caption onto the wrong item.
    for ch in LINE_BREAKS:
        text = text.replace(ch, " ")
    # Characters outside the Basic Multilingual Plane (emoji) reach JFlex as two surrogates no rule covers.
    text = "".join(ch if ord(ch) < 0x10000 else " " for ch in text)
    # differs from reference: a caption is lexed alone, followed by "\n" as in the toolkit's input file; there the
    # next caption follows too, which a few abbreviation rules read as trailing context.
    tokens = [tok.lower() for tok in _ptb_lex(text + "\n")]
    return " ".join(tok for tok in " ".join(tokens).split(" ") if tok not in PTB_DROPPED)


# The shortcut: the same tokens, faster (FastCaptionScorer's; a test checks it equals ptb_tokenize).
_PLAIN_CAPTION = re.compile(r"(?:[A-Za-z0-9 ]*[A-Za-z0-9 ][,;!?.](?= |\Z))*[A-Za-z0-9 ]*")   # most captions: words,
# spaces and lone punctuation marks the lexer splits off and the wrapper drops (each before a space or the end)
_LOWER_WORDS = re.compile(r"[a-z0-9 ]*")       # the commonest of them: lower-case words and spaces
_DIGITS_SPACED = re.compile(r"\d \d")          # "555 123 4567" is one (phone number) token
_BEFORE_PERIOD = re.compile(r"[A-Za-z0-9]+(?=\.)")   # "etc.", "No.", "a.": maybe an abbreviation, ask the lexer
_WORD = re.compile(r"[a-z0-9]+")
# Words the lexer splits although they hold only letters: its "cannot" rule and the assimilations.
_PTB_SPLIT_WORDS = {"cannot": "can not", "gonna": "gon na", "gotta": "got ta", "wanna": "wan na", "lemme": "lem me",
                    "gimme": "gim me"}


def ptb_tokenize_fast(text):
    """ptb_tokenize(text), with a shortcut for captions of words, spaces and lone , ; ! ? . marks (most captions):
    the lexer's tokens are then the words, but for the few it splits, and the marks, which the wrapper drops. A word
    before a period is asked of the lexer (one step: an abbreviation keeps its period). Trying each of the lexer's
    80 rules at every position is slow in Python; what this shortcut buys of the whole process: BENCHMARKS.md
    section 6 (`python -m bench metrics`)."""
    if _DIGITS_SPACED.search(text):
        return ptb_tokenize(text)
    if _LOWER_WORDS.fullmatch(text):              # lower-case words and spaces: nothing to lower or drop
        words = text.split()
    elif _PLAIN_CAPTION.fullmatch(text) and ("." not in text or all(
            _ptb_step(text + "\n", m.start()) == ([m.group()], m.end()) for m in _BEFORE_PERIOD.finditer(text))):
        words = _WORD.findall(text.lower())
    else:
        return ptb_tokenize(text)
    return " ".join([_PTB_SPLIT_WORDS.get(word, word) for word in words])


if __name__ == "__main__":
    text = " ".join(sys.argv[1:]) or "The cube can't move, it's RED!"
    print(f"{text!r} -> {ptb_tokenize(text)!r}")
