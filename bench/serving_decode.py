"""Decode speed of the codes-only cache against the dense caches a user would pick (GPU).

One model, a random-initialised Qwen3 with Qwen3-8B's attention shapes (hidden 4096, 32 query /
8 KV heads of 128, ``--layers`` layers, bfloat16: speed depends on shapes, not on values), and
every cache filled to the context synthetically (random K/V through each cache's own update;
the codes-only cache quantizes them with random codebooks, 2+2 stages of 256). At each context
and batch, in the same process, every path decodes ``--steps`` tokens:

- ``dynamic-sdpa``: ``DynamicCache``, transformers' SDPA with torch's default backend choice;
- ``dynamic-flash``: the same with SDPA forced to the flash backend;
- ``static-compiled``: ``StaticCache`` sized to the context, the forward compiled as
  ``generate`` compiles it (inductor, ``mode="reduce-overhead"``: CUDA graphs);
- ``codes-eager``: ``CodesOnlyCache(capacity=...)``, the trusted per-step path, eager (each
  layer's kernel call replayed from a captured CUDA graph, ``kernels.CapturedCall``);
- ``codes-eager-launched``: the same with ``capture_eager_steps = False`` (the kernels launched
  from Python every step);
- ``codes-compiled``: the same cache, the forward compiled like ``static-compiled``;
- with ``--fsq SPEC`` (e.g. ``fsq-w84-L16``, 97.5x at these shapes), the same model converted
  to FSQ codes (``convert_to_fsq``, calibrated on the weights alone) and its ``FSQCache``
  filled with random codes: ``fsq-eager`` (``capacity=...``: each layer's kernel call
  replayed from a captured CUDA graph), ``fsq-eager-launched`` (the same cache with
  ``capture_eager_steps = False``: the validated kernel call launched every step) and
  ``fsq-growing`` (no capacity: the codes grow by concatenation, the validated call every
  step); and at the compiled points ``fsq-compiled`` (the capacity cache, the forward compiled
  like ``static-compiled``: the kernel one operator in the graph), which ``--generate-at``
  also times through ``generate``'s own compilation.

Compiled paths run only at ``--compiled-points`` (compiling is most of their cost here).
Reported per path: tokens/s, wall time per step, host time per step (one step's Python call
after the device went idle), GPU time per step (kernel time summed by the profiler), peak
memory, cache bytes, and the roofline: weights read per step (every parameter but the input
embedding) plus the cache bytes attention reads, over the copy bandwidth measured in the same
run. Also: the eager call of the kernel against SDPA's at batch 1, ``generate`` tokens/s at
``--generate-at``, and the largest context each cache holds in ``--budget-gib`` at
``--budget-batch`` with ``generate``'s tokens/s there (codes-only: filled with random codes).

Sections run in the order kernel, budget, grid, generate (``--skip`` leaves some out); past
``--deadline-s`` what is left is reported as skipped. Writes ``bench/results/serving-decode.json``
(``--out``) after every point, prints tables. ``--device cpu --small`` is a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, markdown_table, write_json  # noqa: E402
from model_adapters.caches.codes_only import CodesOnlyCache, use_codes_attention  # noqa: E402
from model_adapters.caches.window import DEFAULT_REWIND  # noqa: E402
from model_adapters.models import cache_kwarg, kv_shape  # noqa: E402
from model_adapters.quant.quantizer import KVQuantizer  # noqa: E402

EAGER = ("dynamic-sdpa", "dynamic-flash", "codes-eager", "codes-eager-launched")
FSQ_EAGER = ("fsq-eager", "fsq-eager-launched", "fsq-growing")
COMPILED = ("static-compiled", "codes-compiled")
FSQ_COMPILED = ("fsq-compiled",)
SINKS, RECENT = 4, 32


def qwen3_8b_shapes(layers: int, device, dtype, hidden: int = 4096, heads=(32, 8),
                    head_dim: int = 128, vocab: int = 151936):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=hidden, num_attention_heads=heads[0],
                      num_key_value_heads=heads[1], head_dim=head_dim,
                      intermediate_size=3 * hidden, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=1 << 24, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg).to(dtype).eval()


def random_quantizer(model, device, stages=2, k=256) -> KVQuantizer:
    s = kv_shape(model)
    g = torch.Generator().manual_seed(0)
    books = [0.3 * torch.randn(s.num_layers, s.kv_heads, stages, k, s.head_dim, generator=g)
             for _ in range(2)]
    return KVQuantizer(s, *books).to(device)


def random_kv(shape, batch, n, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, shape.kv_heads, n, shape.head_dim, generator=g, device=device,
                        dtype=dtype) for _ in range(2)]


def fill(cache, shape, batch, n, device, dtype, chunk=8192):
    """``n`` random positions per sequence into every layer, through the cache's own update
    (StaticCache: written into its buffers, which every transformers 5.x reads the same way)."""
    from transformers import StaticCache

    if hasattr(cache, "fsq_attention"):  # FSQCache: random codes, positions 0 .. n - 1
        g = torch.Generator(device=device).manual_seed(0)
        width, levels = len(cache.fsq.levels), max(cache.fsq.levels)
        codes = [torch.randint(0, levels, (batch, n, width), generator=g, device=device)
                 for _ in cache.layers]
        cache.load(codes, torch.arange(n, device=device).expand(batch, n))
        return
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        for li in range(shape.num_layers):
            k, v = random_kv(shape, batch, m, device, dtype, seed=a * 131 + li)
            if isinstance(cache, StaticCache):
                layer = cache.layers[li]
                if not layer.is_initialized:
                    try:
                        layer.lazy_initialization(k[:, :, :1], v[:, :, :1])
                    except TypeError:  # releases whose lazy_initialization takes keys only
                        layer.lazy_initialization(k[:, :, :1])
                layer.keys[:, :, a : a + m] = k
                layer.values[:, :, a : a + m] = v
            else:
                cache.update(k, v, li)
                if isinstance(cache, CodesOnlyCache):
                    cache.layers[li].coded_cache()  # what attention would do: mark it read
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(n)
            elif length is not None:
                layer.cumulative_length = n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compiled(fn, device):
    """``fn`` compiled as ``generate`` compiles a forward (inductor, CUDA graphs); on the CPU
    (a smoke run of this script) traced only."""
    torch._dynamo.reset()
    if torch.device(device).type == "cuda":
        return torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=False)
    return torch.compile(fn, backend="eager", dynamic=False)


def flash_only(path: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if path == "dynamic-flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def cache_bytes(cache) -> int:
    if isinstance(cache, CodesOnlyCache):
        return cache.live_bytes()["total"]
    if hasattr(cache, "fsq_attention"):
        return cache.nbytes()
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values)
                        if t is not None)


def read_bytes(path, cache, shape, batch, n, capacity) -> int:
    """Cache bytes attention reads in one decode step (the roofline's cache term)."""
    per_token = shape.num_layers * 2 * shape.kv_heads * shape.head_dim * 2  # bf16 K and V
    if path.startswith("dynamic"):
        return batch * n * per_token
    if path == "static-compiled":
        return batch * capacity * per_token  # SDPA reads the whole buffer (masked)
    if path.startswith("fsq"):  # the packed codes, the positions and the decoders
        decoders = shape.num_layers * 2 * shape.kv_heads * shape.head_dim * len(
            cache.fsq.levels) * 4
        return batch * n * (shape.num_layers * cache.packed_bytes + 8) + decoders
    q = cache.quantizer
    per_code = shape.num_layers * shape.kv_heads * (q.key_stages + q.value_stages)
    books = 2 * (q.key_codebooks.numel() + q.value_codebooks.numel()) * 4  # attend + quantize
    window = batch * (SINKS + RECENT) * per_token
    return batch * max(0, n - SINKS - RECENT) * per_code + books + window


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 10."""
    x = torch.empty(1 << (31 if torch.device(device).type == "cuda" else 26), dtype=torch.uint8,
                    device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        sync()
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() / statistics.median(times[2:])


def weight_bytes(model) -> int:
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.data_ptr() != embed.data_ptr())


def gpu_ms_per_step(step, steps=3) -> float | None:
    """Kernel time of ``steps`` steps summed by the profiler, per step (None if it saw none)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(
            e, "self_cuda_time_total", 0.0)
    return total / steps / 1e3 if total else None


def measure(step, steps, batch, profile_gpu=True) -> dict:
    """Throughput, host time and GPU time of a warmed-up ``step`` (returns nothing it must
    wait for)."""
    cuda = torch.cuda.is_available()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / steps
    host = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    out = {"tok_s": batch / wall, "step_ms": wall * 1e3,
           "host_ms": statistics.median(host) * 1e3,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    out["gpu_ms"] = gpu_ms_per_step(step) if profile_gpu else None
    return out


def make_cache(path, model, q, capacity):
    from transformers import DynamicCache, StaticCache

    if path.startswith("dynamic"):
        return DynamicCache(config=model.config)
    if path == "static-compiled":
        return StaticCache(config=model.config, max_cache_len=capacity)
    if path.startswith("fsq"):
        from model_adapters.caches.fsq_cache import FSQCache

        cache = FSQCache(model, capacity=None if path == "fsq-growing" else capacity)
        cache.capture_eager_steps = path == "fsq-eager"
        return cache
    cache = CodesOnlyCache(model, q, sinks=SINKS, recent=RECENT, capacity=capacity)
    cache.capture_eager_steps = path != "codes-eager-launched"
    return cache


def set_attention(model, path):
    if path.startswith("fsq"):  # (the converted model attends through its cache)
        return
    if path.startswith("codes"):
        use_codes_attention(model)
    else:
        model.set_attn_implementation("sdpa")


def run_path(path, model, q, shape, batch, n, args, device, dtype, bw) -> dict:
    extra = 4 + args.steps + 5 + 3 + 4  # warm-up, timed, host, profiled, slack
    capacity = n + extra
    set_attention(model, path)
    empty_cache()
    cache = make_cache(path, model, q, capacity)
    fill(cache, shape, batch, n, device, dtype)
    kw = cache_kwarg(model)
    forward = model.forward
    if path in COMPILED + FSQ_COMPILED:
        forward = compiled(model.forward, device)
    tok = torch.full((batch, 1), 5, device=device)
    state = {"tok": tok}

    def step():
        logits = forward(input_ids=state["tok"], **{kw: cache}).logits
        state["tok"] = logits[:, -1:].argmax(-1)

    row = {"path": path, "context": n, "batch": batch}
    try:
        with torch.no_grad(), flash_only(path):
            t0 = time.perf_counter()
            for _ in range(4):  # compile, CUDA graph recording, Triton's first launches
                step()
            sync()
            row["warmup_s"] = time.perf_counter() - t0
            row |= measure(step, args.steps, batch)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as exc:  # a failing path is reported, the others still run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if "step_ms" in row:
        held = cache_bytes(cache)
        reads = read_bytes(path, cache, shape, batch, n, capacity)
        roof = (weight_bytes(model) + reads) / bw * 1e3
        row |= {"cache_GiB": held / 2**30, "read_GiB": reads / 2**30, "roofline_ms": roof,
                "of_roofline": roof / row["step_ms"]}
    print(row, flush=True)
    return row


def empty_cache() -> None:
    """Drop compiled graphs (their CUDA graph pools hold the last cache) and cached blocks."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_call_overhead(model, q, shape, device, dtype, contexts) -> list[dict]:
    """Batch 1: host time of one eager call and GPU time (CUDA-graph replay) of the codes
    kernel on the trusted path against SDPA over the dense cache (default and flash)."""
    use_codes_attention(model)
    rows = []
    for n in contexts:
        rows.append(_kernel_point(model, q, shape, device, dtype, n))
        print(rows[-1], flush=True)
        empty_cache()
    return rows


def _kernel_point(model, q, shape, device, dtype, n) -> dict:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import kernels

    cache = CodesOnlyCache(model, q, sinks=SINKS, recent=RECENT, capacity=n + 8)
    fill(cache, shape, 1, n, device, dtype)
    layer = cache.layers[0]
    coded = layer.coded_cache(mark_read=False)
    query = torch.randn(1, model.config.num_attention_heads, shape.head_dim, device=device,
                        dtype=dtype)
    k, v = random_kv(shape, 1, n, device, dtype, seed=7)
    q4 = query[:, :, None]

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa(q4, k, v, enable_gqa=True)

    def codes(x):
        return kernels.static_decode_attention(x, coded, scale=0.088, backend=layer.kernel_backend)

    captured, capture = codes, {}
    if query.is_cuda:  # the one-off cost of a capture: its time and the memory it reserves
        sync()
        reserved, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        captured = kernels.CapturedCall(codes, query)
        sync()
        capture = {"capture_s": time.perf_counter() - t0,
                   "capture_reserved_MiB": (torch.cuda.memory_reserved() - reserved) / 2**20}
    calls = {
        "codes kernel": lambda: codes(query),
        "codes kernel captured": lambda: captured(query),
        "sdpa default": lambda: sdpa(q4, k, v, enable_gqa=True),
        "sdpa flash": flash,
    }
    row = {"context": n, "codes backend": layer.kernel_backend, **capture}
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        host = []
        for _ in range(50):
            sync()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        row[f"{name} host_us"] = statistics.median(host) * 1e6
        try:
            row[f"{name} gpu_us"] = triton.testing.do_bench_cudagraph(fn) * 1e3
        except Exception as exc:  # noqa: BLE001 (reported, not fatal)
            row[f"{name} gpu_us"] = f"{type(exc).__name__}"
    best_sdpa = min(row["sdpa default host_us"], row["sdpa flash host_us"])
    row["host ratio (codes / best sdpa)"] = row["codes kernel host_us"] / best_sdpa
    row["host ratio (captured / best sdpa)"] = row["codes kernel captured host_us"] / best_sdpa
    ref = kernels.static_decode_attention(query, coded, scale=0.088, backend="torch").float()
    out = calls["codes kernel"]().float()
    row["kernel vs masked reference (relative error)"] = ((out - ref).norm() / ref.norm()).item()
    row["captured equals launched"] = bool(torch.equal(calls["codes kernel captured"](),
                                                       calls["codes kernel"]()))
    return row


def generate_speed(path, model, cache, batch, n, device, new=(8, 40)) -> dict:
    """Tokens/s of ``model.generate`` on ``cache``, pre-filled to ``n`` positions per sequence
    (transformers compiles the decode step of a compileable cache by itself on CUDA): the
    difference between two runs of different lengths, so compiling and the first step cancel
    out. Each run continues the last one's output, so every run starts with one new token."""
    set_attention(model, path)
    kw = cache_kwarg(model)
    ids = torch.randint(2, 1000, (batch, n + 1), device=device)
    times = []
    torch._dynamo.reset()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), flash_only(path):
        for count in (new[0], *new):
            sync()
            t0 = time.perf_counter()
            ids = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=count, min_new_tokens=count, do_sample=False,
                                 **{kw: cache})
            sync()
            times.append(time.perf_counter() - t0)
    per_token = (times[2] - times[1]) / (new[1] - new[0])
    row = {"path": path, "context": n, "batch": batch, "generate_tok_s": batch / per_token,
           "generate_ms_per_step": per_token * 1e3, "first_call_s": times[0],
           "compiled": bool(getattr(model, "_compiled_call", None)),
           "generate_peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    print(row, flush=True)
    return row


def budget_points(shape, q, budget_gib: float, batch: int) -> list[dict]:
    """The most positions per sequence each cache holds in ``budget_gib`` at ``batch``:
    bf16 K and V for the dense cache; for the codes-only cache (capacity) its codes (one uint8
    per stage, kv head and layer for 256 centroids), its codebooks, the quantizer's encoder
    tables and its exact sinks and window."""
    budget_bytes = int(budget_gib * 2**30)
    dense_per_token = shape.num_layers * 2 * shape.kv_heads * shape.head_dim * 2
    code_bytes = torch.empty((), dtype=q.code_dtype).element_size()
    code_per_token = shape.num_layers * shape.kv_heads * (q.key_stages + q.value_stages) * \
        code_bytes
    books = tensor_bytes([q.key_codebooks, q.value_codebooks,
                          *(t for li in range(shape.num_layers) for t in q.table_tensors(li))])
    fixed = books + batch * (SINKS + RECENT + DEFAULT_REWIND) * dense_per_token
    dense_n = budget_bytes // (batch * dense_per_token)
    codes_n = max(0, budget_bytes - fixed) // (batch * code_per_token)
    stages = f"K{q.key_stages}V{q.value_stages}"
    return [{"cache": "DynamicCache (bf16), flash", "path": "dynamic-flash", "batch": batch,
             "context": dense_n, "tokens_held": batch * dense_n},
            {"cache": f"codes-only, capacity ({stages}, 256)", "path": "codes-compiled",
             "batch": batch, "context": codes_n, "tokens_held": batch * codes_n,
             "vs_dense": codes_n / dense_n if dense_n else None}]


def budget(model, q, shape, args, device, dtype, bw, late, save) -> list[dict]:
    """The most positions each cache holds in ``--budget-gib`` (batch ``--budget-batch``), and
    ``generate``'s tokens/s there (codes-only: the capacity cache, which ``generate`` compiles
    with CUDA graphs on CUDA; dense: ``DynamicCache`` with SDPA forced to flash, eager, the
    fastest dense path measured at long contexts). Each cache is built at the point's size and
    filled synthetically up to a margin for the generated tokens: the dense cache with random
    K/V through its update, the codes-only cache with random codes written straight into its
    buffers (no quantization: the speed depends on the shapes). ``save`` is called after each
    point; past the deadline a point is reported as skipped."""
    b = args.budget_batch
    new = tuple(args.generate_tokens)
    margin = 2 * sum(new) + 8  # the generated tokens (three runs) and slack
    rows = budget_points(shape, q, args.budget_gib, b)
    for row in rows:
        path, capacity = row["path"], row["context"]
        n = capacity - margin
        if late():
            row["error"] = "skipped (out of time)"
            continue
        set_attention(model, path)
        empty_cache()
        cache = None
        try:
            if n <= 0:
                raise ValueError(f"the budget holds {capacity} positions per sequence, no "
                                 f"more than the {margin} the generated tokens need")
            if path == "codes-compiled":
                cache = CodesOnlyCache(model, q, sinks=SINKS, recent=RECENT, capacity=capacity)
                _synthetic_codes(cache, shape, b, n, device, dtype)
            else:
                cache = make_cache(path, model, q, capacity)
                fill(cache, shape, b, n, device, dtype)
            row["filled_to"] = n
            row["cache_GiB"] = cache_bytes(cache) / 2**30
            row |= {k: v for k, v in generate_speed(path, model, cache, b, n, device,
                                                    new).items() if k not in row}
            reads = read_bytes(path, cache, shape, b, n, capacity)
            row["roofline_ms"] = (weight_bytes(model) + reads) / bw * 1e3
            row["of_roofline"] = row["roofline_ms"] / row["generate_ms_per_step"]
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as exc:  # noqa: BLE001 (reported, not fatal)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        del cache
        print(row, flush=True)
        save()
    empty_cache()
    return rows


def _synthetic_codes(cache, shape, batch, n, device, dtype):
    """Fill a capacity cache to ``n`` positions with random codes and exact K/V written into
    its buffers (what its update would leave, with random contents)."""
    sinks_v = random_kv(shape, batch, SINKS, device, dtype, seed=1)
    window = random_kv(shape, batch, RECENT, device, dtype, seed=2)
    for li, layer in enumerate(cache.layers):
        layer.lazy_initialization(sinks_v[0])
        layer.sink_k.copy_(sinks_v[0])
        layer.sink_v.copy_(sinks_v[1])
        layer.window_k[:, :, :RECENT] = window[0]
        layer.window_v[:, :, :RECENT] = window[1]
        g = torch.Generator(device=device).manual_seed(li)
        for buf in (layer.key_codes, layer.value_codes):
            buf.random_(0, 256, generator=g)
        layer.length.fill_(n)
        layer.host_length = n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--points", nargs="*", default=None,
                        help="context:batch points of the grid (default: every context with "
                             "every batch)")
    parser.add_argument("--compiled-points", nargs="*", default=["32768:1", "131072:1",
                                                                 "131072:8"],
                        help="context:batch points where the compiled paths run")
    parser.add_argument("--generate-at", nargs="*", default=["32768:1"],
                        help="context:batch points where generate's own compilation is timed")
    parser.add_argument("--generate-tokens", type=int, nargs=2, default=[8, 40],
                        metavar=("SHORT", "LONG"),
                        help="generate's tokens/s is the time of a LONG run less a SHORT one")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--fsq", metavar="SPEC",
                        help="also the FSQ-converted model's paths (fsq-eager, "
                             "fsq-eager-launched, fsq-growing; fsq-compiled at the compiled "
                             "points and in generate), e.g. fsq-w84-L16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--budget-batch", type=int, default=8)
    parser.add_argument("--skip", nargs="*", default=[],
                        help="sections to leave out: kernel, budget, grid, generate (they run "
                             "in that order)")
    parser.add_argument("--out", default="serving-decode")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip what is left (reported as skipped) after this many seconds")
    parser.add_argument("--device", default="cuda",
                        help="cuda (the measurement) or cpu (a smoke run with --small)")
    parser.add_argument("--small", action="store_true",
                        help="a small model (hidden 256, 4/2 heads of 64, vocabulary 1000)")
    args = parser.parse_args(argv)
    device, dtype = args.device, torch.bfloat16
    start = time.perf_counter()

    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - start > args.deadline_s

    import transformers

    size = dict(hidden=256, heads=(4, 2), head_dim=64, vocab=1000) if args.small else {}
    model = qwen3_8b_shapes(args.layers, device, dtype, **size)
    shape = kv_shape(model)
    q = random_quantizer(model, device)
    fsq_model = None
    if args.fsq:
        from model_adapters.quant.fsq_convert import convert_to_fsq

        fsq_model = convert_to_fsq(model, args.fsq)
    bw = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"machine": machine(), "gpu": gpu, "args": vars(args),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "copy_bandwidth_GBs": bw / 1e9, "weights_read_GB": weight_bytes(model) / 1e9,
              "fill": "synthetic: random K/V through each cache's update (random codebooks)"}
    print(report, flush=True)

    def save():
        write_json(args.out, report)

    if "kernel" not in args.skip and device == "cuda":
        report["kernel_call"] = kernel_call_overhead(model, q, shape, device, dtype,
                                                     args.contexts)
        save()
    if "budget" not in args.skip:
        report["budget"] = budget(model, q, shape, args, device, dtype, bw, late, save)
        save()
    compiled_points = {point(p) for p in args.compiled_points}
    grid = report.setdefault("rows", [])
    if "grid" not in args.skip:
        points = [point(p) for p in args.points] if args.points is not None else [
            (n, b) for b in args.batches for n in args.contexts]
        # the compiled points (the targets) first: a deadline skips the others
        points.sort(key=lambda p: p not in compiled_points)
        for n, batch in points:
            fsq = fsq_model is not None
            at_compiled = (n, batch) in compiled_points
            for path in (EAGER + (FSQ_EAGER if fsq else ()) + (COMPILED if at_compiled else ())
                         + (FSQ_COMPILED if fsq and at_compiled else ())):
                if late():
                    grid.append({"path": path, "context": n, "batch": batch,
                                 "error": "skipped (out of time)"})
                    continue
                grid.append(run_path(path, fsq_model if path.startswith("fsq") else model, q,
                                     shape, batch, n, args, device, dtype, bw))
                save()
    if "generate" not in args.skip:
        report["generate"] = []
        new = tuple(args.generate_tokens)
        for n, batch in map(point, args.generate_at):
            for path in COMPILED + (FSQ_COMPILED if fsq_model is not None else ()):
                path_model = fsq_model if path.startswith("fsq") else model
                if late():
                    report["generate"].append({"path": path, "context": n, "batch": batch,
                                               "error": "skipped (out of time)"})
                    continue
                try:
                    empty_cache()
                    set_attention(path_model, path)
                    cache = make_cache(path, path_model, q, n + 2 * sum(new) + 8)
                    fill(cache, shape, batch, n, device, dtype)
                    report["generate"].append(generate_speed(path, path_model, cache, batch, n,
                                                             device, new))
                except Exception as exc:  # noqa: BLE001 (reported, not fatal)
                    report["generate"].append({"path": path, "context": n, "batch": batch,
                                               "error": f"{type(exc).__name__}: {exc}"[:300]})
                save()
    report["seconds"] = time.perf_counter() - start
    print_tables(report)
    print(f"wrote {write_json(args.out, report)}")


