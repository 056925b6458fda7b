"""Does `make setup` resolve on each platform and Python the course supports? pip decides.

For each target (a platform tag and a Python version) this runs pip's own resolver for that
target, without installing or building anything:

    pip install --dry-run --ignore-installed --report - --only-binary=:all:
        --platform TAG --python-version 3.X --implementation cp --target TMP
        -c constraints.txt  <the project's requirements, extras [gpu], [slides] and [site]>

pip evaluates environment markers against the interpreter running it, not against `--platform`
(pypa/pip#10050), so the markers of the project's requirements and of the constraints are
evaluated here, for the target, and pip gets marker-free lines. Markers inside the dependencies'
own metadata are still evaluated by pip for this machine; `resolve` then evaluates every resolved
package's requirements for the target and resolves again with any the target needs and pip left out
(e.g. a macOS-only dependency), until nothing is missing.

`python tests/machinery/platforms.py` prints the table; tests/machinery/test_setup_resolution.py
asserts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ("3.11", "3.12", "3.13")
GPU_PACKAGES = {"cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvcc-cu12"}


@dataclass(frozen=True)
class Platform:
    name: str
    tag: str  # the newest tag: macOS 14 takes macosx_11_0 and universal2 wheels too (pip adds them)
    sys_platform: str
    platform_machine: str
    gpu: bool  # the gpu extra installs here
    constraints: str  # the file `make setup` uses here (relative to the repository root)

    def tags(self) -> list[str]:
        """The platform tags for pip: pip adds older macOS versions itself but not older glibcs
        (manylinux_2_28 would reject a manylinux_2_17 wheel), so those are listed here."""
        if not self.tag.startswith("manylinux_2_"):
            return [self.tag]
        glibc, arch = self.tag.removeprefix("manylinux_2_").split("_", 1)
        return [f"manylinux_2_{m}_{arch}" for m in range(int(glibc), 16, -1)] + [f"manylinux2014_{arch}"]

    def env(self, python: str) -> dict[str, str]:
        system = {"linux": "Linux", "darwin": "Darwin"}[self.sys_platform]
        return {"sys_platform": self.sys_platform, "platform_machine": self.platform_machine,
                "platform_system": system, "os_name": "posix", "python_version": python,
                "python_full_version": python + ".0", "implementation_name": "cpython",
                "platform_python_implementation": "CPython", "implementation_version": python + ".0",
                "platform_release": "", "platform_version": ""}


# Windows: WSL2, which is Linux x86-64 (or aarch64).
PLATFORMS = (
    Platform("linux-x86_64", "manylinux_2_28_x86_64", "linux", "x86_64", True, "constraints.txt"),
    Platform("linux-aarch64", "manylinux_2_28_aarch64", "linux", "aarch64", True, "constraints.txt"),
    Platform("macos-arm64", "macosx_14_0_arm64", "darwin", "arm64", False, "constraints.txt"),
    Platform("macos-x86_64", "macosx_13_0_x86_64", "darwin", "x86_64", False, "constraints.txt"),
)


@dataclass
class Resolution:
    platform: Platform
    python: str
    ok: bool
    versions: dict[str, str] = field(default_factory=dict)  # canonical name -> version
    error: str = ""
    seconds: float = 0.0
    rounds: int = 0


def project_requirements(env: dict[str, str], extras: tuple[str, ...] = ("gpu", "slides", "site")) -> list[Requirement]:
    """pyproject.toml's dependencies and `extras`, those whose markers hold for `env`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def constraint_lines(path: Path, env: dict[str, str]) -> list[str]:
    """The constraints file's pins whose markers hold for `env`, without the markers."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            out.append(str(req))
    return out


def pins(path: Path, env: dict[str, str]) -> dict[str, str]:
    return {canonicalize_name(Requirement(l).name): str(Requirement(l).specifier).removeprefix("==")
            for l in constraint_lines(path, env)}


def borrowed_pins(of: str, on: str = "linux-x86_64", python: str = "3.12") -> list[str]:
    """Constraints for platform `on` with the versions platform `of` pins differently (numba 0.62.1,
    llvmlite, NumPy 2.3 for Intel Macs): how `.ci/run` tests another platform's set on this one.
    Packages that exist only on `of` (appnope) are left out."""
    by_name = {p.name: p for p in PLATFORMS}
    here = pins(ROOT / by_name[on].constraints, by_name[on].env(python))
    there = pins(ROOT / by_name[of].constraints, by_name[of].env(python))
    return [f"{n}=={there.get(n, v)}" for n, v in sorted(here.items())]


def _bare(req: Requirement) -> str:
    r = Requirement(str(req))
    r.marker = None
    return str(r)


def _pip(platform: Platform, python: str, requirements: list[str], constraints: list[str], tmp: Path):
    (tmp / "req.txt").write_text("\n".join(requirements) + "\n")
    (tmp / "con.txt").write_text("\n".join(constraints) + "\n")
    # No wheel is downloaded: pip reads PyPI's PEP 658 metadata files, or (fast-deps, on an index
    # without them) the wheel's metadata alone through HTTP range requests.
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--use-feature=fast-deps",
           "--report", str(tmp / "report.json"), "--only-binary=:all:",
           *[a for t in platform.tags() for a in ("--platform", t)], "--python-version", python, "--implementation", "cp", "--target", str(tmp / "target"),
           "-c", str(tmp / "con.txt"), "-r", str(tmp / "req.txt")]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def missing_for_target(report: dict, env: dict[str, str]) -> list[str]:
    """Requirements of the resolved packages that hold for the target but that pip left out."""
    names = {canonicalize_name(it["metadata"]["name"]) for it in report["install"]}
    missing = []
    for it in report["install"]:
        extras = [""] + list(it.get("requested_extras") or ())
        for line in it["metadata"].get("requires_dist") or ():
            req = Requirement(line)
            if canonicalize_name(req.name) in names:
                continue
            if req.marker is None or any(req.marker.evaluate(dict(env, extra=e)) for e in extras):
                missing.append(_bare(req))
    return sorted(set(missing))


def resolve(platform: Platform, python: str) -> Resolution:
    """pip's resolution of the project's requirements with the gpu extra for one target."""
    import time

    env = platform.env(python)
    start = time.perf_counter()
    reqs = [_bare(r) for r in project_requirements(env)]
    cons = constraint_lines(ROOT / platform.constraints, env)
    res = Resolution(platform, python, ok=False)
    with tempfile.TemporaryDirectory(prefix="mt-resolve-") as d:
        for res.rounds in range(1, 5):
            p = _pip(platform, python, reqs, cons, Path(d))
            if p.returncode != 0:
                out = [l for l in (p.stdout + p.stderr).splitlines() if l.strip() and not l.startswith("WARNING: ")]
                first = next((i for i, l in enumerate(out) if l.startswith("ERROR")), max(len(out) - 12, 0))
                res.error = "\n".join(out[first:first + 20])
                break
            report = json.loads((Path(d) / "report.json").read_text())
            extra = missing_for_target(report, env)
            if not extra:
                res.ok = True
                res.versions = {canonicalize_name(it["metadata"]["name"]): it["metadata"]["version"]
                                for it in report["install"]}
                break
            reqs += extra
        else:
            res.error = f"still missing after {res.rounds} rounds: {extra}"
    res.seconds = time.perf_counter() - start
    return res


def index_reachable() -> tuple[bool, str]:
    """Can pip find numba's macOS arm64 wheels (on PyPI, or the index pip is configured with)?"""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "numba", "--only-binary=:all:",
           "--platform", "macosx_14_0_arm64", "--python-version", "3.12", "--implementation", "cp"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PIP_DEFAULT_TIMEOUT="10", PIP_RETRIES="0"))
    except subprocess.TimeoutExpired:
        return False, "pip cannot reach its package index (no answer in 120 s)"
    if p.returncode == 0 and "0.68.1" in p.stdout:
        return True, ""
    last = [l for l in (p.stderr + p.stdout).splitlines() if l.strip() and not l.startswith("WARNING: Location")]
    return False, "pip cannot reach its package index: " + (last[-1] if last else f"exit status {p.returncode}")


