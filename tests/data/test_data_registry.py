"""Names, options and errors of attnlab.data."""

import dataclasses

import pytest

import attnlab.data as data
from attnlab.errors import AttnlabError, ConfigError, DatasetError


def test_dataset_names():
    assert data.DATASETS == ("cifar10", "cifar100", "digits", "synthetic", "imagefolder", "listops", "lra_text",
                             "stdlib", "text", "nanogpt", "stdlib_bpe", "mqar", "video", "moving_digits", "digits_qa",
                             "video_qa", "shapes", "coco")
    assert data.DEFAULT_DATASET in data.DATASETS


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(DatasetError) as err:
        data.build_dataset("mnist", True)
    assert "'mnist'" in str(err.value)
    assert all(name in str(err.value) for name in data.DATASETS)
    with pytest.raises(DatasetError):
        data.dataset_info("imagenet")


def test_names_ignore_case_and_spaces():
    assert data.dataset_info(" Digits ").name == "digits"


@pytest.mark.parametrize("name, bad, valid", [("digits", "auto_augment", "image_size"),
                                               ("cifar10", "length", "random_erasing"),
                                               ("synthetic", "random_erasing", "num_classes")])
def test_unknown_option_names_valid_ones(name, bad, valid):
    with pytest.raises(ConfigError) as err:
        data.dataset_info(name, **{bad: 1})
    assert bad in str(err.value) and valid in str(err.value)
    assert isinstance(err.value, AttnlabError)


@pytest.mark.parametrize("name, options", [("cifar10", {"random_erasing": 1.5}), ("cifar10", {"auto_augment": "maybe"}),
                                           ("synthetic", {"seed": -1}), ("synthetic", {"num_classes": 0}),
                                           ("synthetic", {"length": 2.5}), ("digits", {"image_size": "big"}),
                                           ("synthetic", {"in_chans": True})])
def test_bad_option_values(name, options):
    with pytest.raises(ConfigError):
        data.build_dataset(name, True, **options)


def test_option_strings_from_the_command_line_are_converted():
    opts = data.registry.resolve_options("cifar10", {"auto_augment": "false", "random_erasing": "0.5"})
    assert opts["auto_augment"] is False and opts["random_erasing"] == 0.5
    assert data.dataset_info("synthetic", num_classes="5").num_classes == 5


def test_unknown_augment():
    with pytest.raises(ConfigError, match="none, recipe"):
        data.build_dataset("digits", True, augment="heavy")


def test_dataset_info_is_frozen():
    info = data.dataset_info("digits")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.num_classes = 3


def test_build_transform_only_for_pil_datasets():
    import numpy as np
    import torch
    from PIL import Image

    # the eval transform is ToTensor + Normalize with CIFAR-10's published channel mean and std
    pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3) * 5
    out = data.build_transform("cifar10", False, image_size=4)(Image.fromarray(pixels))
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    want = torch.from_numpy(((pixels / 255.0 - mean) / std).transpose(2, 0, 1)).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(DatasetError):
        data.build_transform("digits", True)
