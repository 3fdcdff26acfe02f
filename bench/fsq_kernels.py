"""Benchmark decode attention on packed FSQ codes against SDPA on the dense fp16 cache.

One query token per sequence, one layer's attention op, bf16 activations and decoders. For
each (model shape at a compression ratio, batch, context) the script times in one process
(``triton.testing.do_bench`` median; ``do_bench_cudagraph`` for CUDA-graph replay):

* ``fsq``: ``kernels.fsq_decode_attention`` (Triton path; 4 exact sinks + archived codes + 32
  exact recent tokens), eager (validated call, launches from Python) and graph;
* ``sdpa``: ``F.scaled_dot_product_attention`` on the dense fp16 K/V (backend torch picks),
  eager and graph;
* ``rvq``: the RVQ kernel at its nearest configuration (4 + 2 stages of 256 centroids per kv
  head, bytes stated), graph only.

It measures the copy bandwidth and a bf16 matmul in the same run and states both rooflines
per row: bytes moved / bandwidth, tensor-core FLOPs / matmul rate. Also extra peak memory.

    python bench/fsq_kernels.py --out bench/results/fsq_kernels.json [--quick] [--sweep]
        [--contexts 32768 131072] [--batches 1 8]
    python bench/fsq_kernels.py --heads   # kv heads per program of the Hopper kernel
    python bench/fsq_kernels.py --variants   # its code-column knobs on and off
    python bench/fsq_kernels.py --merge   # the merge kernel's knobs on and off
    python bench/fsq_kernels.py --plot bench/results/fsq_kernels.json   # table + docs figure
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))


def _rvq_bench():
    """bench/kernels.py (the RVQ benchmark) for its timing helpers; loaded by path because
    its module name is the package's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rvq_kernels",
                                                  Path(__file__).with_name("kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RVQ = _rvq_bench()
copy_bandwidth, extra_peak_bytes, time_ms = _RVQ.copy_bandwidth, _RVQ.extra_peak_bytes, _RVQ.time_ms


def matmul_rate(device, n=8192):
    """bf16 matmul FLOP/s on random data (the tensor-core ceiling of this run)."""
    import torch
    import triton.testing

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=20, rep=300, return_mode="median")
    return 2 * n ** 3 / (ms * 1e-3)

SINKS, RECENT = 4, 32
# (name, shape, width, levels): dense bytes per token per layer / packed bytes = the ratio
CONFIGS = [
    ("qwen3-8b 12x", {"q_heads": 32, "kv_heads": 8, "head_dim": 128}, 682, 16),
    ("qwen3-8b 32x", {"q_heads": 32, "kv_heads": 8, "head_dim": 128}, 256, 16),
    ("qwen3-8b 97.5x", {"q_heads": 32, "kv_heads": 8, "head_dim": 128}, 84, 16),
    ("gpt2 32x", {"q_heads": 12, "kv_heads": 12, "head_dim": 64}, 192, 16),
]
RVQ_STAGES = (4, 2)


def fsq_case(shape, width, levels, context, batch, rope):
    """A random case (bf16); the packed codes drawn on the GPU (any byte is a valid row)."""
    import torch
    from fsq_cases import make_fsq_case

    case = make_fsq_case(batch=batch, width=width, levels=levels, archived=1, sinks=SINKS,
                         recent=RECENT, dtype=torch.bfloat16, device="cuda",
                         rope=1e6 if rope else None, k_norm=rope, bias=True, **shape)
    size = case["codes"].shape[2]
    case["codes"] = torch.randint(0, 256, (batch, context - SINKS - RECENT, size),
                                  dtype=torch.uint8, device="cuda")
    return case


def tc_flops(shape, width, context, batch):
    """Tensor-core FLOPs no kernel of this model avoids: reconstructing every archived key,
    ``2 w D`` per position and kv head (RoPE and k_norm act after the decoder). The score
    and weighted-code products (``2 g (D + w)`` for ``g`` query heads per kv head; the kernel
    pads them to 16 rows) and the codes' padding to a power of two are left out, so the
    roofline is the ceiling a perfect kernel of this model would meet."""
    hkv, d = shape["kv_heads"], shape["head_dim"]
    return batch * hkv * (context - SINKS - RECENT) * 2 * width * d


