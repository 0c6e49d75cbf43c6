"""`attnlab eval`: one JSON line whose numbers are attnlab.analysis.evaluate's on the same model and images, for
--model with --checkpoint, and for an image folder with --classes and --ood (a folder the test writes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

import attnlab
from attnlab.analysis.evaluation import evaluate
from attnlab.cli import main
from attnlab.data import build_dataset


def run_eval(capsys, *argv) -> dict:
    assert main(["eval", *map(str, argv)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    return json.loads(lines[0])


def test_model_with_checkpoint_on_a_split(tmp_path, capsys):
    torch.manual_seed(3)
    model = attnlab.build_model("vit_digits", num_classes=10, attn="dna").eval()
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    out = run_eval(capsys, "--model", "vit_digits", "--attn", "dna", "--checkpoint", tmp_path / "w.safetensors",
                   "--images", 120, "--noise", 0.3, "--device", "cpu")
    expected = evaluate(model, build_dataset("digits", False), limit=120, noise_std=0.3)
    assert out["model"] == "vit_digits" and out["dataset"] == "digits" and out["split"] == "test"
    for key in ("n", "top1", "top5", "loss", "rms_calibration_error", "aurra", "noise_std"):
        assert out[key] == pytest.approx(expected[key], rel=1e-5), key


def _write_folder(root, classes, per_class, seed):
    g = torch.Generator().manual_seed(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = (torch.rand(40, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / c / f"{i}.png")


def test_folder_with_classes_and_ood(tmp_path, capsys):
    torch.manual_seed(0)
    src = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=6)
    save_file(src.state_dict(), tmp_path / "w.safetensors")
    _write_folder(tmp_path / "val", ["n02", "n05"], 3, seed=1)  # two of the model's six classes
    _write_folder(tmp_path / "ood", ["x"], 4, seed=2)
    (tmp_path / "classes.txt").write_text("\n".join(["n00", "n01", "n02", "n03", "n04", "n05"]) + "\n")
    # depth=2 is not a CLI flag: the file's 2 blocks would not fit timm's 12, so the model comes from the library
    args = ["--model", "vit_tiny_patch16_224", "--pretrained-file", tmp_path / "w.safetensors", "--image-size", 32,
            "--folder", tmp_path / "val", "--classes", tmp_path / "classes.txt", "--ood", tmp_path / "ood"]
    assert main(["eval", *map(str, args)]) == 2  # the mismatch is one line: blocks.2 is missing from the file
    assert "blocks.2" in capsys.readouterr().err
    full = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=6)
    save_file(full.state_dict(), tmp_path / "w.safetensors")
    out = run_eval(capsys, *args)
    assert out["n"] == 6 and out["ood_n"] == 4 and 0 <= out["auroc"] <= 100 and 0 <= out["aurra"] <= 100
    assert out["top5"] == 100.0  # two classes kept: both are always in the top 5
    from torchvision.datasets import ImageFolder

    from attnlab.data.folder import folder_transform

    model = attnlab.build_model("vit_tiny_patch16_224", pretrained_file=tmp_path / "w.safetensors", img_size=32)
    t = folder_transform(False, "none", image_size=32)
    expected = evaluate(model, ImageFolder(str(tmp_path / "val"), transform=t), class_indices=[2, 5],
                        ood=ImageFolder(str(tmp_path / "ood"), transform=t))
    for key in ("top1", "loss", "rms_calibration_error", "aurra", "auroc"):
        assert out[key] == pytest.approx(expected[key], rel=1e-5), key


def test_ood_folder_against_a_dataset_split(tmp_path, capsys):
    # a digits model: the OOD folder's RGB 40 x 40 images are read as the split's 1-channel 8 x 8, normalised alike
    torch.manual_seed(4)
    model = attnlab.build_model("vit_digits", num_classes=10).eval()
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    _write_folder(tmp_path / "ood", ["a", "b"], 3, seed=5)
    out = run_eval(capsys, "--model", "vit_digits", "--checkpoint", tmp_path / "w.safetensors", "--dataset", "digits",
                   "--images", 50, "--ood", tmp_path / "ood")
    from torchvision import transforms

    from attnlab.data import dataset_info

    info = dataset_info("digits")
    ood = [(transforms.functional.normalize(
        transforms.functional.pil_to_tensor(Image.open(p).convert("L").resize((9, 9), Image.BICUBIC)).float()
        .div(255)[:, :8, :8], info.mean, info.std), 0) for p in sorted((tmp_path / "ood").rglob("*.png"))]
    expected = evaluate(model, build_dataset("digits", False), limit=50, ood=ood)
    assert out["ood_n"] == 6
    assert out["auroc"] == pytest.approx(expected["auroc"], abs=1e-6)  # timm's eval transform: resize 9, crop 8


def test_dna_authors_checkpoint_from_the_command_line(tmp_path, capsys):
    """--dna-layout legacy reads their converter's row order (Q+, K, V+, Q-, V-) into attnlab's fused qkv."""
    torch.manual_seed(4)
    model = attnlab.build_model("vit_digits", num_classes=10, attn="dna").eval()
    theirs = {}
    for key, t in model.state_dict().items():
        if key.endswith("attn.qkv.weight") or key.endswith("attn.qkv.bias"):
            qp, qn, k, vp, vn = t.chunk(5)
            theirs[key.replace("qkv", "qqkvv")] = torch.cat([qp, k, vp, qn, vn])
        elif key.endswith("attn.alpha"):
            theirs[key.replace("alpha", "neg_scalers")] = t.reshape(1, -1, 1, 1)
        else:
            theirs[key] = t
    torch.save(theirs, tmp_path / "theirs.pth")
    out = run_eval(capsys, "--model", "vit_digits", "--attn", "dna", "--checkpoint", tmp_path / "theirs.pth",
                   "--dna-layout", "legacy", "--images", 50)
    expected = evaluate(model, build_dataset("digits", False), limit=50)
    assert out["loss"] == pytest.approx(expected["loss"], rel=1e-5)


@pytest.mark.slow
def test_pretrained_offline_without_cache_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "attnlab", "eval", "--model", "vit_tiny_patch16_224", "--pretrained"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cannot fetch timm's weights for vit_tiny_patch16_224" in lines[0] and "--pretrained-file" in lines[0]


def test_run_directory(tmp_path, capsys):
    from attnlab.train import RECIPES, load_run, train

    cfg = RECIPES["demo"].replace(epochs=1, batch_size=256, runs_dir=str(tmp_path), progress=False)
    run = tmp_path / train(cfg)["name"]
    capsys.readouterr()
    out = run_eval(capsys, run, "--images", 80, "--noise", 0.2)
    model, _ = load_run(run)
    expected = evaluate(model, build_dataset("digits", False), limit=80, noise_std=0.2)
    assert out["run"] == str(run) and out["attn"] == "standard" and out["split"] == "test"
    for key in ("n", "top1", "top5", "loss", "rms_calibration_error", "aurra"):
        assert out[key] == pytest.approx(expected[key], rel=1e-5), key


def test_folder_is_read_in_the_models_channels_and_input_size(tmp_path, capsys):
    """A 1-channel 8 x 8 digits model reads a folder of RGB images as greyscale 8 x 8 with the dataset's
    normalisation; a 32-pixel model without --image-size reads it at 32 (its own input size), not timm's 224."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    from attnlab.data import dataset_info
    from attnlab.data.folder import folder_transform

    _write_folder(tmp_path / "val", ["a", "b"], 3, seed=6)
    torch.manual_seed(5)
    digits = attnlab.build_model("vit_digits", num_classes=10).eval()
    save_file(digits.state_dict(), tmp_path / "digits.safetensors")
    out = run_eval(capsys, "--model", "vit_digits", "--checkpoint", tmp_path / "digits.safetensors", "--dataset",
                   "digits", "--folder", tmp_path / "val")
    info = dataset_info("digits")
    grey = transforms.Compose([transforms.Grayscale(1),
                               folder_transform(False, "none", image_size=8, mean=info.mean, std=info.std)])
    expected = evaluate(digits, ImageFolder(str(tmp_path / "val"), transform=grey))
    assert out["n"] == 6 and out["loss"] == pytest.approx(expected["loss"], rel=1e-5)

    full = attnlab.build_model("vit_cifar", num_classes=10).eval()
    save_file(full.state_dict(), tmp_path / "cifar.safetensors")
    out = run_eval(capsys, "--model", "vit_cifar", "--num-classes", 10, "--checkpoint", tmp_path / "cifar.safetensors",
                   "--folder", tmp_path / "val")
    expected = evaluate(full, ImageFolder(str(tmp_path / "val"), transform=folder_transform(False, "none",
                                                                                            image_size=32)))
    assert out["n"] == 6 and out["loss"] == pytest.approx(expected["loss"], rel=1e-5)
