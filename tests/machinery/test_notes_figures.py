"""Figures the hardware notes give as measured on the course's machines stay true to their runs.

hardware_notes/measured.md keeps the runs: under `## Runs`, one `### run-id` heading per run with
`- source:` (the command, and the files in backticks whose code printed the output: a `make bench`
section, a lesson's cell), `- machine:` (one of the machines of its `## Machines` table) and
`- conditions:` (the load and whatever else the figures depend on), then the output as printed, in
one or more ```text blocks (one per repetition). A note writes each such figure as a link to its
run, so that the reader sees where it came from:

    [15.3 GB/s](measured.md#roofline-xeon "== 1 thread > triad bandwidth")

The title, if any, locates the line: substrings found in order (`>` separates them), each on the
same or a later line than the one before; the figure's numbers must follow the last one on that
line (` #k` at the end: the k-th such number, for a range or a derived value). Without a title a
number may be on any line. A number matches when the output prints it at the note's precision
(15 for 15.3) followed by the note's unit (GB/s, ms, x, % ...), or by none (a column's header names
it). A range (`1.9-2.0x`) is printed as such, or, with a title, is the lowest and highest value
over the run's blocks. A title starting with `= ` makes a derived figure (our arithmetic on
measured values): `[2.3](measured.md#roofline-xeon "= {== 2 threads > triad bandwidth} / 13.2")`;
each `{...}` is the first number after that locator (`{other-run: locator}`: in another run's
output), and the figure must equal the expression at its precision (a range: the lowest and
highest value over the blocks, each computed from one block). A fenced block whose info string
says `measured=run-id` must be lines of that run's output.

Checked here, in well under a second, without running any benchmark:
- each link names a run that exists, and each of its figures is in the run's output where it says;
- each output line a figure is read from is still printed by the run's source: it matches a
  string the named files format (an f-string, a str.format or % template, a literal), so renaming
  or dropping the quantity in the code fails here until the run is repeated and recorded;
- each run names existing source files, a known machine and its conditions, and is cited;
- no note states a figure about the course's machines without the link: in a paragraph that says
  `this machine`, `dev machine`, `2-core`, `make bench`, ... (or under a heading that does, or says
  "measured"), every figure with a unit (ms, GB/s, GFLOP/s, x, % ...) and every decimal (a ratio,
  a load; not an exercise's number, a version or a size in bytes) must be a link, and so must every
  bare number of a table row there (or of a table right after such a paragraph), the row's first
  cell (its label) aside. A paragraph that quotes datasheets keeps them apart from figures measured
  here.
"""

from __future__ import annotations

import ast
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTES = REPO / "hardware_notes"
RECORD = "measured.md"

_FENCE = re.compile(r"^\s{0,3}(```|~~~)(.*)$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](measured.md#run "title"): the text may not hold brackets; the title is optional
_TAG = re.compile(r"\[([^\[\]]+)\]\(\s*" + re.escape(RECORD) + r"#([\w-]+)(?:\s+\"([^\"]*)\")?\s*\)")
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e[+-]?\d+)?"
_UNITS = ("GFLOP/s", "TFLOP/s", "FLOP/byte", "FLOP/B", "GB/s", "MB/s", "GiB/s", "tokens/s", "GOPS",
          "GHz", "ns/byte", "ms", "us", "µs", "ns", "s")  # and "x", "%", which stick to the number
_UNIT = "|".join(re.escape(u) for u in _UNITS)
# a figure in a note: a number, or a range of two, and an optional unit
_FIGURE = re.compile(rf"(?<![\w.])({_NUM})(?:\s*(?:-|to)\s*({_NUM}))?(?:(x|%)(?!\w)|\s?({_UNIT})(?![\w/]))?")
_OUT_NUM = re.compile(rf"(?<![\w.])-?({_NUM})")
# sentences about the course's own machines
_CONTEXT = re.compile(r"this (?:dev |development )?machine|dev machine|development (?:machine|VM)|build machine|"
                      r"course's (?:2-core )?machine|\b2-core\b|\b2-vCPU\b|make (?:bench|demo)|measured here|"
                      r"lesson \d+'s (?:demo|timing) cell", re.IGNORECASE)