def fsq_bytes(shape, width, levels, context, batch):
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    packed = -(-width * (levels.bit_length() - 1) // 8)
    codes = batch * (context - SINKS - RECENT) * packed
    exact = batch * hkv * (SINKS + RECENT) * d * 2 * 2
    decoders = 2 * hkv * d * width * 2
    return codes + exact + decoders + batch * hq * d * 2 * 2, packed


def dense_bytes(shape, context, batch):
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    return batch * hkv * context * d * 2 * 2 + batch * hq * d * 2 * 2


def run_grid(contexts, batches, graphs=True, rvq=True, tuning=None, configs=CONFIGS):
    """The table's rows for ``configs``; ``tuning`` (config name -> split-kernel settings,
    e.g. the sweep's best) is applied to the kernel's defaults for that config's rows."""
    import torch
    import torch.nn.functional as F

    from kernels import fsq_decode_attention, fsq_kernel_takes, validate_fsq_args

    bandwidth = copy_bandwidth("cuda")
    rate = matmul_rate("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    rows = []
    from kernels._fsq_plan import SPLIT_TUNING, uses_ws

    shipped = dict(SPLIT_TUNING)
    for name, shape, width, levels in configs:
        rope = name.startswith("qwen3")
        SPLIT_TUNING.clear()
        SPLIT_TUNING.update(shipped)
        if tuning and tuning.get(name):
            # (the sweep tunes the Triton split kernel: whether Hopper runs the
            # warp-specialized one stays the shipped choice)
            SPLIT_TUNING.update({k: v for k, v in tuning[name].items()
                                 if k in SPLIT_TUNING and k != "ws"})
        for batch in batches:
            for context in contexts:
                case = fsq_case(shape, width, levels, context, batch, rope)
                problem = validate_fsq_args(**case)
                row = {"config": name, "batch": batch, "context": context, "width": width}
                nbytes, packed = fsq_bytes(shape, width, levels, context, batch)
                row.update(packed_bytes_per_token=packed, fsq_bytes=nbytes,
                           dense_bytes=dense_bytes(shape, context, batch),
                           tc_flops=tc_flops(shape, width, context, batch))
                row["kernel"] = takes = fsq_kernel_takes(problem)
                if not takes:  # the reference would materialise the dense cache
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                fsq = functools.partial(fsq_decode_attention, **case, check_codes=False)
                row["split_kernel"] = "warp-specialized" if uses_ws(problem) else "triton"
                row["fsq_ms"] = time_ms(fsq, graph=False)
                if graphs:
                    row["fsq_graph_ms"] = time_ms(fsq, graph=True)
                    if uses_ws(problem):  # the Triton split kernel on the same call
                        SPLIT_TUNING["ws"] = False
                        try:
                            row["fsq_graph_triton_ms"] = time_ms(fsq, graph=True)
                        finally:
                            SPLIT_TUNING["ws"] = True
                row["fsq_peak"] = extra_peak_bytes(fsq)
                hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
                q = case["query"].to(torch.float16)[:, :, None, :]
                k = torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.float16)
                v = torch.randn_like(k)
                sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v,
                                         enable_gqa=hq != hkv)
                row["sdpa_ms"] = time_ms(sdpa, graph=False)
                if graphs:
                    row["sdpa_graph_ms"] = time_ms(sdpa, graph=True)
                row["sdpa_peak"] = extra_peak_bytes(sdpa)
                del k, v, sdpa
                if rvq and context >= 32768:
                    row.update(time_rvq(shape, context, batch))
                row["bytes_roof_ms"] = row["fsq_bytes"] / bandwidth * 1e3
                row["tc_roof_ms"] = row["tc_flops"] / rate * 1e3
                row["sdpa_roof_ms"] = row["dense_bytes"] / bandwidth * 1e3
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    SPLIT_TUNING.clear()
    SPLIT_TUNING.update(shipped)
    return {"bandwidth": bandwidth, "matmul_rate": rate, "rows": rows}


