"""The LM head of an RL loss as Triton GEMMs whose epilogue reduces the logits tile in registers:
per-token log-softmax statistics (forward) and the logits gradient (backward), with no ``[M, V]``
fp32 logits buffer in between. This module is their launch plumbing: the checked entries (the
public ones, which validate their inputs) and the unchecked ones the chunk engine calls per chunk
(``rlkernel.ops._linear_epilogue``, inputs validated once per call); the configuration is
``kernels/linear_head_config.py``.

Math (T = temperature, y = target id; the same as ``kernels/logprobs.py`` and the oracle
``rlkernel.reference.logprobs``): the raw logits are ``x = h @ W.T`` (``h [M, H]``, ``W [V, H]``,
one fp32 accumulator per element), ``z = x / T`` and per row

    lse = log Σ_j exp(z_j),   logp = z_y − lse,   H = lse − Σ_j p_j z_j,   p_j = exp(z_j − lse)
    ∂L/∂x_k = [ g_logp·(δ_ky − p_k) − g_H·p_k·(z_k − lse + H) ] / T

Rows whose id is ``ignore_index`` give logp = entropy = lse = 0 and a zero gradient row; an id
outside [0, V) gives a NaN logp (as in ``kernels/logprobs.py``).

Algorithm. Both GEMM kernels are the persistent TMA GEMM of ``kernels/matmul.py`` (one program per
SM looping over ``[BLOCK_M, BLOCK_N]`` output tiles in grouped order; ``kernels/_linear_head_tiles.py``)
with a different epilogue on the fp32 accumulator:

    * statistics (``kernels/linear_head_stats.py``): per row and column tile the max, the sum of
      exponentials (and the entropy's sum), folded by a combine kernel in a fixed order into logp,
      lse and entropy; optionally the raw logits or the tile-shifted exponents go out as well
      (:func:`linear_head_stats`, :func:`linear_head_stats_shifted`, :func:`stats_partials`,
      :func:`combine_partials`);
    * gradient (``kernels/linear_head_grad.py``): the GEMM recomputed, ∂L/∂x written from the saved
      lse and entropy (:func:`linear_head_grad_into`); or, from stored shifted exponents, one
      elementwise pass (:func:`linear_head_grad_from_shifted`).

Batch invariance: a row's bits do not depend on M, on the other rows or on its position in the
tile, for one config (``default_config(dtype)``, never a function of M); why: ``_linear_head_tiles``.

Checked and unchecked entries. Each public launcher validates its arguments (ValueError/TypeError
naming the argument) and then calls its ``*_unchecked`` twin, which trusts them: the chunk engine
validates a call's inputs once and launches per chunk through the twins (host time: the checks
are ~25 small Python calls per launch).

Caveats:
    * Needs Triton's TMA API (host ``TensorDescriptor``) and, on a GPU, compute capability ≥ 9.0;
      ``h`` and ``W`` must be contiguous with a 16-byte aligned base and row pitch (H a multiple of
      8 for 16-bit inputs, of 4 for fp32). fp32 inputs run an IEEE FMA product (no TF32), ~10x
      slower than the tensor cores; they exist for accuracy tests and small heads.
    * Invariance holds for one config on one GPU model and compiler version; different configs
      (BLOCK_N, BLOCK_K, the MMA kind) may differ in the last bits. The bits are not those of
      ``matmul.py``'s table path nor of ``kernels/logprobs.py`` on stored logits (both are within
      the fp32 accuracy contract of the same exact value).
    * The gradient GEMM recomputes the logits (2·M·V·H flops) rather than reading stored ones: that
      is the point (no [M, V] buffer), and it costs one more GEMM than a path that kept the logits.
    * No bias, no vocab-parallel shard offset, no device-side gradient scale (``kernels/logprobs.py``
      has ``grad_scale``); no ``torch.library`` registration yet (kernels layer only).
"""

from __future__ import annotations

import torch

from rlkernel import _validate as v
from rlkernel.kernels import matmul_table as mt
from rlkernel.kernels._dot import interpreted
from rlkernel.kernels._launch import FP_FUSION, FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels.linear_head_config import LinearHeadConfig, default_config
from rlkernel.kernels.linear_head_grad import _linear_head_grad_kernel, _shifted_grad_kernel
from rlkernel.kernels.linear_head_stats import _linear_head_combine_kernel, _linear_head_stats_kernel
from rlkernel.kernels.matmul import _aligned

