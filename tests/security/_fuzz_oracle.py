"""What counts as an acceptable outcome of a fuzz case (the bounds are in ``_fuzz_bounds.py``).

Outcomes (the contract of issue 23, as ``test_fuzz.py`` checks it):

* **hookline error**: an exception that is a :class:`~hookline.storage.HooklineError`; for a CLI
  command, a non-zero exit with exactly one ``Error: ...`` line on stderr (``warning:`` lines
  aside) and no Python traceback.
* **listed problem**: ``handle.problems`` (or ``handle.gaps``) non-empty, run-level ``problems``
  non-empty, or a warning from hookline (a message starting with ``hookline`` or a warning class
  defined by hookline); for a CLI command, a ``warning:`` line on stderr or a ``warning`` in its
  JSON.
* **correct data**: every record that reads back equals (dtype, shape and bytes) the original
  record with the same (step, call); stored norms likewise. Exception: a handle whose file, read
  with plain h5py, changed only in raw values of value datasets (see ``_fuzz_mutations.py``: no
  checksum exists that could reveal it) may read back changed values.

A run that does not read back *clean* (no problem, no warning, correct data) has damage: then
``verify``, ``verify --repair`` and ``sync`` must exit non-zero ("exits non-zero when it found or
quarantined anything"), and after a repair that exits 0 the run must read back without silent loss.

Failures are lines ``[category] operation: detail``; the categories: ``traceback`` (an exception
that is not a hookline error, or the CLI's "unexpected ... please report it" line), ``crash`` (the
process died, e.g. SIGSEGV inside HDF5), ``hang`` (the time bound), ``allocation`` (MemoryError:
a declared size was trusted), ``outside`` (the sentinel directory changed, something was created
next to the run, or a file from outside was read or uploaded), ``silent-empty`` (a handle that had records reads as having none, nothing reported),
``silent-loss`` (fewer records, nothing reported), ``silent-wrong-data``, ``cli-error-format``,
``terminal-escape`` (a raw control character in a command's output), ``verify-ok-on-damage``,
``repair-ok-on-damage``, ``sync-ok-on-damage``, ``uploaded-damaged``, ``sync-dropped-healthy``,
and ``harness`` (an unmutated base run fails a check: the suite itself is wrong).
"""

from __future__ import annotations

import re
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from _fuzz_runs import Original


def _is_hookline_error(e: BaseException) -> bool:
    from hookline.storage import HooklineError

    return isinstance(e, HooklineError)


def crash(op: str, e: BaseException) -> str:
    """The failure line of an exception that is not a hookline error (where it was raised included)."""
    cat = "allocation" if isinstance(e, MemoryError) else "traceback"
    tb = traceback.extract_tb(e.__traceback__)[-2:]
    where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb)
    return f"[{cat}] {op}: {type(e).__name__}: {str(e)[:300]} (at {where})"


# ------------------------------------------------------------------------------------- reading
@dataclass
class HandleRead:
    """What the reader returned for one handle."""

    n: int = 0
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    records: dict[str, list[tuple[int, int, np.ndarray]]] = field(default_factory=dict)
    norms: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)


@dataclass
class ReadOutcome:
    """What ``open_run`` and reading every record of every handle did."""

    error: str | None = None
    crash: BaseException | None = None
    run_problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    handles: dict[str, HandleRead] = field(default_factory=dict)

    @property
    def reported(self) -> bool:
        """A hookline error, a listed problem (run or any handle) or a hookline warning."""
        return bool(self.error or self.run_problems or self.warnings
                    or any(h.problems or h.error for h in self.handles.values()))


def _hookline_warning(w: warnings.WarningMessage) -> bool:
    return str(w.message).startswith("hookline") or w.category.__module__.startswith("hookline")


