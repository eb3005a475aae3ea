"""hookline.storage: the HDF5 run format, the buffered background writer, the reader and the
MLflow adapter. Needs only numpy and h5py (torch and mlflow are imported lazily, on use).

Public names are re-exported here once; import them from ``hookline.storage``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    DuplicateNameError,
    FormatError,
    HookFunctionError,
    HookOutputError,
    HooklineError,
    HookTypeError,
    InvalidArgumentError,
    MissingDependencyError,
    RecordIndexError,
    RunExistsError,
    StorageError,
    TrackingError,
    TrackingUnreachableError,
    UnknownNameError,
    WriterClosedError,
)
from .keys import handle_key
from .mlflow.uri import is_mlflow_reference
from .sources import register_source

# open_run("runs:/<id>") reads MLflow runs through the MLflow source, imported on first use (the
# reader itself knows no remote store).
register_source(is_mlflow_reference, "hookline.storage.mlflow.source:mlflow_source")

# name -> submodule; resolved on first access so that `import hookline.storage` stays cheap and
# never imports mlflow (or torch).
_LAZY = {
    "RunWriter": "writer",
    "WriterStats": "writer",
    "open_run": "reader",
    "Run": "reader",
    "Handle": "reader",
    "Field": "reader",
    "LogicalField": "shards",
    "verify": "verifier",
    "VerifyReport": "verify_report",
    "HandleReport": "verify_report",
    "HandleStats": "writer",
    "LocalSource": "reader",
    "FORMAT_VERSION": "format",
    "MlflowAdapter": "mlflow.adapter",
    "MlflowSource": "mlflow.source",
    "SyncReport": "mlflow.report",
    "mlflow_source": "mlflow.source",
    "sync": "mlflow.sync",
    "recorded_run_id": "mlflow.sync",
    "verify_mlflow_run": "mlflow.verify_remote",
    "compare_runs": "compare",
    "iter_compare": "compare",
    "CompareResult": "compare",
    "FieldComparison": "compare",
    "METRICS": "compare",
    "similarity": "compare",
    "frame": "analysis.across",
    "RecordDataset": "analysis.dataset",
}

__all__ = [
    "DuplicateNameError",
    "FormatError",
    "HookFunctionError",
    "HookOutputError",
    "HooklineError",
    "HookTypeError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "RecordIndexError",
    "RunExistsError",
    "StorageError",
    "TrackingError",
    "TrackingUnreachableError",
    "UnknownNameError",
    "WriterClosedError",
    "handle_key",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hookline.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