_UNIT_FIGURE = re.compile(rf"(?<![\w.*/^])(?:{_NUM})(?:(?:x|%)(?!\w)|\s?(?:{_UNIT})(?![\w/]))")
_BARE_CELL = re.compile(rf"^\s*(?:~|about |≈)?\s*(?:{_NUM})\s*$")
# a decimal in prose about this machine: a ratio or a fraction, unless it names an exercise, a
# section or a version, or is a size (0.4 MB of weights)
_DECIMAL = re.compile(r"(?<![\w.*/^])(?<!exercise )(?<!exercises )(?<!section )(?<!lesson )(?<!Python )"
                      r"(?<!version )\d+\.\d+(?![\w.])(?!\s?(?:[KMGT]i?B|bytes|[KMG]\b))")


def unit_of(text: str) -> str:
    return text.replace("µ", "u")


# ---------------------------------------------------------------------------------------------
# the record: machines and runs

@dataclass
class Run:
    name: str
    line: int
    fields: dict[str, str] = field(default_factory=dict)
    blocks: list[list[str]] = field(default_factory=list)


def slug(heading: str) -> str:
    text = re.sub(r"(`+)(.+?)\1", r"\2", heading).strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def parse_record(text: str) -> tuple[dict[str, str], dict[str, Run]]:
    """({machine name: its table row}, {run anchor: Run}) of a measured.md text."""
    machines: dict[str, str] = {}
    runs: dict[str, Run] = {}
    section, run, fence, block = "", None, None, None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence, block = m.group(1), []
            elif m.group(1) == fence:
                if run is not None and section == "runs":
                    run.blocks.append(block)
                fence, block = None, None
            continue
        if fence is not None:
            block.append(line)
            continue
        if line.startswith("## "):
            section, run = line[3:].strip().lower(), None
        elif line.startswith("### ") and section == "runs":
            run = Run(slug(line[4:]), no)
            runs[run.name] = run
        elif section == "machines" and line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells and cells[0].lower() != "name":
                machines[cells[0].strip("`")] = line
        elif run is not None:
            m = re.match(r"^- (source|machine|conditions):\s*(.*)$", line)
            if m:
                run.fields[m.group(1)] = m.group(2).strip()
            elif line.startswith("  ") and run.fields and line.strip():
                key = list(run.fields)[-1]
                run.fields[key] += " " + line.strip()
    return machines, runs


def source_files(run: Run) -> list[Path]:
    return [REPO / p for p in re.findall(r"`([\w./-]+\.py)`", run.fields.get("source", ""))]


def run_problems(run: Run, machines: dict[str, str]) -> list[str]:
    out = []
    for key in ("source", "machine", "conditions"):
        if not run.fields.get(key):
            out.append(f"run {run.name}: no '- {key}:' line")
    files = source_files(run)
    if run.fields.get("source") and not files:
        out.append(f"run {run.name}: its source names no .py file in backticks")
    out += [f"run {run.name}: source file {p.relative_to(REPO)} does not exist" for p in files if not p.exists()]
    machine = run.fields.get("machine", "")
    if machine and not any(re.match(rf"`?{re.escape(name)}`?\b", machine) for name in machines):
        out.append(f"run {run.name}: machine {machine!r} does not start with a machine of the table "
                   f"({', '.join(machines) or 'none'})")
    if run.fields.get("conditions") and "load" not in run.fields["conditions"]:
        out.append(f"run {run.name}: its conditions do not state the load")
    if not any(any(line.strip() for line in b) for b in run.blocks):
        out.append(f"run {run.name}: no output block")
    return out


