"""Runs the interpreter tests of ``test_fsq_interpreted.py`` in a process of their own.

``TRITON_INTERPRET=1`` is read when a kernel is defined and launched; a separate process keeps
it away from every other test module of the same run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="this process already interprets: the cases run directly")
def test_fsq_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = str(TESTS.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(TESTS / "test_fsq_interpreted.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], \
        proc.stdout[-2000:]
