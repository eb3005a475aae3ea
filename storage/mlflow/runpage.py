"""What the MLflow run page shows of a run directory: a few readable tags per handle and norm metric series.

The run page draws one chart per metric key, so every metric hookline logs is a series with a
point per record (a one-point metric is a chart with a single dot), and there is one chart per
field: its norm. Only gradient fields add a second series, the running maximum of the norm,
which the "gradient norm exceeded v" search filter compares (SPEC §5). Tags are only what a
person reads or searches: the handle id and its record count (the module's name is part of the
key). Everything else a handle has (fields, shapes, dtypes, pictures of its values) is on the
summary page ``hookline/summary.html`` (:mod:`.runsummary`) and in the uploaded manifest; sync
bookkeeping (file digests) is in the ``hookline/sync*.json`` artifact (:mod:`.syncstate`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .keys import cut_tag_value, metric_key, tag_key
from .rundir import NormSeries

__all__ = ["HANDLE_TAGS", "METRIC_STATS", "MAX_FIELDS", "handle_tags", "norm_points"]

#: The tags of one handle (``hookline.K/<name>``): its id and the records whose norms are logged
#: (also the watermark of the next pass).
HANDLE_TAGS = ("id", "records")
#: The metric series of one field (``hookline.K/<field>.<stat>``): the norm of every record, and
#: (gradient fields: :data:`MAX_FIELDS`) its running maximum (whose latest value is the maximum
#: so far, for search filters).
METRIC_STATS = ("norm", "norm_max")
#: Fields (by their first name part) whose running maximum is logged: the gradients.
MAX_FIELDS = ("grad_in", "grad_out")


def handle_tags(handle_id: str, records: int, *, rank: int | None) -> dict[str, str]:
    """The :data:`HANDLE_TAGS` of one handle.

    Args:
        handle_id: the handle id.
        records: records whose norms the run holds.
        rank: the rank in the keys (None: unranked).
    """
    vals = {"id": handle_id, "records": str(records)}
    return {tag_key(handle_id, k, rank=rank): cut_tag_value(v) for k, v in vals.items()}


def norm_points(handle_id: str, series: list[NormSeries], created: int, *, rank: int | None) -> list[Any]:
    """The metric points of the new entries of each field: its norm, and for gradient fields its
    running maximum.

    Every point carries a deterministic timestamp (``created`` + the record's index in the handle),
    so a point sent again is identical and the store drops it.

    The running maximum is logged at the largest step so far (the record's own step unless steps
    went back, e.g. restarting per epoch): MLflow's "latest value", which search filters compare,
    is the value at the largest step, so it is always the maximum over every record so far.

    Args:
        handle_id: the handle id.
        series: the fields' :class:`~.rundir.NormSeries`.
        created: the manifest's creation time, ms since the epoch.
        rank: the rank in the keys (None: unranked).
    """
    from mlflow.entities import Metric

    points = []
    for sr in series:
        if not len(sr.steps):
            continue
        key = metric_key(handle_id, sr.base, "norm", rank=rank)
        points.extend(Metric(key, float(v), created + int(r), int(st))
                      for r, st, v in zip(sr.records, sr.steps, sr.norms))
        if sr.base.partition(".")[0] not in MAX_FIELDS:
            continue  # (one chart per field; the running maximum is for gradient filters)
        order = np.argsort(sr.all_records, kind="stable")
        recs = sr.all_records[order]
        run_max = np.fmax.accumulate(sr.all_norms[order])  # (fmax: a NaN record does not hide the maximum)
        run_step = np.maximum.accumulate(sr.all_steps[order])
        new = recs >= int(sr.records.min())
        key = metric_key(handle_id, sr.base, "norm_max", rank=rank)
        points.extend(Metric(key, float(v), created + int(r), int(st))
                      for r, st, v in zip(recs[new], run_step[new], run_max[new]))
    return points
