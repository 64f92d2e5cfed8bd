"""Datasets (in-memory tensors from offline files) and client partitioners."""

from splitlab.data.datasets import (
    DATASETS,
    LOCATORS,
    Dataset,
    dataset_availability,
    dataset_names,
    load_dataset,
)
from splitlab.data.partition import parse_partition_scheme, partition, partition_report

__all__ = [
    "DATASETS",
    "LOCATORS",
    "Dataset",
    "dataset_availability",
    "dataset_names",
    "load_dataset",
    "parse_partition_scheme",
    "partition",
    "partition_report",
]
