"""The GPU entry point (course.gpu_report) and what lets it run without Jupyter packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from course.gpu_report import render
from course.percent import read
from course.source import ROOT, all_lessons

BLOCKER = "raise ImportError('{0} is not installed on this (simulated) GPU machine')\n"


def test_percent_reader_matches_jupytext_on_every_lesson():
    jupytext = pytest.importorskip("jupytext")
    for lesson in all_lessons():
        want, got = jupytext.read(lesson.source, fmt="py:percent"), read(lesson.source)
        assert len(got.cells) == len(want.cells), f"{lesson.stem}: {len(got.cells)} cells, jupytext {len(want.cells)}"
        for i, (w, g) in enumerate(zip(want.cells, got.cells)):
            where = f"{lesson.stem} cell {i}"
            assert g.cell_type == w.cell_type, where
            assert g.source == w.source, f"{where}: source differs (avoid blank lines right after a cell marker and more than one blank line before the next)"
            assert g.metadata.get("tags", []) == w.get("metadata", {}).get("tags", []), f"{where}: tags differ"


@pytest.fixture
def no_jupyter(tmp_path):
    """An environment in which jupytext, nbformat and nbclient cannot be imported."""
    for mod in ("jupytext", "nbformat", "nbclient"):
        (tmp_path / f"{mod}.py").write_text(BLOCKER.format(mod))
    return dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", MINITORCH_NO_GPU="1")


def test_machinery_loads_lessons_without_jupyter_packages(no_jupyter):
    code = ("from course import loader; from course.source import find_lesson; "
            "ref = loader.load(find_lesson('08'), 'reference'); sol = loader.load(find_lesson('07'), 'solution'); "
            "print(ref.sgemm_vec4_source()[:9] == sol.vector_add_kernel.__name__[:0] + ref.sgemm_vec4_source()[:9], "
            "sol.load_errors)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=no_jupyter, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "True []" in out.stdout, out.stdout


def test_gpu_report_runs_and_reports_when_there_is_no_gpu(no_jupyter, tmp_path):
    md = tmp_path / "report.md"
    out = subprocess.run([sys.executable, "-m", "course.gpu_report", "--steps", "env,bench", "--out", str(md)],
                         cwd=ROOT, env=no_jupyter, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, "no usable GPU: the report must not claim success"
    text = md.read_text()
    assert "NOT USABLE: MINITORCH_NO_GPU=1 is set" in text and "jupytext: missing (ImportError)" in text, text
    assert "skipped: needs a CUDA GPU" in text
    assert Path(md.with_suffix(".json")).exists()


def test_render_lists_failures_and_sanitizer_results():
    text = render({
        "tests": {"ok": False, "summary": {"passed": 3, "failed": 1}, "seconds": 2.0,
                  "failed": [{"test": "t::x", "message": "boom"}], "skipped": []},
        "sanitize": {"ok": False, "runs": {"racecheck": {"clean": False, "exit": 86, "seconds": 1.0,
                                                        "summary": ["RACECHECK SUMMARY: 1 hazard displayed"],
                                                        "tail": "hazard in sgemm"}}},
    })
    assert "FAILED t::x: boom" in text and "racecheck: NOT CLEAN" in text and "hazard in sgemm" in text