# ------------------------------------------------------------------------------------- launchers
_launch_stats = FastLauncher(_linear_head_stats_kernel)
_launch_grad = FastLauncher(_linear_head_grad_kernel)
_launch_combine = FastLauncher(_linear_head_combine_kernel)
_launch_shifted_grad = FastLauncher(_shifted_grad_kernel)
# The shifted gradient kernel's program: 16 rows × BLOCK_N columns on 8 warps. H100, M = 2048,
# V = 151,936 (a one-off sweep, removed; see git history): 0.438 ms = 2.84 TB/s (copy ceiling
# ~2.9) vs 0.490 ms on 4 warps; 8 rows / 4 warps 0.436, 32 / 8 0.524. An elementwise kernel: no bit
# depends on these.
SHIFTED_GRAD_ROWS = 16
SHIFTED_GRAD_WARPS = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def can_run(w: torch.Tensor) -> bool:
    """Whether these kernels can run with the LM-head weight ``w [V, H]`` (the staged hidden rows
    are contiguous): 16-bit, contiguous and 16-byte aligned for TMA, Triton's TMA API, and on a GPU
    compute capability >= 9.0 (the CPU interpreter runs them too)."""
    if w.dtype not in (torch.float16, torch.bfloat16) or w.dim() != 2 or not w.is_contiguous():
        return False
    if not _aligned(w) or not mt.tma_api_available():
        return False
    return not w.is_cuda or mt.device_capability(w.device)[0] >= 9


