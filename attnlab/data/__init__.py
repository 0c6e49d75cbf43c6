"""Datasets and the NS-Attn paper's transforms.

``build_dataset(name, train, ...)`` yields (image, label) with image a normalised float tensor (C, H, W) and
label an int; ``dataset_info(name, ...)`` gives what a model needs (classes, size, channels, mean, std).
Names: cifar10, cifar100 (torchvision), digits (scikit-learn's 8x8 digits, the embedded default),
synthetic (random tensors for benchmarks), imagefolder (any ImageNet-style folder tree, timm transforms).
``build_device_pipeline`` keeps a tensor dataset's train split on a device and augments it there per sample.
"""

from attnlab.data.device_pipeline import AugmentRecipe, DeviceBatch, DevicePipeline, build_device_pipeline
from attnlab.data.registry import (
    AUGMENTS,
    DATASETS,
    DEFAULT_DATASET,
    OPTIONS,
    DatasetInfo,
    build_dataset,
    build_transform,
    dataset_info,
)

__all__ = ["AUGMENTS", "DATASETS", "DEFAULT_DATASET", "OPTIONS", "AugmentRecipe", "DatasetInfo", "DeviceBatch",
           "DevicePipeline", "build_dataset", "build_device_pipeline", "build_transform", "dataset_info"]
