"""``rlkernel.invariant``: the batch-invariant forward chain, so rollout and training agree bit for bit.

Every op here gives each row (token) a result that is bitwise independent of what else is in the
batch: the batch size, slicing, padding, its position in a packed stream, and KV-cache decode vs
prefill. See DESIGN.md, "Numerical contract", and docs/guides/invariance.md.

    matmul, linear          GEMM with one K-reduction order for every M (no split-K, no autotuning)
    rms_norm                RMSNorm in the HF Qwen3/Llama cast order, deterministic backward
    attention               causal GQA attention: prefill (padded, packed), chunked prefill, decode
    patch_hf_model          route an HF Qwen3/Llama model through these kernels (and unpatch_hf_model)
"""

from rlkernel.invariant.attention import attention
from rlkernel.invariant.matmul import linear, matmul
from rlkernel.invariant.patch import patch_hf_model, unpatch_hf_model
from rlkernel.invariant.rmsnorm import rms_norm

__all__ = ["attention", "linear", "matmul", "patch_hf_model", "rms_norm", "unpatch_hf_model"]
