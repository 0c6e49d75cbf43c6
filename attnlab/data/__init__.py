"""Datasets and the recipes' transforms, as one table (:mod:`attnlab.data.registry`; docs/training.md, "Data").

``build_dataset``, ``dataset_info`` and ``DATASET_TABLE`` load without torch; the builders and
``build_device_pipeline`` load on first use.
"""

import importlib

from attnlab.data.registry import (
    AUGMENTS,
    DATASET_TABLE,
    DATASETS,
    DEFAULT_DATASET,
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


__all__ = ["AUGMENTS", "DATASETS", "DATASET_TABLE", "DEFAULT_DATASET", "AugmentRecipe", "Dataset", "DatasetInfo",
           "DeviceBatch", "DeviceData", "DevicePipeline", "Option", "build_dataset", "build_device_pipeline",
           "build_transform", "dataset", "dataset_info"]
