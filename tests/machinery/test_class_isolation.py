"""Class grading keeps the answers out of a submission's reach (course/isolation.py, course/classgrade.py).

The cheating submission of issue 37 on the real lesson 03: the untouched stubs plus a cell that copies
minitorch.nn and minitorch.optim into the notebook (graded as before, inside the checkout, it passes
every exercise), plus a cell that reads ../solutions and the checkout by its absolute path, asks the
editable install where the package is, walks the whole file system for the reference's text, tries the
network and leaves a process behind. Graded by `make grade-class`: nothing found, nothing passes."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from course import isolation

REPO = Path(__file__).resolve().parent.parent.parent
NAMESPACES = isolation.probe("namespaces")
needs_namespaces = pytest.mark.skipif(bool(NAMESPACES), reason=f"no namespaces here: {NAMESPACES}")

PROBE = r'''
import json, os, socket, sys, time
out = {"uid": os.getuid(), "root": sorted(os.listdir("/")), "env": sorted(os.environ),
       "checkout": os.path.exists(sys.argv[1]), "prefix": os.path.exists(sys.prefix)}
try:
    socket.create_connection(("192.0.2.1", 80), timeout=3)  # TEST-NET-1: never routed
    out["net"] = "reached"
except OSError as e:
    out["net"] = type(e).__name__
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
socket.create_connection(srv.getsockname(), timeout=3)
out["loopback"] = "ok"
for path in (sys.prefix + "/mt-written", "/mt-written"):
    try:
        open(path, "w")
        out.setdefault("wrote", []).append(path)
    except OSError:
        pass
if os.fork() == 0:  # a process meant to outlive the run
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "987653"])
    os._exit(0)
open(os.environ["MT_RESULTS"], "w").write(json.dumps(out))
'''


def _survivors(tag: str) -> list[str]:
    r = subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True)
    return [ln for ln in r.stdout.splitlines() if "pgrep" not in ln]


@needs_namespaces
def test_the_sandbox_shows_nothing_but_what_grading_needs(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    results = tmp_path / "results.json"
    results.write_text("")
    box = isolation.Sandbox("namespaces", readable=[str(tree)], cwd=str(tree))
    env = {**os.environ, "MT_RESULTS": str(results), "GITHUB_TOKEN": "a secret", "AWS_SECRET_ACCESS_KEY": "another"}
    cmd, env, cleanup = box.prepare([sys.executable, "-c", PROBE, str(REPO / "solutions")], env, [str(results)])
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    finally:
        cleanup()
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(results.read_text())
    assert out["checkout"] is False and out["prefix"] is True  # Python is there; the answers are not
    assert not set(out["root"]) & {"home", "root", "work", "mnt", "opt", "srv", "media"} - {
        p.split("/")[1] for p in isolation.python_paths() + [str(tree)]}, out["root"]
    assert out["net"] in ("OSError", "TimeoutError") and out["net"] != "reached" and out["loopback"] == "ok"
    assert "GITHUB_TOKEN" not in out["env"] and "AWS_SECRET_ACCESS_KEY" not in out["env"]
    assert not out.get("wrote"), out  # read-only, everywhere but its results file and /tmp
    if os.geteuid() == 0:
        assert out["uid"] == isolation.sandbox_uid()
    assert not _survivors("sleep 987653")  # its PID namespace ended with it


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root and /usr/bin/python3")
def test_uid_mode_runs_as_another_user_and_clears_up(tmp_path):
    """The mode a Docker container or Gradescope gets: another user, no_new_privs, its processes killed after."""
    folder = Path(tempfile.mkdtemp(prefix="mt-uid-test-", dir="/tmp"))  # a folder the user can reach, as /tmp is
    os.chmod(folder, 0o755)
    results = folder / "results.json"
    results.write_text("")
    box = isolation.Sandbox("uid", readable=[], cwd="/")
    cmd, env, cleanup = box.prepare(["/usr/bin/python3", "-c", PROBE, str(REPO / "solutions")],
                                    {**os.environ, "MT_RESULTS": str(results)}, [str(results)])
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    finally:
        cleanup()
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(results.read_text())
    assert out["uid"] == isolation.sandbox_uid() and not out.get("wrote")
    assert not _survivors("sleep 987653")
    assert os.stat(results).st_uid == os.geteuid()  # handed back to the grader
    shutil.rmtree(folder)


def test_no_isolation_is_never_chosen_silently(monkeypatch):
    monkeypatch.setattr(isolation, "_probed", {"namespaces": "no unshare", "uid": "not root"})
    with pytest.raises(SystemExit, match="ISOLATION=none"):
        isolation.mode("auto")
    assert isolation.mode("none")[0] == "none"


def cheating_notebook(marker: str) -> dict:
    """Lesson 03's stubs, a cell copying the reference into the notebook, a cell looking for the answers."""
    nb = json.loads((REPO / "lessons" / "03_training.ipynb").read_text())
    copy = ("import minitorch.nn as _nn, minitorch.optim as _optim\n"
            "globals().update({k: v for m in (_nn, _optim) for k, v in vars(m).items() if not k.startswith('__')})\n")
    probe = f'''import json, os, socket, time
MARKER = {marker[::-1]!r}[::-1]  # a line of lesson 03's reference, reversed here so this notebook is no match
REPORT = {{"uid": os.getuid(), "found": []}}
for p in ["solutions/03_training.py", "../solutions/03_training.py", "../../solutions/03_training.py",
          {str(REPO / "solutions" / "03_training.py")!r}, {str(REPO / "minitorch" / "nn.py")!r}]:
    try:
        open(p).read()
        REPORT["found"].append(p)
    except OSError:
        pass
try:
    import __editable___minitorch_systems_0_1_0_finder as _finder  # where the editable install points
    REPORT["found"] += [d for d in _finder.MAPPING.values() if os.path.exists(os.path.join(d, "nn.py"))]
except ImportError:
    pass
n, t0 = 0, time.monotonic()
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys", "/dev") or time.monotonic() - t0 > 10:
        dirs[:] = []
        continue
    for name in files:
        n += 1
        if name.endswith((".py", ".ipynb", ".json", ".txt")) and (
                "solution" in top or name in ("nn.py", "optim.py", "03_training.py") or "training" in name):
            try:
                if MARKER in open(os.path.join(top, name), errors="replace").read():
                    REPORT["found"].append(os.path.join(top, name))
            except OSError:
                pass
REPORT["walked"] = n
try:
    socket.create_connection(("192.0.2.1", 80), timeout=3)
    REPORT["net"] = "reached"
except OSError as e:
    REPORT["net"] = type(e).__name__
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "987654"])
    os._exit(0)
'''
    report = 'def init_std(*args, **kwargs):\n    raise AssertionError("CHEAT REPORT " + json.dumps(REPORT))\n'
    cells = [{"cell_type": "code", "id": f"cheat-{i}", "metadata": {}, "source": src, "outputs": [], "execution_count": None}
             for i, src in enumerate([copy, probe, report])]
    return {**nb, "cells": nb["cells"] + cells}


