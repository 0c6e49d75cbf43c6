"""The fused CPU kernels as torch.library custom ops: FlopCounterMode counts them like the torch paths they
replace, torch.compile(fullgraph=True) traces models that call them, FakeTensor gets their shapes; and the safety
of the C side (version / struct handshake, private cache, no large stack arrays), including without a compiler."""

import os
import stat
import sys
import textwrap

import forked
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnlab
from attnlab.models import attention_modules
from attnlab.ops import ckernel, dna_cpu


def _flops(model, x, grad):
    with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("attn", ["dna", "ns", "dna(variant=q)+ns"])
@pytest.mark.parametrize("name", ["vit_cifar", "swin_cifar"])
def test_flop_count_is_the_same_with_and_without_gradient(name, attn, monkeypatch):
    # without gradient the kernels run, with it the torch paths: the count must not depend on which
    torch.manual_seed(0)
    small = {"depth": 2} if name == "vit_cifar" else {}
    model = attnlab.build_model(name, num_classes=10, attn=attn, **small).eval()
    x = torch.randn(2, 3, 32, 32)
    calls = []
    real = dna_cpu.dna_attention
    monkeypatch.setattr(dna_cpu, "dna_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    no_grad = _flops(model, x, grad=False)
    with_grad = _flops(model, x, grad=True)
    if dna_cpu.unavailable() is None and "dna" in attn:
        assert calls, "the DnA kernel did not run without gradient"
    assert no_grad == with_grad


def test_the_dna_op_counts_two_sdpa_calls():
    # 2 branches x (q k^T and weights @ v) x 2 flops per multiply-add, by hand
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, H, N, M, D = 2, 3, 5, 7, 16
    with FakeTensorMode():  # shapes only: counted where the kernel cannot be built too
        q, k = torch.zeros(B, H, N, D), torch.zeros(B, H, M, D)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            torch.ops.attnlab.dna_fused(q, q, k, k, k, None, 0.25, 0.25, None, None, [])
    assert counter.get_total_flops() == 2 * 2 * (2 * B * H * N * M * D)


def _tiny(attn):
    torch.manual_seed(0)
    return attnlab.build_model("vit_cifar", num_classes=10, attn=attn, depth=1).eval()


@pytest.mark.parametrize("attn", ["dna", "ns"])
@pytest.mark.usefixtures("dna_kernel")  # tests/ops/conftest.py
def test_compile_fullgraph_of_an_eval_model(attn):
    import torch._dynamo

    torch._dynamo.reset()
    model = _tiny(attn)
    x = torch.randn(2, 3, 32, 32)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True, backend=backend)(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any(op.startswith("attnlab.") for op in ops), sorted(ops)  # the kernel is in the graph


@pytest.mark.slow  # inductor's C++ build of the graph (tests/train/test_train_compile.py compiles whole models)
@pytest.mark.compiler
@pytest.mark.usefixtures("dna_kernel")  # tests/ops/conftest.py
def test_compile_fullgraph_with_inductor_runs_the_kernel():
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    attn = attention_modules(_tiny("dna"))[0][1]  # the attention module alone: the fewest C++ kernels to build
    x = torch.randn(2, 65, 192)
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(attn, fullgraph=True), x)
        torch.testing.assert_close(got, attn(x), rtol=1e-4, atol=1e-4)
    assert "torch.ops.attnlab.dna_fused" in "\n".join(code)  # inductor calls the kernel, not a decomposition


def test_fake_tensors_get_the_dna_op_shape_and_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 3, 5, 16), torch.empty(2, 3, 7, 16)
        out = torch.ops.attnlab.dna_fused(q, q, k, k, k, torch.ones(3), 0.25, 0.25, None, None, [])
        assert out.shape == (2, 3, 5, 16) and out.transpose(1, 2).is_contiguous()  # head-merge layout
        with pytest.raises(ValueError, match="v_neg has shape"):
            torch.ops.attnlab.dna_fused(q, q, k, k, torch.empty(2, 3, 6, 16), None, 0.25, 0.25, None, None, [])


@pytest.mark.usefixtures("dna_kernel")  # tests/ops/conftest.py
def test_kernel_and_python_agree_on_supported_shapes():
    c_supports = dna_cpu.KERNEL.library().attnlab_dna_supports
    for D in range(8, 80, 8):
        for M in (0, 1, 1024, 1025):
            assert bool(c_supports(D, M)) == dna_cpu.supports(D, M), (D, M)


@pytest.mark.usefixtures("dna_kernel")  # tests/ops/conftest.py
def test_handshake_refuses_a_kernel_of_another_version_or_layout(monkeypatch):
    for abi, sizes, needle in ((dna_cpu._ABI + 1, {}, "interface version"),
                               (dna_cpu._ABI, {"attnlab_dna_args_size": 8}, "attnlab_dna_args_size")):
        monkeypatch.setattr(ckernel, "_libs", {})
        monkeypatch.setattr(ckernel, "_errors", {})
        assert ckernel.load("dna_kernel.c", abi=abi, abi_sizes=sizes) is None
        assert needle in ckernel.load_error("dna_kernel.c")


def test_cache_directory_is_private(tmp_path, monkeypatch):
    cache = tmp_path / "a" / "cache"
    assert ckernel._private_dir(cache) == cache
    assert stat.S_IMODE(cache.stat().st_mode) & 0o077 == 0
    cache.chmod(0o777)  # left world-writable: anyone may have planted a library, so it is refused, not repaired
    with pytest.raises(OSError, match="can be written by group or others"):
        ckernel._private_dir(cache)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o777


SMALL_STACK = textwrap.dedent("""
    import threading
    import torch
    from attnlab.ops import dna_cpu

    torch.set_num_threads(1)  # the kernel runs on the calling thread
    assert dna_cpu.unavailable() is None, dna_cpu.unavailable()
    q = torch.randn(5, 1, 2, 1024, 64).unbind(0)  # the largest working set: 1024 keys, head dim 64
    result = []
    threading.stack_size(256 * 1024)  # smaller than macOS's 512 KiB secondary threads
    t = threading.Thread(target=lambda: result.append(dna_cpu.dna_attention(*q, None, scale_pos=0.1, scale_neg=0.1)))
    t.start()
    t.join()
    print("ok", tuple(result[0].shape))
""")


@pytest.mark.usefixtures("dna_kernel")  # tests/ops/conftest.py
def test_kernel_runs_on_a_thread_with_a_small_stack(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the test run's kernel cache (tests/conftest.py)
    out = forked.run([sys.executable, "-c", SMALL_STACK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok (1, 2, 1024, 64)" in out.stdout, (out.returncode, out.stderr[-2000:])


NO_COMPILER = textwrap.dedent("""
    import torch
    import attnlab
    from attnlab.ops import dna_cpu, ns_cpu

    why = dna_cpu.unavailable()
    assert why and "could not be built" in why, why
    assert ns_cpu.kernel_error(torch.randn(2, 3, 16, 16)), "ns kernel claims to run without a compiler"
    torch.manual_seed(0)
    for attn in ("dna", "ns"):
        model = attnlab.build_model("vit_cifar", num_classes=10, attn=attn, depth=1).eval()
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(model(x), model(x))
    print("ok")
""")


def test_without_a_compiler_everything_runs_on_the_torch_paths(tmp_path):
    env = dict(os.environ, ATTNLAB_CACHE=str(tmp_path / "cache"), CC=str(tmp_path / "missing" / "cc"))
    env.pop("ATTNLAB_KERNELS", None)
    out = forked.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