def point(text: str) -> tuple[int, int]:
    """``"context:batch"`` as two ints; anything else exits naming the text."""
    try:
        n, batch = map(int, text.split(":"))
    except ValueError:
        raise SystemExit(f"a point is context:batch (two integers), got {text!r}") from None
    return n, batch


def print_tables(report: dict) -> None:
    rows = report.get("rows", [])
    best = {}
    for r in rows:
        if not r["path"].startswith(("codes", "fsq")) and "tok_s" in r:
            key = (r["context"], r["batch"])
            best[key] = max(best.get(key, 0.0), r["tok_s"])
    for r in rows:
        if "tok_s" in r and (r["context"], r["batch"]) in best:
            r["vs_best_dense"] = r["tok_s"] / best[(r["context"], r["batch"])]
    if rows:
        print(markdown_table(rows, [
            ("context", "context"), ("batch", "batch"), ("path", "path"), ("tok_s", "tok/s"),
            ("vs_best_dense", "vs best dense"), ("step_ms", "ms/step"),
            ("gpu_ms", "GPU ms/step"), ("host_ms", "host ms/step"),
            ("roofline_ms", "roofline ms"), ("of_roofline", "roofline / measured"),
            ("peak_GiB", "peak GiB"), ("cache_GiB", "cache GiB"), ("error", "error")]))
    if report.get("kernel_call"):
        cols = [("context", "context")] + [(k, k) for k in report["kernel_call"][0]
                                            if k != "context"]
        print(markdown_table(report["kernel_call"], cols))
    for name in ("generate", "budget"):
        if report.get(name):
            keys = list(dict.fromkeys(k for r in report[name] for k in r))
            print(markdown_table(report[name], [(k, k) for k in keys]))


if __name__ == "__main__":
    main()
