"""What a wheel of the course holds beyond the `course` and `minitorch` packages (pyproject.toml
says the rest).

A notebook opened outside a checkout (Colab, a JupyterHub) after `pip install` of the course needs,
for its check cells, each lesson's tests and source: they go into the wheel as `course/_tree/`
(tests/*.py, solutions/*.py and the pyproject.toml that configures pytest), which
`course.source` uses when there is no checkout around the package. The shipped model and corpus
(data/) go into `minitorch/_data/` (not minitorch/data/: lesson 03 owns the module minitorch.data),
where `minitorch.gpt` looks when there is no data/ beside the package. An editable install
(`make setup`) copies nothing: it uses the checkout itself.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
TREE = {  # destination in the wheel: files of the checkout
    "course/_tree/tests": sorted((HERE / "tests").glob("*.py")),
    "course/_tree/solutions": sorted((HERE / "solutions").glob("[0-9][0-9]_*.py")),
    "course/_tree": [HERE / "pyproject.toml"],
    "minitorch/_data": sorted(p for p in (HERE / "data").iterdir() if p.is_file()),
}


class BuildWithCourseTree(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for dest in ("course/_tree", "minitorch/_data"):  # nothing left from an earlier build
            shutil.rmtree(Path(self.build_lib) / dest, ignore_errors=True)
        for dest, files in TREE.items():
            folder = Path(self.build_lib) / dest
            folder.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copyfile(f, folder / f.name)


setup(cmdclass={"build_py": BuildWithCourseTree})