def time_rvq(shape, context, batch):
    import torch
    from kernels_cases import make_case

    from kernels import rvq_decode_attention

    ks, vs = RVQ_STAGES
    case = make_case(batch=batch, archived=context - SINKS - RECENT, codebook_size=256,
                     key_stages=ks, value_stages=vs, sinks=SINKS, recent=RECENT,
                     dtype=torch.float16, device="cuda", **shape)
    rvq = functools.partial(rvq_decode_attention, **case, check_codes=False)
    return {"rvq_graph_ms": time_ms(rvq, graph=True),
            "rvq_bytes_per_token": shape["kv_heads"] * (ks + vs)}


# split-kernel settings (the split count is the model's, kernels._fsq_plan.split_count; the
# programs-per-SM rules it replaced: fsq_kernels_splits.json). Variants measured and removed
# because they were slower: a transposed score product (fsq_kernels_sweep_transposed.json),
# scores and weighted codes both transposed (the sweep in fsq_kernels.json), the query rotated
# by each block's base angle and the RMS scale applied to the scores
# (fsq_kernels_sweep_lean.json), 16-level codes unpacked by bit operations on 16-bit words
# (fsq_kernels_sweep_nibbles.json)
SWEEP_KNOBS = [{"block_n": bn, "num_warps": warps, "prefetch": prefetch, "no_licm": no_licm}
               for bn, warps, prefetch, no_licm in ((128, 8, True, False), (128, 8, True, True),
                                                    (64, 4, True, True), (128, 8, False, True))]


def sweep(points=((8, 131072), (1, 32768)), check_context=4096):
    """The split kernel's tuning knobs (positions per step, warps, register prefetch of the
    next block, the loop's live ranges) at a few shapes of the Qwen3 configs the kernel takes,
    CUDA-graph time. Every variant is first checked against the float32 reference on a
    ``check_context`` case (a wrong variant is recorded as such, never timed). Returns the
    rows and, per config, the fastest correct setting at the first point."""
    import torch
    from fsq_cases import assert_rows_close

    from kernels import _fsq, reference_fsq_decode_attention, validate_fsq_args
    from kernels._fsq_plan import SPLIT_TUNING

    out, best = [], {}
    for name, shape, width, levels in CONFIGS[1:3]:
        rope = name.startswith("qwen3")
        small = fsq_case(shape, width, levels, check_context, 2, rope)
        small_problem = validate_fsq_args(**small)
        ref = reference_fsq_decode_attention(**small, out_dtype=torch.float32)
        cases = {pt: validate_fsq_args(**fsq_case(shape, width, levels, pt[1], pt[0], rope))
                 for pt in points}
        for knobs in SWEEP_KNOBS:
            tune = {**knobs, "num_stages": 1, "ws": False}  # the Triton split kernel's knobs
            row = {"config": name, **tune}
            saved = dict(SPLIT_TUNING)
            SPLIT_TUNING.update(tune)
            try:
                assert_rows_close(_fsq.decode(small_problem), ref)
                for (batch, context), problem in cases.items():
                    row[f"b{batch}_{context}_ms"] = time_ms(
                        functools.partial(_fsq.decode, problem), graph=True)
            except AssertionError as exc:
                row["wrong"] = str(exc)
            except Exception as exc:  # noqa: BLE001 (out of resources: record it)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            finally:
                SPLIT_TUNING.clear()
                SPLIT_TUNING.update(saved)
            out.append(row)
            print(json.dumps(row), flush=True)
        key = f"b{points[0][0]}_{points[0][1]}_ms"
        timed = [r for r in out if r["config"] == name and key in r]
        if timed:
            best[name] = min(timed, key=lambda r: r[key])
        del cases
        torch.cuda.empty_cache()
    return {"rows": out, "best": best}


WS_CHOICES = ((1, 3, 2), (2, 3, 2), (2, 3, 1), (2, 2, 1), (4, 3, 2), (4, 2, 2), (4, 2, 1))


