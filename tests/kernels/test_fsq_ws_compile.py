"""The warp-specialized FSQ split kernel (Gluon, Hopper) compiled for sm_90 without a GPU.

The Triton interpreter cannot run Gluon and CI has no GPU, so this is what CI can check: with
the installed Triton, the kernel compiles to a cubin from the arguments the launcher builds
for real problems, its shared memory fits a Hopper multiprocessor, every product is a
warp-group MMA, and the partitions set their registers. Its results are checked on a GPU
(``test_fsq_gpu.py``)."""

from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

import pytest
import torch
from fsq_cases import make_fsq_case

from kernels import validate_fsq_args
from kernels._fsq_plan import (
    WS_MIN_TRITON,
    WS_REGS,
    WS_SHARED_LIMIT,
    WS_SHARED_SLACK,
    WS_TUNING,
    _triton_version,
    check_ws_regs,
    splits_for,
    uniform_bits,
    ws_block_bytes,
    ws_program_heads,
    ws_shared_bytes,
)

pytestmark = pytest.mark.skipif(_triton_version() < WS_MIN_TRITON,
                                reason="the Gluon kernel needs Triton >= 3.6")

QWEN3 = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
          torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


def _compile(case):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import _fsq_ws

    problem = validate_fsq_args(**case)
    batch, q_heads, _ = problem.query.shape
    split_len, splits = splits_for(problem, None, _fsq_ws.BLOCK_N.value)
    acc = torch.empty(batch, q_heads, splits, 256, dtype=torch.float32)
    ml = torch.empty(batch, q_heads, splits, 2, dtype=torch.float32)
    args, consts, options = _fsq_ws.kernel_arguments(problem, problem.codes, acc, ml,
                                                     split_len)
    fn = _fsq_ws._split_kernel_ws
    params = list(inspect.signature(fn.fn).parameters)
    signature = {}
    for name, value in zip(params, args, strict=False):
        if isinstance(value, torch.Tensor):
            signature[name] = _TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    signature.update({name: "constexpr" for name in consts})
    assert list(signature) == params  # every parameter has an argument or a constexpr
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(params.index(k),): v for k, v in consts.items()})
    # 4-bit codes take the bit-operation unpack; rows that are not whole 4-byte words are
    # read as aligned words and shifted (when the codes start at a word)
    words = problem.codes.shape[2] % 4 != 0
    assert consts["FAST"] == (uniform_bits(problem.levels) == 4 and consts["BLOCK_B"] >= 64
                              and (not words or problem.codes.data_ptr() % 4 == 0))
    assert consts["WORDS"] == (consts["FAST"] and words)
    # kv heads per program and code buffers as the plan counts them
    assert (consts["HEADS"], consts["Z_STAGES"], consts["K_STAGES"]) == ws_program_heads(problem)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return problem, consts, kernel


def _assert_shared_as_counted(problem, consts, kernel):
    """The launcher's buffers, counted with the biases in the form this launch holds them,
    bound what the kernel takes; the plan's count (the largest form) bounds that."""
    heads, code_stages, key_stages = ws_program_heads(problem)
    form = (None if problem.key_bias is None or consts["BIAS_CODE"] >= 0
            else "mma" if consts["BIAS_MMA"] else "float")
    counted, planned = (
        ws_shared_bytes(problem.width, problem.query.shape[2], uniform_bits(problem.levels),
                        problem.k_norm is not None, heads, code_stages, bias, key_stages)
        for bias in (form, "mma" if problem.key_bias is not None else None))
    assert counted <= kernel.metadata.shared <= counted + WS_SHARED_SLACK
    assert counted <= planned and planned + WS_SHARED_SLACK <= WS_SHARED_LIMIT


