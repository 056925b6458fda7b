"""`make gradescope L=NN`: the autograder bundle Gradescope expects, and what runs in it.

    python -m course.gradescope build NN [--from NN] [--out build/gradescope] [--points FILE]
                                      [--partial tests|all] [--late RULE] [--deadline ISO]
    python -m course.gradescope run [--autograder /autograder]       # what run_autograder calls

The bundle (build/gradescope/NN_topic.zip, and the folder it was zipped from) holds, at its root:
  setup.sh         run once by Gradescope, as root, while it builds the autograder's image (Ubuntu
                   22.04, whose Python is 3.10): installs Python 3.12 (uv's standalone build, in /opt),
                   the course's packages CPU-only (no `gpu` extra: Gradescope has no GPU), g++ for the
                   CUDA C emulator, and the user `mtstudent` that students' code runs as
  run_autograder   run for each submission: grades it, writes /autograder/results/results.json
  config.json      the lessons graded, the late rule and deadline
  tree/            the grading tree of lesson NN (course/release.py `grading_tree`: the release for
                   that lesson, every test, hidden ones included; the lesson's answers are not in it)

Lessons graded: NN, or FROM..NN for a multi-lesson assignment (--from). The submission is whatever the
student uploaded (/autograder/submission: the notebook, renamed by a browser or not, in folders or not;
a GitHub repository), found as course/submissions.py finds notebooks. results.json has one test per
exercise with its points and partial credit (course/points.toml); an exercise that needs a GPU is
worth 0 here and is not failed; hidden cases show only that one failed; a late submission (its
created_at in submission_metadata.json, against --deadline or else the assignment's due date) loses
what the --late rule says. A failure of the grader itself still writes results.json (score 0, a line
to the student; details in the instructor's stdout).

AUTOGRADER_DIR stands for /autograder and MT_GRADER_PYTHON for the venv's Python when run_autograder is
tried outside Gradescope (tests/machinery/test_gradescope.py runs it on a folder laid out as Gradescope
lays one out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path

from course.source import ROOT, find_lesson

SETUP = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, while it builds the autograder's image. Its Ubuntu 22.04 ships
# Python 3.10; the course needs 3.11-3.13: Python 3.12 comes from uv's standalone builds, into /opt
# (readable by the user students' code runs as). CPU only: no CuPy/NVRTC (`gpu` extra).
set -euo pipefail
SOURCE="$(cd "$(dirname "$0")" && pwd)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq g++ make python3-pip python3-venv util-linux > /dev/null
PY=""
for v in 3.12 3.11 3.13; do
    if command -v "python$v" > /dev/null && "python$v" -c "import venv" 2> /dev/null; then PY="$(command -v "python$v")"; break; fi
done
if [ -z "$PY" ]; then
    python3 -m pip install -q uv
    export UV_PYTHON_INSTALL_DIR=/opt/uv-python
    python3 -m uv python install 3.12
    PY="$(ls -d /opt/uv-python/cpython-3.12*/bin/python3.12 2> /dev/null | head -n 1)"
    [ -x "$PY" ] || PY="$(python3 -m uv python find 3.12)"
fi
echo "minitorch autograder: $("$PY" --version) from $PY"
"$PY" -m venv /opt/minitorch-venv
/opt/minitorch-venv/bin/python -m pip install -q --upgrade pip
/opt/minitorch-venv/bin/python -m pip install -q -c "$SOURCE/tree/constraints.txt" -r "$SOURCE/tree/requirements-grading.txt"
chmod -R a+rX /opt/minitorch-venv "$SOURCE/tree"
id -u mtstudent > /dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin mtstudent
/opt/minitorch-venv/bin/python -c "import numpy, numba, pytest, hypothesis; print('minitorch autograder: ready')"
"""

RUN = r"""#!/usr/bin/env bash
# Gradescope runs this for each submission, as root, in /autograder: it grades /autograder/submission
# and writes /autograder/results/results.json (course/gradescope.py). The student's code runs isolated
# (course/isolation.py) as the user mtstudent. Outside Gradescope: AUTOGRADER_DIR for /autograder,
# MT_GRADER_PYTHON for the Python that setup.sh installed.
A="${AUTOGRADER_DIR:-/autograder}"
PY="${MT_GRADER_PYTHON:-/opt/minitorch-venv/bin/python}"
unset MT_ROOT MT_WALK MT_SANDBOX
if [ -z "${MT_SANDBOX_UID:-}" ] && id -u mtstudent > /dev/null 2>&1; then export MT_SANDBOX_UID="$(id -u mtstudent)"; fi
cd "$A/source/tree"
PYTHONPATH="$A/source/tree" exec "$PY" -m course.gradescope run --autograder "$A"
"""


