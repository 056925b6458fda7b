"""The modules' names before lessons 11 and 15 were renamed and split (minitorch.serve, server,
server_kit) still import, for the notebooks students saved before: each holds the very objects of
the new modules (kv_cache; scheduler, engine, metrics, api_server; serving_kit, fused_decode)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")

OLD = {"serve": ("kv_cache",), "server": ("scheduler", "engine", "metrics", "api_server"),
       "server_kit": ("serving_kit", "fused_decode")}


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_name_holds_the_new_modules_objects(old):
    alias = importlib.import_module(f"minitorch.{old}")
    for new in OLD[old]:
        module = importlib.import_module(f"minitorch.{new}")
        own = [n for n, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__]
        assert own, f"minitorch.{new} defines nothing"
        missing = [n for n in own if getattr(alias, n, None) is not getattr(module, n)]
        assert not missing, f"minitorch.{old} should hold minitorch.{new}'s {missing}"


def test_python_m_minitorch_server_still_runs_the_api_server():
    out = subprocess.run([sys.executable, "-m", "minitorch.server", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "python -m minitorch.api_server" in out.stdout, out.stdout + out.stderr