@pytest.mark.parametrize("kwargs", [
    dict(QWEN3, width=256, dtype=torch.bfloat16),  # Qwen3-8B at 32x: the most shared memory
    dict(QWEN3, width=84, dtype=torch.float16),  # 97.5x: 42-byte rows, shifted words
    dict(q_heads=12, kv_heads=12, head_dim=64, width=192, rope=None, k_norm=False,
         dtype=torch.bfloat16),  # GPT-2: no RoPE, no norm
    dict(q_heads=32, kv_heads=2, head_dim=32, width=40, levels=256, bias=False,
         dtype=torch.bfloat16),  # 16 query heads per kv head, 8-bit codes, head_dim / 2 = 16
    dict(width=24, dtype=torch.float16),  # 12-byte rows: the codes padded to 64 MMA rows
    dict(width=16, levels=256, head_dim=64, dtype=torch.bfloat16),
    dict(QWEN3, width=256, dtype=torch.float16, bias=False),  # the fast unpack in float16
], ids=["qwen3-32x", "qwen3-97.5x", "gpt2", "group16-256levels", "w24", "w16-256levels",
        "qwen3-32x-fp16"])
def test_warp_specialized_kernel_compiles_for_hopper(kwargs):
    problem, consts, kernel = _compile(make_fsq_case(batch=2, archived=300, **kwargs))
    _assert_shared_as_counted(problem, consts, kernel)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "mbarrier.try_wait" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert kernel.asm["cubin"]  # ptxas accepted it
    fast = (uniform_bits(problem.levels) == 4 and ws_block_bytes(problem.width, 4) >= 64
            and (problem.codes.shape[2] % 4 == 0 or problem.codes.data_ptr() % 4 == 0))
    assert ("0x000F000F" in ptx) == fast
    assert ("shf.r.clamp" in ptx) == (fast and problem.codes.shape[2] % 4 != 0)


def test_rows_off_word_boundaries_take_the_general_unpack():
    """42-byte rows whose codes start 2 bytes past a word cannot be read as aligned words:
    the launcher picks the byte-wise unpack, which compiles."""
    case = make_fsq_case(batch=2, archived=300, width=84, dtype=torch.bfloat16, **QWEN3)
    codes = case["codes"]
    shifted = torch.zeros(codes.numel() + 2, dtype=torch.uint8)[2:].view(codes.shape)
    shifted.copy_(codes)
    problem, _, kernel = _compile(dict(case, codes=shifted))
    assert problem.codes.data_ptr() % 4 == 2
    assert "0x000F000F" not in kernel.asm["ptx"] and "shf.r.clamp" not in kernel.asm["ptx"]


