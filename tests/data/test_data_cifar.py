"""CIFAR through build_dataset, on small archives written here in the real python-pickle layout."""

import pickle
import urllib.error

import numpy as np
import pytest
import torch

import attnlab.data.cifar as cifar_module
from attnlab.data import build_dataset, dataset_info
from attnlab.errors import DatasetError

N_PER_BATCH, N_TEST = 2, 3


def pixel(k: int, c: int, y: int, x: int) -> int:
    """The value written for image k, channel c (0 R, 1 G, 2 B), row y, column x."""
    return (k * 37 + c * 80 + y * 7 + x * 3) % 256


def cifar_rows(first: int, n: int) -> np.ndarray:
    """Rows of 3072 bytes as in the CIFAR files: the 1024 red values row by row, then green, then blue."""
    rows = np.zeros((n, 3072), dtype=np.uint8)
    for i in range(n):
        for c in range(3):
            for y in range(32):
                for x in range(32):
                    rows[i, c * 1024 + y * 32 + x] = pixel(first + i, c, y, x)
    return rows


def expected_image(k: int) -> np.ndarray:
    return np.array([[[pixel(k, c, y, x) for x in range(32)] for y in range(32)] for c in range(3)], np.float64)


def dump(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    k = 0
    for b in range(1, 6):
        dump(folder / f"data_batch_{b}", {"batch_label": f"training batch {b} of 5", "data": cifar_rows(k, N_PER_BATCH),
                                          "labels": [(k + i) % 10 for i in range(N_PER_BATCH)],
                                          "filenames": [f"img{k + i}.png" for i in range(N_PER_BATCH)]})
        k += N_PER_BATCH
    dump(folder / "test_batch", {"batch_label": "testing batch 1 of 1", "data": cifar_rows(100, N_TEST),
                                 "labels": [9, 0, 5], "filenames": ["t0.png", "t1.png", "t2.png"]})
    dump(folder / "batches.meta", {"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": 2,
                                   "num_vis": 3072})
    return folder


def write_cifar100(root):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    n_train = 4
    dump(folder / "train", {"batch_label": "training batch 1 of 1", "data": cifar_rows(0, n_train),
                            "fine_labels": [0, 42, 99, 7], "coarse_labels": [4, 3, 19, 1],
                            "filenames": [f"img{i}.png" for i in range(n_train)]})
    dump(folder / "test", {"batch_label": "testing batch 1 of 1", "data": cifar_rows(200, N_TEST),
                           "fine_labels": [55, 1, 98], "coarse_labels": [0, 1, 2],
                           "filenames": ["t0.png", "t1.png", "t2.png"]})
    dump(folder / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                           "coarse_label_names": [f"coarse{i}" for i in range(20)]})
    return folder


def unnormalise(image: torch.Tensor, info) -> np.ndarray:
    """Back to 0..255 pixel values: x * std + mean, times 255 (ToTensor divides by 255)."""
    mean = np.array(info.mean).reshape(3, 1, 1)
    std = np.array(info.std).reshape(3, 1, 1)
    return (image.double().numpy() * std + mean) * 255.0


def test_cifar_statistics_are_the_published_training_set_values():
    c10, c100 = dataset_info("cifar10"), dataset_info("cifar100")
    assert (c10.num_classes, c10.image_size, c10.in_chans) == (10, 32, 3)
    assert (c100.num_classes, c100.image_size, c100.in_chans) == (100, 32, 3)
    np.testing.assert_allclose(c10.mean, (0.4914, 0.4822, 0.4465))
    np.testing.assert_allclose(c10.std, (0.2470, 0.2435, 0.2616))
    np.testing.assert_allclose(c100.mean, (0.5071, 0.4865, 0.4409))
    np.testing.assert_allclose(c100.std, (0.2673, 0.2564, 0.2762))


def test_cifar10_loads_pixels_and_labels(tmp_path):
    write_cifar10(tmp_path)
    info = dataset_info("cifar10")
    train = build_dataset("cifar10", True, data_dir=tmp_path, verify_md5=False)
    test = build_dataset("cifar10", False, data_dir=tmp_path, verify_md5=False)
    assert len(train) == 5 * N_PER_BATCH and len(test) == N_TEST
    assert [train[i][1] for i in range(len(train))] == [i % 10 for i in range(10)]
    assert [test[i][1] for i in range(N_TEST)] == [9, 0, 5]
    for ds, first, idx in ((train, 0, [0, 3, 9]), (test, 100, [0, 2])):
        for i in idx:
            image, label = ds[i]
            assert isinstance(label, int)
            assert image.shape == (3, 32, 32) and image.dtype == torch.float32
            np.testing.assert_allclose(unnormalise(image, info), expected_image(first + i), atol=1e-3)


def test_cifar100_loads_fine_labels_and_pixels(tmp_path):
    write_cifar100(tmp_path)
    info = dataset_info("cifar100")
    train = build_dataset("cifar100", True, data_dir=str(tmp_path), verify_md5=False)
    test = build_dataset("cifar100", False, data_dir=str(tmp_path), verify_md5=False)
    assert [train[i][1] for i in range(4)] == [0, 42, 99, 7]
    assert [test[i][1] for i in range(3)] == [55, 1, 98]
    assert train.classes[42] == "fine42"
    np.testing.assert_allclose(unnormalise(train[2][0], info), expected_image(2), atol=1e-3)
    np.testing.assert_allclose(unnormalise(test[1][0], info), expected_image(201), atol=1e-3)


