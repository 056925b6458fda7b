"""`make lab` starts JupyterLab on the lessons, as root too (containers, many cloud machines), where
JupyterLab refuses to start unless given --allow-root: the Makefile passes it when `id -u` is 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (REPO / ".venv" / "bin" / "jupyter").exists(), reason="needs make setup's .venv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_make_lab_serves_the_lessons():
    port = _free_port()
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token= --ServerApp.password="
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, page = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/lessons", timeout=2) as r:
                    page = r.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        if page is None:
            os.killpg(proc.pid, signal.SIGTERM)
            out = proc.communicate(timeout=20)[0]
            pytest.fail(f"make lab did not serve the lessons (running as uid {os.getuid()}):\n{out[-2000:]}")
        assert "01_tensors.ipynb" in page
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
