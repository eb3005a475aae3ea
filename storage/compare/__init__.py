"""Streaming comparison of two hookline runs (numpy only; never imports torch).

For every hook handle and field present in both runs, the records are paired on their
``(step, call)`` index (a step with several calls is compared call by call) and three metrics are
computed per pair, in float64, on the flattened record tensors ``a`` (run A) and ``b`` (run B):

* ``cosine``     = ``a.b / (||a|| ||b||)``  (1.0 when both are all-zero, NaN when only one is),
* ``rel_l2``     = ``||a - b|| / ||a||``     (0.0 when both are all-zero, inf when only ``a`` is),
* ``norm_ratio`` = ``||b|| / ||a||``         (1.0 when both are all-zero, inf when only ``a`` is).

``metrics=["cka", "procrustes"]`` compare each record pair as a samples x features matrix
(linear CKA; the angular Procrustes distance; :mod:`.represent`) and give each field's value
over all its common records at once (``FieldComparison.overall``, streamed).
:func:`similarity` builds, per handle, the N x N matrix of such values over N runs, on a
``dask.distributed`` client when given (:mod:`.matrix`). Handles pair on their names, a
framework's wrapper prefix (``model.``, ``module.``, ``_orig_mod.``) dropped when needed, or
as ``rename=`` says (:mod:`.align`).

Records are read in blocks of consecutive records of at most ``block_bytes`` (float64) each
(:mod:`hookline.storage.blocks`), so memory stays bounded however large the runs are: a run larger than RAM
compares fine. When only ``norm_ratio`` is asked for, the per-record norms the writer stored
(``Field.norms()``) are used and no data is read.

Problems are results, not exceptions: a handle or field present in only one run, per-record
shapes that differ, or no common ``(step, call)`` pairs each yield a :class:`FieldComparison`
with a non-``"ok"`` ``status`` and a message that says what is wrong. Only a handle or field
selection that matches nothing in either run raises :class:`InvalidArgumentError`.

The package: :mod:`.metrics` (the element-wise metrics), :mod:`.represent` (CKA, Procrustes),
:mod:`.results` (what a comparison returns), :mod:`.fields` (one field of two handles,
streaming), :mod:`.align` (pairing handle names), :mod:`.runs` (choosing handles and fields,
comparing runs), :mod:`.matrix` (N runs). Its public names are exported here.

Example::

    from hookline.storage import compare_runs
    result = compare_runs("runs/lr0.01", "runs/lr0.1", handles="grads[*]")
    for r in result:
        print(r.handle, r.field, r.status, r.summary("cosine"))
"""

from __future__ import annotations

from .align import WRAPPER_PREFIXES, Alignment, align_handles, parse_rename
from .fields import compare_fields
from .matrix import similarity
from .metrics import ALL_METRICS, METRICS, pair_metrics
from .represent import REPRESENTATION_METRICS
from .results import STATUSES, CompareResult, FieldComparison
from .runs import compare_runs, count_pairs, iter_compare, plan

__all__ = [
    "METRICS",
    "ALL_METRICS",
    "REPRESENTATION_METRICS",
    "WRAPPER_PREFIXES",
    "Alignment",
    "align_handles",
    "parse_rename",
    "similarity",
    "STATUSES",
    "FieldComparison",
    "CompareResult",
    "compare_runs",
    "iter_compare",
    "compare_fields",
    "pair_metrics",
    "plan",
    "count_pairs",
]