def build(upto: str, frm: str | None = None, out: Path | None = None, points=None, partial=None, late=None,
          deadline=None, isolation: str = "auto") -> Path:
    """Write the bundle's folder and its zip; returns the zip."""
    from course.points import LatePolicy, parse_time
    from course.release import grading_tree, window

    released, first, last = window(upto, frm)
    LatePolicy.parse(late)  # refuse a bad rule now, not on Gradescope
    if deadline:
        parse_time(deadline)
    name = last.stem if first == last else f"{first.number}-{last.stem}"
    out = Path(out or ROOT / "build" / "gradescope")
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    grading_tree(folder / "tree", last.number, first.number, points, partial)
    lessons = [le.number for le in released if int(le.number) >= int(first.number)]
    (folder / "config.json").write_text(json.dumps({"lessons": lessons, "from": first.number, "upto": last.number,
                                                    "late": late or "none", "deadline": deadline,
                                                    "isolation": isolation}, indent=1) + "\n")
    for fname, text in (("setup.sh", SETUP), ("run_autograder", RUN)):
        (folder / fname).write_text(text)
        os.chmod(folder / fname, 0o755)
    archive = out / f"{name}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                info = zipfile.ZipInfo.from_file(p, p.relative_to(folder).as_posix())
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, p.read_bytes())
    return archive


def run(autograder: Path) -> int:
    """Grade /autograder/submission into /autograder/results/results.json; always writes it."""
    results = autograder / "results"
    results.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chmod(results, 0o700)  # out of the student code's reach (it runs as mtstudent)
    try:
        report = _grade(autograder)
    except BaseException as exc:  # noqa: BLE001 - Gradescope must get a results.json whatever happened
        traceback.print_exc()
        report = {"score": 0, "tests": [], "output": "The autograder could not grade this submission "
                  f"({type(exc).__name__}: {str(exc)[:300]}). Your instructor can see the details."}
    (results / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"results.json: score {report['score']}")
    return 0


def _grade(autograder: Path) -> dict:
    from course.classgrade import apply_late, feedback_text, gradescope, grade_submission
    from course.isolation import mode as isolation_mode, summary
    from course.points import LatePolicy, Points, parse_time
    from course.submissions import student_submission

    config = json.loads((ROOT.parent / "config.json").read_text())
    lessons = [find_lesson(k) for k in config["lessons"]]
    sub = student_submission("submission", autograder / "submission", [le.stem for le in lessons])
    meta_path = autograder / "submission_metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("created_at"):
        sub.submitted, sub.submitted_from = parse_time(meta["created_at"]), "Gradescope"
    due = config.get("deadline") or (meta.get("assignment") or {}).get("due_date")
    mode, note = isolation_mode(config.get("isolation") or "auto")
    print(summary(mode) + (f" [{note}]" if note else ""), flush=True)
    windows = {le.stem: (config["from"], config["upto"]) for le in lessons}
    work = Path(tempfile.mkdtemp(prefix="mt-grading-"))
    os.chmod(work, 0o711)
    try:
        res = grade_submission(sub, lessons, {le.stem: ROOT for le in lessons}, mode, work, Points.load(), windows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    apply_late(res, sub, parse_time(due) if due else None, LatePolicy.parse(config.get("late")))
    report = gradescope(res)
    report["output"] = feedback_text(res)
    print("\n".join(res.full_boards), flush=True)  # stdout: the instructor's, unmasked
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the bundle")
    b.add_argument("lesson", help="the lesson (the last one, with --from)")
    b.add_argument("--from", dest="frm", default=None, help="the first lesson of a multi-lesson assignment")
    b.add_argument("--out", type=Path, default=None)
    b.add_argument("--points", default=None)
    b.add_argument("--partial", default=None, choices=("tests", "all"))
    b.add_argument("--late", default=None, help="the penalty rule, e.g. '10%%/day, max 50%%'")
    b.add_argument("--deadline", default=None, help="ISO 8601 (default: the assignment's due date on Gradescope)")
    b.add_argument("--isolation", default="auto")
    r = sub.add_parser("run", help="grade a submission (run_autograder)")
    r.add_argument("--autograder", type=Path, default=Path(os.environ.get("AUTOGRADER_DIR", "/autograder")))
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args.autograder)
    archive = build(args.lesson, args.frm, args.out, args.points, args.partial, args.late, args.deadline, args.isolation)
    print(f"wrote {archive} (upload it as the assignment's autograder: Configure Autograder > Zip file upload; "
          f"the folder beside it holds the same files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