# ---------------------------------------------------------------------------------------------
# what the source code can print

ANY = ".*?"


def _lit(text: str) -> str:
    return "\n".join(re.escape(piece) for piece in text.split("\n"))


def _template(text: str, spec: str) -> str:
    return ANY.join(_lit(piece) for piece in re.split(spec, text))


def _rx(node: ast.AST) -> str:
    """A regex for what the expression `node` can produce as text (non-text parts: anything)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _lit(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_lit(v.value) if isinstance(v, ast.Constant) else ANY for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _rx(node.left) + _rx(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
            and isinstance(node.left.value, str):
        return _template(node.left.value, r"%[-+ #0]*\d*(?:\.\d+)?[sdifgeExXr]")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for s, _ in ((node.left, node.right), (node.right, node.left)):
            if isinstance(s, ast.Constant) and isinstance(s.value, str):
                return f"(?:{_lit(s.value)})*"
    if isinstance(node, ast.IfExp):
        return f"(?:{_rx(node.body)}|{_rx(node.orelse)})"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
        return _template(node.func.value.value, r"\{[^{}]*\}")
    return ANY


def _stringy(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _stringy(node.left) or _stringy(node.right)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"


_SKELETONS: dict[Path, list[re.Pattern]] = {}


def printed_lines(path: Path) -> list[re.Pattern]:
    """One pattern per line that the strings formatted in `path` can print."""
    if path not in _SKELETONS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = set()
        for node in ast.walk(tree):
            exprs = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and node.args:
                exprs.append(r"\ ".join(_rx(a) for a in node.args))
            if _stringy(node):
                exprs.append(_rx(node))
            for expr in exprs:
                for line in expr.split("\n"):
                    literal = re.sub(r"\.\*\?|\\(.)", r"\1", line)
                    if sum(ch.isalnum() for ch in literal) >= 4 or line.count(ANY) >= 4:  # a label, or a table row
                        found.add(line)
        _SKELETONS[path] = [re.compile(rf"\s*{line}\s*") for line in sorted(found)]
    return _SKELETONS[path]


def printed_by(line: str, files: list[Path]) -> bool:
    return any(p.fullmatch(line) for f in files if f.exists() for p in printed_lines(f))


# ---------------------------------------------------------------------------------------------
# figures

def _value(text: str) -> tuple[float, float]:
    """(value, half a unit of its last digit) of a number as a note writes it."""
    plain = text.replace(",", "")
    mant, _, exp = plain.partition("e")
    decimals = len(mant.partition(".")[2])
    return float(plain), 0.5 * 10 ** (int(exp or 0) - decimals) * (1 + 1e-9)


def split_title(title: str) -> tuple[str, int]:
    """(locator, k) of a title ending in " #k" (the k-th number after the locator; default 1)."""
    m = re.fullmatch(r"(.*?)\s+#(\d+)", title.strip())
    return (m.group(1), int(m.group(2))) if m else (title, 1)


def locate(block: list[str], title: str) -> tuple[int, int] | None:
    """(line index, column after the last locator) in `block`, or None where a locator is missing."""
    row, col = 0, 0
    for part in (p.strip() for p in title.split(" > ")):
        while row < len(block):
            at = block[row].find(part, col)
            if at >= 0:
                col = at + len(part)
                break
            row, col = row + 1, 0
        else:
            return None
    return row, col


def numbers_after(line: str, col: int) -> list[tuple[float, str]]:
    """(value, what follows it) for every number on `line` from column `col`."""
    return [(float(m.group(1).replace(",", "")), unit_of(line[m.end():].lstrip()))
            for m in _OUT_NUM.finditer(line, col)]


_OUT_UNIT = re.compile(rf"(?:{_UNIT}|x|%|[A-Za-z]+/[A-Za-z]+)(?![\w/])")


def unit_ok(unit: str | None, after: str) -> bool:
    """The output's number is followed by the note's unit, or by no unit (a table column's header gives it)."""
    return not unit or after.startswith(unit_of(unit)) or not _OUT_UNIT.match(after)


def matches(number: str, unit: str | None, value: float, after: str) -> bool:
    want, tol = _value(number)
    return abs(value - want) <= tol and unit_ok(unit, after)


def printed_range(lo: str, hi: str, unit: str | None, line: str, col: int) -> bool:
    """Whether `line` prints the range lo-hi itself (from column `col`), as "3.1-4.9x"."""
    for m in re.finditer(rf"(?<![\w.])({_NUM})\s*(?:-|to)\s*({_NUM})", line[col:]):
        if matches(lo, None, float(m.group(1).replace(",", "")), "") and \
                matches(hi, unit, float(m.group(2).replace(",", "")), unit_of(line[col + m.end():].lstrip())):
            return True
    return False


def derived(expr: str, blocks: list[list[str]], runs: dict[str, Run] | None = None,
            used: list[tuple[str, list[Path]]] | None = None) -> float:
    """The value of a derived figure's expression, each {locator} replaced by the number after it
    ({other-run: locator}: in another run's output); `used` receives (line, its run's files)."""
    def ref(m: re.Match) -> str:
        where, k = split_title(m.group(1))
        other = re.match(r"^([\w-]+):\s+(.*)$", where)
        if other and runs and other.group(1) in runs:
            where, source = other.group(2), [b for b in runs[other.group(1)].blocks if b]
            files = source_files(runs[other.group(1)])
        else:
            source, files = blocks, None
        for block in source:
            at = locate(block, where)
            if at is not None:
                nums = numbers_after(block[at[0]], at[1])
                if len(nums) >= k:
                    if used is not None:
                        used.append((block[at[0]], files))
                    return repr(nums[k - 1][0])
        raise LookupError(f"{{{m.group(1)}}} is not in the run's output")

    text, refs = re.subn(r"\{([^{}]+)\}", ref, expr)
    if not refs:
        raise LookupError("a derived figure's expression refers to no measured value ({locator})")
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.Pow, ast.USub, ast.Call, ast.Name, ast.Load)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or (isinstance(node, ast.Name) and node.id not in ("sqrt", "min", "max")):
            raise ValueError(f"{expr!r}: only arithmetic, sqrt, min and max are allowed")
    return eval(compile(tree, "<figure>", "eval"), {"__builtins__": {}, "sqrt": math.sqrt, "min": min, "max": max})


