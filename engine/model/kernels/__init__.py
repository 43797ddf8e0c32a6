"""nanoserve's own CPU kernels, C++ built once on this machine and cached.

- ``gguf_linear``: ``x @ w.T`` with w kept in its GGUF blocks (Q4_0, Q4_1, Q8_0;
  gguf_linear.cpp; up to 8 rows by 16-bit activations and exact integer dots, more in float32,
  or in bf16 by AVX-512 BF16 dot products or AMX tiles where the CPU has them; or, for batch
  invariance, every row count by the 16-bit integer arithmetic: AVX-512 VNNI panels beyond 8 rows).
- ``paged_decode_attention``: one query token per sequence against its K/V read through
  the block table, each query group (the heads sharing a KV head) in one pass over the
  keys and one over the values, a vectorized exp; AVX2 and AVX-512 bodies chosen at run
  time (paged_attention.cpp).
- ``add_rms_norm``: the residual add and RMSNorm in one pass (rms_norm.cpp).
- ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` in one pass (silu_and_mul.cpp).
- ``rope_and_write_kv``: rotary embedding of Q and K in place, and K/V written into their
  cache slots, in one pass (rope_kv.cpp).

All take and return float32 CPU tensors; the KV caches that ``paged_decode_attention``
reads and ``rope_and_write_kv`` writes may also be float16 or bfloat16.

The source is compiled by ``torch.utils.cpp_extension`` (needs a C++ compiler and
ninja) into ``cache_dir("kernels")/<key>/``, key = hash of the source, the flags, the
torch and Python versions; later starts only load the library (milliseconds). The
first build takes about 30 s on 2 cores: ``python -m nanoserve.engine.model.kernels`` (run
by scripts/install.sh and the Dockerfile) does it ahead of serving. Where the CPU
lacks AVX2/FMA/F16C or the build fails, ``load()`` returns False, says why once in
the log, and callers use torch's kernels instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import platform
import sys
import threading
import time
from pathlib import Path

import structlog
import torch

from nanoserve.engine.model.file_cache import cache_dir

log = structlog.get_logger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("gguf_linear.cpp", "paged_attention.cpp", "rms_norm.cpp", "silu_and_mul.cpp", "rope_kv.cpp")
]
# included by SOURCES
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("gguf_linear_tile.h", "paged_attention_body.h", "cpu_features.h", "kv_cache_types.h")
]
# -fopenmp: at::parallel_for runs on torch's own OpenMP pool (torch ships libgomp.so.1, which the loader reuses)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
LIBRARY_NAME = "nanoserve_kernels"
BUILD_GUARD = "build.flock"  # the flock builders of one folder take turns on (_build)
TORCH_BUILD_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # ggml's type ids, the kernel's quant_type argument

_lock = threading.Lock()
_state: dict[str, bool | str] = {}  # "loaded": bool, "reason": why not


def build_key() -> str:
    """A hash of what the built library depends on: sources and headers, flags, torch, Python, machine."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join([*CFLAGS, torch.__version__, sys.version, platform.machine()]).encode())
    return digest.hexdigest()[:16]


