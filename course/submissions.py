"""Find each student's lesson notebooks in a folder of submissions, as LMSs hand them over.

    discover(folder, lessons) -> [Submission]

Layouts: one folder per student (its name is the student; notebooks anywhere under it: a clone of the
release, a Gradescope upload folder, an unpacked zip), and Canvas's flat download (every file in one
folder, named `student_LATE_12345_678_01_tensors.ipynb`), side by side. A notebook is matched to its
lesson by what it holds (the lesson's cell ids, its title, its check cells) or else by its name, LMS
renamings included (`01_tensors (1).ipynb`, `01_tensors-1.ipynb`, Canvas's prefix); a file that names
one lesson and holds another is matched by what it holds, with a note. What cannot be matched is
reported by name, never dropped silently: a notebook that matches no lesson, a file that is not valid
JSON (an upload cut short: "unreadable"), two different notebooks for one lesson ("duplicate": not
graded, so that neither is picked by its name's order).
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from course.points import parse_time

CANVAS = re.compile(r"^(?P<student>[^_]+)_(?:(?P<late>late)_)?(?P<uid>\d+)_(?P<sid>\d+)_(?P<file>.+)$", re.IGNORECASE)
IGNORED_DIRS = {".git", ".ipynb_checkpoints", "__MACOSX", "__pycache__", ".venv", "node_modules"}


@dataclass
class Notebook:
    path: Path
    name: str  # as the student's submission has it (relative path)
    stem: str | None = None  # the lesson it is
    data: dict | None = None  # the parsed notebook (None: unreadable)
    error: str = ""  # why it is unreadable
    note: str = ""  # e.g. named for one lesson, holding another

    def code(self) -> list[str]:
        return ["".join(c.get("source", "")) for c in (self.data or {}).get("cells", []) if c.get("cell_type") == "code"]


@dataclass
class Submission:
    student: str
    where: Path  # the student's folder (Canvas: the submissions folder)
    notebooks: list[Notebook] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # files not graded, LMS marks
    submitted: datetime | None = None
    submitted_from: str = ""  # where the submission time came from
    flat: bool = False  # Canvas's flat download: `where` is the whole class's folder

    def for_lesson(self, stem: str) -> tuple[str, Notebook | None, str]:
        """(status, notebook, message): status "ok", "missing", "unreadable" or "duplicate"."""
        found = [n for n in self.notebooks if n.stem == stem]
        if not found:
            return "missing", None, f"no notebook for lesson {stem} (looked for {stem}.ipynb, under any folder and " \
                                    "as an LMS renames it)"
        readable = [n for n in found if n.data is not None]
        if len(found) > 1:
            if len(readable) == len(found) and len({json.dumps(n.code()) for n in readable}) == 1:
                return "ok", found[0], ""  # copies with the same code: any will do
            names = ", ".join(n.name for n in found)
            return "duplicate", None, f"{len(found)} different notebooks for lesson {stem}: {names}. Not graded: " \
                                      "hand in one (which is yours to say, not the order of their names)"
        nb = found[0]
        if nb.data is None:
            return "unreadable", nb, f"{nb.name} is not a readable notebook ({nb.error}); was the upload cut short? " \
                                     "Open it in JupyterLab, save it, and hand it in again"
        return "ok", nb, ""


def _clean(name: str) -> str:
    base = name[:-6] if name.lower().endswith(".ipynb") else name
    base = re.sub(r"\s*\(\d+\)$", "", base)  # a browser's second download: "01_tensors (1)"
    base = re.sub(r"-\d+$", "", base)  # Canvas's resubmission: "01_tensors-1"
    return base.strip().lower()


def lesson_from_name(name: str, stems: list[str]) -> str | None:
    base = _clean(name)
    for stem in stems:
        if base == stem.lower() or re.search(rf"(?:^|[_\W]){re.escape(stem.lower())}$", base):
            return stem
    return None


def lesson_from_content(data: dict, stems: list[str]) -> str | None:
    """The lesson a notebook holds: its generated cell ids ('03-training-012'), else its title ('# Lesson 03:'),
    else the exercises its check cells name (check("3.2"))."""
    by_id = {s.replace("_", "-"): s for s in stems}
    by_number = {s[:2]: s for s in stems}
    votes: dict[str, int] = {}
    for cell in data.get("cells", []):
        cid = str(cell.get("id") or "")
        m = re.fullmatch(r"(.+)-\d{3}", cid)
        if m and m.group(1) in by_id:
            votes[by_id[m.group(1)]] = votes.get(by_id[m.group(1)], 0) + 1
    if votes:
        return max(votes, key=votes.get)
    for cell in data.get("cells", []):
        src = "".join(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            m = re.match(r"#\s+Lesson\s+(\d+)\b", src.strip())
            if m and f"{int(m.group(1)):02d}" in by_number:
                return by_number[f"{int(m.group(1)):02d}"]
        m = re.search(r"check\(\s*[\"'](\d+)\.\d+[\"']", src)
        if cell.get("cell_type") == "code" and m and f"{int(m.group(1)):02d}" in by_number:
            return by_number[f"{int(m.group(1)):02d}"]
    return None


def read_notebook(path: Path) -> tuple[dict | None, str]:
    """(the notebook, '') or (None, why it cannot be read)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror}"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not text (a binary file?)"
    except json.JSONDecodeError as exc:
        if not raw.rstrip().endswith(b"}"):
            return None, "its JSON breaks off before the end"
        return None, f"its JSON is broken at line {exc.lineno}, column {exc.colno} ({exc.msg})"
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        return None, "valid JSON but not a notebook (no list of cells)"
    for cell in data["cells"]:
        if not isinstance(cell, dict) or not isinstance(cell.get("source", ""), (str, list)):
            return None, "a cell of it is not a notebook cell"
    return data, ""


