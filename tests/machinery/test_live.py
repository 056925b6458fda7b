"""course.live: the lecturer's live controls. The helper itself on toy figures; every lesson
has one. (Each lesson's own control is driven over its extremes and middle, and timed,
whenever its notebook runs under course.executor: `make check` fails on a control that changes
nothing or whose redraw takes more CPU time than LIVE_REDRAW_LIMIT x the machine's time scale; the timings are
written to build/check/NN_topic.live.jsonl.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course.live import Live, live, signature  # noqa: E402
from course.source import ROOT, all_lessons, read_source, tags  # noqa: E402


def draw_power(a: float, kind: str):
    fig, ax = plt.subplots(figsize=(3, 2))
    x = np.linspace(0, 1, 20)
    ax.plot(x, x**a)
    ax.set_title(kind)
    return fig


def test_render_follows_the_controls_and_the_probe_says_so(tmp_path, monkeypatch):
    probe = tmp_path / "probe.jsonl"
    monkeypatch.setenv("MT_LIVE_PROBE", str(probe))
    ctl = live(draw_power, a=(0.5, 4.0), kind=["x", "y"])
    assert isinstance(ctl, Live) and set(ctl.widgets) == {"a", "kind"}
    sigs = {signature(ctl.render(a=v)) for v in (0.5, 2.25, 4.0)}
    assert len(sigs) == 3
    assert signature(ctl.render(kind="x")) != signature(ctl.render(kind="y"))
    seen = []
    ctl.draw = lambda **values: seen.append(values) or draw_power(**values)
    ctl.widgets["a"].value = 3.0  # what a drag does: a redraw with the new value
    assert seen == [{"a": 3.0, "kind": "x"}]
    (report,) = [json.loads(line) for line in probe.read_text().splitlines()]
    assert report["controls"] == {"a": True, "kind": True} and report["slowest_s"] < 5
    assert 0 < report["slowest_cpu_s"] < 5
    bundle = ctl._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["image/png"]


def test_the_probe_judges_cpu_time_not_waiting(tmp_path, monkeypatch):
    """make check judges a redraw by its CPU time: a redraw that waits (as on a busy machine,
    for a core) is not slow work, and one that computes is, whatever the load."""
    import time

    def spin(seconds: float) -> None:
        t0 = time.process_time()
        while time.process_time() - t0 < seconds:
            pass

    from threadpoolctl import threadpool_limits

    probe = tmp_path / "probe.jsonl"
    monkeypatch.setenv("MT_LIVE_PROBE", str(probe))
    # CPU time is the process's: one BLAS thread, so that no idle BLAS worker spins beside the redraw
    # (under make check's load one added 0.2 s of CPU to the sleeping redraw)
    with threadpool_limits(1):
        warm = draw_power(2, "x")  # matplotlib's first drawing (fonts, caches) before either probe
        warm.canvas.draw()
        plt.close(warm)
        live(lambda a: (time.sleep(0.3), draw_power(a, "x"))[1], a=(1, 3))
        live(lambda a: (spin(0.8), draw_power(a, "x"))[1], a=(1, 3))
    waits, works = [json.loads(line) for line in probe.read_text().splitlines()]
    assert waits["slowest_s"] >= 0.3 and works["slowest_cpu_s"] >= 0.8, (waits, works)
    # the sleep is wall time, not CPU: the waiting redraw's CPU is well under its wall time and
    # under the computing redraw's CPU
    assert waits["slowest_cpu_s"] < waits["slowest_s"] - 0.15, (waits, works)
    assert waits["slowest_cpu_s"] < works["slowest_cpu_s"] - 0.15, (waits, works)


def test_a_control_that_changes_nothing_is_reported(tmp_path, monkeypatch):
    probe = tmp_path / "probe.jsonl"
    monkeypatch.setenv("MT_LIVE_PROBE", str(probe))
    live(lambda a, unused: draw_power(a, "x"), a=(1, 3), unused=(0, 10))
    assert json.loads(probe.read_text())["controls"] == {"a": True, "unused": False}


def test_bad_controls_are_named():
    with pytest.raises(ValueError, match="give at least one control"):
        live(draw_power)
    with pytest.raises(ValueError, match="a=.*not a slider range"):
        live(draw_power, a=object(), kind=["x"])


@pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="needs the course's sources")
def test_every_lesson_has_a_live_control_in_a_demo_cell():
    missing = []
    for lesson in all_lessons():
        cells = read_source(lesson).cells
        if not any(c.cell_type == "code" and "demo" in tags(c) and "\nlive(" in "\n" + c.source for c in cells):
            missing.append(lesson.stem)
    assert not missing, f"no live control in {missing}"


@pytest.mark.parametrize("spec", [(1, 32, 1), (2, 8), (0, 10, 3), (1, 30, 4), (0.5, 4.0), (0.0, 1.0, 0.1), True, False,
                                  ["x", "y", "z"], [("one", 1), ("two", 2)]])
def test_without_ipywidgets_the_figure_is_drawn_once_where_interact_would_start(spec, monkeypatch, capsys):
    """A Python without ipywidgets (a GPU machine's own, a script) gets the figure at the values
    ipywidgets would start the controls at, and a line saying there are no controls."""
    import ipywidgets as w

    from course.live import Still

    want = w.interactive.widget_from_abbrev(spec).value
    seen = []

    def draw(v):
        seen.append(v)
        return draw_power(1.0, str(v))

    monkeypatch.setitem(__import__("sys").modules, "ipywidgets", None)  # import ipywidgets raises ImportError
    still = live(draw, v=spec)
    assert isinstance(still, Still) and seen == [want] and still.values() == {"v": want}
    assert still.first_png.startswith(b"\x89PNG") and "image/png" in still._repr_mimebundle_()
    assert "ipywidgets is not installed" in capsys.readouterr().out
