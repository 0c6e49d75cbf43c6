"""DDP without find_unused_parameters and compiled DDP, checked without a GPU.

attnlab's trainer wraps the model in DistributedDataParallel with find_unused_parameters=False (attnlab/train/loop.py),
which needs every parameter to receive a gradient in every step: a parameter left out leaves its bucket waiting and
the next step's forward fails. The fast check runs one step of every registered term on one process; the slow ones
run DDP on 2 CPU ranks (gloo) with 1 MB buckets (5 of them), eager and under torch.compile (Dynamo's DDPOptimizer
splits the graph at the buckets; through aot_eager), and compare the averaged gradient with the one-process gradient
of the whole batch (about 25 and 45 s of CPU). NCCL itself needs GPUs.
"""

import sys
from pathlib import Path

import forked
import pytest
import torch
import torch.nn.functional as F

from attnlab.models import build_model
from attnlab.variants import VARIANTS

WORKER = Path(__file__).with_name("ddp_variants_worker.py")
SUITE = ["standard", "ns", "dna", "sigma", "speccond"]  # what the GPU suite trains compiled


def unused(model, x, y) -> list[str]:
    model.train()
    F.cross_entropy(model(x), y).backward()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


@pytest.mark.parametrize("term", sorted(VARIANTS))
def test_every_term_gives_every_parameter_a_gradient_in_one_step(term):
    torch.manual_seed(0)
    model = build_model("vit_digits", attn=term, drop_path_rate=0.0)
    assert unused(model, torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))) == []


@pytest.mark.parametrize("spec", ["ns", "dna", "sigma+qknorm", "dna(variant=q)+speccond"])
def test_windowed_and_composed_specs_give_every_parameter_a_gradient(spec):
    torch.manual_seed(0)
    model = build_model("swin_cifar", attn=spec, depths=(2, 1), num_heads=(3, 6), drop_path_rate=0.0)
    assert unused(model, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))) == []


def run_ranks(tmp_path, specs, *extra):
    proc = forked.run([sys.executable, str(WORKER), str(tmp_path), ";".join(specs), *extra], capture_output=True,
                      text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


def check_averaged(ranks, specs):
    for spec in specs:
        a, b = ranks[0][spec], ranks[1][spec]
        assert a["ddp"].keys() == a["full"].keys(), spec  # every parameter got a gradient under DDP
        for name in a["ddp"]:
            torch.testing.assert_close(a["ddp"][name], b["ddp"][name], rtol=0, atol=0)  # all-reduced
            # the mean of the two ranks' means of 4 images is the mean over the 8
            torch.testing.assert_close(a["ddp"][name], a["full"][name], rtol=1e-4, atol=1e-6, msg=f"{spec} {name}")


@pytest.mark.slow
def test_ddp_on_two_cpu_ranks_without_find_unused_parameters(tmp_path):
    check_averaged(run_ranks(tmp_path, SUITE), SUITE)


@pytest.mark.slow
def test_compiled_ddp_on_two_cpu_ranks(tmp_path):
    specs = ["ns+sigma"]  # extra ops in the attention and parametrised weights with a power iteration, one trace
    check_averaged(run_ranks(tmp_path, specs, "--compile", "aot_eager"), specs)
