"""Run a test module under Triton's CPU interpreter in a process of its own.

``TRITON_INTERPRET=1`` is read when a kernel is defined and launched, so the interpreted cases
live in modules that skip unless the variable was set at process start, and a test of the
normal run starts them in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(test_file: Path, *, timeout: int = 900) -> str:
    """Run ``test_file`` with pytest and ``TRITON_INTERPRET=1``; assert that it passed with
    nothing skipped, and return its output."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, proc.stdout[-2000:]
    return proc.stdout
