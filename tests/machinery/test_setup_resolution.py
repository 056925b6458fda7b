"""`make setup` resolves to the pinned versions on every platform and Python the course supports.

The markers are checked offline, always. The resolution itself asks pip's resolver for each target
(Linux x86-64 and aarch64, macOS arm64 and x86-64; Python 3.11, 3.12, 3.13) and needs the package
index: it takes a few minutes (pip reads ~100 index pages per target), so it runs only with
MT_RESOLVE_PLATFORMS=1 (`.ci/run` sets it) and is skipped, with the reason, where pip cannot reach
its index.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).parent))
import platforms as P  # noqa: E402

TARGETS = [(pl, py) for pl in P.PLATFORMS for py in P.PYTHONS]
IDS = [f"{pl.name}-py{py}" for pl, py in TARGETS]
# Targets expected not to resolve, {platform: the package without a wheel}. None today: numba 0.68 has
# no macOS x86-64 wheel, so constraints.txt pins numba 0.62.1 (with llvmlite 0.45.1, NumPy 2.3.5) there.
UNSUPPORTED: dict[str, str] = {}


@pytest.mark.parametrize(("platform", "python"), TARGETS, ids=IDS)
def test_markers_pick_the_gpu_packages_only_where_their_wheels_exist(platform, python):
    env = platform.env(python)
    names = {canonicalize_name(r.name) for r in P.project_requirements(env)}
    assert (P.GPU_PACKAGES <= names) == platform.gpu and (P.GPU_PACKAGES & names) in (set(), P.GPU_PACKAGES)
    pins = P.pins(P.ROOT / platform.constraints, env)
    missing = sorted(n for n in names if n not in pins)
    assert not missing, f"{platform.name} / {python}: requirements without a pin in {platform.constraints}: {missing}"
    assert ("appnope" in pins) == (platform.sys_platform == "darwin")


@pytest.fixture(scope="module")
def resolutions():
    if os.environ.get("MT_RESOLVE_PLATFORMS") != "1":
        pytest.skip("asks the package index for every platform (minutes): set MT_RESOLVE_PLATFORMS=1 (.ci/run does)")
    ok, why = P.index_reachable()
    if not ok:
        pytest.skip(why)
    results = P.resolve_all(jobs=6)
    print("\n" + P.table(results))
    return {(r.platform.name, r.python): r for r in results}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("platform", "python"), TARGETS, ids=IDS)
def test_pip_resolves_the_pinned_set(resolutions, platform, python):
    r = resolutions[platform.name, python]
    if platform.name in UNSUPPORTED:
        assert not r.ok and UNSUPPORTED[platform.name] in r.error, (
            f"{platform.name} / {python} was expected not to resolve (no {UNSUPPORTED[platform.name]} wheel) "
            f"but {'it did: update README and UNSUPPORTED' if r.ok else 'failed otherwise'}:\n{r.error}")
        return
    assert r.ok, f"pip cannot resolve the set-up for {platform.name} / Python {python}:\n{r.error}"
    pins = P.pins(P.ROOT / platform.constraints, platform.env(python))
    unpinned = sorted(n for n in r.versions if n not in pins)
    assert not unpinned, f"{platform.name} / {python}: installed without a pin in {platform.constraints}: {unpinned}"
    wrong = {n: (v, pins[n]) for n, v in r.versions.items() if v != pins[n]}
    assert not wrong, f"{platform.name} / {python}: resolved (got, pinned) {wrong}"
    gpu = P.GPU_PACKAGES & set(r.versions)
    assert gpu == (P.GPU_PACKAGES if platform.gpu else set()), f"{platform.name}: gpu packages {sorted(gpu)}"