def _notebook(path: Path, name: str, stems: list[str]) -> Notebook:
    data, error = read_notebook(path)
    by_name = lesson_from_name(path.name, stems)
    nb = Notebook(path, name, by_name, data, error)
    if data is not None:
        by_content = lesson_from_content(data, stems)
        if by_content and by_name and by_content != by_name:
            nb.note = f"{name} is named for lesson {by_name} but holds lesson {by_content}: graded as {by_content}"
        nb.stem = by_content or by_name
    return nb


def _files(folder: Path) -> list[Path]:
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).parts
        if any(part in IGNORED_DIRS for part in rel[:-1]) or not p.is_file():
            continue
        if p.name.startswith("._"):  # macOS's AppleDouble companions in a zip: not notebooks
            continue
        out.append(p)
    return out


def _known() -> list[str]:
    from course.source import all_lessons

    try:
        return [le.stem for le in all_lessons()]
    except (OSError, ValueError):
        return []


def student_submission(student: str, folder: Path, stems: list[str], files: list[Path] | None = None,
                       names: dict[Path, str] | None = None) -> Submission:
    """The notebooks of lessons `stems` in a student's folder (or in `files`), the others reported."""
    sub = Submission(student, folder)
    known = list(dict.fromkeys([*stems, *_known()]))  # what a notebook holds is told among all lessons
    for p in files if files is not None else _files(folder):
        name = (names or {}).get(p) or str(p.relative_to(folder))
        if p.suffix.lower() != ".ipynb":
            continue
        nb = _notebook(p, name, known)
        if nb.note:
            sub.notes.append(nb.note)
        if nb.stem not in stems:
            why = f" ({nb.error})" if nb.data is None else ""
            which = f" (it holds lesson {nb.stem})" if nb.stem else ""
            sub.notes.append(f"{name}: not a notebook of any lesson graded here{which}{why}: not graded")
            continue
        sub.notebooks.append(nb)
    return sub


def discover(submissions: Path, stems: list[str]) -> tuple[list[Submission], list[str]]:
    """(one Submission per student, notes about files no student could be given)."""
    subs: dict[str, Submission] = {}
    notes = []
    for d in sorted(p for p in submissions.iterdir() if p.is_dir()):
        if d.name.startswith(".") or d.name in IGNORED_DIRS:
            continue
        subs[d.name] = student_submission(d.name, d, stems)
    flat: dict[str, list[Path]] = {}
    late: set[str] = set()
    for f in sorted(p for p in submissions.iterdir() if p.is_file() and not p.name.startswith(".")):
        m = CANVAS.match(f.name)
        if f.suffix.lower() != ".ipynb":
            if f.suffix.lower() not in (".csv", ".txt", ".yml", ".yaml", ".json", ".md"):
                notes.append(f"{f.name}: not a notebook, and in no student's folder: not graded")
            continue
        if not m:
            notes.append(f"{f.name}: in no student's folder and not named as Canvas names files "
                         "(student_12345_678_01_tensors.ipynb): not graded, no student to give it to")
            continue
        flat.setdefault(m.group("student"), []).append(f)
        if m.group("late"):
            late.add(m.group("student"))
    for student, files in flat.items():
        names = {f: CANVAS.match(f.name).group("file") for f in files}
        sub = student_submission(student, submissions, stems, files, names)
        sub.flat = True
        for nb in sub.notebooks:  # Canvas's prefix says nothing of the lesson; its original name does
            nb.name = f"{nb.path.name}"
        if student in late:
            sub.notes.append("Canvas marked this submission LATE")
        if student in subs:
            notes.append(f"{student}: both a folder and Canvas-named files: the folder is graded")
            continue
        subs[student] = sub
    return [subs[k] for k in sorted(subs)], notes


def read_times(path: Path) -> dict[str, datetime]:
    """student -> submission time, from a CSV with a header naming a `student` column and a `submitted`
    (or `time`, `submitted_at`, `created_at`) column; ISO 8601 times."""
    out = {}
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        cols = {c.lower(): c for c in rows.fieldnames or []}
        who = cols.get("student") or cols.get("name")
        when = next((cols[c] for c in ("submitted", "time", "submitted_at", "created_at") if c in cols), None)
        if not who or not when:
            raise SystemExit(f"{path}: needs a 'student' column and a 'submitted' column (ISO 8601 times)")
        for row in rows:
            if row[who] and row[when]:
                out[row[who].strip()] = parse_time(row[when])
    return out


def submission_time(sub: Submission, times: dict[str, datetime]) -> None:
    """Sets sub.submitted (and where it came from): the times file, else Gradescope's
    submission_metadata.json in the student's folder, else the last commit of a git clone (the
    student's clock: a hint, not proof)."""
    if sub.student in times:
        sub.submitted, sub.submitted_from = times[sub.student], "times file"
        return
    if sub.flat or not sub.where.is_dir():
        return
    meta = sub.where / "submission_metadata.json"
    if meta.exists():
        try:
            sub.submitted = parse_time(json.loads(meta.read_text())["created_at"])
            sub.submitted_from = "Gradescope"
            return
        except (KeyError, ValueError, TypeError):
            sub.notes.append("submission_metadata.json has no readable created_at")
    if (sub.where / ".git").exists():
        r = subprocess.run(["git", "-C", str(sub.where), "log", "-1", "--format=%cI"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            sub.submitted, sub.submitted_from = parse_time(r.stdout.strip()), "last commit (the student's clock)"
