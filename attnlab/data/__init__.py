"""Datasets and the recipes' transforms, as one table (:mod:`attnlab.data.registry`).

``build_dataset(name, train, ...)`` yields one split as a torch Dataset (for images: (image, label), image a
normalised float tensor (C, H, W)); ``dataset_info(name, ...)`` gives what a model needs (classes, sizes,
statistics); ``DATASET_TABLE`` holds every entry (name, task, options with bounds, builder).
``build_device_pipeline`` keeps a device-resident dataset's train split on a device and augments it there per
sample. The table's names load without torch; the builders and the pipeline load on first use.
"""

import importlib

from attnlab.data.registry import (
    AUGMENTS,
    DATASET_TABLE,
    DATASETS,
    DEFAULT_DATASET,
    OPTIONS,
    Dataset,
    DatasetInfo,
    DeviceData,
    Option,
    build_dataset,
    build_transform,
    dataset,
    dataset_info,
)

_LAZY = {"AugmentRecipe": "device_pipeline", "DeviceBatch": "device_pipeline", "DevicePipeline": "device_pipeline",
         "build_device_pipeline": "device_pipeline"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AUGMENTS", "DATASETS", "DATASET_TABLE", "DEFAULT_DATASET", "OPTIONS", "AugmentRecipe", "Dataset",
           "DatasetInfo", "DeviceBatch", "DeviceData", "DevicePipeline", "Option", "build_dataset",
           "build_device_pipeline", "build_transform", "dataset", "dataset_info"]
