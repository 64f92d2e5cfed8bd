"""Datasets (in-memory tensors from offline files) and client partitioners."""

from splitlab.data.datasets import (
    DATASETS,
    LOCATORS,
    Dataset,
    dataset_availability,
    dataset_names,
    load_dataset,
    load_split,
)
from splitlab.data.partition import counts_report, parse_partition_scheme, partition, partition_report

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
]
