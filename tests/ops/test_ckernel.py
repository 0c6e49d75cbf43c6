"""attnlab.ops.ckernel: the kernels build with OpenMP where the compiler has it, and split their work over Python
threads where it does not (checked in a fresh process with a compiler that rejects -fopenmp)."""

import os
import platform
import sys
import textwrap

import forked
import pytest

pytestmark = [pytest.mark.usefixtures("c_compiler"), pytest.mark.compiler]

CODE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from attnlab.ops import ns_transform
    from attnlab.ops import dna_cpu, ns_cpu
    from attnlab.ops.dna_cpu import dna_attention

    torch.set_num_threads(2)
    x = torch.randn(64, 4, 20, 16)  # 256 head matrices: two threads
    with torch.no_grad():
        torch.testing.assert_close(ns_transform(x, impl="kernel"), ns_transform(x, impl="fast"), rtol=1e-5, atol=1e-6)
    q = torch.randn(5, 32, 3, 40, 16).unbind(0)  # 96 heads: two threads
    assert dna_cpu.kernel_error(q[0], q[1]) is None
    got = dna_attention(q[0], q[1], q[2], q[3], q[4], torch.tensor([0.5, -0.5, 1.0]), scale_pos=0.25, scale_neg=0.25)
    # softmax(s q+ k^T) v+ + alpha softmax(-s q- k^T) v-, by SDPA
    want = (F.scaled_dot_product_attention(q[0], q[2], q[3], scale=0.25) + torch.tensor([0.5, -0.5, 1.0]).view(-1, 1, 1)
            * F.scaled_dot_product_attention(-q[1], q[2], q[4], scale=0.25))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print("openmp", int(ns_cpu.KERNEL.library().built_with_openmp), int(dna_cpu.KERNEL.library().built_with_openmp))
""")


def _run(tmp_path, cc=None):
    env = dict(os.environ)
    if cc:  # another compiler builds into a fresh cache; the default one shares the test run's (tests/conftest.py)
        env.update(CC=cc, ATTNLAB_CACHE=str(tmp_path / "cache"))
    out = forked.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_kernels_use_openmp_when_the_compiler_has_it(tmp_path):
    assert "openmp 1 1" in _run(tmp_path)


def test_kernels_fall_back_to_python_threads_without_openmp(tmp_path):
    cc = tmp_path / "cc-without-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && exit 1; done\nexec cc "$@"\n')
    cc.chmod(0o755)
    assert "openmp 0 0" in _run(tmp_path, str(cc))


PORTABLE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from attnlab.ops import dna_cpu
    from attnlab.ops.dna_cpu import dna_attention

    g = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(5, 2, 3, 21, 32, generator=g)).unbind(0)  # logits spread to ~ -100: exp's clamp and zeros
    blocked = torch.rand(2, 3, 21, 21, generator=g) < 0.3
    blocked[..., 0] = False  # every row keeps a key
    bias = torch.zeros(2, 3, 21, 21).masked_fill(blocked, float("-inf"))
    alpha = torch.tensor([0.5, -0.5, 1.0])
    assert dna_cpu.kernel_error(q[0], q[1]) is None
    got = dna_attention(*q, alpha, scale_pos=0.25, scale_neg=0.25, bias_pos=bias, bias_neg=bias)
    want = (F.scaled_dot_product_attention(q[0], q[2], q[3], attn_mask=bias, scale=0.25) + alpha.view(-1, 1, 1)
            * F.scaled_dot_product_attention(-q[1], q[2], q[4], attn_mask=bias, scale=0.25))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print("ok")
""")


# The DnA kernel has AVX-512 intrinsics (exp, max) and a portable vector-extension path; -march=native picks the
# former on an AVX-512 machine, so there the latter is built with AVX-512 switched off (an x86 flag: elsewhere the
# portable path is the native one, and one build covers it).
BUILDS = ["native", "without-avx512"] if platform.machine() in ("x86_64", "AMD64") else ["native"]


@pytest.mark.parametrize("build", BUILDS)
def test_dna_kernel_exp_clamp_and_masks_in_both_code_paths(tmp_path, build):
    env = dict(os.environ)
    if build == "without-avx512":
        env["ATTNLAB_CACHE"] = str(tmp_path / "cache")
        cc = tmp_path / "cc-without-avx512"
        cc.write_text('#!/bin/sh\nexec cc "$@" -mno-avx512f\n')
        cc.chmod(0o755)
        env["CC"] = str(cc)
    out = forked.run([sys.executable, "-c", PORTABLE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
