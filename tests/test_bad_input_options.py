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
    assert opts.matmul_table == "tuned" and opts.grad_in_forward_max_vocab == 262144
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
    assert compiled(x).tolist() == [262144.0, 262144.0]
    with rk.use_options(grad_in_forward_max_vocab=3):
        assert compiled(x).tolist() == [3.0, 3.0]
        with rk.use_options(grad_in_forward_max_vocab=5):
            assert compiled(x).tolist() == [5.0, 5.0]
    assert compiled(x).tolist() == [262144.0, 262144.0]


def _holding(cm_factory, read):
    """A generator that enters ``cm_factory()``, yields what ``read()`` sees inside, then holds the
    block open across a second yield."""
    with cm_factory():
        yield read()
        yield read()


def test_use_options_blocks_ending_out_of_order():
    """Issue 29: two generators each holding a use_options block across a yield, closed in the order
    they were opened (out of order for the scopes) left the other block's options in force. Now: a
    block still open keeps its own changes (not those of an enclosing block that ended), and once
    both end the defaults are back."""
    read = lambda: (rk.current_options().matmul_table, rk.current_options().linear_chunk_bytes)  # noqa: E731
    a = _holding(lambda: rk.use_options(matmul_table="single"), read)
    b = _holding(lambda: rk.use_options(linear_chunk_bytes=4096), read)
    assert next(a) == ("single", 1280 << 20)
    assert next(b) == ("single", 4096)  # b began inside a
    a.close()  # a's block ends first
    assert read() == ("tuned", 4096)  # b's change stays in force, a's is gone
    assert next(b) == ("tuned", 4096)
    b.close()
    assert rk.current_options() == rk.Options()
    # The reverse order (properly nested) is unchanged.
    a = _holding(lambda: rk.use_options(matmul_table="single"), read)
    b = _holding(lambda: rk.use_options(linear_chunk_bytes=4096), read)
    next(a), next(b)
    b.close()
    assert read() == ("single", 1280 << 20)
    a.close()
    assert rk.current_options() == rk.Options()


def test_use_options_out_of_order_under_torch_compile():
    """The per-thread mirror compiled code reads follows the same rule."""
    import torch

    compiled = torch.compile(lambda x: x * rk.current_options().grad_in_forward_max_vocab, backend="eager")
    x = torch.ones(1)
    a = _holding(lambda: rk.use_options(grad_in_forward_max_vocab=3), lambda: compiled(x).item())
    b = _holding(lambda: rk.use_options(linear_chunk_bytes=4096), lambda: compiled(x).item())
    assert next(a) == 3.0 and next(b) == 3.0
    a.close()
    assert compiled(x).item() == 262144.0 and rk.current_options().linear_chunk_bytes == 4096
    b.close()
    assert compiled(x).item() == 262144.0 and rk.current_options() == rk.Options()


def test_use_backend_blocks_ending_out_of_order():
    """The same for rk.use_backend: the block still open keeps its backend."""
    from rlkernel._dispatch import requested_backend

    a = _holding(lambda: rk.use_backend("reference"), requested_backend)
    b = _holding(lambda: rk.use_backend("triton"), requested_backend)
    assert next(a) == "reference" and next(b) == "triton"
    a.close()
    assert requested_backend() == "triton" and next(b) == "triton"
    b.close()
    assert requested_backend() == "auto"


def test_use_options_ended_in_another_thread_raises():
    """A block entered in one thread and ended in another cannot restore the first thread's
    options from there: RuntimeError (the ending thread's options are untouched)."""
    cm = rk.use_options(matmul_table="single")
    entered, ended = threading.Event(), threading.Event()
    seen = []

    def holder():  # enters the block in its own thread and keeps it in force there
        cm.__enter__()
        entered.set()
        ended.wait(30)
        seen.append(rk.current_options().matmul_table)

    t = threading.Thread(target=holder)
    t.start()
    entered.wait(30)
    with pytest.raises(RuntimeError, match="ended in another thread or asyncio task"):
        cm.__exit__(None, None, None)
    ended.set()
    t.join()
    assert seen == ["single"] and rk.current_options() == rk.Options()