def _label(choice):
    return "h{}z{}k{}".format(*choice)


def ws_fits(problem, heads, code_stages, key_stages):
    """Whether the warp-specialized kernel can run ``problem`` with ``heads`` kv heads per
    program (at most 16 query heads) and these buffers in shared memory."""
    from kernels._fsq_plan import (
        WS_SHARED_LIMIT,
        WS_SHARED_SLACK,
        uniform_bits,
        ws_shared_bytes,
    )

    q_heads, head_dim = problem.query.shape[1:]
    need = ws_shared_bytes(problem.width, head_dim, uniform_bits(problem.levels),
                           problem.k_norm is not None, heads, code_stages,
                           "mma" if problem.key_bias is not None else None, key_stages)
    return (problem.kv_heads % heads == 0 and heads * q_heads // problem.kv_heads <= 16
            and need + WS_SHARED_SLACK <= WS_SHARED_LIMIT)


def parse_choice(label):
    """``"h2z3k4"`` -> ``(2, 3, 4)``: kv heads per program, code buffers, key buffers."""
    m = re.fullmatch(r"h(\d+)z(\d+)k(\d+)", label)
    if not m:
        raise ValueError(f"{label!r} is not a choice like h2z3k4 (heads, code and key buffers)")
    return tuple(int(g) for g in m.groups())


def heads_sweep(points=((8, 131072), (1, 32768), (8, 32768), (32, 131072)),
                check_context=4096, choices=WS_CHOICES):
    """The warp-specialized kernel's kv heads per program and buffers: every ``(heads, code
    buffers, key buffers)`` of ``choices`` that fits (at most 16 query heads per program,
    shared memory) at each config it takes, CUDA-graph time, each with the split count the
    plan picks for ``batch x kv_heads / heads`` programs. Every choice is first checked
    against the float32 reference on a ``check_context`` case. ``plan`` in a row is what
    ``_fsq_plan.ws_program_heads`` picks."""
    from kernels import _fsq, _fsq_ws
    from kernels._fsq_plan import WS_BLOCK_N, choose_num_splits, ws_program_heads

    def run(problem, choice):
        splits = choose_num_splits(problem, WS_BLOCK_N, choice[0])
        launch = _fsq_ws.launch_split
        _fsq_ws.launch_split = functools.partial(launch, heads=choice)
        try:
            return _fsq.decode(problem, num_splits=splits)
        finally:
            _fsq_ws.launch_split = launch

    return checked_then_timed(
        run, lambda small: [c for c in choices if ws_fits(small, *c)], _label, points,
        check_context, lambda problem: {"plan": _label(ws_program_heads(problem))})


def checked_then_timed(run, variants_of, label, points, check_context, row_extra=None):
    """Rows of ``run(problem, variant)``'s CUDA-graph time at each config the warp-specialized
    kernel takes and each ``(batch, context)`` of ``points``, a column per variant
    (``label(variant)``) of ``variants_of(small problem)``; every variant is first checked
    against the float32 reference on a ``check_context`` case, and a wrong one is recorded
    as such, never timed. ``row_extra(problem)``: more columns of a row."""
    import torch
    from fsq_cases import assert_rows_close

    from kernels import reference_fsq_decode_attention, validate_fsq_args

    out = []
    for name, shape, width, levels in CONFIGS[1:]:
        rope = name.startswith("qwen3")
        small = fsq_case(shape, width, levels, check_context, 2, rope)
        small_problem = validate_fsq_args(**small)
        ref = reference_fsq_decode_attention(**small, out_dtype=torch.float32)
        variants = variants_of(small_problem)
        wrong = {}
        for variant in variants:
            try:
                assert_rows_close(run(small_problem, variant), ref)
            except AssertionError as exc:
                wrong[label(variant)] = str(exc)
        for batch, context in points:
            problem = validate_fsq_args(**fsq_case(shape, width, levels, context, batch, rope))
            row = {"config": name, "batch": batch, "context": context,
                   **(row_extra(problem) if row_extra else {})}
            for variant in variants:
                key = label(variant)
                row[key] = ("wrong: " + wrong[key] if key in wrong else
                            time_ms(functools.partial(run, problem, variant), graph=True))
            out.append(row)
            print(json.dumps(row), flush=True)
            del problem
            torch.cuda.empty_cache()
    return out


