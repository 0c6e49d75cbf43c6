"""The opt-in Triton kernel of DnA's two branches (attnlab/ops/dna_triton.py). No GPU here: the kernel runs under
Triton's CPU interpreter, which must be on before Triton is first imported, so those checks
(tests/ops/triton_interpreted.py: against the float64 per-head loop, and inside DnAAttention) run in a subprocess."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from attnlab.ops import dna_triton
from attnlab.ops.dna_triton import dna_attention_triton, prune_configs, triton_error, warps_for


def test_kernel_under_the_interpreter():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", ATTNLAB_DNA_TRITON="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(here / "triton_interpreted.py")], env=env, capture_output=True, text=True,
                          cwd=here.parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


@pytest.mark.parametrize(
    "env,kwargs,needle",
    [
        ("0", {}, "opt-in"),
        ("1", dict(bias=True), "no attention bias"),
        ("1", dict(D=24), "power-of-two head dim"),
        ("1", dict(grad=True), "needs a gradient"),
        ("1", dict(dtype=torch.float64), "fp16, bf16 or fp32"),
    ],
)
def test_triton_error_says_why(monkeypatch, env, kwargs, needle):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read per call: stands in for a CUDA device here
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", env)
    D = kwargs.get("D", 16)
    q = torch.randn(1, 2, 8, D, dtype=kwargs.get("dtype", torch.float32), requires_grad=kwargs.get("grad", False))
    assert needle in triton_error(q, q.detach(), bias=kwargs.get("bias", False))


def test_without_the_interpreter_it_wants_cuda(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    assert "runs on CUDA" in triton_error(q, q)


def test_triton_error_refuses_grids_and_strides_past_32_bit_limits(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", "1")
    # 2^27 heads x 256 rows in 16-row tiles: 2^31 programs (expand: no memory behind it)
    many = torch.zeros(1, 1, 1, 16).expand(2**27, 1, 256, 16)
    assert "2^31 - 1 programs" in triton_error(many, many)
    wide = torch.zeros(16).as_strided((1, 1, 1, 16), (1, 1, 2**24, 1))  # row stride 2^24, one row
    assert "row strides" in triton_error(wide, wide)


class _Config:
    """Stands in for triton.Config: the prune reads only kwargs and num_warps."""

    def __init__(self, block_m, block_n, num_warps):
        self.kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n}
        self.num_warps = num_warps


def _candidates():
    return [_Config(bm, bn, w) for bm, bn in dna_triton.TILES for w in (4, 8)]


def _useful(n, m, c):
    """Fraction of the padded tile grid that holds real (query, key) pairs."""
    pad = lambda x, b: -(-x // b) * b  # noqa: E731
    return n * m / (pad(n, c.kwargs["BLOCK_M"]) * pad(m, c.kwargs["BLOCK_N"]))


def test_tiles_for_65_tokens_do_not_waste_most_of_the_work():
    # vit_cifar: 65 tokens; one 64 x 64 tile grid (2 x 2 tiles) holds 26% real pairs
    kept = prune_configs(_candidates(), {"N": 65, "M": 65}, D=16)
    assert kept and _useful(65, 65, _Config(64, 64, 4)) < 0.3
    assert all(_useful(65, 65, c) > 0.33 for c in kept), [c.kwargs for c in kept]
    tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept]
    assert len(tiles) == len(set(tiles))  # one warp count per tile


def test_eight_warps_where_four_spill_at_head_dim_64():
    # ViT-B/16: 197 tokens, head dim 64; the large tiles are worth trying there, with 8 warps
    kept = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]): c.num_warps
            for c in prune_configs(_candidates(), {"N": 197, "M": 197}, D=64)}
    assert kept[(64, 64)] == 8 and kept[(128, 64)] == 8
    assert all(w == 8 for (bm, _), w in kept.items() if bm >= 64)
    assert warps_for(64, 64, 16) == 4 and warps_for(32, 32, 64) == 4


def test_launch_grid_stays_within_cuda_limits(monkeypatch):
    # B x H = 72,000 heads (ViT, 12 heads, batch 6,000): more than gridDim.y's 65,535. A recorder stands in for the
    # kernels and evaluates the grid for every tile the autotuner may pick.
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                for bm in [meta["BLOCK_M"]] if "BLOCK_M" in meta else [16, 32, 64, 128]:
                    launches.append((bm, grid(dict(meta, BLOCK_M=bm)) if callable(grid) else grid))
            return launch

    monkeypatch.setattr(dna_triton, "_kernels", lambda: (Recorder(), Recorder()))
    B, H, N = 6000, 12, 20
    t = torch.zeros(1, 1, 1, 16).expand(B, H, N, 16)
    dna_attention_triton(t, t, t, t, t, None, scale_pos=1.0, scale_neg=1.0, block_m=16, block_n=16)
    dna_attention_triton(t, t, t, t, t, None, scale_pos=1.0, scale_neg=1.0)
    for bm, grid in launches:
        assert len(grid) <= 3 and grid[0] <= 2**31 - 1 and all(g <= 65535 for g in grid[1:]), grid
        assert math.prod(grid) == B * H * -(-N // bm)  # one program per (batch, head, query tile)
    assert len(launches) == 5


def test_fake_tensors_on_a_cuda_device_without_a_gpu():
    # FakeTensor (what torch.compile and shape checks use) needs only the registered fake implementation
    with FakeTensorMode():
        proj = torch.empty(128, 197, 5, 12, 64, device="cuda", dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
        out = dna_attention_triton(*proj, torch.empty(12, device="cuda"), scale_pos=0.125, scale_neg=0.125)
        assert out.shape == (128, 12, 197, 64) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        assert out.transpose(1, 2).is_contiguous()  # the (B, N, H, D) layout head merge reads


def test_flop_counter_counts_both_branches():
    # per (batch, head): q+ k^T and q- k^T (N x M x D multiply-adds each), W+ v+ and W- v- (N x M x D each);
    # 2 FLOPs per multiply-add, as FlopCounterMode counts SDPA and matmuls
    B, H, N, M, D = 2, 3, 7, 11, 16
    q = torch.empty(B, H, N, D, device="meta")
    kv = torch.empty(B, H, M, D, device="meta")
    with FlopCounterMode(display=False) as counter:
        dna_attention_triton(q, q, kv, kv, kv, None, scale_pos=0.25, scale_neg=0.25)
    assert counter.get_total_flops() == 2 * 2 * (2 * B * H * N * M * D)
