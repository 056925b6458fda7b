"""`make` alone is `make help`: every target, grouped by who uses it (students, lecturers, instructors,
maintainers), one line each with its settings, from the `## who: what | settings` comment on the
target's line in the Makefile. A target without one is missing from the list: this test says so.
Renamed targets keep their old names working (`browser`, `gpucheck`), since lessons and notes name them."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from course.source import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None or not (ROOT / "Makefile").exists(),
                                reason="needs make and the course's Makefile")
GROUPS = ["Students", "Lecturers", "Instructors", "Maintainers"]
ALIASES = {"browser": "browser-test", "gpucheck": "gpu-report"}


def _make(*args: str) -> str:
    r = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _phony() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for t in line.split()]


@pytest.fixture(scope="module")
def shown() -> str:
    return _make()


def test_make_alone_prints_the_help_and_sets_nothing_up(shown):
    assert shown == _make("help")
    assert "make TARGET" in shown.splitlines()[0]
    assert "setup_venv" not in _make("-n"), "the default target must not set anything up"


def test_targets_are_grouped_by_who_uses_them_in_order(shown):
    at = [shown.index(f"\n{g}\n") for g in GROUPS]
    assert at == sorted(at), "groups out of order"
    groups = {g: shown[shown.index(f"\n{g}\n"):] for g in GROUPS}
    for g in GROUPS:
        groups[g] = groups[g].split("\n\n", 1)[0]
    assert "make lab" in groups["Students"] and "make test" in groups["Students"]
    assert "make demo" in groups["Lecturers"] and "make slides" in groups["Lecturers"] and "make site " in groups["Lecturers"]
    assert "make release" in groups["Instructors"] and "make grade-class" in groups["Instructors"]
    assert "make check" in groups["Maintainers"] and "make build" in groups["Maintainers"]


def test_every_target_has_one_line_with_its_settings(shown):
    lines = {m.group(1): m.group(0) for m in re.finditer(r"^  make (\S+) .*$", shown, re.M)}
    undocumented = [t for t in _phony() if t not in lines and t not in ALIASES]
    assert not undocumented, (f"targets with no `## who: what | settings` comment on their line in the Makefile "
                              f"(so `make help` does not list them): {undocumented}")
    for target, settings in {"test": "L=NN", "lab": "BLAS_THREADS=1", "demo": "L=NN", "slides": "SHOTS=1",
                             "site": "SMALL=1", "release": "UPTO=NN", "grade-class": "SUBMISSIONS=dir",
                             "gradescope": "L=NN", "build": "FORCE=1", "setup": "GPU=0", "gpu-report": "PY=python3"}.items():
        assert settings in lines[target], lines[target]
    # the settings stay a column (at 83): after the description, or under it when the description is longer
    rows = shown.splitlines()
    for i, line in enumerate(rows):
        if not line.startswith("  make "):
            continue
        settings = line[83:] if len(line) > 83 and line[82] == " " else ""
        if not settings and i + 1 < len(rows) and rows[i + 1].startswith(" " * 83):
            settings = rows[i + 1][83:]
        assert not settings.startswith(" "), f"settings out of their column: {line!r}"
        assert (settings == "") == (line.split()[1] in ("help", "clean")), f"no settings shown: {line!r}"


def test_renamed_targets_keep_their_old_names(shown):
    for old, new in ALIASES.items():
        assert f"{old} (now: {new})" in shown
        assert f"make {new}" in shown
    assert "-m course.browser 01" in _make("-n", "browser", "L=01")
    assert "-m course.gpu_report" in _make("-n", "gpucheck", "PY=python3")
    assert _make("-n", "browser", "L=01") == _make("-n", "browser-test", "L=01")


def test_every_make_target_the_guides_name_exists():
    """`make X` in README.md, docs/, AUTHORING.md and the notes (code spans and code blocks) is a target
    of the Makefile (`make verify` is the class release's own Makefile's: docs/instructors.md)."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M)) | {"verify"}
    files = [ROOT / "README.md", ROOT / "AUTHORING.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "hardware_notes").glob("*.md"))]
    named, unknown = set(), []
    for path in files:
        prose = path.read_text()
        code = re.findall(r"`([^`\n]+)`", prose) + re.findall(r"^```[^\n]*\n(.*?)^```", prose, re.M | re.S)
        for snippet in code:
            for target in re.findall(r"(?:^|[\s;(&])make ([a-z][a-z0-9-]*)", snippet):
                named.add(target)
                if target not in targets:
                    unknown.append(f"{path.relative_to(ROOT)}: make {target}")
    assert not unknown, "\n".join(unknown)
    assert {"lab", "test", "check", "site", "help"} <= named