@pytest.mark.parametrize("halves", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("width", [256, 84], ids=["qwen3-32x", "qwen3-97.5x"])
def test_key_product_in_halves_or_whole(monkeypatch, width, halves):
    """The ``halves`` knob: the key product in two pipelined column halves (N = head_dim / 2
    MMAs) or one over all ``head_dim`` columns (N = head_dim, serial: shipped); the scores
    and weighted codes (N = 16) are the same either way."""
    monkeypatch.setitem(WS_TUNING, "halves", halves)
    monkeypatch.setitem(WS_TUNING, "key_ahead", halves)
    case = make_fsq_case(batch=2, archived=300, width=width, dtype=torch.bfloat16, **QWEN3)
    _, consts, kernel = _compile(case)
    assert consts["PARTS"] == (2 if halves else 1)
    ptx = kernel.asm["ptx"]
    assert ("m64n64k16" in ptx) == halves and ("m64n128k16" in ptx) != halves
    assert "m64n16k16" in ptx


@pytest.mark.parametrize("rope,k_norm", [(1e6, True), (1e6, False), (None, True)],
                         ids=["rope-norm", "rope", "norm"])
def test_norm_weight_folded_into_the_rotation_only_with_both(monkeypatch, rope, k_norm):
    """``fold_norm``: the RMSNorm weight rides in RoPE's rotation tables only where there
    are both (with one of them there is nothing to fold into, and the kernel is the same
    either way). Both forms' results are checked on a GPU (``test_fsq_gpu.py``)."""
    case = make_fsq_case(batch=2, archived=300, width=84, dtype=torch.bfloat16, rope=rope,
                         k_norm=k_norm, **QWEN3)
    ptx = {}
    for fold in (True, False):
        monkeypatch.setitem(WS_TUNING, "fold_norm", fold)
        _, consts, kernel = _compile(case)
        assert consts["FOLD"] == (fold and rope is not None and k_norm)
        ptx[fold] = kernel.asm["ptx"]
    assert (ptx[True] != ptx[False]) == (rope is not None and k_norm)


def test_key_bias_buffer_in_the_form_the_keys_read(monkeypatch):
    """At 32x (no padding codes to carry the bias) the kernel holds the biases either as the
    extra MMA step's tile or as float rows, never both: its shared memory is the count of
    that one form, and only the MMA form issues the extra step."""
    case = make_fsq_case(batch=2, archived=300, width=256, dtype=torch.bfloat16, **QWEN3)
    shared, steps = {}, {}
    for bias_mma in (True, False):
        monkeypatch.setitem(WS_TUNING, "bias_mma", bias_mma)
        problem, consts, kernel = _compile(case)
        assert consts["BIAS_CODE"] < 0 and consts["BIAS_MMA"] == bias_mma
        _assert_shared_as_counted(problem, consts, kernel)
        shared[bias_mma] = kernel.metadata.shared
        steps[bias_mma] = kernel.asm["ptx"].count("wgmma.mma_async")
    assert shared[True] > shared[False]
    assert steps[True] > steps[False]  # (ones @ the bias tile, once per head)


def _sass(kernel, folder: Path) -> str:
    """The cubin's SASS, by the cuobjdump that Triton carries."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("this Triton carries no cuobjdump")
    cubin = folder / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("pv_ahead", [False, True], ids=["product-waited", "product-ahead"])
@pytest.mark.parametrize("width", [256, 84], ids=["qwen3-32x", "qwen3-97.5x"])
def test_no_product_is_serialized(monkeypatch, tmp_path, width, pv_ahead):
    """ptxas serializes every warp-group MMA of the kernel (a wait after each) when it finds
    an accumulator in flight that other instructions may touch, e.g. one carried across a
    loop: the ``pv_ahead`` form keeps the next block's first scores beside the weighted-code
    product but waits for both inside the loop, so its cubin, like the shipped one's, waits
    far less often than it issues."""
    monkeypatch.setitem(WS_TUNING, "pv_ahead", pv_ahead)
    case = make_fsq_case(batch=2, archived=300, width=width, dtype=torch.bfloat16, **QWEN3)
    _, consts, kernel = _compile(case)
    assert consts["PV_AHEAD"] == pv_ahead
    sass = _sass(kernel, tmp_path)
    issued, waits = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
    assert issued >= 16 and waits < issued / 2, (issued, waits)


def _setmaxnreg(ptx: str) -> list[int]:
    return sorted(int(line.rsplit(None, 1)[-1].rstrip(";")) for line in ptx.splitlines()
                  if "setmaxnreg." in line)


@pytest.mark.parametrize("regs", [None, (168, 152, 192)], ids=["plan", "knob"])
def test_partitions_take_the_register_split(monkeypatch, regs):
    """``WS_TUNING["regs"]`` (else ``WS_REGS``) sets the three partitions' registers: the
    scores partition's by the launch's ``maxnreg``, the other two by ``setmaxnreg``."""
    monkeypatch.setitem(WS_TUNING, "regs", regs)
    case = make_fsq_case(batch=2, archived=300, q_heads=12, kv_heads=12, head_dim=64,
                         width=192, rope=None, k_norm=False, dtype=torch.bfloat16)
    _, consts, kernel = _compile(case)
    scores, unpack, keys = regs or WS_REGS
    assert (consts["UNPACK_REGS"], consts["KEY_REGS"]) == (unpack, keys)
    assert set(_setmaxnreg(kernel.asm["ptx"])) >= {unpack, keys}
    assert kernel.metadata.maxnreg == scores


@pytest.mark.parametrize("regs", [(168, 104), (168, 104, 236), (256, 256, 8), (200, 160, 160),
                                  (176, 96, 240), "abc"])
def test_a_bad_register_split_is_refused_by_name(regs):
    with pytest.raises(ValueError, match="regs must be three multiples of 8"):
        check_ws_regs(regs)