def cpu_supported() -> bool:
    """Whether this CPU runs the kernels: torch's capability AVX2 or any AVX-512 (both imply FMA and F16C)."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def library_path() -> Path:
    """Where the built library for this build key lives."""
    return cache_dir("kernels") / build_key() / f"{LIBRARY_NAME}.so"


def _build(target: Path) -> None:
    """Compiles SOURCES into ``target``'s folder (ninja; raises on any failure), or loads what a
    process that built it meanwhile left there.

    Builders of one folder take turns on ``BUILD_GUARD``, an flock the kernel releases when its
    holder dies. torch's own guard is a ``lock`` file that a build killed midway (SIGKILL, Ctrl-C
    during the compile, a container stopped) leaves behind, and every later ``load`` waits on it
    forever; holding the flock proves no builder of ours is alive, so such a file is stale and
    is removed (``kernels.stale_build_lock_removed``).
    """
    from torch.utils.cpp_extension import load

    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / BUILD_GUARD).open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits only for a live builder; released with the file or its process
        if target.exists():  # built by the process we waited for
            torch.ops.load_library(str(target))
            return
        stale = target.parent / TORCH_BUILD_LOCK
        if stale.exists():
            log.warning("kernels.stale_build_lock_removed", path=str(stale))
            stale.unlink(missing_ok=True)
        started = time.perf_counter()
        load(
            name=LIBRARY_NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(target.parent),
            is_python_module=False,
            verbose=False,
        )
    log.info("kernels.built", path=str(target), seconds=round(time.perf_counter() - started, 1))


def load() -> bool:
    """Loads the kernels into torch.ops.nanoserve, building them first if this machine has none cached.

    Returns False (and logs ``kernels.unavailable`` with the reason, once) where the CPU
    cannot run them or the build fails; never raises.
    """
    if "loaded" in _state:  # decided: no lock (called per layer)
        return bool(_state["loaded"])
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        reason = ""
        if not cpu_supported():
            reason = f"CPU capability {torch.backends.cpu.get_cpu_capability()}: the kernels need AVX2"
        else:
            target = library_path()
            try:
                if not target.exists():
                    _build(target)
                else:
                    torch.ops.load_library(str(target))
            except Exception as exc:  # a missing compiler or ninja, a full disk: fall back, never fail
                last_line = str(exc).strip().splitlines()[-1:] or [""]
                reason = f"build failed: {type(exc).__name__}: {last_line[0]}"
        _state["loaded"] = not reason
        _state["reason"] = reason
        if reason:
            log.warning("kernels.unavailable", reason=reason, fallback="torch's int4/int8 kernels")
        return not reason


def unavailable_reason() -> str:
    """Why ``load()`` returned False ('' when it did not, or was not called)."""
    return str(_state.get("reason", ""))


ISA_IDS = {
    "best": 0,
    "avx2": 1,
    "avx512": 2,
    "avx512_bf16": 3,
    "amx_bf16": 4,
    "int16": 5,
    "int16_avx2": 6,
}  # the kernels' isa argument
LAYOUT_IDS = {"rows": 0, "groups": 1}  # the kernel's layout argument
GROUP_ROWS = 4  # rows per record of the grouped layout


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    quant_type: str,
    in_features: int,
    isa: str = "best",
    layout: str = "rows",
) -> torch.Tensor:
    """``x @ w.T``, w in GGUF blocks. x: [T, in_features] float32 or bfloat16 -> [T, N] float32.

    Up to 8 rows of x are rounded to 16-bit integers per block of 32 by a power-of-two
    scale (at least 15 significant bits of each block's largest element) and their
    products with the weights' codes summed exactly (the AVX-512 tiles read each weight
    block once for all the rows; the AVX2 ones take 4 rows a call). More rows: float32 x runs against
    gguf's weight values in float32; bfloat16 x (a bf16 model's activations), on a CPU
    with AVX-512 BF16, runs against the weights rounded to bf16 by bf16 dot products
    summed in float32 (the dense bf16 path's arithmetic, twice the float32 rate), and
    elsewhere is widened to float32 exactly (see gguf_linear.cpp).
    isa: ``best`` (the most the CPU has), ``avx2``, ``avx512`` (the same bits as
    ``avx2``), ``avx512_bf16`` (``avx512`` plus the bf16 body) or ``amx_bf16`` (the bf16
    body's operands multiplied by AMX tiles, Sapphire Rapids on: the same up to 8 rows,
    beyond it equal to ``avx512_bf16`` to float32 rounding, not to the bit), ``int16`` (every
    row count by the decode path's arithmetic: a row's bits depend on that row alone, whatever
    T; AVX-512 VNNI panels for more than 8 rows where the CPU has them, else the decode tiles
    8 (AVX2: 4) rows at a time) or ``int16_avx2`` (``int16`` by the AVX2 decode tiles only, what a CPU
    without AVX-512 runs: the same bits). layout: ``rows`` (blocks
    as in the file, [N, K / 32 * block bytes]) or ``groups`` (Q4_0/Q4_1 from
    ``group_rows``, [N / 4, ...]): the same bits. ``load()`` first.
    Raises RuntimeError (from the op) on shapes, dtypes or layouts it cannot take, or an
    isa this CPU lacks.
    """
    return torch.ops.nanoserve.gguf_linear(
        x, blocks, GGML_TYPE_IDS[quant_type], in_features, ISA_IDS[isa], LAYOUT_IDS[layout]
    )


def group_rows(blocks: torch.Tensor, quant_type: str, in_features: int) -> torch.Tensor:
    """Q4_0/Q4_1 blocks [N, K / 32 * block bytes] uint8 -> the grouped layout [N / 4, K / 32 * (72 or 80)].

    Per four rows and block index, one record: the rows' 16 bytes of nibbles, then their d,
    then (Q4_1) their m, as fp16: the file's bytes rearranged (``load()`` first). Raises
    RuntimeError for another type, N not a multiple of 4, or a shape that does not hold
    ``in_features`` weights per row.
    """
    return torch.ops.nanoserve.gguf_group_rows(blocks, GGML_TYPE_IDS[quant_type], in_features)


def has_bf16_dot() -> bool:
    """Whether ``gguf_linear`` has its bf16 body here (AVX-512 BF16; ``load()`` first)."""
    return bool(torch.ops.nanoserve.gguf_linear_has_bf16_dot())


def has_amx_bf16() -> bool:
    """Whether ``gguf_linear`` has its AMX body here: AMX-BF16 tiles, and Linux gave this process
    their state (``arch_prctl``, Linux 5.16 on). ``load()`` first."""
    return bool(torch.ops.nanoserve.gguf_linear_has_amx_bf16())


def has_int16_panels() -> bool:
    """Whether ``gguf_linear``'s ``int16`` isa runs large steps on its AVX-512 VNNI panels here
    (else on the decode tiles, 8 (AVX2: 4) rows at a time: the same bits, slower; ``load()`` first)."""
    return bool(torch.ops.nanoserve.gguf_linear_has_int16_panels())


def best_isa() -> str:
    """The instruction set ``gguf_linear`` uses on this CPU: ``avx512`` or ``avx2`` (``load()`` first)."""
    return {v: k for k, v in ISA_IDS.items()}[int(torch.ops.nanoserve.gguf_linear_best_isa())]


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    isa: str = "best",
) -> torch.Tensor:
    """Decode attention through block tables (``load()`` first).

    q: [B, H, D] float32, D a multiple of 8; caches: [num_blocks, block_size, Hkv, D]
    float32, float16 or bfloat16 (both alike; a 16-bit element is widened exactly as it is
    loaded: the float32 result on the cache's values), this step's K/V already written;
    block_tables: [B, max_blocks] int32; context_lens: [B] int32 (keys per sequence,
    tokens). Returns [B, H * D] float32, softmax(q k^T scale) v within float32 rounding (its
    own exp: ``attention_exp``).
    isa: ``best`` (AVX-512 where the CPU has it), ``avx2`` or ``avx512``; the bodies sum
    in different orders, so their bits may differ. Raises RuntimeError naming the
    argument on a dtype or shape it cannot take, a context longer than its table, a
    block id outside the cache, or ``avx512`` on a CPU without it.
    """
    return torch.ops.nanoserve.paged_decode_attention(
        q, key_cache, value_cache, block_tables, context_lens, scale, ISA_IDS[isa]
    )


def attention_exp(x: torch.Tensor, isa: str = "best") -> torch.Tensor:
    """exp(x) by ``paged_decode_attention``'s vectorized exp (for tests; ``load()`` first).

    x: float32, any shape, every value <= 0 (-inf included) as softmax's ``s - max s``.
    Within 1e-7 relative of the exact exp; 0 below ln(2^-126) (subnormal results); exp(0)
    = 1 exactly. Raises RuntimeError on another dtype or a positive value.
    """
    return torch.ops.nanoserve.paged_attention_exp(x, ISA_IDS[isa])


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed): residual = hidden + delta (hidden alone when delta is None), normed = RMSNorm(residual).

    hidden, delta: [T, N] float32; weight: [N] float32, N a multiple of 8 (``load()`` first).
    """
    residual, normed = torch.ops.nanoserve.add_rms_norm(hidden, delta, weight, eps)
    return residual, normed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: gate_up [T, 2I] float32 -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I] float32.

    Within 3 ulp of ``F.silu(gate) * up`` (relative error under 1e-6): the same ops and
    roundings but for exp, computed here to about an ulp. ``load()`` first; raises
    RuntimeError on another dtype or an odd width.
    """
    return torch.ops.nanoserve.silu_and_mul(gate_up)


def rope_and_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotates Q and K of ``qkv`` in place and writes K and V into their cache slots (``load()`` first).

    qkv: [T, (num_heads + 2 * num_kv_heads) * D] float32, contiguous, rows (Q | K | V),
    modified in place; cos, sin_signed: [T, 1, D] or [T, D] float32, contiguous, the rows
    ``RotaryEmbedding.lookup`` gives ("rotate half" layout); caches: [num_blocks,
    block_size, num_kv_heads, D] float32, float16 or bfloat16 (both alike; K and V rounded
    by torch's cast), contiguous; slot_mapping: [T] int64, token t's
    slot ``block_id * block_size + offset``. Returns views of qkv: q [T, num_heads, D],
    k and v [T, num_kv_heads, D], k rotated. The values equal ``apply_rope`` then
    ``write_kv``'s bit for bit (the same float32 ops). Raises RuntimeError naming the
    argument on a dtype, shape or layout it cannot take, or a slot outside the cache
    (then nothing is written).
    """
    q, k, v = torch.ops.nanoserve.rope_and_write_kv(
        qkv, cos, sin_signed, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
    )
    return q, k, v