def resolve_all(jobs: int = 6) -> list[Resolution]:
    targets = [(pl, py) for pl in PLATFORMS for py in PYTHONS]
    with ThreadPoolExecutor(jobs) as ex:
        return list(ex.map(lambda t: resolve(*t), targets))


def table(results: list[Resolution]) -> str:
    rows = ["| platform | Python | resolves | numba | numpy | mpich | gpu extra | seconds |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        v = r.versions
        gpu = ", ".join(sorted(f"{n} {v[n]}" for n in GPU_PACKAGES if n in v)) or "-"
        first = r.error.splitlines()[0] if r.error else ""
        rows.append(f"| {r.platform.name} | {r.python} | {'yes' if r.ok else 'NO: ' + first} | "
                    f"{v.get('numba', '-')} | {v.get('numpy', '-')} | {v.get('mpich', '-')} | {gpu} | {r.seconds:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import time

    if sys.argv[1:2] == ["--pins-of"]:  # `platforms.py --pins-of macos-x86_64`: that set, for this machine
        print("\n".join(borrowed_pins(sys.argv[2])))
        sys.exit(0)

    ok, why = index_reachable()
    if not ok:
        sys.exit(why)
    t = time.perf_counter()
    results = resolve_all()
    print(table(results))
    print(f"\n{len(results)} resolutions in {time.perf_counter() - t:.0f} s")
    for r in results:
        if r.error:
            print(f"\n{r.platform.name} / {r.python}:\n{r.error}")