def _check_operands(h, w, ids, config) -> LinearHeadConfig:
    """Validate ``h [M, H]``, ``w [V, H]``, ``ids [M]``; return the config to run."""
    h = v.float_tensor("h", h)
    w = v.float_tensor("w", w)
    ids = v.int_tensor("ids", ids)
    for name, t in (("h", h), ("w", w)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {v.describe(t)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got {v.describe(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} ({v.describe(t)})")
    if w.dtype != h.dtype:
        raise TypeError(f"w must have h's dtype {h.dtype}, got {v.describe(w)}")
    v.same_device("w", w, "h", h.device)
    v.same_device("ids", ids, "h", h.device)
    if w.shape[1] != h.shape[1] or w.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"w must be [V >= 1, H] with h's H = {h.shape[1]} >= 1, got {v.describe(w)}")
    v.same_shape("ids", ids, "h's rows", (h.shape[0],))
    for name, t in (("h", h), ("w", w)):
        if not _aligned(t):
            raise ValueError(
                f"{name} must have a 16-byte aligned base and row pitch for TMA (H·itemsize % 16 == 0), "
                f"got {v.describe(t)} at address % 16 = {t.data_ptr() % 16}"
            )
    if not mt.tma_api_available():
        raise ValueError("this Triton has no host TensorDescriptor / tl.range(warp_specialize=): no TMA")
    if h.is_cuda and mt.device_capability(h.device)[0] < 9:
        raise ValueError(f"h must be on a GPU with TMA (compute capability >= 9.0), got {v.describe(h)}")
    if config is None:
        return default_config(h.dtype)
    if not isinstance(config, LinearHeadConfig):
        raise TypeError(f"config must be a LinearHeadConfig or None, got {type(config).__name__}")
    return config


def _check_output(name: str, t: object, h: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = v.float_tensor(name, t)
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be fp32, fp16 or bf16, got {v.describe(t)}")
    v.same_shape(name, t, "[h rows, w rows]", (h.shape[0], n_cols))
    v.same_device(name, t, "h", h.device)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return t


def _row_vector(name: str, t: object, rows: int, device: torch.device) -> torch.Tensor:
    """An fp32 ``[rows]`` tensor on ``device`` (made contiguous)."""
    t = v.float_tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be fp32, got {v.describe(t)}")
    v.same_shape(name, t, "one value per row", (rows,))
    v.same_device(name, t, "the operands", device)
    return t.contiguous()


def _scalars(temperature: object, ignore_index: object) -> tuple[float, int]:
    t = v.fp32_float("temperature", v.positive_float("temperature", temperature), positive=True)
    return t, v.integer("ignore_index", ignore_index)


def _descriptors(h, w, out, cfg: LinearHeadConfig):
    """TMA descriptors of the operands; for ``out``: ``(descriptor, True, split)`` if TMA stores it,
    else ``(out, False, 1)`` (a pointer store; ``out`` may be None)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    h_desc = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    if out is None:
        return h_desc, w_desc, None, False, 1
    split = cfg.store_split(out.element_size())
    box_n = cfg.block_n // split
    # A TMA box row must be >= 16 bytes; the tensor's row pitch 16-byte aligned.
    if cfg.tma_store and _aligned(out) and box_n * out.element_size() >= 16:
        return h_desc, w_desc, TensorDescriptor.from_tensor(out, [cfg.block_m, box_n]), True, split
    return h_desc, w_desc, out, False, 1


def _launch_gemm(launch, programs: int, args: tuple, own: dict[str, object], h, cfg) -> None:
    """Launch a GEMM kernel (statistics or gradient) on ``programs`` persistent programs.

    Both kernels' constexprs are the block sizes, then their ``own`` flags, then the shared tail, in
    that signature order (:class:`FastLauncher` passes them positionally and checks the order)."""
    constexprs = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        **own,
        "INPUT_PRECISION": "ieee" if h.dtype == torch.float32 else "tf32",  # 16-bit: unused
        "FLATTEN": cfg.flatten,
        "WARP_SPECIALIZE": cfg.warp_specialize,
        "INTERPRETED": interpreted(h),
    }
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": FP_FUSION}
    with _device_guard(h):
        launch((programs,), args, constexprs, options)


def _programs(h: torch.Tensor, m: int, n: int, cfg: LinearHeadConfig) -> int:
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    return min(num_sms(h.device, interpreter=4), tiles)



# ------------------------------------------------------------------------------ checked entries
def stats_partials(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    store_z: torch.Tensor | None = None,
    shifted: bool = False,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The STATS GEMM alone (arguments as in :func:`linear_head_stats`): ``(parts, z_y)``.
    ``shifted``: ``store_z`` receives the tile-shifted exponents (:func:`linear_head_stats_shifted`).

    ``parts``: fp32 ``[2 or 3, n_t, M]``, n_t = ceil(V / block_n): per column tile and row the max
    of z, Σ exp(z − max) and (with the entropy) Σ (z − max)·exp(z − max). ``z_y``: fp32 ``[M]``,
    the target's z (undefined where the id is outside [0, V)). :func:`combine_partials` reduces them.
    """
    cfg = _check_operands(h, w, ids, config)
    temperature, _ = _scalars(temperature, 0)
    with_entropy = v.boolean("with_entropy", with_entropy)
    if store_z is not None:
        store_z = _check_output("store_z", store_z, h, w.shape[0])
    ids = ids.contiguous()
    return stats_partials_unchecked(h, w, ids, temperature, with_entropy, store_z, bool(shifted), cfg)


def combine_partials(
    parts: torch.Tensor,
    z_y: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_size: int,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reduce :func:`stats_partials`' output over the column tiles (fixed order, per row):
    ``(logp, lse, entropy)`` fp32 ``[M]``, ``entropy`` None when ``parts`` has no third plane."""
    parts = v.float_tensor("parts", parts)
    if parts.dtype != torch.float32 or parts.dim() != 3 or parts.shape[0] not in (2, 3):
        raise ValueError(f"parts must be fp32 [2 or 3, n_tiles, M] (stats_partials), got {v.describe(parts)}")
    if not parts.is_contiguous():
        raise ValueError(f"parts must be contiguous, got strides {parts.stride()}")
    m = parts.shape[2]
    z_y = _row_vector("z_y", z_y, m, parts.device)
    ids = v.int_tensor("ids", ids)
    v.same_shape("ids", ids, "parts' rows", (m,))
    for name, t in (("z_y", z_y), ("ids", ids)):
        v.same_device(name, t, "parts", parts.device)
    vocab_size = v.positive_int("vocab_size", vocab_size)
    ignore_index = v.integer("ignore_index", ignore_index)
    return combine_partials_unchecked(parts, z_y, ids.contiguous(), vocab_size, ignore_index, config)


def linear_head_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    store_z: torch.Tensor | None = None,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob, log-sum-exp and (optionally) entropy of ``softmax((h @ w.T) / T)``,
    without an ``[M, V]`` logits buffer: :func:`stats_partials` then :func:`combine_partials`.

    Args:
        h: ``[M, H]`` bf16/fp16/fp32, contiguous, 16-byte aligned rows (hidden states).
        w: ``[V, H]`` of h's dtype, contiguous (the LM head weight).
        ids: ``[M]`` integer target ids; ``ignore_index`` rows give zeros.
        temperature: T > 0 (runtime scalar: no recompilation per value).
        with_entropy: also compute the entropy (one more partial buffer, one FMA per logit).
        store_z: ``None``, or a contiguous ``[M, V]`` fp32/fp16/bf16 tensor that receives the raw
            logits ``h @ w.T`` (not divided by T), rounded once from the fp32 accumulator.
        config: launch configuration; None: ``default_config(h.dtype)``. A row's bits depend on it.

    Returns:
        ``(logp, lse, entropy)``: fp32 ``[M]`` each (``lse`` of z = x / T, saved for
        :func:`linear_head_grad_into`); ``entropy`` is None unless ``with_entropy``.
    """
    temperature, ignore_index = _scalars(temperature, ignore_index)
    cfg = _check_operands(h, w, ids, config)
    with_entropy = v.boolean("with_entropy", with_entropy)
    if store_z is not None:
        store_z = _check_output("store_z", store_z, h, w.shape[0])
    return linear_head_stats_unchecked(
        h, w, ids.contiguous(), temperature, ignore_index, with_entropy, cfg, store_z=store_z
    )


def linear_head_stats_shifted(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`linear_head_stats` that also keeps what the logits gradient needs, in half the bytes of
    fp32 logits: ``out [M, V]`` (16-bit, contiguous) receives ``d = (z − m_t)·log2 e`` per element,
    z = x / T shifted by the max ``m_t`` of its row within its ``block_n``-column tile (floored at
    −200: exp2 of less is 0 in fp32). The entries that carry probability mass have d near 0, where a
    16-bit value is accurate to ~2⁻⁹·|d| (unshifted bf16 logits lose ~2⁻⁹·|z|, with |z| ≈ 10–30).

    Returns:
        ``(logp, lse, entropy, tile_max)``: as :func:`linear_head_stats`, plus fp32
        ``tile_max [n_tiles, M]`` (the m_t) for :func:`linear_head_grad_from_shifted`.
    """
    temperature, ignore_index = _scalars(temperature, ignore_index)
    out = _check_output("out", out, h, w.shape[0])
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out must be bf16 or fp16 (the shifted exponents), got {v.describe(out)}")
    cfg = _check_operands(h, w, ids, config)
    with_entropy = v.boolean("with_entropy", with_entropy)
    return linear_head_stats_shifted_unchecked(
        h, w, ids.contiguous(), out, temperature, ignore_index, with_entropy, cfg
    )


def linear_head_grad_from_shifted(
    d: torch.Tensor,
    tile_max: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    grad_out: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> torch.Tensor:
    """∂L/∂x ``[M, V]`` (L = Σ g_logp·logp + g_ent·entropy, x = h @ w.T) from the shifted exponents
    ``d`` and ``tile_max`` of :func:`linear_head_stats_shifted` (same temperature and config),
    written into ``grad_out`` (default: ``d`` itself, in place), rounded once from fp32; one
    elementwise pass (reads 2 bytes and writes 2 per logit). Ignored rows get 0.

    Args:
        d: ``[M, V]`` bf16/fp16, contiguous rows; tile_max: fp32 ``[ceil(V / block_n), M]``.
        ids, lse, entropy, g_logp, g_ent: as in :func:`linear_head_grad_into`.
        grad_out: ``[M, V]`` 16-bit or fp32, or None (``d``).
    """
    cfg = config or LinearHeadConfig()
    temperature, ignore_index = _scalars(temperature, ignore_index)
    d = v.float_tensor("d", d)
    if d.dtype not in (torch.bfloat16, torch.float16) or d.dim() != 2 or d.stride(1) != 1:
        raise ValueError(f"d must be a bf16/fp16 [M, V] tensor with contiguous rows, got {v.describe(d)}")
    m, n = d.shape
    out = d if grad_out is None else _check_output("grad_out", grad_out, d, n)
    tile_max = v.float_tensor("tile_max", tile_max)
    v.same_shape("tile_max", tile_max, "[n_tiles, M]", (_cdiv(n, cfg.block_n), m))
    if tile_max.dtype != torch.float32 or not tile_max.is_contiguous():
        raise ValueError(f"tile_max must be contiguous fp32, got {v.describe(tile_max)}")
    ids = v.int_tensor("ids", ids)
    v.same_shape("ids", ids, "d's rows", (m,))
    lse = _row_vector("lse", lse, m, d.device)
    g_logp, g_ent, entropy = _row_grads(g_logp, g_ent, entropy, m, d.device)
    for name, t in (("tile_max", tile_max), ("ids", ids), ("out", out)):
        v.same_device(name, t, "d", d.device)
    return linear_head_grad_from_shifted_unchecked(
        d, tile_max, ids.contiguous(), lse, entropy, g_logp, g_ent, out, temperature, ignore_index, cfg
    )


def linear_head_grad_into(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    grad_out: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> None:
    """Fill ``grad_out [M, V]`` with ∂L/∂x, x = h @ w.T, for L = Σ g_logp·logp + g_ent·entropy,
    recomputing the logits tile by tile (the formula is in the module docstring).

    Args:
        h, w, ids: as in :func:`linear_head_stats` (the same values).
        lse: fp32 ``[M]`` from :func:`linear_head_stats` (same temperature).
        entropy: fp32 ``[M]`` from :func:`linear_head_stats`; needed when ``g_ent`` is given.
        g_logp, g_ent: fp32 ``[M]`` upstream gradients, or None (zero).
        grad_out: contiguous ``[M, V]`` bf16/fp16/fp32; rounded once from fp32. Ignored rows get 0.
        config: as in :func:`linear_head_stats` (pass the same one).
    """
    cfg = _check_operands(h, w, ids, config)
    temperature, ignore_index = _scalars(temperature, ignore_index)
    m = h.shape[0]
    grad_out = _check_output("grad_out", grad_out, h, w.shape[0])
    lse = _row_vector("lse", lse, m, h.device)
    g_logp, g_ent, entropy = _row_grads(g_logp, g_ent, entropy, m, h.device)
    linear_head_grad_into_unchecked(
        h, w, ids.contiguous(), lse, entropy, g_logp, g_ent, grad_out, temperature, ignore_index, cfg
    )


def _row_grads(g_logp, g_ent, entropy, rows: int, device: torch.device):
    """The checked ``(g_logp, g_ent, entropy)`` of a gradient launch (None stays None; the entropy
    is read only with ``g_ent``, so it is checked, and kept, only then)."""
    if g_ent is not None and entropy is None:
        raise ValueError("entropy must be given with g_ent (the gradient of the entropy needs it)")
    g_logp = _row_vector("g_logp", g_logp, rows, device) if g_logp is not None else None
    g_ent = _row_vector("g_ent", g_ent, rows, device) if g_ent is not None else None
    entropy = _row_vector("entropy", entropy, rows, device) if g_ent is not None else None
    return g_logp, g_ent, entropy


# ---------------------------------------------------------------------------- unchecked entries
# The chunk engine's launches: the arguments are those the checked entries pass on (contiguous
# operands of one dtype, contiguous int ids, fp32 contiguous [M] vectors, contiguous outputs of the
# right shape, Python float temperature > 0 and int ignore_index, a LinearHeadConfig).
def stats_partials_unchecked(
    h, w, ids, temperature: float, with_entropy: bool, store_z, shifted: bool, cfg: LinearHeadConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stats_partials` without its checks."""
    m, k = h.shape
    n = w.shape[0]
    n_tiles = _cdiv(n, cfg.block_n)
    parts = torch.empty((3 if with_entropy else 2, n_tiles, m), dtype=torch.float32, device=h.device)
    z_y = torch.empty(m, dtype=torch.float32, device=h.device)
    if m == 0:
        return parts, z_y
    h_desc, w_desc, z_arg, z_tma, split = _descriptors(h, w, store_z, cfg)
    programs = _programs(h, m, n, cfg)
    p = parts.unbind(0)  # (one op for the 2-3 views: host time)
    _launch_gemm(
        _launch_stats, programs,
        (p[0], p[1], p[-1], z_y, z_arg if store_z is not None else z_y, n,
         h_desc, w_desc, ids, m, n, k, programs, temperature),
        {"WITH_ENTROPY": with_entropy, "STORE_Z": store_z is not None, "Z_SHIFTED": shifted,
         "Z_TMA": z_tma, "STORE_SPLIT": split},
        h, cfg,
    )  # fmt: skip
    return parts, z_y


def combine_partials_unchecked(
    parts, z_y, ids, vocab_size: int, ignore_index: int, config: LinearHeadConfig | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`combine_partials` without its checks."""
    m = parts.shape[2]
    with_entropy = parts.shape[0] == 3
    logp = torch.empty(m, dtype=torch.float32, device=parts.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    if m == 0:
        return logp, lse, entropy
    cfg = config or LinearHeadConfig()
    rows, tiles = cfg.combine_rows, cfg.combine_tiles
    p = parts.unbind(0)  # (one op for the 2-3 views: host time)
    with _device_guard(parts):
        _launch_combine(
            (_cdiv(m, rows),),
            (logp, lse, entropy if with_entropy else logp, p[0], p[1], p[-1],
             z_y, ids, m, vocab_size, parts.shape[1], ignore_index),
            {"BLOCK_R": rows, "BLOCK_T": tiles, "WITH_ENTROPY": with_entropy},
            {"num_warps": max(1, min(4, rows * tiles // 256)), "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return logp, lse, entropy


def linear_head_stats_unchecked(
    h, w, ids, temperature: float, ignore_index: int, with_entropy: bool, cfg: LinearHeadConfig,
    store_z=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`linear_head_stats` without its checks."""
    parts, z_y = stats_partials_unchecked(h, w, ids, temperature, with_entropy, store_z, False, cfg)
    return combine_partials_unchecked(parts, z_y, ids, w.shape[0], ignore_index, cfg)


def linear_head_stats_shifted_unchecked(
    h, w, ids, out, temperature: float, ignore_index: int, with_entropy: bool, cfg: LinearHeadConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`linear_head_stats_shifted` without its checks."""
    parts, z_y = stats_partials_unchecked(h, w, ids, temperature, with_entropy, out, True, cfg)
    logp, lse, entropy = combine_partials_unchecked(parts, z_y, ids, w.shape[0], ignore_index, cfg)
    return logp, lse, entropy, parts[0]


def linear_head_grad_from_shifted_unchecked(
    d, tile_max, ids, lse, entropy, g_logp, g_ent, out, temperature: float, ignore_index: int,
    cfg: LinearHeadConfig,
) -> torch.Tensor:
    """:func:`linear_head_grad_from_shifted` without its checks (``out``: ``d`` or another output)."""
    m, n = d.shape
    if m == 0:
        return out
    if g_logp is None and g_ent is None:
        return out.zero_()
    with _device_guard(d):
        _launch_shifted_grad(
            (_cdiv(m, SHIFTED_GRAD_ROWS), _cdiv(n, cfg.block_n)),
            (d, out, d.stride(0), out.stride(0), tile_max, ids, lse,
             entropy if entropy is not None else lse, g_logp if g_logp is not None else lse,
             g_ent if g_ent is not None else lse, m, n, temperature, ignore_index),
            {"BLOCK_R": SHIFTED_GRAD_ROWS, "BLOCK_N": cfg.block_n, "HAS_GRAD_LOGP": g_logp is not None,
             "HAS_GRAD_ENTROPY": g_ent is not None},
            {"num_warps": SHIFTED_GRAD_WARPS, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return out


def linear_head_grad_into_unchecked(
    h, w, ids, lse, entropy, g_logp, g_ent, grad_out, temperature: float, ignore_index: int,
    cfg: LinearHeadConfig,
) -> None:
    """:func:`linear_head_grad_into` without its checks."""
    m, k = h.shape
    n = w.shape[0]
    if m == 0:
        return
    if g_logp is None and g_ent is None:
        grad_out.zero_()
        return
    h_desc, w_desc, g_arg, g_tma, split = _descriptors(h, w, grad_out, cfg)
    programs = _programs(h, m, n, cfg)
    _launch_gemm(
        _launch_grad, programs,
        (g_arg, n, h_desc, w_desc, ids, lse,
         entropy if entropy is not None else lse, g_logp if g_logp is not None else lse,
         g_ent if g_ent is not None else lse, m, n, k, programs, temperature, ignore_index),
        {"HAS_GRAD_LOGP": g_logp is not None, "HAS_GRAD_ENTROPY": g_ent is not None, "G_TMA": g_tma,
         "STORE_SPLIT": split},
        h, cfg,
    )  # fmt: skip