WS_VARIANTS = ({}, {"bias_pad": False}, {"trim": False}, {"bias_pad": False, "trim": False},
               {"bias_mma": True}, {"bias_pad": False, "bias_mma": True}, {"key_ahead": True},
               {"halves": True}, {"halves": True, "key_ahead": True, "bias_mma": True})


def variants_sweep(points=((8, 131072), (1, 32768), (8, 32768), (32, 131072)),
                   check_context=4096, knob_sets=WS_VARIANTS):
    """The warp-specialized kernel's knobs (``_fsq_plan.WS_TUNING``: the key bias carried by
    the padding bytes' codes, the key product trimmed to the columns that hold codes, the
    next key product issued before the one in hand is waited for, the bias elsewhere added
    by one more MMA step, the key product in two column halves) on and off at each config,
    :func:`checked_then_timed`; ``knob_sets``: the settings timed, each a change from the
    shipped one. A row's ``shipped`` is the setting the kernel ships with."""
    from kernels import _fsq
    from kernels._fsq_plan import WS_TUNING, ws_code_columns

    def run(problem, knobs):
        saved = dict(WS_TUNING)
        WS_TUNING.update(knobs)
        ws_code_columns.cache_clear()
        try:
            return _fsq.decode(problem)
        finally:
            WS_TUNING.update(saved)
            ws_code_columns.cache_clear()

    def label(knobs):
        return ",".join(f"{k}={v}" for k, v in knobs.items()) or "shipped"

    return checked_then_timed(run, lambda small: knob_sets, label, points, check_context)


WIDE_SETTINGS = ((64, 64, 8), (128, 64, 8), (64, 128, 8), (64, 64, 4), (128, 128, 8),
                 (32, 64, 4))


