"""Builds the RULER suite's shipped assets (megablu/eval/assets/ruler/) from registry packages.

    pip download --no-deps wonderwords==3.0.1            # MIT: RULER's own word lists
    apt-get download python3.11-doc wamerican             # PSF licence / SCOWL (permissive)
    dpkg-deb -x python3.11-doc_*.deb doc; dpkg-deb -x wamerican_*.deb wam
    python -m megablu.eval.ruler.make_assets --wonderwords WONDERWORDS_3.0.1_WHEEL \
        --python-doc doc/usr/share/doc/python3.11/html/_sources --wamerican wam/usr/share/dict/american-english

Writes wonderwords_{nouns,adjectives,verbs}.txt (the package's lists, verbatim), english_words.txt (the
longer list cwe falls back to, as RULER falls back to its json/english_words.json) and essays.txt.gz (the
prose of the Python documentation's HOWTOs, FAQs, tutorial and What's New essays: the stand-in for Paul
Graham's essays). Provenance and licences: megablu/eval/assets/ruler/README.md, docs/EVAL.md.
"""

from __future__ import annotations

import argparse
import gzip
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "assets" / "ruler"
WONDER = {"nouns": "nounlist.txt", "adjectives": "adjectivelist.txt", "verbs": "verblist.txt"}
ESSAY_DIRS = ("whatsnew", "howto", "faq", "tutorial")

_ROLE = re.compile(r":[\w:+-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`~a.b <x>` -> a.b
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`__?")  # `text <url>`_ -> text
_LIT = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"(\*\*|\*|`)([^*`]+)\1_?")
_HEADING = re.compile(r"^([=\-~^*#+\"'`.:_])\1{2,}\s*$")


def rst_prose(text: str) -> list[str]:
    """The prose paragraphs of an reStructuredText file: unindented paragraphs that are not headings,
    directives, tables, comments or the literal blocks after '::', inline markup reduced to its text."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not block.strip() or any(_HEADING.match(x) for x in lines):
            continue
        first = lines[0]
        if first[:1].isspace() or first.startswith((".. ", "..\t", "+-", "|", "=", ">>>", "$ ", "%")):
            continue  # indented (literal blocks, directive bodies, quotes), directives, tables, sessions
        para = " ".join(x.strip() for x in lines)
        for role, name in (("pep", "PEP "), ("rfc", "RFC "), ("issue", "bpo-"), ("bpo", "bpo-"), ("gh", "gh-")):
            para = re.sub(rf":{role}:`(\d+)`", rf"{name}\1", para)
        para = _ROLE.sub(
            lambda m: m.group(1).strip().split(".")[-1] if m.group(0).count("~") else m.group(1).strip(), para
        )
        para = _LINK.sub(r"\1", para)
        para = _LIT.sub(r"\1", para)
        para = _EMPH.sub(r"\2", para)
        para = re.sub(r"\[#\w*\]_|\|\w+\|", "", para).replace("\\", "")
        para = re.sub(r"::$", ":", para)
        para = re.sub(r"\s+", " ", para).strip()
        # prose: at least two sentences' worth of words, ending like a sentence
        if len(para.split()) >= 12 and para[-1] in ".?!:)" and not para.startswith(("* ", "- ", "#. ")):
            out.append(para)
    return out


def essays(doc_sources: Path) -> str:
    docs = []
    for d in ESSAY_DIRS:
        for f in sorted((doc_sources / d).glob("*.rst.txt")):
            if f.name.startswith(("changelog", "index")):  # lists of issue numbers, tables of contents
                continue
            paras = rst_prose(f.read_text(encoding="utf-8"))
            if paras:
                docs.append("\n\n".join(paras))
    return "\n\n\n".join(docs) + "\n"


def english_words(path: Path, exclude: set[str]) -> list[str]:
    """Lower-case a-z words of 4-10 letters, without the inflections whose stem is in the list (-s, -es,
    -ed, -ing, -ly): a long list of distinct base words."""
    ws = {w.strip() for w in path.read_text(encoding="utf-8", errors="replace").split("\n")}
    ws = {w for w in ws if re.fullmatch(r"[a-z]{4,10}", w)}
    stem = lambda w: any(w.endswith(s) and w[: -len(s)] in ws for s in ("s", "es", "ed", "ing", "ly", "d"))  # noqa: E731
    return sorted(w for w in ws if not stem(w) and w not in exclude)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wonderwords", type=Path, required=True, help="the wonderwords-3.0.1 wheel")
    ap.add_argument("--python-doc", type=Path, required=True, help="python3.11-doc's html/_sources dir")
    ap.add_argument("--wamerican", type=Path, required=True, help="wamerican's /usr/share/dict/american-english")
    a = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    wonder = set()
    with zipfile.ZipFile(a.wonderwords) as z:
        for name, f in WONDER.items():
            data = z.read(f"wonderwords/assets/{f}")
            (OUT / f"wonderwords_{name}.txt").write_bytes(data)
            wonder |= set(data.decode().split("\n"))
        lic = z.read("wonderwords-3.0.1.dist-info/licenses/LICENSE")
        (OUT / "LICENSE.wonderwords").write_bytes(lic)
    (OUT / "english_words.txt").write_text("\n".join(english_words(a.wamerican, wonder)) + "\n")
    with gzip.GzipFile(OUT / "essays.txt.gz", "wb", mtime=0) as g:
        g.write(essays(a.python_doc).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
