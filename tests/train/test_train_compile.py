"""Every registered term trains under --compile (issue 11 item 3): one digits epoch compiled with inductor on the CPU
gives the eager run's train loss, test loss and accuracy.

One compile per kernel, the other terms composed in (qkclip does not compose with dna, diff or cog): five image
compositions here and the language model's dna+sigma (tests/train/test_train_lm.py, the same loop and compile,
DnA's branches with causal masks), which together hold every registered term, among them the weight terms that act
every step (sigma, specnorm, speccond), the head term ns, qknorm and QK-clip's optimizer hook. Inductor's C++
builds are most of the suite's time with a cold cache (docs/perf.md, "Test suite time"), hence no second compile of
a kernel. Tolerance: the compiled kernels sum in other orders (fused reductions), so float32 rounding differs
from eager by ~1e-7 relative per step; over 22 AdamW steps the epoch's mean loss agreed to 1e-7 relative when
measured, and 1e-4 leaves room for other CPUs' vector widths while a wrong graph (a parametrisation or hook
skipped) moves the loss by far more than that.
"""

from __future__ import annotations

import json

import pytest
from torch._dynamo.utils import counters
from train_helpers import tiny

from attnlab.spec import parse_spec
from attnlab.train import train
from attnlab.variants import VARIANTS

COMPOSITIONS = ("diff+qknorm+speccond", "cog(all_layers=true)+specnorm", "ns+qkclip(tau=1)", "nystrom", "performer")


def test_the_compositions_cover_every_registered_term():
    from test_train_lm import COMPILED_SPECS

    used = {term.name for spec in (*COMPOSITIONS, *COMPILED_SPECS) for term in parse_spec(spec).terms} | {"standard"}
    assert used == set(VARIANTS)


def _first_epoch(runs_dir, spec, compile):
    # one block: the compile's time grows with the graph, and one block holds every term's code
    cfg = tiny(runs_dir, epochs=1, attn=spec, compile=compile, model_options={"depth": 1})
    result = train(cfg)
    return json.loads((runs_dir / result["name"] / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
@pytest.mark.compiler
@pytest.mark.parametrize("spec", COMPOSITIONS)
def test_compiled_epoch_matches_eager(tmp_path, spec):
    eager = _first_epoch(tmp_path / "eager", spec, False)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = _first_epoch(tmp_path / "compiled", spec, True)
    # it did compile (past its recompile limit dynamo falls back to eager without a word): a training graph and an
    # evaluation graph, and no graph break
    assert counters["stats"]["unique_graphs"] - graphs >= 2
    assert sum(counters["graph_break"].values()) == breaks
    for key in ("train_loss", "test_loss"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4), key
    assert abs(compiled["top1"] - eager["top1"]) <= 100 / 360 + 1e-9  # at most one of the 360 test images flips
    if "qkclip" in spec:  # tau=1 makes the hook clip on every step, so a skipped hook would show here
        assert compiled["qkclip/clipped_heads"] > 0 and eager["qkclip/clipped_heads"] > 0
