"""Runs the interpreter tests of ``test_fsq_interpreted.py`` in a process of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="this process already interprets: the cases run directly")
def test_fsq_kernels_under_the_interpreter():
    run_interpreted(Path(__file__).with_name("test_fsq_interpreted.py"))
