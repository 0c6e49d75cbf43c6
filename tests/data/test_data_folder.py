"""imagefolder on a tiny tree of PNG files written here."""

import numpy as np
import pytest
import torch
from PIL import Image

from attnlab.data import build_dataset, dataset_info
from attnlab.errors import DatasetError

COLOURS = {"cat": (200, 100, 50), "dog": (10, 250, 128), "eel": (0, 0, 255)}


def write_tree(root, splits=("train", "val"), classes=("cat", "dog", "eel"), per_class=2):
    for split in splits:
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                # Solid colour, odd size: any resize or crop keeps every pixel at this colour.
                Image.new("RGB", (40 + 7 * i, 30), COLOURS[name]).save(folder / f"{i}.png")


def colour_of(image, info):
    mean = torch.tensor(info.mean).view(3, 1, 1)
    std = torch.tensor(info.std).view(3, 1, 1)
    return (image * std + mean) * 255


def test_tree_loads_with_class_labels_and_colours(tmp_path):
    write_tree(tmp_path)
    info = dataset_info("imagefolder", data_dir=tmp_path, image_size=32)
    assert (info.num_classes, info.image_size, info.in_chans) == (3, 32, 3)
    np.testing.assert_allclose(info.mean, (0.485, 0.456, 0.406))
    np.testing.assert_allclose(info.std, (0.229, 0.224, 0.225))
    for train in (True, False):
        ds = build_dataset("imagefolder", train, data_dir=tmp_path, image_size=32)
        assert len(ds) == 6
        for i in range(len(ds)):
            image, label = ds[i]
            assert image.shape == (3, 32, 32) and isinstance(label, int)
            rgb = COLOURS[["cat", "dog", "eel"][label]]
            pixels = colour_of(image, info)
            for c in range(3):
                assert torch.allclose(pixels[c], torch.full((32, 32), float(rgb[c])), atol=0.5)


def test_default_size_is_224_and_recipe_keeps_shape(tmp_path):
    write_tree(tmp_path, per_class=1)
    assert dataset_info("imagefolder", data_dir=tmp_path).image_size == 224
    torch.manual_seed(0)
    ds = build_dataset("imagefolder", True, data_dir=tmp_path, augment="recipe", image_size=48)
    assert all(ds[i][0].shape == (3, 48, 48) for i in range(len(ds)))
    names = [type(t).__name__ for t in ds.transform.transforms]
    assert "RandAugment" in names and "RandomErasing" in names


def test_val_falls_back_to_test_and_keeps_train_class_indices(tmp_path):
    write_tree(tmp_path, splits=("train",))
    write_tree(tmp_path, splits=("test",), classes=("eel",), per_class=1)  # eel only: still label 2
    ds = build_dataset("imagefolder", False, data_dir=tmp_path, image_size=16)
    assert len(ds) == 1 and ds[0][1] == 2


def test_missing_tree_names_the_path(tmp_path):
    with pytest.raises(DatasetError) as err:
        build_dataset("imagefolder", True, data_dir=tmp_path)
    assert str((tmp_path / "train").resolve()) in str(err.value) and "--data-dir" in str(err.value)
    with pytest.raises(DatasetError, match="val"):
        dataset_info("imagefolder", data_dir=tmp_path)


def test_empty_train_folder_is_an_error(tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="no images"):
        build_dataset("imagefolder", True, data_dir=tmp_path)