def figure_problems(text: str, title: str | None, run: Run, runs: dict[str, Run] | None = None) -> list[str]:
    """What is wrong with one tagged figure `text` (the link's text) of `run`."""
    figures = list(_FIGURE.finditer(text))
    if not figures:
        return [f"[{text}]: the link's text holds no number"]
    blocks = [b for b in run.blocks if b]
    files = source_files(run)
    out = []
    if title and title.startswith("=") and not title.startswith("=="):
        lo, hi = figures[0].group(1), figures[0].group(2)
        used: list[tuple[str, list[Path] | None]] = []
        try:  # a range: the expression's lowest and highest value over the blocks that hold its values
            values = ([derived(title[1:].strip(), [b], runs, used) for b in blocks] if hi
                      else [derived(title[1:].strip(), blocks, runs, used)])
        except (LookupError, ValueError, SyntaxError, ZeroDivisionError) as exc:
            return [f"[{text}]: {exc}"]
        for line, line_files in dict(used).items():
            if not printed_by(line, line_files or files):
                out.append(f"[{text}]: its line {line.strip()!r} is printed by none of "
                           f"{', '.join(str(f.relative_to(REPO)) for f in line_files or files)} any more")
        got = f"{min(values):.6g}" + (f" to {max(values):.6g}" if hi else "")
        if not (matches(lo, None, min(values), "") and matches(hi or lo, None, max(values), "")):
            out.append(f"[{text}]: {title[1:].strip()} gives {got}, not {lo}{' to ' + hi if hi else ''}")
        return out
    title, k = split_title(title) if title else (title, 1)
    where = [(b, locate(b, title)) for b in blocks] if title else [(b, (r, 0)) for b in blocks for r in range(len(b))]
    where = [(b, at) for b, at in where if at is not None]
    if not where:
        return [f"[{text}]: {title!r} is not in the run's output"]
    for fig in figures:
        lo, hi, unit = fig.group(1), fig.group(2), fig.group(3) or fig.group(4)
        printed = [b[row] for b, (row, col) in where if hi and printed_range(lo, hi, unit, b[row], col)]
        if printed:  # the output prints the range itself
            lines = printed[:1]
        elif hi and title:  # a range over the run's repetitions: their lowest and highest
            values = []
            for b, (row, col) in where:
                nums = [(v, a) for v, a in numbers_after(b[row], col) if unit_ok(unit, a)]
                if len(nums) >= k:
                    values.append((nums[k - 1][0], b[row]))
            if not values:
                out.append(f"[{text}]: no {unit or 'number'} after {title!r}")
                continue
            (vmin, lmin), (vmax, lmax) = min(values), max(values)
            if not (matches(lo, None, vmin, "") and matches(hi, None, vmax, "")):
                out.append(f"[{text}]: the run's {len(values)} values after {title!r} go from {vmin:g} to "
                           f"{vmax:g}, not {lo} to {hi}")
            lines = [lmin, lmax]
        else:
            lines = []
            for number in (lo, hi) if hi else (lo,):
                hit = next((b[row] for b, (row, col) in where
                            if any(matches(number, unit, v, a) for v, a in numbers_after(b[row], col))), None)
                if hit is None:
                    out.append(f"[{text}]: {number}{' ' + unit if unit else ''} is not in the run's output"
                               + (f" after {title!r}" if title else ""))
                else:
                    lines.append(hit)
        for line in lines:
            if not printed_by(line, files):
                out.append(f"[{text}]: its line {line.strip()!r} is printed by none of "
                           f"{', '.join(str(f.relative_to(REPO)) for f in files) or 'no file'} any more")
    return out