@pytest.mark.timeout(600)
@pytest.mark.skipif(not (REPO / "solutions").is_dir(), reason="needs the course's sources")
def test_a_cheating_submission_reaches_no_answer(tmp_path):
    from course.grade import run_tests
    from course.release import solution_bodies
    from course.source import find_lesson, read_source

    lesson = find_lesson("03")
    marker = max((ln for b in solution_bodies(read_source(lesson)) for ln in b.splitlines()), key=len)
    nb = cheating_notebook(marker)
    # the copy works where the answers are: graded inside the checkout, as before, it passes everything
    before = {**nb, "cells": nb["cells"][:-2]}
    path = tmp_path / "copying.ipynb"
    path.write_text(json.dumps(before))
    old = run_tests(lesson, str(path))
    assert {ex.status for ex in old.exercises() if ex.id != "?"} == {"passed"}, [ex.status for ex in old.exercises()]
    # graded by make grade-class: the lesson's answers do not exist where its code runs
    subs = tmp_path / "submissions"
    (subs / "mallory" / "lessons").mkdir(parents=True)
    (subs / "mallory" / "lessons" / "03_training.ipynb").write_text(json.dumps(nb))
    out = tmp_path / "grades"
    env = {k: v for k, v in os.environ.items() if k not in ("MT_ROOT", "MT_WALK")}
    if NAMESPACES and isolation.probe("uid"):
        pytest.skip(f"no isolation here (namespaces: {NAMESPACES}; uid: {isolation.probe('uid')})")
    r = subprocess.run([sys.executable, "-m", "course.classgrade", str(subs), "--lessons", "03", "--out", str(out),
                        "--isolation", "auto"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(csv.DictReader(open(out / "gradebook.csv")))
    ids = [f"3.{k}" for k in range(1, 8)]
    assert row["student"] == "mallory" and {row[i] for i in ids} == {"todo", "fail"}, row  # nothing passes
    assert row["points"] == "0" and {row[f"{i} pts"] for i in ids} == {"0"}, row
    notes = (out / "instructor" / "mallory.txt").read_text()
    report = json.loads(re.search(r"CHEAT REPORT (\{.*?\})\n", notes).group(1))
    assert report["found"] == [], report  # not the solutions, not the checkout, not the reference, anywhere
    assert report["walked"] > 10_000, report  # (it did look)
    assert report["uid"] != 0 or not NAMESPACES, report
    if not NAMESPACES:
        assert report["net"] != "reached", report
    assert not _survivors("sleep 987654")
    assert "imports this lesson's own module" in notes and "walks the file system" in notes
