"""Live controls for lectures: a slider (or menu) beside a figure that redraws as it moves.

    from course.live import live
    live(draw_bubble, micro_batches=(1, 32, 1), stages=(2, 8, 1))

`draw(**values)` draws one matplotlib figure for the controls' values (it may create it with
`plt.subplots` and return it, or draw on the current figure) and must be fast enough to drag:
precompute what is slow (a measured sweep, a trained model) in an earlier cell and only look it up
or simulate here. Controls are ipywidgets' `interact` abbreviations: `(lo, hi)` or `(lo, hi, step)`
(an int or float slider), a list of choices (a dropdown), a bool (a checkbox), or a widget.

Executed in a plain kernel (`make check`, `make demo`, `make slides`) the cell renders its first
picture once, which is also what the slides and a static page show (the output carries a PNG
beside the widget); in JupyterLab the widget takes over and each move redraws.

With MT_LIVE_PROBE=<file> in the environment (course.executor's notebook runs set it) each control
is also driven at its extremes and its middle, and one line per control goes to the file: whether
the pictures differ and the slowest redraw, so `make check` proves every control is live and fast.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import time
from typing import Any, Callable


def _widget(name: str, spec: Any):
    import ipywidgets as w

    if isinstance(spec, w.ValueWidget):
        widget = spec
    else:
        widget = w.interactive.widget_from_abbrev(spec)
        if widget is None:
            raise ValueError(f"live: control {name}={spec!r} is not a slider range (lo, hi[, step]), a list or a bool")
    widget.description = name
    widget.continuous_update = True
    widget.style = {"description_width": "initial"}
    return widget


def _values(widget) -> list:
    """The control's extremes and middle (what the probe drives)."""
    if hasattr(widget, "min") and hasattr(widget, "max"):
        lo, hi = widget.min, widget.max
        mid = (lo + hi) / 2
        if isinstance(lo, int) and isinstance(hi, int):
            step = getattr(widget, "step", 1) or 1
            mid = lo + round((mid - lo) / step) * step
        return [lo, mid, hi]
    if hasattr(widget, "options") and widget.options:
        opts = [o[1] if isinstance(o, tuple) else o for o in widget.options]
        return [opts[0], opts[len(opts) // 2], opts[-1]]
    if isinstance(widget.value, bool):
        return [False, True]
    return [widget.value]


def signature(fig) -> str:
    """A hash of what the figure shows (lines, bars, images, texts, axis limits), to tell two
    pictures apart without rasterising them."""
    import numpy as np

    parts = []
    for ax in fig.axes:
        parts += [np.asarray(line.get_xydata()).tobytes() for line in ax.lines]
        parts += [np.asarray(p.get_path().vertices).tobytes() + p.get_patch_transform().get_matrix().tobytes()
                  for p in ax.patches]
        parts += [np.asarray(im.get_array()).tobytes() for im in ax.images]
        parts += [np.asarray(c.get_offsets()).tobytes() for c in ax.collections]
        parts += [np.asarray(path.vertices).tobytes() for c in ax.collections for path in c.get_paths()]
        parts += [t.get_text().encode() for t in ax.texts + [ax.title, ax.xaxis.label, ax.yaxis.label]]
        parts += [repr((ax.get_xlim(), ax.get_ylim())).encode()]
    parts += [t.get_text().encode() for t in fig.texts]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


class Live:
    """A live control: `widgets` by name, `render(**values)` draws and returns the figure (what
    tests call), `box` the ipywidgets layout shown in JupyterLab."""

    def __init__(self, draw: Callable[..., Any], controls: dict[str, Any]):
        import ipywidgets as w

        if not controls:
            raise ValueError("live: give at least one control, e.g. live(draw, n=(1, 10))")
        self.draw = draw
        self.widgets = {name: _widget(name, spec) for name, spec in controls.items()}
        self.out = w.Output()
        self.box = w.VBox([w.HBox(list(self.widgets.values())), self.out])
        self.first_png = b""
        for widget in self.widgets.values():
            widget.observe(lambda _change: self.redraw(), names="value")

    def values(self) -> dict[str, Any]:
        return {name: widget.value for name, widget in self.widgets.items()}

    def render(self, **values):
        """Draw the figure for these values (the controls' current ones where not given)."""
        import matplotlib.pyplot as plt

        values = {**self.values(), **values}
        plt.close("all")
        fig = self.draw(**values)
        return fig if fig is not None else plt.gcf()

    def redraw(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import clear_output, display

        with self.out:
            clear_output(wait=True)
            fig = self.render()
            display(fig)
            plt.close(fig)

    def probe(self) -> dict:
        """Drive each control over its extremes and middle (the others at their values): does the
        picture change, and the slowest redraw in seconds: wall time and the process's CPU time
        (the one judged: on a busy machine wall time also counts the waits for a core, which a
        lecturer's quiet laptop does not have)."""
        import matplotlib.pyplot as plt

        report = {"draw": getattr(self.draw, "__name__", "?"), "controls": {}, "slowest_s": 0.0, "slowest_cpu_s": 0.0}
        for name, widget in self.widgets.items():
            sigs = []
            for v in _values(widget):
                t0, c0 = time.perf_counter(), time.process_time()
                fig = self.render(**{name: v})
                fig.canvas.draw()  # what the browser waits for: the picture, not just the data
                report["slowest_s"] = max(report["slowest_s"], time.perf_counter() - t0)
                report["slowest_cpu_s"] = max(report["slowest_cpu_s"], time.process_time() - c0)
                sigs.append(signature(fig))
                plt.close(fig)
            report["controls"][name] = len(set(sigs)) > 1
        return report

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.box._repr_mimebundle_(**kwargs) or {}
        if self.first_png:
            bundle["image/png"] = base64.b64encode(self.first_png).decode()
        bundle["text/plain"] = f"live control: {', '.join(self.widgets)}"
        return bundle


def _start_value(name: str, spec: Any) -> Any:
    """Where ipywidgets' interact would start a control (for a Python without ipywidgets)."""
    if isinstance(spec, bool):
        return spec
    if isinstance(spec, tuple) and len(spec) in (2, 3) and all(isinstance(v, (int, float)) for v in spec):
        lo, hi = spec[:2]
        if all(isinstance(v, int) for v in spec):
            step = spec[2] if len(spec) == 3 else 1
            return lo + ((hi - lo) // 2) // step * step
        return (lo + hi) / 2
    if isinstance(spec, (list, tuple)) and spec:
        first = spec[0]
        return first[1] if isinstance(first, tuple) and len(first) == 2 else first
    if hasattr(spec, "value"):
        return spec.value
    raise ValueError(f"live: control {name}={spec!r} is not a slider range (lo, hi[, step]), a list or a bool")


class Still:
    """What `live` returns where ipywidgets is not installed (a GPU machine's own Python, a
    script): the figure drawn once at the controls' starting values, no controls."""

    def __init__(self, draw: Callable[..., Any], controls: dict[str, Any]):
        if not controls:
            raise ValueError("live: give at least one control, e.g. live(draw, n=(1, 10))")
        self.draw = draw
        self.start = {name: _start_value(name, spec) for name, spec in controls.items()}
        self.first_png = b""

    def values(self) -> dict[str, Any]:
        return dict(self.start)

    render = Live.render

    def _repr_mimebundle_(self, **kwargs):
        return {"image/png": base64.b64encode(self.first_png).decode(),
                "text/plain": f"figure at {self.start} (ipywidgets is not installed: no live controls)"}


def live(draw: Callable[..., Any], **controls: Any) -> Live | Still:
    """A figure with controls: `draw(**values)` redraws it for the controls' values. Returns the
    Live object (display it as the cell's last expression; tests call `.render(...)`); where
    ipywidgets is not installed, a Still: the figure drawn once."""
    import matplotlib.pyplot as plt

    try:
        import ipywidgets  # noqa: F401 - only whether it is installed
        ctl: Live | Still = Live(draw, controls)
    except ImportError:
        ctl = Still(draw, controls)
    fig = ctl.render()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    ctl.first_png = buf.getvalue()
    if isinstance(ctl, Still):
        plt.close(fig)
        print(f"live control drawn once at {ctl.start}: ipywidgets is not installed")
        return ctl
    with ctl.out:
        from IPython.display import display

        display(fig)
    plt.close(fig)
    probe_file = os.environ.get("MT_LIVE_PROBE")
    if probe_file:
        with open(probe_file, "a") as f:
            f.write(json.dumps(ctl.probe()) + "\n")
    return ctl