# ---------------------------------------------------------------------------------------------
# the notes

def note_units(text: str) -> list[tuple[int, str, str, bool, bool]]:
    """(first line, text, text with inline code blanked, is a table row, in a measured context) of
    each paragraph, list item and table row outside fenced code. The context is the unit's own
    text, its section's heading (or a heading saying "measured"), and for a table row the
    paragraph just before the table."""
    out, para, fence = [], [], None
    heading, before_table = "", ""

    def blank(t: str) -> str:
        return _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), t)

    def context(t: str) -> bool:
        return bool(_CONTEXT.search(t) or _CONTEXT.search(heading) or re.search(r"\bmeasured\b", heading, re.I))

    def flush():
        nonlocal before_table
        if para:
            joined = " ".join(t for _, t in para)
            out.append((para[0][0], joined, blank(joined), False, context(joined)))
            before_table = joined
            para.clear()

    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            flush()
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is not None:
            continue
        if line.lstrip().startswith("#"):
            flush()
            heading, before_table = line, ""
        elif not line.strip():
            flush()
        elif line.lstrip().startswith("|"):
            flush()
            out.append((no, line, blank(line), True, context(line + " " + before_table)))
        elif re.match(r"^\s*([-*+]|\d+\.)\s", line):
            flush()
            para.append((no, line))
        else:
            para.append((no, line))
    flush()
    return out


