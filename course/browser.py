"""The browser test: lesson notebooks run in JupyterLab in a real browser, as a student runs them.

    python -m course.browser                 # the stub notebook of every lesson
    python -m course.browser 01 07 08 12     # some lessons (what `make check` runs)
    python -m course.browser --solution 03   # a solution notebook (progress bars, plots, passing checks)

JupyterLab is started on loopback in a temporary folder holding copies of the notebooks (the
student's files are never opened), Debian's Chromium is driven by Playwright, and each notebook
gets the student's Run All from the Run menu. Then, for every cell, what the page shows is
checked: the last cell ran; no traceback anywhere; each check cell says "not attempted" (stub)
or "all N tests passed" (solution); each `gpu` cell says why it skipped where no GPU works; and
what was rendered (plots, progress widgets) is counted. A screenshot of each notebook goes to
build/browser/.

Needs the `browser` extra (Playwright's Python package; `make check` installs it) and a Chromium
(`apt-get install chromium`, or CHROMIUM=/path). Where either is missing it says so and exits 2,
unless MT_BROWSER_REQUIRED=1 (set by CI), where that is a failure like any other.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from course.source import ROOT, Lesson, all_lessons, find_lesson, tags

OUT = ROOT / "build" / "browser"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]
RUN_ALL_LIMIT = 900  # s for one notebook's Run All on the reference machine (x course.timing's scale)


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[browser]')"
    if find_chromium() is None:
        return "no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """JupyterLab on 127.0.0.1 serving `folder`, with its own settings and runtime folders."""

    def __init__(self, folder: Path, env: dict):
        self.folder, self.port, self.token = folder, _free_port(), "minitorch-browser-test"
        settings = folder / ".settings" / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True)
        # Every cell in the page (JupyterLab 4 otherwise leaves far-away cells out of the DOM).
        (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        news = folder / ".settings" / "@jupyterlab" / "apputils-extension"  # no "get Jupyter news?" toast
        news.mkdir(parents=True)
        (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={folder}", f"--LabApp.user_settings_dir={folder / '.settings'}",
               f"--LabApp.workspaces_dir={folder / '.workspaces'}", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
            cmd.append("--allow-root")
        env = {**env, "JUPYTER_RUNTIME_DIR": str(folder / ".runtime")}
        self.log = open(folder / ".lab.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.close)  # never leave a server (and its kernels) behind
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited at start:\n{(folder / '.lab.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url('api/status')}", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("JupyterLab did not answer on loopback within 120 s")

    def url(self, path: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?{query + '&' if query else ''}token={self.token}"

    def shutdown_kernels(self) -> None:
        """Stop every kernel (one notebook's kernel must not slow the next notebook down)."""
        for kernel in json.loads(urllib.request.urlopen(self.url("api/kernels"), timeout=30).read()):
            req = urllib.request.Request(self.url(f"api/kernels/{kernel['id']}"), method="DELETE")
            urllib.request.urlopen(req, timeout=60)

    def close(self) -> None:
        import signal

        from course.process import kill_group

        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            kill_group(self.proc)
        self.log.close()


@dataclass
class Seen:
    """What the page showed for one notebook after Run All."""

    stem: str
    seconds: float = 0.0
    cells: list[dict] = field(default_factory=list)  # per cell: kind, prompt, text, images, widgets
    problems: list[str] = field(default_factory=list)

    @property
    def images(self) -> int:
        return sum(c["images"] for c in self.cells)

    @property
    def widgets(self) -> int:
        return sum(c["progress"] for c in self.cells)


_READ_CELLS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell')).map(c => ({
  kind: c.classList.contains('jp-CodeCell') ? 'code' : 'markdown',
  prompt: (c.querySelector('.jp-InputArea-prompt') || {}).innerText || '',
  text: Array.from(c.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText).join('\\n'),
  stderr: Array.from(c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')).map(o => o.innerText).join('\\n'),
  images: c.querySelectorAll('.jp-OutputArea-output img').length,
  progress: c.querySelectorAll('.jp-OutputArea-output .widget-hprogress .progress-bar').length,
}))"""


def run_all(page, lab: Lab, name: str, n_cells: int, limit: float) -> tuple[list[dict], float]:
    """Open notebook `name` (n_cells cells), wait for its kernel, Run All from the Run menu, wait
    until the last cell has run."""
    # a workspace of its own, reset: only this notebook open
    page.goto(lab.url(f"lab/workspaces/{Path(name).stem}/tree/{name}", "reset"))
    page.wait_for_function(f"""() => document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell').length === {n_cells}""", timeout=300_000)
    page.wait_for_function("""() => {
        const bar = (document.querySelector('#jp-main-statusbar') || {}).innerText || '';
        return bar.includes('| Idle') && !bar.includes('No Kernel'); }""", timeout=300_000)
    t0 = time.monotonic()
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).first.click()
    cells: list[dict] = []
    while time.monotonic() - t0 < limit:
        time.sleep(2)
        cells = page.evaluate(_READ_CELLS)
        prompts = [c["prompt"] for c in cells if c["kind"] == "code"]
        if prompts and not any("*" in p for p in prompts) and re.search(r"\d", prompts[-1]):
            break
    else:
        cells = page.evaluate(_READ_CELLS)
    return cells, time.monotonic() - t0


