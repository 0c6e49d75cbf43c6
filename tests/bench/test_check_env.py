"""benchmarks/check_env.py, the GPU suite's first step: it finds every torch/timm/torchvision name attnlab uses,
and a missing one, an old version or a failing training step ends it with one line and exit status 3."""

import importlib.util
from pathlib import Path

import pytest
import timm.layers
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_env", ROOT / "benchmarks" / "check_env.py")
check_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_env)


def test_the_scan_finds_the_names_attnlab_uses_and_each_exists_here():
    names = check_env.referenced_names()
    # one of each kind: a torch attribute chain, an aliased module's function, a from-import, a private name
    for name in ("torch.compiler.cudagraph_mark_step_begin", "torch.nn.functional.grid_sample",
                 "timm.layers.Attention", "torchvision.transforms.functional._get_inverse_affine_matrix",
                 "timm.data.distributed_sampler.RepeatAugSampler"):
        assert name in names, name
    assert names["torch.compiler.cudagraph_mark_step_begin"] == "attnlab/train/loop.py"
    assert check_env.check_names(names) == len(names)
    source = "".join(p.read_text() for d in ("attnlab", "benchmarks") for p in (ROOT / d).rglob("*.py")
                     if p.name != "check_env.py")
    for name in check_env.REQUIRED:  # the list names what the code uses, nothing stale
        assert name.rsplit(".", 1)[1] in source, name


def run(capsys, *argv):
    rc = check_env.main(["--device", "cpu", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("module,attr,where", [
    (torch.compiler, "cudagraph_mark_step_begin", "attnlab/train/loop.py, since torch 2.1"),
    (timm.layers, "Attention", "since timm 1.0.16"),
])
def test_a_missing_api_stops_with_one_line(capsys, monkeypatch, module, attr, where):
    monkeypatch.delattr(module, attr)
    rc, out, err = run(capsys, "--no-steps")
    assert rc == 3 and out == ""
    assert err.count("\n") == 1 and err.startswith("environment: missing: ")
    assert f"{module.__name__}.{attr} (used by " in err and where in err and f"torch {torch.__version__}" in err


def test_an_old_torch_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    rc, _, err = run(capsys, "--no-steps")
    assert rc == 3 and err == "environment: torch 2.10.1+cu128 is older than the 2.11 the suite supports\n"


def test_a_failing_training_step_is_named(capsys, monkeypatch):
    import attnlab.models

    def build(name, **kwargs):
        if kwargs.get("attn") == "sigma":
            raise RuntimeError("no kernel image is available for execution on the device\nmore")
        return original(name, **kwargs)

    original = attnlab.models.build_model
    monkeypatch.setattr(attnlab.models, "build_model", build)
    monkeypatch.setattr(check_env, "SUITE_MODELS", {"vit_digits": "standard,sigma"})
    rc, _, err = run(capsys)
    assert rc == 3 and err.count("\n") == 1
    assert "a training step of vit_digits sigma on cpu failed: RuntimeError: no kernel image is available" in err


def test_versions_are_printed_as_a_table(capsys, monkeypatch):
    monkeypatch.setattr(check_env, "SUITE_MODELS", {"vit_digits": "standard"})
    rc, out, err = run(capsys)
    assert rc == 0 and err == ""
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()[2:]}
    assert rows["torch"] == torch.__version__ and rows["timm"] == timm.__version__ and "torchvision" in rows
    assert rows["training steps"] == "1 on cpu"