def wide_sweep(points=((8, 32768), (1, 32768)), check_context=4096, settings=WIDE_SETTINGS):
    """The tiled kernel's (codes wider than a tile: 12x) positions per block, coordinates per
    tile and warps (``_fsq_plan.WIDE_TUNING``, ``SPLIT_TUNING["num_warps"]``), each checked
    against the float32 reference first, then timed in a CUDA graph."""
    import torch
    from fsq_cases import assert_rows_close

    from kernels import fsq_decode_attention, reference_fsq_decode_attention
    from kernels._fsq_plan import SPLIT_TUNING, WIDE_TUNING

    name, shape, width, levels = CONFIGS[0]
    saved = dict(WIDE_TUNING), dict(SPLIT_TUNING)
    small = fsq_case(shape, width, levels, check_context, 2, True)
    ref = reference_fsq_decode_attention(**small, out_dtype=torch.float32)
    rows = []
    try:
        for block_n, tile, warps in settings:
            WIDE_TUNING.update(block_n=block_n, tile=tile)
            SPLIT_TUNING["num_warps"] = warps
            row = {"config": name, "block_n": block_n, "tile": tile, "num_warps": warps}
            try:
                assert_rows_close(fsq_decode_attention(**small, backend="triton"), ref)
            except AssertionError as exc:
                row["wrong"] = str(exc)
            else:
                for batch, context in points:
                    case = fsq_case(shape, width, levels, context, batch, True)
                    row[f"b{batch}_{context}"] = time_ms(functools.partial(
                        fsq_decode_attention, **case, check_codes=False), graph=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        WIDE_TUNING.update(saved[0])
        SPLIT_TUNING.update(saved[1])
    return rows


# (also measured and removed: the merge launched as a programmatic dependent of the split
# kernel, its exact tokens before `griddepcontrol.wait`: 0.97x-1.03x, commit 3236a20's
# fsq_kernels_merge_knobs.json)
MERGE_VARIANTS = ({}, {"block_e": 32}, {"block_e": 32, "num_warps": 8})


def merge_sweep(points=((1, 32768), (1, 131072), (8, 32768), (8, 131072)),
                check_context=4096, knob_sets=MERGE_VARIANTS):
    """The merge's knobs (``_fsq.MERGE_TUNING``: warps, exact tokens per step) at each config,
    :func:`checked_then_timed`,
    with SDPA's CUDA-graph time on the same shapes' dense fp16 cache in each row."""
    import torch
    import torch.nn.functional as F

    from kernels import _fsq

    def run(problem, knobs):
        saved = dict(_fsq.MERGE_TUNING)
        _fsq.MERGE_TUNING.update(knobs)
        try:
            return _fsq.decode(problem)
        finally:
            _fsq.MERGE_TUNING.update(saved)

    def sdpa(problem):
        batch, hq, d = problem.query.shape
        context = problem.codes.shape[1] + SINKS + RECENT
        q = problem.query.to(torch.float16)[:, :, None, :]
        k = torch.randn(batch, problem.kv_heads, context, d, device="cuda",
                        dtype=torch.float16)
        return {"sdpa": time_ms(functools.partial(F.scaled_dot_product_attention, q, k,
                                                  torch.randn_like(k),
                                                  enable_gqa=hq != problem.kv_heads),
                                graph=True)}

    def label(knobs):
        return ",".join(f"{k}={v}" for k, v in knobs.items()) or "shipped"

    return checked_then_timed(run, lambda small: knob_sets, label, points, check_context, sdpa)


def eager_calls(points=((1, 4096), (1, 32768), (8, 32768))):
    """Host-side cost of one call (batch 1, and batch 8 at 32K): eager time (``do_bench``) of
    the validated call, of the trusted per-step path (``decode_fsq_problem`` on a problem
    validated once, lengths and positions not read back), of that path replayed from a
    captured CUDA graph (``kernels.CapturedCall``: copy in, replay, copy out, as a static
    cache's eager step runs it) and of SDPA's eager call, launched and captured the same way,
    beside the kernel's CUDA-graph time."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from kernels import CapturedCall, decode_fsq_problem, fsq_decode_attention, validate_fsq_args

    rows = []
    for name, shape, width, levels in CONFIGS[1:]:
        for batch, context in points:
            case = fsq_case(shape, width, levels, context, batch, name.startswith("qwen3"))
            problem = validate_fsq_args(**case, check_codes=False)
            trusted = functools.partial(decode_fsq_problem, problem)
            captured = CapturedCall(
                lambda q, problem=problem: decode_fsq_problem(dataclasses.replace(problem,
                                                                                  query=q)),
                problem.query)
            hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
            q = case["query"].to(torch.float16)
            k = torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)

            def sdpa(query, k=k, v=v, gqa=hq != hkv):
                return F.scaled_dot_product_attention(query[:, :, None], k, v, enable_gqa=gqa)

            sdpa_captured = CapturedCall(sdpa, q)
            row = {"config": name, "batch": batch, "context": context,
                   "validated_ms": time_ms(functools.partial(fsq_decode_attention, **case,
                                                             check_codes=False), graph=False),
                   "trusted_ms": time_ms(trusted, graph=False),
                   "captured_ms": time_ms(functools.partial(captured, problem.query),
                                          graph=False),
                   "graph_ms": time_ms(trusted, graph=True),
                   "sdpa_ms": time_ms(functools.partial(sdpa, q), graph=False),
                   "sdpa_captured_ms": time_ms(functools.partial(sdpa_captured, q),
                                               graph=False)}
            if batch == 1 and context == points[1][1]:  # the captured call matches the launched
                torch.testing.assert_close(captured(problem.query), trusted(), rtol=0, atol=0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


DEFAULT_OUT = Path("bench/results/fsq_kernels.json")


def print_table(data, min_context=0):
    print("| config | B/token | batch | context | fsq eager ms | sdpa eager ms | eager ratio | "
          "fsq graph ms | sdpa graph ms | speed-up | TC roofline % | bytes roofline % | "
          "rvq graph ms (B/token) | fsq / sdpa peak MiB | Triton split kernel graph ms |")
    print("|" + "---|" * 15)
    for r in data["rows"]:
        if r["context"] < min_context:
            continue
        if not r.get("kernel"):
            print(f"| {r['config']} | {r['packed_bytes_per_token']} | {r['batch']} | "
                  f"{r['context']} | kernel n/a (width {r['width']} > 256) |" + " |" * 10)
            continue
        g, s = r.get("fsq_graph_ms"), r.get("sdpa_graph_ms")
        e, se, rvq = r.get("fsq_ms"), r.get("sdpa_ms"), r.get("rvq_graph_ms")
        print(f"| {r['config']} | {r['packed_bytes_per_token']} | {r['batch']} | {r['context']} "
              f"| {fmt(e)} | {fmt(se)} | {ratio(se, e)} | {fmt(g)} | {fmt(s)} | {ratio(s, g)} "
              f"| {ratio(100 * r['tc_roof_ms'], g, '%')} "
              f"| {ratio(100 * r['bytes_roof_ms'], g, '%')} | "
              + (f"{rvq:.3f} ({r['rvq_bytes_per_token']})" if rvq else "-")
              + f" | {r['fsq_peak'] / 2**20:.1f} / {r['sdpa_peak'] / 2**20:.1f} | "
              + (f"{fmt(r['fsq_graph_triton_ms'])} ({ratio(r['fsq_graph_triton_ms'], g)})"
                 if r.get("fsq_graph_triton_ms") else "-") + " |")


def fmt(x):
    return "-" if x is None else f"{x:.3f}"


def ratio(a, b, unit="x"):
    if a is None or not b:
        return "-"
    return f"{a / b:.0f}" if unit == "%" else f"{a / b:.2f}x"

def plot(data, figure: Path):
    """CUDA-graph time per call against context, one panel per batch: FSQ per config, SDPA
    on the dense cache and the RVQ kernel (4 + 2 stages)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        models = set()  # SDPA and RVQ once per model shape (the same for its configs)
        for name in [c[0] for c in CONFIGS]:
            rows = [r for r in data["rows"] if r["config"] == name and r["batch"] == batch
                    and r.get("fsq_graph_ms")]
            if not rows:
                continue
            ctx = [r["context"] for r in rows]
            ax.plot(ctx, [r["fsq_graph_ms"] for r in rows], "o-", label=f"FSQ {name}")
            model = name.split()[0]
            if model in models:
                continue
            models.add(model)
            style = "k" if model.startswith("qwen3") else "0.5"
            ax.plot(ctx, [r["sdpa_graph_ms"] for r in rows], "--", color=style,
                    label=f"SDPA dense ({model})")
            rvq = [(r["context"], r["rvq_graph_ms"]) for r in rows if r.get("rvq_graph_ms")]
            if rvq:
                ax.plot(*zip(*rvq, strict=True), "x:", color=style, label=f"RVQ 4+2 ({model})")
        ax.set(xscale="log", yscale="log", xlabel="context", ylabel="ms per call (CUDA graph)",
               title=f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="with --heads / --variants / --merge / --eager the default is "
                    "fsq_kernels_<flag>.json beside it")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--contexts", type=int, nargs="+", help="grid contexts (default: 4K-128K)")
    ap.add_argument("--batches", type=int, nargs="+", help="grid batches (default: 1 8 32)")
    ap.add_argument("--configs", nargs="+", metavar="NAME",
                    help="grid configs whose names contain one of these, e.g. 12x "
                    f"(default: all of {', '.join(c[0] for c in CONFIGS)})")
    ap.add_argument("--sweep", action="store_true", help="time the split kernel's knobs first")
    ap.add_argument("--no-grid", action="store_true", help="with --sweep: only the sweep")
    ap.add_argument("--heads", action="store_true", help="only the warp-specialized kernel's "
                    "kv heads per program and buffers (Hopper)")
    ap.add_argument("--choices", nargs="+", metavar="hHzZkK",
                    help="with --heads: the choices to time instead of the built-in list, "
                    "e.g. h2z3k2 h2z3k4 (kv heads per program, code buffers, key buffers)")
    ap.add_argument("--variants", action="store_true", help="only the warp-specialized "
                    "kernel's knobs (_fsq_plan.WS_TUNING) on and off (Hopper)")
    ap.add_argument("--knobs", type=json.loads, nargs="+", metavar="JSON",
                    help="with --variants: the knob settings to time instead of the built-in "
                    "list, each a JSON object of changes, e.g. '{}' '{\"halves\": false}'")
    ap.add_argument("--merge", action="store_true", help="only the merge kernel's knobs "
                    "(_fsq.MERGE_TUNING) on and off, SDPA beside them")
    ap.add_argument("--wide", action="store_true", help="only the tiled (12x) kernel's "
                    "block, tile and warps (_fsq_plan.WIDE_TUNING)")
    ap.add_argument("--eager", action="store_true", help="only the host-side cost of a call "
                    "(validated, trusted path, SDPA) at a few small shapes")
    ap.add_argument("--plot", type=Path, help="print the table of a saved result")
    ap.add_argument("--figure", type=Path, default=Path("docs/kernels_fsq.png"),
                    help="with --plot: where the figure goes")
    args = ap.parse_args(argv)
    if args.plot:
        data = json.loads(args.plot.read_text())
        print_table(data)
        plot(data, args.figure)
        return
    if args.no_grid and not args.sweep:
        ap.error("--no-grid leaves nothing to run without --sweep")
    configs = CONFIGS
    if args.configs is not None:
        configs = [c for c in CONFIGS if any(part in c[0] for part in args.configs)]
        if not configs:
            ap.error(f"--configs: {args.configs!r} names none of "
                     f"{', '.join(c[0] for c in CONFIGS)}")
    choices = None
    if args.choices is not None:
        if not args.heads:
            ap.error("--choices goes with --heads")
        try:
            choices = tuple(parse_choice(c) for c in args.choices)
        except ValueError as exc:
            ap.error(f"--choices: {exc}")
    if args.knobs is not None:
        if not args.variants:
            ap.error("--knobs goes with --variants")
        from kernels._fsq_plan import WS_TUNING, check_ws_regs

        for knobs in args.knobs:
            unknown = sorted(set(knobs) - set(WS_TUNING)) if isinstance(knobs, dict) else knobs
            if unknown or not isinstance(knobs, dict):
                ap.error(f"--knobs: {unknown!r} is not a set of WS_TUNING knobs "
                         f"({', '.join(WS_TUNING)})")
            if knobs.get("regs") is not None:
                try:
                    check_ws_regs(knobs["regs"])
                except ValueError as exc:
                    ap.error(f"--knobs: {exc}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/fsq_kernels.py needs a CUDA GPU (--plot reads a saved result)")
    variants = (functools.partial(variants_sweep, knob_sets=tuple(args.knobs))
                if args.knobs else variants_sweep)
    heads = functools.partial(heads_sweep, choices=choices) if choices else heads_sweep
    for flag, measure in (("heads", heads), ("variants", variants),
                          ("merge", merge_sweep), ("wide", wide_sweep),
                          ("eager", eager_calls)):
        if getattr(args, flag):  # one measurement alone, to its own file by default
            out = args.out
            if out == DEFAULT_OUT:
                out = DEFAULT_OUT.with_name(f"fsq_kernels_{flag}.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({flag: measure(),
                                       "device": torch.cuda.get_device_name()}, indent=1))
            return
    contexts = args.contexts or ([4096, 32768] if args.quick else [4096, 16384, 32768, 131072])
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    data = {"device": torch.cuda.get_device_name()}  # (timings compare within one card only)
    tuning = None
    if args.sweep:
        data["sweep"] = sweep()
        tuning = data["sweep"]["best"]
        # the gpt2 shape takes the setting of the Qwen3 config of the nearest width
        tuning["gpt2 32x"] = tuning.get("qwen3-8b 32x")
    if not args.no_grid:
        data.update(run_grid(contexts, batches, tuning=tuning, configs=configs))
        data["tuning"] = tuning
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    if "rows" in data:
        print_table(data)


if __name__ == "__main__":
    main()