def measured_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, run, lines) of each fenced block whose info string says measured=run."""
    out, fence, current = [], None, None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
            tag = re.search(r"measured=([\w-]+)", m.group(2))
            current = (no, tag.group(1), []) if tag else None
        elif m and m.group(1) == fence:
            if current:
                out.append(current)
            fence, current = None, None
        elif current is not None:
            current[2].append(line)
    return out


def note_problems(name: str, text: str, runs: dict[str, Run]) -> tuple[list[str], set[str], int]:
    """(problems, runs cited, figures checked) of one note."""
    out, cited, count = [], set(), 0
    for no, raw, kind_text, is_row, in_context in note_units(text):
        for m in _TAG.finditer(kind_text):
            run = runs.get(m.group(2))
            if not _FIGURE.search(m.group(1)):
                continue  # a plain link to the record: a run ("one run"), its machines (test_links checks anchors)
            count += 1
            if run is None:
                out.append(f"{name}:{no}: [{m.group(1)}] links to run {m.group(2)!r}, which {RECORD} does not have")
                continue
            cited.add(run.name)
            out += [f"{name}:{no}: {p}" for p in figure_problems(m.group(1), m.group(3), run, runs)]
        if not in_context:
            continue
        rest = _TAG.sub(" ", kind_text)
        rest = re.sub(r"\[[^\]]*\]\([^)]*\)", lambda s: re.sub(r"\]\([^)]*\)", "]", s.group(0)), rest)  # other links: text only
        loose = [f.group(0) for f in _UNIT_FIGURE.finditer(rest)]
        if is_row:
            loose += [c.strip() for c in rest.strip().strip("|").split("|")[1:] if _BARE_CELL.match(c)]  # the first labels the row
        else:
            loose += [d.group(0) for d in _DECIMAL.finditer(_UNIT_FIGURE.sub(" ", rest))]
        if loose:
            out.append(f"{name}:{no}: about this machine but not linked to a run in {RECORD}: "
                       f"{', '.join(loose)} (in: {raw.strip()[:160]!r})")
    for no, run_name, lines in measured_blocks(text):
        count += 1
        run = runs.get(run_name)
        if run is None:
            out.append(f"{name}:{no}: a block says measured={run_name}, which {RECORD} does not have")
            continue
        cited.add(run.name)
        have = {" ".join(line.split()) for b in run.blocks for line in b}
        out += [f"{name}:{no}: {line.strip()!r} is not a line of run {run_name}'s output"
                for line in lines if line.strip() and " ".join(line.split()) not in have]
    return out, cited, count


def all_problems(notes: dict[str, str], record: str) -> tuple[list[str], int]:
    machines, runs = parse_record(record)
    out = [] if runs else [f"{RECORD}: no runs under '## Runs'"]
    for run in runs.values():
        out += run_problems(run, machines)
    cited, count = set(), 0
    for name, text in sorted(notes.items()):
        problems, c, n = note_problems(name, text, runs)
        out += problems
        cited |= c
        count += n
    out += [f"{RECORD}: run {r} is cited by no note" for r in sorted(set(runs) - cited)]
    used = {m for r in runs.values() for m in machines if r.fields.get("machine", "").strip("`").startswith(m)}
    out += [f"{RECORD}: machine {m} is used by no run" for m in sorted(set(machines) - used)]
    return out, count


def repo_notes() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(NOTES.glob("*.md")) if p.name != RECORD}


# ---------------------------------------------------------------------------------------------
# the tests

def test_every_measured_figure_in_the_notes_comes_from_a_recorded_run():
    record = NOTES / RECORD
    assert record.exists(), f"{record} is missing: the runs behind the notes' measured figures live there"
    notes = repo_notes()
    assert len(notes) > 10, f"found only {sorted(notes)}: is the layout different?"
    problems, count = all_problems(notes, record.read_text(encoding="utf-8"))
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)
    assert count >= 20, f"only {count} measured figures found in the notes: is the tag format different?"


RECORD_SAMPLE = '''# Measured here

## Machines

| name | CPU |
|---|---|
| box | a CPU |

## Runs

### bench-1

- source: `make bench L=x` (`{src}`)
- machine: box, 2 vCPUs
- conditions: load average 0.5

```text
== 1 thread
triad bandwidth     25.3 GB/s
== 2 threads
triad bandwidth     53.1 GB/s
ratio 1.94x
py 3.0us 1.20x 2.5us 1.50x
     (8, 64)     8.42     1.97   3.1-4.9x
```

```text
== 1 thread
triad bandwidth     24.0 GB/s
== 2 threads
triad bandwidth     50.2 GB/s
ratio 2.10x
py 3.1us 1.30x 2.6us 1.70x
```
'''

SOURCE_SAMPLE = '''
print(f"== {threads} thread{'s' * (threads > 1)}")
print(f"triad bandwidth     {bw / 1e9:8.1f} GB/s")
print("ratio %.2fx" % r)
print(f"py {a}us {b:.2f}x {c}us {d:.2f}x")
print(f"{str(shape):>12} {e:>8.2f} {n:>8.2f}   {lo:.1f}-{hi:.1f}x")
'''


@pytest.fixture
def sample(tmp_path, monkeypatch):
    src = tmp_path / "bench_x.py"
    src.write_text(SOURCE_SAMPLE)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    return RECORD_SAMPLE.format(src=src.name), src


def test_the_check_accepts_figures_that_are_in_their_run(sample):
    record, _ = sample
    note = ("On this machine one thread moved [25 GB/s](measured.md#bench-1 \"== 1 thread > triad\") and two "
            "[53.1 GB/s](measured.md#bench-1 \"== 2 threads > triad\"), a ratio of "
            "[1.94-2.10x](measured.md#bench-1 \"ratio\") over the runs, [1.5-1.7x](measured.md#bench-1 \"py #2\") "
            "in Python, [8.42 ms](measured.md#bench-1 \"(8, 64)\") and [3.1-4.9x](measured.md#bench-1 \"(8, 64)\") "
            "in a table; a 13 GB model then reads at most "
            "[0.24](measured.md#bench-1 \"= 13 / {== 2 threads > triad bandwidth}\") times a second, "
            "[2.09-2.10](measured.md#bench-1 \"= {== 2 threads > triad} / {== 1 thread > triad}\") times one thread's.\n\n"
            "| this machine ([measured](measured.md#bench-1)) | [25 GB/s](measured.md#bench-1) |\n\n"
            "```text measured=bench-1\ntriad bandwidth 53.1 GB/s\n```\n")
    problems, count = all_problems({"n.md": note}, record)
    assert problems == [] and count == 10, problems


@pytest.mark.parametrize("note, expected", [
    ("[26 GB/s](measured.md#bench-1 \"== 1 thread > triad\")", "26 GB/s is not in the run's output"),
    ("[25 GFLOP/s](measured.md#bench-1)", "25 GFLOP/s is not in the run's output"),
    ("[53 GB/s](measured.md#bench-1 \"== 1 thread > triad\")", "53 GB/s is not in the run's output"),
    ("[1.9-2.2x](measured.md#bench-1 \"ratio\")", "go from 1.94 to 2.1, not 1.9 to 2.2"),
    ("[1.2-1.3x](measured.md#bench-1 \"py #2\")", "go from 1.5 to 1.7, not 1.2 to 1.3"),
    ("[3.1-5.0x](measured.md#bench-1 \"(8, 64)\")", "not 3.1 to 5.0"),
    ("[1.97 ms](measured.md#bench-1 \"(8, 64) > 1.97\")", "1.97 ms is not in the run's output after"),
    ("[25 GB/s](measured.md#bench-2)", "links to run 'bench-2'"),
    ("[0.3](measured.md#bench-1 \"= 13 / {== 2 threads > triad bandwidth}\")", "gives 0.244821, not 0.3"),
    ("[0.3](measured.md#bench-1 \"= 13 / 53.1\")", "refers to no measured value"),
    ("[2.1-2.2](measured.md#bench-1 \"= {== 2 threads > triad} / {== 1 thread > triad}\")", "gives 2.09167 to 2.09881"),
    ("On the 2-core machine the triad moved 25 GB/s.", "not linked to a run"),
    ("| this dev machine (lesson 04) | about 21 GB/s | 1.6 |", "21 GB/s, 1.6"),
    ("| this machine | 8 | 1.6 |", "not linked to a run in measured.md: 8, 1.6"),
    ("`make bench` gave [25 GB/s](measured.md#bench-1) and 1.9x.", "not linked to a run in measured.md: 1.9x"),
    ("## This machine\n\nOne thread: 25 GB/s.", "not linked to a run in measured.md: 25 GB/s"),
    ("## Measured: the block\n\nEager 8.15 ms.", "not linked to a run in measured.md: 8.15 ms"),
    ("On this machine (load 1.9) the kernel ran at 0.29-0.38 of BLAS, as exercise 10.6 says; its 0.4 MB "
     "of weights, NumPy 2.4.6.", "not linked to a run in measured.md: 1.9, 0.29, 0.38 (in"),
    ("Measured on the 2-core machine:\n\n| threads | GB/s | GFLOP/s |\n|---|---|---|\n| 1 | 25 | 98 |", ": 25, 98"),
    ("```text measured=bench-1\ntriad bandwidth 54.0 GB/s\n```", "is not a line of run bench-1's output"),
])
def test_the_check_finds_each_kind_of_untrue_figure(sample, note, expected):
    record, _ = sample
    problems, _ = all_problems({"n.md": note}, record)
    assert any(expected in p for p in problems), f"{expected!r} not reported for {note!r}:\n" + "\n".join(problems)


def test_the_check_fails_when_the_source_no_longer_prints_the_quantity(sample):
    record, src = sample
    note = ("[25 GB/s](measured.md#bench-1 \"== 1 thread > triad\") [1.94x](measured.md#bench-1) "
            "[0.24](measured.md#bench-1 \"= 13 / {== 2 threads > triad bandwidth}\")")
    assert all_problems({"n.md": note}, record)[0] == []
    src.write_text(SOURCE_SAMPLE.replace("triad bandwidth", "copy bandwidth").replace("ratio %.2fx", "speed-up %.2fx"))
    _SKELETONS.clear()
    problems, _ = all_problems({"n.md": note}, record)
    assert sum("is printed by none of bench_x.py" in p for p in problems) == 3, "\n".join(problems)


def test_the_check_wants_every_run_complete_and_cited(sample):
    record, _ = sample
    broken = (record.replace("- conditions: load average 0.5\n", "").replace("(`bench_x.py`)", "(`gone.py`)")
              .replace("- machine: box", "- machine: other"))
    problems, _ = all_problems({"n.md": "nothing measured here"}, broken)
    for expected in ("no '- conditions:' line", "gone.py does not exist", "machine 'other, 2 vCPUs'",
                     "run bench-1 is cited by no note", "machine box is used by no run"):
        assert any(expected in p for p in problems), f"{expected!r} not in:\n" + "\n".join(problems)


def test_skeletons_follow_the_ways_python_formats_text(tmp_path):
    src = tmp_path / "s.py"
    src.write_text('x = 1\nprint(f"{x:>9} bytes: one way {x:8.1f} us", "and more")\n'
                   'line = "{} ranks: {:.2f}x".format(2, 1.5)\n'
                   'print("peak " + (f"{x} GFLOP/s" if x else "none") + "\\nsecond line %d items" % 3)\n')
    for ok in ("     1024 bytes: one way      7.9 us and more", "2 ranks: 1.50x", "peak 98.1 GFLOP/s",
               "peak none", "second line 12 items"):
        assert printed_by(ok, [src]), ok
    for bad in ("1024 bytes: two ways 7.9 us and more", "peak 98 TFLOP/s", "ranks 2: 1.5x"):
        assert not printed_by(bad, [src]), bad
