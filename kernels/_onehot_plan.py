"""Block sizes and split count of the one-hot kernel (pure Python: no triton import)."""

from __future__ import annotations

import functools
import math

from kernels._plan import MAX_GRID_Y, MAX_SPLITS, floor_pow2, multiprocessors, pow2, split_layout
from kernels.coded_cache import DecodeProblem

MIN_CODEBOOK = 256  # codebooks are padded to at least 16 x 16 (tl.dot needs 16 rows and columns)
MAX_ACC = 4096  # float32 histogram entries per program (registers)
MAX_OPERAND = 8192  # entries of either one-hot operand per block (16 KB of shared memory)
MAX_SCRATCH_BYTES = 256 << 20  # score tables and the split programs' value histograms
# key stages from which the centroid-major score table pays (measured, docs/kernels.md)
CENTROID_MAJOR_STAGES = 4


class Plan:
    """Block sizes of the one-hot kernel for one problem shape (``supported``: whether the
    value histogram fits a program).

    A code splits as ``c = hi * LO + lo``; per position and value stage the kernel reads two
    identity rows (``HI`` and ``LO`` entries) and multiplies ``heads * HI`` of them by the
    weights, so ``LO`` near ``sqrt(heads * codebook)`` balances the two operands.
    The score table is centroid-major (``centroid_major``: a position's heads in one load)
    when a program has several heads and ``CENTROID_MAJOR_STAGES`` key stages or more;
    otherwise it is head-major.
    ``hi_bits``, ``block_n`` and ``centroid_major`` override the defaults (tuning).
    """

    def __init__(self, group: int, value_stages: int, value_codebook: int, key_stages: int,
                 key_codebook: int, hi_bits: int | None = None, block_n: int | None = None,
                 centroid_major: bool | None = None):
        self.value_stages_p = pow2(value_stages)
        self.codebook_p = pow2(value_codebook, MIN_CODEBOOK)
        self.key_codebook_p = pow2(key_codebook)
        block_g = min(pow2(group), max(1, MAX_ACC // (self.value_stages_p * self.codebook_p)))
        self.block_g = block_g
        bits = self.codebook_p.bit_length() - 1
        if hi_bits is None:
            hi_bits = bits - round(math.log2(block_g * self.codebook_p) / 2)
        # LO >= 16 rows and BLOCK_G * HI >= 16 columns (tl.dot)
        min_hi_bits = max(0, 4 - (block_g.bit_length() - 1))
        self.lo_bits = max(4, min(bits - min_hi_bits, bits - hi_bits))
        self.lo = 1 << self.lo_bits
        self.hi = self.codebook_p >> self.lo_bits
        self.eye = max(self.hi, self.lo)  # the identity both one-hot factors are read from
        if block_n is None:
            per_position = self.value_stages_p * max(block_g * self.hi, self.lo)
            block_n = max(16, min(128, floor_pow2(MAX_OPERAND // per_position)))
        self.block_n = block_n
        self.supported = self.value_stages_p * block_g * self.codebook_p <= MAX_ACC
        if centroid_major is None:
            # with one head per program both layouts address the same memory, and the
            # head-major expression compiled faster (H200, GPT-2 shapes, 4 key stages)
            centroid_major = key_stages >= CENTROID_MAJOR_STAGES and block_g > 1
        self.centroid_major = bool(centroid_major)

    def table_floats(self, key_stages: int) -> int:
        """Floats of one (batch, kv head, chunk)'s score table."""
        return key_stages * self.block_g * self.key_codebook_p

    @property
    def hist_floats(self) -> int:
        """Floats of one split program's value histogram."""
        return self.value_stages_p * self.block_g * self.codebook_p


def plan_for(problem: DecodeProblem, **tuning) -> Plan:
    """The plan of a problem's shape (shared: a decode step asks for it several times)."""
    return _plan(problem.q_heads // problem.kv_heads, problem.cache.value_codebooks.shape[1],
                 problem.cache.value_codebooks.shape[2], problem.cache.key_codebooks.shape[1],
                 problem.cache.key_codebooks.shape[2], **tuning)


_plan = functools.lru_cache(maxsize=256)(Plan)


def supports(problem: DecodeProblem, num_splits: int | None = None,
             num_warps: int = 4) -> bool:
    """Whether the one-hot kernel handles this problem (a histogram fits a program, the score
    tables and the split programs' histograms fit ``MAX_SCRATCH_BYTES``, and the (batch, kv
    head, chunk) programs fit a grid axis)."""
    plan = plan_for(problem)
    if not plan.supported:
        return False
    splits = num_splits or choose_num_splits(problem, num_warps)
    # the count decode runs: split lengths are whole blocks, no split left empty
    splits = split_layout(problem.cache.key_codes.shape[2], splits, plan.block_n)[1]
    bhg = problem.batch * problem.kv_heads * group_chunks(problem, plan)
    floats = bhg * (plan.table_floats(problem.cache.key_codebooks.shape[1])
                    + splits * plan.hist_floats)
    return floats * 4 <= MAX_SCRATCH_BYTES and bhg <= MAX_GRID_Y


def group_chunks(problem: DecodeProblem, plan: Plan) -> int:
    return math.ceil(problem.q_heads // problem.kv_heads / plan.block_g)


MAX_REGISTERS = 168  # per thread: three 4-warp programs fit a multiprocessor's 64K registers
MIN_SPLIT_LEN = 256  # positions per split, at least
PROGRAM_COST = 256  # a split program's fixed work (reference, histogram store, merge) in positions
# How much longer a multiprocessor takes per position when it runs only one or two programs
# (too few loads in flight); fitted to the H200 measurements in docs/kernels.md
LOAD_SLOWDOWN = {1: 1.8, 2: 1.1}
PREFETCH_STEPS = 2  # blocks ahead whose codes are requested into L2


def position_parts(num_warps: int, value_stages_p: int, block_n: int) -> int:
    """Runs each block's positions are cut into so that the batched histogram product has one
    entry per warp (``num_warps // value_stages_p``, a power of two), while each run keeps the
    16 positions a tensor-core product needs; at least 1.

    Triton gives each warp of a batched ``tl.dot`` its own batch entry: with fewer entries
    than warps, two warps compute the same products (docs/kernels.md has the measurement)."""
    parts = max(1, num_warps // value_stages_p)
    while parts > 1 and block_n // parts < 16:
        parts //= 2
    return floor_pow2(parts)


def resident_programs(num_warps: int = 4) -> int:
    """Programs of ``num_warps`` warps a multiprocessor holds at once (64K registers, each
    thread capped at ``MAX_REGISTERS``; at least 1)."""
    return max(1, 65536 // (MAX_REGISTERS * 32 * num_warps))


def _rounds_cost(load: int, resident: int) -> float:
    """Time of ``load`` programs on one multiprocessor, in program lengths: rounds of
    ``resident`` programs, then the rest, each round slowed down if it holds few programs
    (``LOAD_SLOWDOWN``)."""
    full, rest = divmod(load, resident)
    return (full * resident * LOAD_SLOWDOWN.get(resident, 1.0)
            + rest * LOAD_SLOWDOWN.get(rest, 1.0))


@functools.lru_cache(maxsize=1024)
def _best_splits(programs_per_split: int, capacity: int, multiprocessors: int, resident: int,
                 block_n: int) -> int:
    """The split count that :func:`split_layout` keeps (so the kernel runs exactly it) with the
    least modelled time ``_rounds_cost(load) x (positions per split + PROGRAM_COST)``, where
    ``load`` is the most programs a multiprocessor runs."""
    most = max(1, min(math.ceil(capacity / MIN_SPLIT_LEN), MAX_SPLITS))
    best = None
    for wanted in range(1, most + 1):
        split_len, splits = split_layout(capacity, wanted, block_n)
        # the exact-token programs are short and are not counted
        load = math.ceil(programs_per_split * splits / multiprocessors)
        cost = _rounds_cost(load, resident) * (split_len + PROGRAM_COST)
        if best is None or cost < best[0]:
            best = (cost, splits)
    return best[1]


def choose_num_splits(problem: DecodeProblem, num_warps: int = 4) -> int:
    """The split count with the least modelled time (:func:`_best_splits`). The kernel is bound
    by each multiprocessor's load units, so a multiprocessor's time is the positions of all the
    programs it runs (plus their fixed work), whether they are resident together or come in
    waves, and the busiest one sets the time; one or two programs running alone leave the
    units idle part of the time (``LOAD_SLOWDOWN``). At most ``capacity / MIN_SPLIT_LEN``
    splits (rounded up); the H200 sweep in ``docs/kernels.md`` checks the choice."""
    capacity = problem.cache.key_codes.shape[2]
    if capacity == 0:
        return 1
    plan = plan_for(problem)
    programs = problem.batch * problem.kv_heads * group_chunks(problem, plan)
    return _best_splits(programs, capacity, multiprocessors(problem.query.device),
                        resident_programs(num_warps), plan.block_n)


def default_block_c(problem: DecodeProblem, plan: Plan) -> int:
    """Centroids per program of the score table and the value merge: 32 when 64 would leave
    multiprocessors idle (batch 1; measured in docs/kernels.md)."""
    _, stages, size, _ = problem.cache.value_codebooks.shape
    pieces = (problem.batch * problem.kv_heads * group_chunks(problem, plan)
              * stages * math.ceil(size / 64))
    return 32 if pieces < multiprocessors(problem.query.device) else 64