def test_recipe_crop_and_flip_keep_the_image_up_to_a_shift(tmp_path):
    """With AutoAugment and erasing off, the recipe is a 4-pixel-padded random crop and a random flip."""
    write_cifar10(tmp_path)
    info = dataset_info("cifar10")
    ds = build_dataset("cifar10", True, data_dir=tmp_path, augment="recipe", auto_augment=False, random_erasing=0.0,
                       verify_md5=False)
    padded = np.pad(expected_image(4), ((0, 0), (4, 4), (4, 4)))  # zero padding: black
    torch.manual_seed(0)
    for _ in range(6):
        out = unnormalise(ds[4][0], info)
        candidates = [padded[:, dy:dy + 32, dx:dx + 32] for dy in range(9) for dx in range(9)]
        candidates += [c[:, :, ::-1] for c in candidates]
        assert min(np.abs(out - c).max() for c in candidates) < 1e-3


def test_full_recipe_output_shape_and_test_split_untouched(tmp_path):
    write_cifar100(tmp_path)
    torch.manual_seed(0)
    train = build_dataset("cifar100", True, data_dir=tmp_path, augment="recipe", verify_md5=False)
    for i in range(4):
        image, label = train[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and torch.isfinite(image).all()
    test = build_dataset("cifar100", False, data_dir=tmp_path, augment="recipe", verify_md5=False)
    np.testing.assert_allclose(unnormalise(test[0][0], dataset_info("cifar100")), expected_image(200), atol=1e-3)
    names = [type(t).__name__ for t in train.transform.transforms]
    assert names == ["RandomCrop", "RandomHorizontalFlip", "AutoAugment", "ToTensor", "Normalize", "RandomErasing"]
    assert train.transform.transforms[-1].p == 0.25


def test_image_size_option_resizes(tmp_path):
    write_cifar10(tmp_path)
    ds = build_dataset("cifar10", False, data_dir=tmp_path, image_size=64, verify_md5=False)
    assert ds[0][0].shape == (3, 64, 64)
    assert dataset_info("cifar10", image_size=64).image_size == 64


@pytest.mark.parametrize("name, folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")])
def test_missing_files_error_names_path_and_download(tmp_path, name, folder):
    with pytest.raises(DatasetError) as err:
        build_dataset(name, True, data_dir=tmp_path, verify_md5=False)
    message = str(err.value)
    assert str((tmp_path / folder).resolve()) in message
    assert "--download" in message and "--data-dir" in message
    assert "\n" not in message


def test_one_missing_file_is_named(tmp_path):
    folder = write_cifar10(tmp_path)
    (folder / "test_batch").unlink()
    with pytest.raises(DatasetError, match="test_batch") as err:
        build_dataset("cifar10", True, data_dir=tmp_path, verify_md5=False)
    assert str(folder.resolve()) in str(err.value)


def test_malformed_layout_is_a_dataset_error(tmp_path):
    folder = write_cifar100(tmp_path)
    dump(folder / "train", {"data": np.zeros((4, 1024), np.uint8), "fine_labels": [0, 1, 2, 3]})
    with pytest.raises(DatasetError, match="malformed|layout"):
        build_dataset("cifar100", True, data_dir=tmp_path, verify_md5=False)
    (folder / "train").write_bytes(b"not a pickle")
    with pytest.raises(DatasetError, match="layout"):
        build_dataset("cifar100", True, data_dir=tmp_path, verify_md5=False)


def test_out_of_range_labels_are_a_dataset_error(tmp_path):
    folder = write_cifar10(tmp_path)
    dump(folder / "test_batch", {"data": cifar_rows(0, 2), "labels": [3, 10]})
    with pytest.raises(DatasetError, match="labels outside"):
        build_dataset("cifar10", False, data_dir=tmp_path, verify_md5=False)


def test_md5_is_checked_by_default_and_the_message_names_the_opt_out(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(DatasetError, match="md5") as err:
        build_dataset("cifar10", True, data_dir=tmp_path)
    assert "verify_md5: false" in str(err.value)
    assert len(build_dataset("cifar10", True, data_dir=tmp_path, verify_md5=False)) == 5 * N_PER_BATCH


def test_download_failure_is_a_dataset_error(tmp_path, monkeypatch):
    calls = []

    def unreachable(url, root, filename, md5):
        calls.append((url, filename, md5))
        raise urllib.error.URLError("network unreachable")

    monkeypatch.setattr(cifar_module, "download_and_extract_archive", unreachable)
    with pytest.raises(DatasetError, match="could not download CIFAR-10") as err:
        build_dataset("cifar10", True, data_dir=tmp_path, download=True, verify_md5=False)
    assert str(tmp_path.resolve()) in str(err.value)
    # The archive's md5 is handed to torchvision's downloader, which checks it.
    assert calls == [("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                      "c58f30108f718f92721af3b95e74349a")]


def test_download_skipped_when_files_present(tmp_path, monkeypatch):
    write_cifar10(tmp_path)

    def must_not_run(*args, **kwargs):
        raise AssertionError("download attempted although the files are present")

    monkeypatch.setattr(cifar_module, "download_and_extract_archive", must_not_run)
    assert len(build_dataset("cifar10", False, data_dir=tmp_path, download=True, verify_md5=False)) == N_TEST
