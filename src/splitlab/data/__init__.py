"""Datasets (in-memory tensors from offline files) and client partitioners."""

from splitlab.data.datasets import (
    DATASETS,
    LOCATORS,
    Dataset,
    dataset_availability,
    dataset_names,
    load_dataset,
    load_split,
    register_dataset,
)
from splitlab.data.partition import counts_report, parse_partition_scheme, partition, partition_report

from splitlab.data import leaf  # isort: skip (builds on datasets)

# The LEAF datasets (femnist, celeba, shakespeare), registered here so that datasets.py need not
# import the modules that build on it.
DATASETS.update(leaf.LOADERS)
LOCATORS.update(leaf.LOCATORS)

__all__ = [
    "counts_report",
    "DATASETS",
    "LOCATORS",
    "Dataset",
    "dataset_availability",
    "dataset_names",
    "load_dataset",
    "load_split",
    "parse_partition_scheme",
    "partition",
    "partition_report",
    "register_dataset",
]
