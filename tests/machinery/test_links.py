"""Every relative link in the course's prose resolves.

Checked: README.md, AUTHORING.md, hardware_notes/*.md, and the markdown cells of the lesson
sources solutions/*.py. A lesson's links are relative to lessons/, where its notebook lives
(`../hardware_notes/caches.md`). A link must name an existing file; a `#anchor` into a .md
file (or within the same file) must name one of its headings, slugged as GitHub does.
Absolute URLs are not checked: no network. Links inside code (fenced blocks, `code spans`)
are not links.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the markdown in `path`; for a lesson source, its markdown cells."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".py":
        return list(enumerate(lines, 1))
    out, in_markdown = [], False
    for no, line in enumerate(lines, 1):
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
        elif in_markdown:
            out.append((no, line[2:] if line.startswith("# ") else line.lstrip("#")))
    return out


def outside_code(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    out, fence = [], None
    for no, line in lines:
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((no, _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"(`+)(.+?)\1", r"\2", text)  # code spans: their content
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = re.sub(r"(?<![\w])_(.+?)_(?![\w])", r"\1", text)  # _emphasis_ (intra-word _ stays)
    text = text.strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    found, seen = set(), Counter()
    lines = outside_code(list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1)))
    previous = ""
    for _, line in lines:
        atx = _ATX.match(line)
        if atx:
            text = atx.group(2)
        elif _SETEXT.match(line) and previous.strip() and not _ATX.match(previous):
            text = previous
        else:
            previous = line
            continue
        base = slug(text)
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
        previous = ""
    return found


def links(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition.

    A link's text may wrap onto the next line, so links are searched paragraph by paragraph
    (runs of consecutive non-blank lines); the line reported is where the link starts.
    """
    out, block = [], []

    def flush():
        if block:
            text = "\n".join(line for _, line in block)
            for m in _INLINE.finditer(text):
                out.append((block[0][0] + text.count("\n", 0, m.start()), m.group(1)))
            block.clear()

    for no, line in lines:
        m = _REFDEF.match(line)
        if m:
            flush()
            out.append((no, m.group(1)))
        elif not line.strip() or (block and no != block[-1][0] + 1):
            flush()
            if line.strip():
                block.append((no, line))
        else:
            block.append((no, line))
    flush()
    return out


def problems(path: Path, base: Path | None = None) -> list[str]:
    """What is wrong with the relative links of `path`, resolved from `base` (default: its folder)."""
    base = base or path.parent
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    out = []
    for no, target in links(outside_code(prose_lines(path))):
        if not target or _SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (base / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{where}:{no}: link to {target!r}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            known = ", ".join(sorted(anchors(dest))) or "none"
            out.append(f"{where}:{no}: link to {target!r}: {dest.name} has no heading "
                       f"with anchor #{anchor} (its anchors: {known})")
    return out


def course_prose() -> list[tuple[Path, Path]]:
    """(file, folder its links are relative to) for every checked file of the course."""
    files = [(REPO / name, REPO) for name in ("README.md", "AUTHORING.md")]
    files += [(p, p.parent) for p in sorted((REPO / "hardware_notes").glob("*.md"))]
    files += [(p, REPO / "lessons") for p in sorted((REPO / "solutions").glob("*.py"))]
    return [(p, b) for p, b in files if p.exists()]


def test_every_relative_link_in_the_course_resolves():
    checked = course_prose()
    assert len(checked) > 10, f"found only {[str(p) for p, _ in checked]}: is the layout different?"
    found = [msg for path, base in checked for msg in problems(path, base)]
    assert not found, f"{len(found)} broken link(s):\n" + "\n".join(found)


def test_the_checker_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "b.md").write_text("# Title\n\n## Alpha and beta (lessons 12–13)\n\n"
                                             "## Repeat\n\n## Repeat\n\nSetext\n------\n")
    page = tmp_path / "a.md"
    page.write_text(
        "# Here\n"
        "[ok](notes/b.md) [ok](notes/b.md#alpha-and-beta-lessons-1213) [ok](#here)\n"
        "[ok](notes/b.md#repeat-1) [ok](notes/b.md#setext) [ok](https://example.com/x#y)\n"
        "[missing](notes/c.md)\n"
        "[bad anchor](notes/b.md#alpha-beta)\n"
        "[bad local anchor](#there)\n"
        "![missing image](img/x.png)\n"
        "a link whose text [wraps onto\nthe next line](notes/wrapped.md)\n\n"
        "[ref]: notes/gone.md\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[not a link](nowhere.md)\n```\n")
    found = problems(page)
    assert len(found) == 6, "\n".join(found)
    expected_all = ("notes/c.md", "#alpha-beta", "#there", "img/x.png",
                    "a.md:8: link to 'notes/wrapped.md'", "notes/gone.md")
    for expected in expected_all:
        assert any(expected in msg for msg in found), f"{expected} not reported in:\n" + "\n".join(found)


def test_lesson_sources_are_read_from_markdown_cells_only(tmp_path):
    src = tmp_path / "01_x.py"
    src.write_text('# %% [markdown]\n# See [caches](../notes/caches.md).\n\n'
                   '# %%\nkernel[grid, block](args)  # code, not a link\n')
    (tmp_path / "lessons").mkdir()
    found = problems(src, tmp_path / "lessons")
    assert len(found) == 1 and "../notes/caches.md" in found[0] and ":2:" in found[0], found
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "caches.md").write_text("# Caches\n")
    assert problems(src, tmp_path / "lessons") == []


def test_slugs_follow_github():
    assert slug("The shape of the machine") == "the-shape-of-the-machine"
    assert slug("Alpha and beta for lessons 12-13") == "alpha-and-beta-for-lessons-12-13"
    assert slug("H100 variants: SXM, PCIe, NVL, and what dense and sparse mean") == \
        "h100-variants-sxm-pcie-nvl-and-what-dense-and-sparse-mean"
    assert slug("From CUDA C to the machine: PTX and SASS") == "from-cuda-c-to-the-machine-ptx-and-sass"
    assert slug("Reading `memory_layout` and [links](x.md)") == "reading-memory_layout-and-links"
    assert slug("This machine (measured, 2-core dev machine)") == "this-machine-measured-2-core-dev-machine"
