"""Data for mpipar: data sets, the IDX file format, checked downloads and the batch sampler.

The trainer needs only `load_dataset`, `agree_on_data` and the sampler functions; `mpipar data`
(see mpipar/cli/data.py) uses the download registry and `locate_dataset`, which the tests also
ask before they need a set this machine may lack. The `download` function is
deliberately not re-exported: it would hide the `mpipar.data.download` module
of the same name. Exercised by
`pytest tests/test_data.py tests/test_download.py tests/test_data_identity.py`.
"""

from mpipar.data.datasets import (
    DATASETS,
    TOKEN_DATASETS,
    Dataset,
    DatasetLocation,
    ImageDataset,
    load_dataset,
    locate_dataset,
)
from mpipar.data.download import DOWNLOADS, DownloadSpec
from mpipar.data.identity import agree_on_data
from mpipar.data.idx import read_idx, write_idx
from mpipar.data.sampler import GlobalBatchSampler
from mpipar.data.tokens import TokenStream

__all__ = [
    "DATASETS",
    "DOWNLOADS",
    "Dataset",
    "DatasetLocation",
    "DownloadSpec",
    "GlobalBatchSampler",
    "ImageDataset",
    "TOKEN_DATASETS",
    "TokenStream",
    "agree_on_data",
    "load_dataset",
    "locate_dataset",
    "read_idx",
    "write_idx",
]
