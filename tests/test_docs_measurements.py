"""docs/MEASUREMENTS.md and the code's pointers into it: every `docs/MEASUREMENTS.md#anchor`
in the sources and docs names one of its headings (anchors computed as GitHub does), and no two
headings share an anchor."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "MEASUREMENTS.md"
POINTER = re.compile(r"docs/MEASUREMENTS\.md#([A-Za-z0-9_-]+)")
GENERATED = {"cython/expert_ffn.c", "cython/plan.c"}  # Cython's output, not ours


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but '-' and '_' dropped, spaces
    to '-'. Example: 'Fills: zero-copy gather vs copy engine' ->
    'fills-zero-copy-gather-vs-copy-engine'; 'Split rule (q*)' -> 'split-rule-q'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(text: str) -> list:
    """The ATX headings of a markdown text, outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def pointer_files():
    """The files that may point into the doc: sources under freetoken/, ftw/, tools/, the
    hand-written ones under cython/, and the markdown under docs/."""
    for folder, exts in (("freetoken", (".py",)), ("ftw", (".py", ".md")),
                         ("tools", (".py", ".md")), ("docs", (".md",)),
                         ("cython", (".pyx", ".pxd", ".h", ".c"))):
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix in exts and path.is_file() and rel not in GENERATED:
                yield rel, path.read_text(encoding="utf-8")


def test_anchor_rule():
    assert anchor("Fills: zero-copy gather vs copy engine") == "fills-zero-copy-gather-vs-copy-engine"
    assert anchor("Split rule (q*)") == "split-rule-q"
    assert anchor("Ready/done signals") == "readydone-signals"
    assert anchor("Row split of a CPU expert") == "row-split-of-a-cpu-expert"


def test_doc_anchors_are_unique():
    anchors = [anchor(h) for h in headings(DOC.read_text(encoding="utf-8"))]
    assert len(anchors) > 1
    duplicates = sorted({a for a in anchors if anchors.count(a) > 1})
    assert not duplicates, f"docs/MEASUREMENTS.md headings share anchors: {duplicates}"


def test_every_pointer_names_a_heading():
    known = {anchor(h) for h in headings(DOC.read_text(encoding="utf-8"))}
    found, bad = 0, []
    for rel, text in pointer_files():
        for i, line in enumerate(text.splitlines(), 1):
            for name in POINTER.findall(line):
                found += 1
                if name not in known:
                    bad.append(f"{rel}:{i}: #{name}")
    assert found, "no docs/MEASUREMENTS.md#... pointers found: is the scan looking in the right place?"
    assert not bad, "pointers to no heading of docs/MEASUREMENTS.md:\n" + "\n".join(bad)
