"""The layering of README's Layout: ops < attention < reparam < models < data < train < analysis | bench < report <
cli, with the spec language (spec < variants < errors) under ops, as the import-linter contract in pyproject.toml
states it. Lower layers never import higher ones, neither by an import statement (lint-imports) nor by name through
importlib (which lint-imports cannot see). The variant registry's ``"module:attribute"`` targets are the one sanctioned
route upwards: they name a method's code so that the method is one file plus one registry entry."""

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import attnlab

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attnlab"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports on the package under ``cwd`` (it puts ``cwd`` first on sys.path), with its pyproject.toml."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def layer_ranks() -> dict[str, int]:
    """Top-level module or package -> its rank in the contract (0 = lowest); ``a | b`` share a rank."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    assert contract["type"] == "layers" and contract["containers"] == ["attnlab"]
    ranks = {}
    for rank, layer in enumerate(reversed(contract["layers"])):
        assert ":" not in layer  # siblings that may import each other would need a rule below
        for name in layer.split("|"):
            ranks[name.strip()] = rank
    return ranks


def test_the_package_keeps_the_layers_contract():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("ops/spectra.py", "from attnlab.cli import main", "attnlab.ops.spectra -> attnlab.cli"),  # upwards
    ("attention/standard.py", "from attnlab.reparam import fold", "attnlab.attention.standard -> attnlab.reparam"),
    ("bench/latency.py", "import attnlab.analysis.spectra", "attnlab.bench.latency -> attnlab.analysis.spectra"),
    ("spec.py", "def _f():\n    from attnlab.models import build_model", "attnlab.spec -> attnlab.models"),  # lazy
    # the seam: the loop asks the run's task, it names no dataset or task family itself
    ("train/loop.py", "from attnlab.data.registry import dataset", "attnlab.train.loop -> attnlab.data.registry"),
    ("train/loop.py", "from attnlab.train.tasks.classify import evaluate",
     "attnlab.train.loop -> attnlab.train.tasks.classify"),
])
def test_the_contract_catches_a_bad_import(tmp_path, module, line, broken):
    shutil.copytree(PACKAGE, tmp_path / "attnlab", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / "attnlab" / module
    path.write_text(path.read_text() + "\n\n" + line + "\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1 and "BROKEN" in done.stdout, done.stdout + done.stderr
    assert broken in done.stdout


def test_a_new_top_level_module_needs_a_layer(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "attnlab", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "attnlab" / "extras.py").write_text("X = 1\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1 and "attnlab.extras" in done.stdout, done.stdout + done.stderr


def _named_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every importlib.import_module / __import__ call whose argument starts with a literal."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in ("import_module", "__import__"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            arg = arg.values[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((node.lineno, arg.value))
    return found


def upward_imports_by_name(package: Path) -> list[str]:
    ranks = layer_ranks()
    bad = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if len(parts) < 2 or parts[1] == "__init__":
            continue  # the package root's lazy attributes are its public API, above every layer
        source = parts[1]
        for line, target in _named_imports(ast.parse(path.read_text())):
            pieces = target.split(".")
            if pieces[0] != "attnlab" or len(pieces) < 2 or pieces[1] in ("", source) or pieces[1] not in ranks:
                continue
            if ranks[pieces[1]] >= ranks[source]:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {target} by name")
    return bad


def test_no_lower_layer_imports_a_higher_one_by_name():
    assert upward_imports_by_name(PACKAGE) == []


def test_the_by_name_check_can_fail(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "attnlab", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    loop = tmp_path / "attnlab" / "train" / "loop.py"
    loop.write_text(loop.read_text() + '\n\ndef _probe():\n    import importlib\n\n'
                    '    return importlib.import_module("attnlab.analysis.entropy").training_probe\n')
    assert [b.split(":")[0] for b in upward_imports_by_name(tmp_path / "attnlab")] == ["attnlab/train/loop.py"]


# ------------------------------------------------------------ the training probe comes from above the trainer
def test_train_without_a_probe_refuses_probe_every(tmp_path):
    from attnlab.train import RECIPES, train

    cfg = RECIPES["demo"].replace(epochs=1, probe_every=5, runs_dir=str(tmp_path), progress=False)
    with pytest.raises(attnlab.ConfigError, match="probe_every=5 needs a probe"):
        train(cfg)
    assert not any(tmp_path.iterdir())  # refused before any run directory was made


def test_the_command_line_passes_the_training_probe(tmp_path, monkeypatch):
    import attnlab.train
    import attnlab.train.grid
    from attnlab.analysis import training_probe
    from attnlab.cli import main

    given = []

    def spy(cfg, probe=None, **kwargs):
        given.append(kwargs.get("probe", probe))
        raise attnlab.AttnlabError("stop here")

    monkeypatch.setattr(attnlab.train, "train", spy)
    monkeypatch.setattr(attnlab.train, "run_grid", lambda *a, probe=None, **k: spy(None, probe))
    monkeypatch.setattr(attnlab.train.grid, "plan_grid", lambda *a, **k: [])  # compare checks its grid first
    assert main(["train", "--recipe", "demo", "--probe-every", "5", "--runs-dir", str(tmp_path)]) == 2
    assert main(["train", "--recipe", "demo", "--runs-dir", str(tmp_path)]) == 2
    assert main(["compare", "--attn", "standard", "--runs-dir", str(tmp_path)]) == 2
    assert given == [training_probe, None, training_probe]


# --------------------------------------------------- a new method is one file plus one registry entry, nothing else
TOY_METHOD = '''
import torch
from torch import nn

from attnlab.attention.base import Intermediates
from attnlab.attention.standard import StandardAttention


class ReluAttention(StandardAttention):
    def kernel(self, q, k, v, mask, want, backend):
        w = torch.relu(q @ k.transpose(-2, -1) * self.scale)
        return w / w.sum(-1, keepdim=True).clamp_min(1e-6) @ v, Intermediates()


class Doubler(nn.Module):
    def __init__(self, factor=2.0):
        super().__init__()
        self.factor = factor

    def forward(self, o):
        return self.factor * o
'''


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    from attnlab.variants import VARIANTS, Option, Variant, register

    (tmp_path / "toy_method.py").write_text(TOY_METHOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    register(Variant("relu", "kernel", "relu-normalised attention", "none", "toy_method:ReluAttention"))
    register(Variant("double", "head", "head outputs times factor", "none", "toy_method:Doubler",
                     options={"factor": Option(2.0, float)}))
    yield
    del VARIANTS["relu"], VARIANTS["double"]


def test_a_new_method_needs_only_its_file_and_its_registry_entry(toy_method, capsys):
    import torch

    from attnlab.cli import main
    from attnlab.models import attention_modules

    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", num_classes=10, attn="relu+double(factor=3)").eval()
    found = attention_modules(model)
    assert found and all(type(m).__name__ == "ReluAttention" for _, m in found)
    assert all(m.head_transform.factor == 3.0 for _, m in found)
    images = torch.randn(2, 1, 8, 8)
    assert torch.isfinite(model(images)).all()

    # one block against the formula, float64: o_h = 3 * relu(q k^T / sqrt(D)) v / max(row sum, 1e-6)
    name, block = found[0]
    x = torch.randn(2, 5, block.qkv.in_features)
    q, k, v = block.qkv(x).double().reshape(2, 5, 3, block.num_heads, -1).permute(2, 0, 3, 1, 4)
    w = torch.relu(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5)
    o = 3 * (w / w.sum(-1, keepdim=True).clamp_min(1e-6)) @ v
    expected = block.proj(o.transpose(1, 2).reshape(2, 5, -1).float())
    torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-5)

    assert main(["variants"]) == 0
    assert "| relu | kernel |" in capsys.readouterr().out
