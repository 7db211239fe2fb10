"""``rk.use_options`` / ``rk.Options``: scoping and bad input (unknown names, values outside the
allowed sets) raise ``ValueError`` naming the option."""

from __future__ import annotations

import asyncio
import threading

import pytest

import rlkernel as rk

COVERED = [rk.use_options, rk.Options, rk.MatmulThresholds, rk.current_options]


def test_defaults_are_the_documented_ones():
    opts = rk.current_options()
    assert opts == rk.Options()
    assert opts.matmul_table == "tuned" and opts.grad_in_forward_max_vocab == 65536
    assert opts.linear_chunk_bytes == 1280 << 20 and opts.linear_logits_dtype == "fp32"


def test_scoped_nested_and_restored_on_error():
    with rk.use_options(matmul_table="single") as outer:
        assert rk.current_options() is outer and outer.matmul_table == "single"
        with rk.use_options(linear_chunk_bytes=4096) as inner:
            assert inner.matmul_table == "single" and inner.linear_chunk_bytes == 4096
        assert rk.current_options().linear_chunk_bytes == 1280 << 20
        with pytest.raises(RuntimeError), rk.use_options(token_level_fusion=False):
            raise RuntimeError("boom")
        assert rk.current_options().token_level_fusion is True
    assert rk.current_options() == rk.Options()


def test_per_thread_and_per_task():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, table):
        with rk.use_options(matmul_table=table):
            barrier.wait()
            seen[name] = rk.current_options().matmul_table

    threads = [threading.Thread(target=worker, args=(n, t)) for n, t in (("a", "single"), ("b", "tuned"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "single", "b": "tuned"}

    async def task(v):
        with rk.use_options(grad_in_forward_max_vocab=v):
            await asyncio.sleep(0)
            return rk.current_options().grad_in_forward_max_vocab

    async def both():
        return await asyncio.gather(task(0), task(7))

    assert asyncio.run(both()) == [0, 7]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"matmul_tabel": "single"}, "unknown option.*matmul_tabel"),
        ({"matmul_table": "fast"}, "matmul_table must be one of"),
        ({"invariant_backward": "cublas"}, "invariant_backward must be one of"),
        ({"linear_logits_dtype": "bf16"}, "linear_logits_dtype must be one of"),
        ({"linear_dweight_accum": "fp16"}, "linear_dweight_accum"),
        ({"tp_gemm": "tf32"}, "tp_gemm must be one of"),
        ({"tp_elementwise": "triton"}, "tp_elementwise must be one of"),
        ({"token_level_fusion": 1}, "token_level_fusion must be a bool"),
        ({"fast_launch": "yes"}, "fast_launch must be a bool"),
        ({"grad_in_forward_max_vocab": -1}, "grad_in_forward_max_vocab must be an int >= 0"),
        ({"grad_in_forward_max_vocab": 1.5}, "grad_in_forward_max_vocab must be an int"),
        ({"linear_chunk_bytes": 0}, "linear_chunk_bytes must be an int >= 1"),
        ({"linear_grad_bytes": True}, "linear_grad_bytes must be an int"),
        ({"matmul_thresholds": (1, 2, 3, 4)}, "matmul_thresholds must be a MatmulThresholds"),
        ({"matmul_thresholds": rk.MatmulThresholds(min_tiles=0)}, "matmul_thresholds.min_tiles"),
    ],
)
def test_bad_options_raise_naming_the_option(changes, match):
    with pytest.raises(ValueError, match=match), rk.use_options(**changes):
        pass
    assert rk.current_options() == rk.Options()


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        rk.current_options().matmul_table = "single"  # type: ignore[misc]
    with pytest.raises(ValueError, match="vocab_n"):
        rk.Options(matmul_thresholds=rk.MatmulThresholds(vocab_n=-5))


def test_options_under_torch_compile_are_guarded():
    """Compiled code reads the options in force at each call (recompiles when they change)."""
    import torch

    def f(x):
        return x * rk.current_options().grad_in_forward_max_vocab

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.ones(2)
    assert compiled(x).tolist() == [65536.0, 65536.0]
    with rk.use_options(grad_in_forward_max_vocab=3):
        assert compiled(x).tolist() == [3.0, 3.0]
        with rk.use_options(grad_in_forward_max_vocab=5):
            assert compiled(x).tolist() == [5.0, 5.0]
    assert compiled(x).tolist() == [65536.0, 65536.0]
