"""``bench/fsq_kernels.py``'s command line refuses a bad comparison before any GPU work."""

from __future__ import annotations

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def fsq_bench():
    return bench_script("fsq_kernels")


def test_a_choice_reads_as_heads_code_and_key_buffers(fsq_bench):
    assert fsq_bench.parse_choice("h2z3k4") == (2, 3, 4)
    assert fsq_bench._label(fsq_bench.parse_choice("h1z2k6")) == "h1z2k6"
    with pytest.raises(ValueError, match="'h2z3'"):
        fsq_bench.parse_choice("h2z3")


@pytest.mark.parametrize("argv,message", [
    (["--choices", "h2z3k4"], "--choices goes with --heads"),
    (["--heads", "--choices", "h2k4"], "'h2k4' is not a choice"),
    (["--knobs", "{}"], "--knobs goes with --variants"),
    (["--variants", "--knobs", '{"no_such_knob": true}'], "no_such_knob"),
    (["--configs", "13x"], "'13x'] names none of"),
    (["--variants", "--knobs", "[]"], "[] is not a set of WS_TUNING knobs"),
    (["--variants", "--knobs", '{"regs": [168, 152, 200]}'], "[168, 152, 200]"),
    (["--variants", "--knobs", '{"regs": [168, 150, 192]}'], "multiples of 8"),
])
def test_bad_arguments_are_refused_by_name(fsq_bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        fsq_bench.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
