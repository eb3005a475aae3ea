"""Fuzz suite for damaged and hostile run directories (issue 23).

About 300 seeded variants of two real runs (``_fuzz_runs.py``: a closed run recorded by the
Recorder, and a run of unmerged segments) go through ``open_run`` (every record, norm, step and
call read), ``hookline show`` (table, ``--json``, one handle's statistics), ``hookline export``,
``hookline verify`` and ``hookline verify --repair`` followed by ``open_run`` again. The variants
(``_fuzz_mutations.py``): bit flips at seeded offsets in each handle file's metadata (superblock,
object headers, heaps, B-trees), in its first 2 KiB, and in its live raw data; truncations at
seeded lengths; JSON-level manifest mutations (a value of the wrong type, negative and huge
numbers, deleted keys, ``file``/``key`` paths that are absolute or lead out with ``../``, control
characters in ids and names, flipped and truncated bytes); and structural ones (a handle file that
is a symlink out of the run, a symlinked sub-directory, a FIFO, a directory, ``/dev/zero``, a
deleted segment). Test ids name base, mutation, seed and target:
``rec-h5-meta-flip-s03-outputs_fc1.h5``; the failure message gives the concrete offsets and bits.

Each outcome must be a hookline error, a listed problem, or correct data (defined in
``_fuzz_oracle.py``); never a traceback, a hang (every operation is bounded by
``BOUND_S`` seconds and a memory margin), a path touched outside the run, or a silent empty
result. The run lives in ``<tmp>/ws/run`` beside ``<tmp>/ws/sentinel``, a run with the same file
names and other values: the sentinel's bytes, modes and mtimes must not change, nothing may appear
in ``ws`` or its parent, and data read from the sentinel does not pass as the run's.

``sync`` runs against the session's real MLflow server for a subset of about 30 variants
(``sync_plan``: a sync takes up to a second, every other operation milliseconds): nothing from
outside the run is uploaded (every artifact's bytes are a regular file of the run), no file the
reader finds damaged is uploaded, the other handles' files are, and a sync that exits 0 found
nothing wrong and tags every handle with its real record count.

Speed and isolation: the base runs are recorded once per session and copied per variant, the
commands run in-process with click's ``CliRunner``, and each case runs in a forked child (about
20 ms): HDF5 segfaults on a few damaged files, and such a crash fails that case (``[crash]``), not
the session. The suite takes about 1.5 minutes on two cores when nothing hangs (a hang costs
``BOUND_S``, 5 s); ``SYNC_IDS`` and ``sync_plan`` pick the synced variants.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import h5py
import pytest

from _fuzz_bounds import BOUND_S, Hang, bounded, fifo_unblocker, in_child
from _fuzz_mutations import FILES, HANDLES, SYNC_IDS, Applied, Variant, apply, plan, sync_plan
from _fuzz_oracle import (
    Comparison,
    HandleRead,
    ReadOutcome,
    compare_records,
    crash,
    invoke,
    judge_cli,
    judge_read,
    judge_silence,
    read_all,
)
from _fuzz_runs import RECORDERS, Original, file_digests, read_original, snapshot, snapshot_diff

VARIANTS = plan()
SYNC_VARIANTS = sync_plan(VARIANTS)


def _params(variants: list[Variant], default: Any) -> list[Any]:
    """The variants as test parameters: those ``default(v)`` picks run by default, the others
    are the ``slow`` (fuller) set that ``pytest -m slow`` (CI) runs."""
    return [pytest.param(v, id=v.id, marks=() if default(v) else pytest.mark.slow) for v in variants]


#: By default the first seed of every mutation kind of every base run (all kinds are covered), and
#: the hand-picked sync variants (:data:`SYNC_IDS`); every other seed in the slow set.
VARIANT_PARAMS = _params(VARIANTS, lambda v: v.seed == 0)
SYNC_PARAMS = _params(SYNC_VARIANTS, lambda v: v.id in SYNC_IDS)


@dataclass
class Bases:
    """The session's base runs (and sentinels), their original records and the h5py ground truth."""

    runs: dict[str, Path]
    sentinels: dict[str, Path]
    originals: dict[str, Original]
    sentinel_originals: dict[str, Original]
    ground: dict[Path, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    root = tmp_path_factory.mktemp("fuzz-bases")
    runs, sentinels, originals, theirs = {}, {}, {}, {}
    for name, record in RECORDERS.items():
        runs[name] = record(root / name, seed=0)
        sentinels[name] = record(root / f"{name}-sentinel", seed=7)
        originals[name] = read_original(runs[name], name)
        other = theirs[name] = read_original(sentinels[name], name)
        for hid, fields in originals[name].records.items():  # (reading the sentinel must not pass)
            for f, recs in fields.items():
                assert any(k not in other.records[hid][f] or other.records[hid][f][k].tobytes() != a.tobytes()
                           for k, a in recs.items()), (name, hid, f)
    return Bases(runs, sentinels, originals, theirs)


@pytest.fixture(scope="module")
def runner() -> Any:
    from click.testing import CliRunner

    return CliRunner()


@dataclass
class Case:
    """One variant applied to a fresh copy of its base run, with its sentinel next to it."""

    variant: Variant
    ws: Path
    run: Path
    sentinel: Path
    out: Path
    orig: Original
    theirs: Original  # (the sentinel's records)
    applied: Applied
    snap: dict[str, Any]
    fails: list[str] = field(default_factory=list)
    read: ReadOutcome | None = None  # (what open_run returned before any command ran)
    clean: bool = False
    damaged: set[str] = field(default_factory=set)  # handles the reader lists problems of
    repair_code: int = 0

    @property
    def progress(self) -> Path:
        return self.out / "progress"

    def check_outside(self, op: str) -> None:
        """A failure when anything outside the run changed since the last check."""
        now = snapshot(self.ws, self.run)
        diff = snapshot_diff(self.snap, now)
        if diff:
            self.fails.append(f"[outside] {op}: {'; '.join(diff[:5])}")
            self.snap = now

    def bounded(self, op: str, seconds: float | None = None) -> Any:
        kw = {} if seconds is None else {"seconds": seconds}
        return bounded(f"{self.variant.id} {op}", **kw)

    def unblocker(self) -> Any:
        """A :func:`fifo_unblocker` on the run when the variant made a FIFO (else nothing)."""
        return fifo_unblocker(self.run) if self.applied.fifos else contextlib.nullcontext()

    def report(self) -> str:
        return (f"{self.variant.id}: {self.applied.note}\n  " + "\n  ".join(self.fails))


def make_case(v: Variant, bases: Bases, tmp_path: Path) -> Case:
    """Copy the base run and its sentinel into ``tmp_path/ws``, apply ``v``, take the snapshot."""
    ws = tmp_path / "ws"
    run, sentinel = ws / "run", ws / "sentinel"
    shutil.copytree(bases.runs[v.base], run, symlinks=True)
    shutil.copytree(bases.sentinels[v.base], sentinel, symlinks=True)
    out = tmp_path / "out"
    out.mkdir()
    with bounded(f"{v.id} apply"):
        applied = apply(v, run, sentinel, bases.runs[v.base], bases.ground)
    return Case(v, ws, run, sentinel, out, bases.originals[v.base], bases.sentinel_originals[v.base], applied,
                snapshot(ws, run))


def _first_handle(case: Case) -> tuple[str, str]:
    hid = case.variant.handle or sorted(HANDLES[case.variant.base])[0]
    return hid, HANDLES[case.variant.base][hid][1][0]


# ------------------------------------------------------------------------------------------ steps
def step_read(case: Case, runner: Any) -> list[str]:
    outcome = case.read = read_all(case.run)
    fails, case.clean = judge_read("open_run", outcome, case.orig, case.applied.values_only, case.theirs)
    if case.variant.kind == "none" and not case.clean:
        fails.append(f"[harness] open_run: the unmutated base run does not read back clean: {outcome}")
    return fails


def step_show_table(case: Case, runner: Any) -> list[str]:
    return _cli(case, runner, "show", ["show", str(case.run)])[0]


def step_show_json(case: Case, runner: Any) -> list[str]:
    fails, out = _cli(case, runner, "show --json", ["show", str(case.run), "--json"])
    if out.code != 0 or out.warned:
        return fails
    for info in json.loads(out.stdout)["handles"]:
        n = case.orig.counts.get(info["handle"])
        if n and info["records"] < n and not info["warning"]:
            cat = "silent-empty" if info["records"] == 0 else "silent-loss"
            fails.append(f"[{cat}] show --json: {info['handle']!r} shows {info['records']} of {n} records")
    return fails


def step_show_handle(case: Case, runner: Any) -> list[str]:
    hid, _ = _first_handle(case)
    fails, out = _cli(case, runner, "show HANDLE", ["show", str(case.run), hid, "--json"])
    if out.code != 0 or out.warned or hid in case.applied.values_only:
        return fails
    d = json.loads(out.stdout)
    for f in d["fields"]:
        recs = case.orig.records[hid].get(f["name"])
        if recs is None:
            fails.append(f"[silent-wrong-data] show HANDLE: {hid!r} shows a field {f['name']!r} it never recorded")
            continue
        lo = min(float(a.min()) for a in recs.values() if a.size)
        hi = max(float(a.max()) for a in recs.values() if a.size)
        if f["records"] < len(recs) or (f["min"], f["max"]) != (lo, hi):
            fails.append(f"[silent-wrong-data] show HANDLE: {hid!r} {f['name']}: {f['records']} records, "
                         f"min/max {f['min']}/{f['max']}; recorded {len(recs)}, {lo}/{hi}")
    return fails


def step_export(case: Case, runner: Any) -> list[str]:
    hid, name = _first_handle(case)
    dest = case.out / "export.h5"
    fails, out = _cli(case, runner, "export", ["export", str(case.run), hid, name, "--format", "h5",
                                                "--out", str(dest), "--force", "-q"])
    if out.code != 0 or out.warned:
        return fails
    with h5py.File(dest, "r") as f:
        data = f["data"]
        rows = [data[k][()] for k in sorted(data)] if isinstance(data, h5py.Group) else list(data[()])
        got = [(int(s), int(c), r) for s, c, r in zip(f["step"][:], f["call"][:], rows)]
    cmp = Comparison()
    compare_records(case.orig, hid, name, got, cmp, case.theirs)
    return fails + judge_silence("export", cmp, False, case.applied.values_only)


def step_verify(case: Case, runner: Any) -> list[str]:
    fails, out = _cli(case, runner, "verify", ["verify", str(case.run)])
    if out.code == 0 and not case.clean:
        fails.append("[verify-ok-on-damage] verify: exit 0 (OK), but reading the run was not clean")
    return fails


def step_repair(case: Case, runner: Any) -> list[str]:
    fails, out = _cli(case, runner, "verify --repair", ["verify", str(case.run), "--repair"])
    case.repair_code = out.code
    if out.code == 0 and not case.clean:
        fails.append("[repair-ok-on-damage] verify --repair: exit 0, but reading the run was not clean before")
    return fails


def step_read_repaired(case: Case, runner: Any) -> list[str]:
    outcome = read_all(case.run)
    fails, _ = judge_read("open_run after repair", outcome, case.orig, case.applied.values_only, case.theirs)
    if case.repair_code != 0:  # (the repair said what it found; a crash or outside data still count)
        fails = [f for f in fails if not f.startswith("[silent")]
    return fails


def _cli(case: Case, runner: Any, op: str, args: list[str]) -> tuple[list[str], Any]:
    out = invoke(runner, args)
    fails = judge_cli(op, out)
    expect_fail = case.variant.base == "seg" and op == "verify"  # (unmerged segments are a problem)
    if case.variant.kind == "none" and (out.code != 0) != expect_fail:
        fails.append(f"[harness] {op}: the unmutated base run exits {out.code}: {out.stderr[-300:]!r}")
    return fails, out


STEPS: list[tuple[str, Callable[[Case, Any], list[str]]]] = [
    ("open_run", step_read), ("show", step_show_table), ("show --json", step_show_json),
    ("show HANDLE", step_show_handle), ("export", step_export), ("verify", step_verify),
    ("verify --repair", step_repair), ("open_run after repair", step_read_repaired),
]


def run_steps(case: Case, runner: Any, steps: list[tuple[str, Callable[[Case, Any], list[str]]]]) -> None:
    """Run the steps in order, each bounded; after each, check nothing outside the run changed.
    A hang ends the case (what follows would wait on the same thing). Each step's name is
    appended to ``case.progress`` first, so a crash of the process can name its step."""
    for op, fn in steps:
        with open(case.progress, "a") as fh:
            fh.write(op + "\n")
        try:
            with case.bounded(op):
                case.fails += fn(case, runner)
        except Hang as e:
            case.fails.append(f"[hang] {op}: {e}")
            case.check_outside(op)
            return
        except Exception as e:  # (a harness error, or an exception the step did not expect)
            case.fails.append(crash(op, e))
        case.check_outside(op)


def run_isolated(case: Case, runner: Any, steps: list[tuple[str, Callable[[Case, Any], list[str]]]]) -> None:
    """:func:`run_steps` in a forked child (``in_child``): a crash of HDF5 fails this case only.
    Afterwards ``case.fails``, ``case.clean`` and ``case.damaged`` are the child's."""

    def body() -> dict[str, Any]:
        run_steps(case, runner, steps)
        damaged = sorted(h for h, r in (case.read or ReadOutcome()).handles.items() if r.problems or r.error)
        return {"fails": case.fails, "clean": case.clean, "damaged": damaged}

    with case.unblocker():
        got, why = in_child(body, timeout=len(steps) * BOUND_S + 60)
    if why is not None:
        done = case.progress.read_text().split() if case.progress.exists() else []
        op = done[-1] if done else "start"
        cat = "hang" if why.startswith("did not finish") else "crash"
        case.fails.append(f"[{cat}] {op} (and what follows): the process {why}")
        return
    case.fails, case.clean, case.damaged = got["fails"], got["clean"], set(got["damaged"])


@pytest.mark.timeout(300, method="thread")  # a backstop only: every operation has its own bound
@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_variant(variant: Variant, bases: Bases, tmp_path: Path, runner: Any) -> None:
    case = make_case(variant, bases, tmp_path)
    run_isolated(case, runner, STEPS)
    if case.fails:
        pytest.fail(case.report(), pytrace=False)


def test_the_plan_covers_the_issue() -> None:
    """At least 200 variants, ids unique, every mutation kind present, a sync subset of 20-40."""
    ids = [v.id for v in VARIANTS]
    assert len(ids) >= 200 and len(set(ids)) == len(ids)
    kinds = {v.kind for v in VARIANTS}
    assert kinds >= {"h5-meta-flip", "h5-data-flip", "h5-trunc", "json-type", "json-num", "json-path", "json-del",
                     "json-flip", "json-trunc", "json-ctrl", "symlink-out", "fifo", "dir"}
    assert 20 <= len(SYNC_VARIANTS) <= 40, len(SYNC_VARIANTS)
    # the default run (not slow) still meets every mutation kind of every base run
    default = {p.values[0] for p in VARIANT_PARAMS if not p.marks}
    assert {(v.base, v.kind) for v in default} == {(v.base, v.kind) for v in VARIANTS}
    assert set(SYNC_IDS) <= set(ids), set(SYNC_IDS) - set(ids)


def test_the_oracle_rejects_the_sentinel_and_a_silent_empty_handle(bases: Bases, tmp_path: Path) -> None:
    """The harness itself: the sentinel's records are not the run's, and an empty handle with
    nothing reported is a failure (so a passing variant means something)."""
    orig = bases.originals["rec"]
    fails, clean = judge_read("open_run", read_all(bases.sentinels["rec"]), orig, set())
    assert not clean and fails and all(f.startswith("[silent-wrong-data]") for f in fails), fails
    fails, _ = judge_read("open_run", read_all(bases.sentinels["rec"]), orig, set(), bases.sentinel_originals["rec"])
    assert fails and all(f.startswith("[outside]") for f in fails), fails
    fake = read_all(bases.runs["rec"])
    fake.handles["outputs[head]"] = HandleRead()
    fails, clean = judge_read("open_run", fake, orig, set())
    assert not clean and fails == ["[silent-empty] open_run: handle 'outputs[head]' reads as empty"], fails


# ------------------------------------------------------------------------------------------- sync
@pytest.fixture(scope="session")
def mlflow_experiment(mlflow_server: str) -> tuple[Any, str, str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    return client, client.create_experiment(f"hookline-fuzz-{uuid.uuid4().hex[:8]}"), mlflow_server


#: hookline's own sync record in the MLflow run (no file of the run: its digests of what it uploaded)
SYNC_RECORD = "hookline/sync.json"
#: The summary page the final upload draws (`storage/mlflow/runsummary.py`), per rank or not.
SUMMARY_PAGE = re.compile(r"hookline/summary(\.rank\d+)?\.html")


def _artifacts(client: Any, rid: str, dest: Path) -> dict[str, str]:
    """sha256 of every artifact of the MLflow run (downloaded), by artifact path; for the sync
    record, its ``files`` (artifact path -> sha256) as JSON."""
    out, todo = {}, [None]
    while todo:
        for a in client.list_artifacts(rid, todo.pop()):
            if a.is_dir:
                todo.append(a.path)
            else:
                got = Path(client.download_artifacts(rid, a.path, str(dest)))
                if a.path == SYNC_RECORD:
                    files = json.loads(got.read_text())["files"]
                    out[a.path] = json.dumps({k: v.split(":", 1)[1] for k, v in files.items()})
                elif SUMMARY_PAGE.fullmatch(a.path):  # (drawn by hookline from the run's files)
                    data = got.read_bytes()
                    page = data.startswith(b"<!DOCTYPE html><html>")
                    out[a.path] = ("html:" if page else "") + hashlib.sha256(data).hexdigest()
                else:
                    out[a.path] = hashlib.sha256(got.read_bytes()).hexdigest()
    return out


def judge_uploads(case: Case, bases: Bases, uploaded: dict[str, str], damaged: set[str]) -> list[str]:
    """Every artifact is a regular file of the run (nothing from the sentinel or elsewhere), no
    damaged handle's file is uploaded, and every healthy handle's file is (handle mutations)."""
    fails = []
    mine = file_digests(case.run)
    outside = {sha: rel for rel, sha in case.theirs.digests.items()}
    for apath, sha in sorted(uploaded.items()):
        if apath == SYNC_RECORD:  # (it must list what the run holds, by digest)
            listed = json.loads(sha)
            held = {a: uploaded[a].removeprefix("html:") if a in uploaded else None for a in listed}
            if listed != held:
                fails.append(f"[sync-record] sync: {apath} lists {sorted(listed)}, not what the run holds")
            continue
        if SUMMARY_PAGE.fullmatch(apath):  # (the run page's summary: an HTML page, not a run file)
            if not sha.startswith("html:") or sha[5:] in outside:
                fails.append(f"[outside] sync: artifact {apath!r} is not a summary page hookline drew")
            continue
        if sha in outside:
            fails.append(f"[outside] sync: artifact {apath!r} holds the sentinel's {outside[sha]!r}")
        elif sha not in mine.values():
            fails.append(f"[outside] sync: artifact {apath!r} holds bytes that are no regular file of the run")
    for rel in FILES[case.variant.base]:
        hid = next(h for h, (k, _) in HANDLES[case.variant.base].items() if rel == k + ".h5")
        got = uploaded.get(f"hookline/{rel}")
        if hid in damaged and got is not None and got == mine.get(rel) != case.orig.digests[rel]:
            fails.append(f"[uploaded-damaged] sync: uploaded {rel!r}, which the reader reports damaged")
        if case.variant.handle not in (None, hid) and got != case.orig.digests[rel]:
            fails.append(f"[sync-dropped-healthy] sync: the undamaged {rel!r} was not uploaded")
    return fails


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("variant", SYNC_PARAMS)
def test_sync_variant(variant: Variant, bases: Bases, tmp_path: Path, runner: Any,
                      mlflow_experiment: tuple[Any, str, str]) -> None:
    """``hookline sync`` of a variant to a fresh MLflow run on the real server (see the module
    docstring for what is checked)."""
    client, exp, uri = mlflow_experiment
    case = make_case(variant, bases, tmp_path)
    run_isolated(case, runner, [("open_run", step_read)])  # (a crash here would also end sync's process)
    if not any(f.startswith("[crash]") for f in case.fails):
        with case.unblocker():
            _sync_case(case, bases, runner, client, exp, uri)
    if case.fails:
        pytest.fail(case.report(), pytrace=False)


def _sync_case(case: Case, bases: Bases, runner: Any, client: Any, exp: str, uri: str) -> None:
    from hookline.storage.mlflow.keys import tag_key

    rid = client.create_run(exp).info.run_id
    try:
        with case.bounded("sync", seconds=60):
            out = invoke(runner, ["sync", str(case.run), "--run-id", rid, "--tracking-uri", uri, "--json"])
            uploaded = _artifacts(client, rid, case.out / "dl")
    except Hang as e:
        case.fails.append(f"[hang] sync: {e}")
    else:
        case.fails += judge_cli("sync", out)
        case.check_outside("sync")
        if out.code == 0 and not case.clean:
            case.fails.append("[sync-ok-on-damage] sync: exit 0, but reading the run was not clean")
        if case.variant.kind == "none" and out.code != 0:
            case.fails.append(f"[harness] sync: the unmutated run exits {out.code}: {out.stderr[-300:]!r}")
        case.fails += judge_uploads(case, bases, uploaded, case.damaged)
        if out.code == 0:
            tags = client.get_run(rid).data.tags
            for hid, n in case.orig.counts.items():
                if tags.get(tag_key(hid, "records")) != str(n):
                    case.fails.append(f"[silent-empty] sync: {hid!r} tagged records="
                                      f"{tags.get(tag_key(hid, 'records'))!r}, recorded {n}")