def read_all(run_dir: Path) -> ReadOutcome:
    """Open the run with ``open_run`` and read every record, norm, step and call of every handle."""
    from hookline.storage import open_run

    out = ReadOutcome()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run = open_run(run_dir)
        except Exception as e:
            if _is_hookline_error(e):
                out.error = f"{type(e).__name__}: {e}"
            else:
                out.crash = e
        else:
            try:
                with run:
                    out.run_problems = list(getattr(run, "problems", None) or [])
                    for hid in run.handles:
                        out.handles[hid] = _read_handle(run, hid)
            except Exception as e:  # (_read_handle lets only non-hookline errors through)
                out.crash = e
    out.warnings = [str(w.message) for w in caught if _hookline_warning(w)]
    return out


def _read_handle(run: Any, hid: str) -> HandleRead:
    hr = HandleRead()
    h = None
    try:
        h = run[hid]
        for name in h.fields:
            f = h[name]
            keys = list(zip(np.asarray(f.steps).tolist(), np.asarray(f.calls).tolist()))
            data = f.read()
            hr.records[name] = [(s, c, np.asarray(data[i])) for i, (s, c) in enumerate(keys)]
            if f.dtype.kind in "fc":
                hr.norms[name] = [(s, c, float(x)) for (s, c), x in zip(keys, np.asarray(f.norms()).tolist())]
        hr.n = len(h)
    except Exception as e:
        if not _is_hookline_error(e):
            raise
        hr.error = f"{type(e).__name__}: {e}"
    if h is not None:
        hr.problems = list(h.problems) + [f"gap {g}" for g in getattr(h, "gaps", [])]
    return hr


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (dtype, shape, bytes: NaN payloads included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@dataclass
class Comparison:
    """How records read back compare with the originals, per handle id."""

    wrong: dict[str, list[str]] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    empty: set[str] = field(default_factory=set)
    outside: dict[str, int] = field(default_factory=dict)  # records equal to the sentinel's

    def add_wrong(self, hid: str, text: str) -> None:
        self.wrong.setdefault(hid, []).append(text)


def compare_records(orig: Original, hid: str, name: str, got: list[tuple[int, int, np.ndarray]],
                    cmp: Comparison, sentinel: Original | None = None) -> None:
    """Compare one field's records (step, call, value) with the originals; note wrong and lost
    ones, and those that are the ``sentinel`` run's records (read from outside the run)."""
    recs = orig.records[hid][name]
    theirs = sentinel.records.get(hid, {}).get(name, {}) if sentinel is not None else {}
    good = 0
    for s, c, a in got:
        exp = recs.get((s, c))
        if (s, c) in theirs and same(a, theirs[(s, c)]) and not (exp is not None and same(a, exp)):
            cmp.outside[hid] = cmp.outside.get(hid, 0) + 1
        elif exp is None:
            cmp.add_wrong(hid, f"{name}: a record at step {s} call {c} the run never recorded")
        elif not same(a, exp):
            cmp.add_wrong(hid, f"{name} at step {s} call {c}: {np.asarray(a).dtype}{np.asarray(a).shape} "
                               f"differs from the recorded {exp.dtype}{exp.shape}")
        else:
            good += 1
    if len(recs) > len(got):
        cmp.lost[hid] = cmp.lost.get(hid, 0) + len(recs) - len(got)


def compare(outcome: ReadOutcome, orig: Original, sentinel: Original | None = None) -> Comparison:
    """Compare everything a :func:`read_all` returned with the originals (and the sentinel's)."""
    cmp = Comparison()
    for hid, fields in orig.records.items():
        hr = outcome.handles.get(hid)
        if hr is None or hr.error:
            if hr is None and orig.counts[hid]:
                cmp.empty.add(hid)
            continue
        if hr.n == 0 and orig.counts[hid]:
            cmp.empty.add(hid)
        for name in fields:
            compare_records(orig, hid, name, hr.records.get(name, []), cmp, sentinel)
            theirs = sentinel.norms.get(hid, {}).get(name, {}) if sentinel is not None else {}
            for s, c, x in hr.norms.get(name, []):
                exp = orig.norms[hid].get(name, {}).get((s, c))
                if exp is None or same(np.float64(x), np.float64(exp)):
                    continue
                if (s, c) not in theirs or not same(np.float64(x), np.float64(theirs[(s, c)])):
                    cmp.add_wrong(hid, f"norm of {name} at step {s} call {c}: {x!r} != {exp!r}")
    for hid, hr in outcome.handles.items():
        if hid not in orig.records and hr.n:
            cmp.add_wrong(hid, f"{hr.n} records under a handle id the run never recorded")
    return cmp


def judge_silence(op: str, cmp: Comparison, reported: bool, values_only: set[str]) -> list[str]:
    """Failures for records read from outside the run (reported or not), and for what went wrong
    without being reported (empty, lost, wrong records)."""
    out = [f"[outside] {op}: {n} records of {hid!r} are the sentinel run's (read from outside the run)"
           for hid, n in sorted(cmp.outside.items())]
    if reported:
        return out
    out += [f"[silent-empty] {op}: handle {hid!r} reads as empty" for hid in sorted(cmp.empty)]
    out += [f"[silent-loss] {op}: {n} records of {hid!r} are missing"
            for hid, n in sorted(cmp.lost.items()) if hid not in cmp.empty]
    out += [f"[silent-wrong-data] {op}: {hid!r}: {'; '.join(w[:3])}"
            for hid, w in sorted(cmp.wrong.items()) if hid not in values_only]
    return out


def judge_read(op: str, outcome: ReadOutcome, orig: Original, values_only: set[str],
               sentinel: Original | None = None) -> tuple[list[str], bool]:
    """``(failures, clean)`` of a :func:`read_all`: ``clean`` when nothing was reported and every
    record read back correct (or changed only where ``values_only`` allows)."""
    if outcome.crash is not None:
        return [crash(op, outcome.crash)], False
    if outcome.error:
        return [], False
    cmp = compare(outcome, orig, sentinel)
    fails = judge_silence(op, cmp, outcome.reported, values_only)
    clean = not (outcome.reported or cmp.empty or cmp.lost or cmp.outside or (cmp.wrong.keys() - values_only))
    return fails, clean


# ------------------------------------------------------------------------------------------ CLI
@dataclass
class CliOutcome:
    """One in-process ``hookline`` command (click's CliRunner)."""

    args: list[str]
    code: int
    stdout: str
    stderr: str
    crash: BaseException | None = None

    @property
    def warned(self) -> bool:
        return any(line.startswith("warning:") for line in self.stderr.splitlines())


def invoke(runner: Any, args: list[str]) -> CliOutcome:
    """``hookline ARGS`` in-process (warnings always shown, as a fresh process would show them)."""
    from hookline.cli.main import cli

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        res = runner.invoke(cli, args, catch_exceptions=True)
    exc = res.exception if not isinstance(res.exception, SystemExit) else None
    return CliOutcome(args, res.exit_code, res.stdout, res.stderr, exc)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def judge_cli(op: str, out: CliOutcome) -> list[str]:
    """Failures of any command's output: a traceback, the CLI's catch-all line (a non-hookline
    exception), an error that is not one line, a raw control character."""
    fails = []
    if out.crash is not None:
        fails.append(crash(op, out.crash))
    text = out.stdout + out.stderr
    if "Traceback (most recent call last)" in text:
        fails.append(f"[traceback] {op}: a Python traceback in the output")
    for line in out.stderr.splitlines():
        if line.startswith("Error: unexpected ") and "please report it" in line:
            cat = "allocation" if "MemoryError" in line else "traceback"
            fails.append(f"[{cat}] {op}: {line[:300]}")
    if out.code != 0 and not out.crash:
        errors = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
        if len(errors) != 1 or not errors[0].startswith("Error: "):
            fails.append(f"[cli-error-format] {op}: exit {out.code} with stderr {out.stderr[-300:]!r}")
    m = _CONTROL.search(text)
    if m:
        at = text[max(0, m.start() - 40): m.end() + 20]
        fails.append(f"[terminal-escape] {op}: raw control character {m.group()!r} in {at!r}")
    return fails
