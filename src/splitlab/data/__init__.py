"""Datasets (in-memory tensors from offline files) and client partitioners."""

import functools

from splitlab.data.datasets import (
    BUILT_IN,
    DATASETS,
    LOCATORS,
    SAMPLE_KINDS,
    SAMPLES,
    SEQUENCE_DATASETS,
    Dataset,
    TextSource,
    dataset_availability,
    dataset_names,
    load_dataset,
    load_split,
    register_dataset,
)
from splitlab.data.partition import counts_report, parse_partition_scheme, partition, partition_report

from splitlab.data import language, leaf, tables  # isort: skip (build on datasets)

# The LEAF datasets (femnist, celeba, shakespeare), registered here so that datasets.py need not
# import the modules that build on it.
DATASETS.update(leaf.LOADERS)
LOCATORS.update(leaf.LOCATORS)
DATASETS.update(tables.LOADERS)  # breast_cancer, csv
LOCATORS.update(tables.LOCATORS)
# The language datasets, likewise; listed among all datasets at their default sequence length.
SEQUENCE_DATASETS.update(language.LOADERS)
LOCATORS.update(language.LOCATORS)
DATASETS.update(
    {
        name: functools.partial(lambda name, data_dir, seed: SEQUENCE_DATASETS[name](TextSource(data_dir)), name)
        for name in SEQUENCE_DATASETS
    }  # fmt: skip
)
BUILT_IN.update(DATASETS)  # splitlab's own: a plugin may not replace them

__all__ = [
    "counts_report",
    "DATASETS",
    "LOCATORS",
    "SAMPLE_KINDS",
    "SAMPLES",
    "Dataset",
    "TextSource",
    "dataset_availability",
    "dataset_names",
    "load_dataset",
    "load_split",
    "parse_partition_scheme",
    "partition",
    "partition_report",
    "register_dataset",
]