def judge(lesson: Lesson, cells: list[dict], solution: bool, gpu_reason: str | None) -> list[str]:
    """What is wrong with what the page shows, against the notebook's cells and tags."""
    from course.build import solution_notebook, student_notebook
    from course.executor import GPU_SKIP, check_cell_exercise, check_cell_says_what_it_must

    nb = solution_notebook(lesson) if solution else student_notebook(lesson)
    problems = []
    if len(cells) != len(nb.cells):
        return [f"the page shows {len(cells)} cells, the notebook has {len(nb.cells)}"]
    for i, (cell, seen) in enumerate(zip(nb.cells, cells)):
        if cell.cell_type != "code":
            continue
        first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
        where = f"cell {i} (`{first}`)"
        if not re.search(r"\d", seen["prompt"]):
            problems.append(f"{where} did not run (prompt {seen['prompt']!r}): Run All stopped before it")
            break
        if "Traceback" in seen["text"] or re.search(r"^\w+(Error|Exception): ", seen["stderr"], re.M):
            problems.append(f"{where} shows an error:\n{seen['text'][-800:]}")
        ex = check_cell_exercise(cell)
        if ex and not check_cell_says_what_it_must(ex, seen["text"], stub=not solution):
            want = "all tests passed" if solution else "not attempted"
            problems.append(f"{where}: the check cell should say {want} but shows:\n{seen['text'][:600]}")
        if "gpu" in tags(cell) and gpu_reason and not seen["text"].startswith(GPU_SKIP):
            problems.append(f"{where}: a gpu cell should say why it skipped, but shows:\n{seen['text'][:400]}")
    return problems


def browse(lessons: list[Lesson], solution: bool = False, small: bool = True) -> list[Seen]:
    """Run All on each lesson's notebook in JupyterLab in Chromium; what each page showed."""
    from playwright.sync_api import sync_playwright

    from course.build import notebook_text, solution_notebook
    from course.gpu import gpu_status
    from course.timing import time_scale

    ok, reason = gpu_status()
    OUT.mkdir(parents=True, exist_ok=True)
    limit = RUN_ALL_LIMIT * time_scale()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MINITORCH_SMALL": "1" if small else "0", "OPENBLAS_NUM_THREADS": "1"}
    seen: list[Seen] = []
    with tempfile.TemporaryDirectory(prefix="minitorch-lab-") as tmp:
        folder = Path(tmp)
        for lesson in lessons:
            text = notebook_text(solution_notebook(lesson)) if solution else lesson.notebook.read_text()
            (folder / lesson.notebook.name).write_text(text)
        t0 = time.monotonic()
        lab = Lab(folder, env)
        print(f"JupyterLab answered on 127.0.0.1:{lab.port} after {time.monotonic() - t0:.1f} s", flush=True)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_FLAGS)
                for lesson in lessons:
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    result = Seen(lesson.stem)
                    n_cells = len(json.loads((folder / lesson.notebook.name).read_text())["cells"])
                    try:
                        result.cells, result.seconds = run_all(page, lab, lesson.notebook.name, n_cells, limit)
                        result.problems = judge(lesson, result.cells, solution, None if ok else reason)
                    except Exception as exc:  # noqa: BLE001 - a page that never loads: report it, go on
                        result.problems = [f"{type(exc).__name__}: {exc}"]
                    kind = "solution" if solution else "stub"
                    page.screenshot(path=str(OUT / f"{lesson.stem}.{kind}.png"), full_page=False)
                    page.close()
                    lab.shutdown_kernels()
                    seen.append(result)
                    status = "ok" if not result.problems else "FAIL"
                    print(f"   {lesson.stem:<20} {kind:<8} {status:<4} Run All {result.seconds:5.1f} s, "
                          f"{sum(c['kind'] == 'code' for c in result.cells)} code cells, {result.images} plots, "
                          f"{result.widgets} progress widgets", flush=True)
                    for p in result.problems:
                        print("      " + p.replace("\n", "\n      "), flush=True)
                browser.close()
        finally:
            lab.close()
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="*")
    ap.add_argument("--solution", action="store_true", help="run the solution notebooks instead of the stubs")
    ap.add_argument("--full", action="store_true", help="full size (MINITORCH_SMALL unset)")
    ap.add_argument("--expect-plots", type=int, default=0, help="fail unless at least this many plots rendered")
    ap.add_argument("--expect-progress", type=int, default=0, help="... and this many progress widgets")
    args = ap.parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops JupyterLab (atexit)
    why = missing()
    if why:
        print(f"browser test: cannot run here: {why}")
        return 1 if os.environ.get("MT_BROWSER_REQUIRED") == "1" else 2
    lessons = [find_lesson(k) for k in args.lessons] if args.lessons else all_lessons()
    seen = browse(lessons, solution=args.solution, small=not args.full)
    failed = sum(bool(s.problems) for s in seen)
    plots, widgets = sum(s.images for s in seen), sum(s.widgets for s in seen)
    if plots < args.expect_plots:
        print(f"   expected at least {args.expect_plots} rendered plots, saw {plots}")
        failed += 1
    if widgets < args.expect_progress:
        print(f"   expected at least {args.expect_progress} progress widgets, saw {widgets}")
        failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
