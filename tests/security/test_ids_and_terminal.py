"""Names that enter a run are checked where they enter; names that come out of a run never reach
the terminal raw.

Case 1 of issue 23: a NUL in a handle id or module name was accepted by ``add_handle()`` and then
failed the writer thread at the first flush, losing every handle's records. Case 5: ``hookline
show`` printed handle ids raw, so an ANSI escape sequence in a module name reached the terminal.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.cli.options import safe_text
from hookline.storage import HookTypeError, InvalidArgumentError, RunWriter, open_run
from hookline.storage.keys import MAX_NAME_LEN, handle_key
from hookline.tracker import HookManager, Recorder

# --------------------------------------------------------------------------------------------
# case 1: names are checked when they enter, and a refused one costs nothing
# --------------------------------------------------------------------------------------------
BAD_NAMES = {
    "nul": "ba\x00d",
    "esc": "\x1b[31mred",
    "newline": "two\nlines",
    "del": "x\x7fy",
    "c1_csi": "x\x9b2J",
    "surrogate": "x\ud800y",
    "too_long": "m" * (MAX_NAME_LEN + 1),
}


def _good_records(w: RunWriter, steps: range) -> None:
    for s in steps:
        w.write("outputs[good]", s, 0, {"outputs.0": np.full(4, s, np.float32)})


def _assert_good_intact(run_dir: Path, n: int) -> None:
    run = open_run(run_dir)
    assert list(run.handles) == ["outputs[good]"]
    f = run["outputs[good]"]["outputs.0"]
    assert f.steps.tolist() == list(range(n))
    for s in range(n):
        np.testing.assert_array_equal(f[s], np.full(4, s, np.float32))
    assert run["outputs[good]"].problems == []


@pytest.mark.parametrize("where", ["handle_id", "module_name", "module_type", "category", "hook_fn_name"])
@pytest.mark.parametrize("kind", sorted(BAD_NAMES))
def test_writer_refuses_bad_name_at_add_handle_and_loses_nothing(tmp_path, kind, where):
    bad = BAD_NAMES[kind]
    w = RunWriter(tmp_path / "run")
    w.add_handle("outputs[good]", module_name="good", hook_fn_name="outputs")
    _good_records(w, range(3))
    kwargs = {"module_name": "m"}
    handle_id = "outputs[m]"
    if where == "handle_id":
        handle_id = f"outputs[{bad}]"
    else:
        kwargs[where] = bad
    with pytest.raises(InvalidArgumentError) as e:
        w.add_handle(handle_id, **kwargs)
    value = handle_id if where == "handle_id" else bad
    msg = str(e.value)
    if kind == "too_long":
        assert f"{value[:60]!r}... is {len(value)} characters long; at most 1000" in msg, msg
    else:
        assert repr(value) in msg and "U+" in msg, msg  # quoted, and the character named
    fix = ("use another handle id" if where == "handle_id"
           else "use a shorter name" if kind == "too_long" else "remove the character")
    assert fix in msg, msg
    with pytest.raises(Exception):  # never declared: its records cannot be queued either
        w.write(handle_id, 0, 0, {"outputs.0": np.ones(4, np.float32)})
    _good_records(w, range(3, 6))
    w.flush()  # failed with "VLEN strings do not support embedded NULLs" (case 1)
    w.close()
    _assert_good_intact(tmp_path / "run", 6)


@pytest.mark.parametrize("kind", ["nul", "esc", "c1_csi", "too_long"])
def test_writer_refuses_bad_field_name_at_write_and_reserve_fields(tmp_path, kind):
    bad = BAD_NAMES[kind]
    w = RunWriter(tmp_path / "run")
    w.add_handle("outputs[good]", module_name="good")
    _good_records(w, range(2))
    with pytest.raises(InvalidArgumentError, match="field name"):
        w.write("outputs[good]", 2, 0, {"outputs.0": np.ones(4, np.float32), bad: np.ones(2, np.float32)})
    with pytest.raises(InvalidArgumentError, match="field name"):
        w.write_block("outputs[good]", [2], [0], {bad: np.ones((1, 2), np.float32)})
    with pytest.raises(InvalidArgumentError, match="field name"):
        w.reserve_fields("outputs[good]", {bad: ("float32", (2,))})
    _good_records(w, range(2, 4))
    w.close()
    _assert_good_intact(tmp_path / "run", 4)
    assert list(open_run(tmp_path / "run")["outputs[good]"].fields) == ["outputs.0"]


def test_writer_accepts_printable_unicode_and_the_longest_name(tmp_path):
    long_module = "m" * (MAX_NAME_LEN - len("outputs[]"))
    ids = ["outputs[блок.0]", "outputs[层 1]", "outputs[a\u202eb]", f"outputs[{long_module}]"]
    with RunWriter(tmp_path / "run") as w:
        for hid in ids:
            w.add_handle(hid, module_name=hid[8:-1], hook_fn_name="outputs")
            w.write(hid, 0, 0, {"outé.0": np.ones(2, np.float32)})
    run = open_run(tmp_path / "run")
    assert sorted(run.handles) == sorted(ids)
    assert all(len(run[h]["outé.0"]) == 1 for h in ids)


def test_writer_refuses_a_non_str_handle_id(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        with pytest.raises(HookTypeError, match="handle id must be a str"):
            w.add_handle(b"outputs[fc]")  # type: ignore[arg-type]


class _Net(torch.nn.Module):
    """A good Linear, and Linears under names torch allows but a run cannot store."""

    def __init__(self) -> None:
        super().__init__()
        self.good = torch.nn.Linear(3, 4)
        self.bad = torch.nn.ModuleDict({BAD_NAMES["esc"]: torch.nn.Linear(4, 4),
                                        BAD_NAMES["nul"]: torch.nn.Linear(4, 4)})

    def forward(self, x):
        x = self.good(x)
        for m in self.bad.values():
            x = m(x)
        return x


def _train(model: torch.nn.Module, rec: Recorder, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for s in range(steps):
        with rec.step(s):
            model(torch.randn(2, 3, generator=gen)).sum().backward()


@pytest.mark.parametrize("kind", ["esc", "nul"])
def test_recorder_refuses_control_characters_in_module_names_at_registration(tmp_path, kind):
    model = _Net()
    bad_name = BAD_NAMES[kind]
    bad_module = model.bad[bad_name]
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, good=model.good)
        with pytest.raises(InvalidArgumentError) as e:
            mgr.register_forward_hook(rec.outputs, **{bad_name: bad_module})
        assert repr(bad_name) in str(e.value) and "register the module under another name" in str(e.value)
        # (a registration that names the good module and a bad one registers neither)
        with pytest.raises(InvalidArgumentError):
            mgr.register_backward_hook(rec.grads, good=model.good, **{bad_name: bad_module})
        assert list(mgr.name_to_hookhandle) == ["outputs[good]"]
        _train(model, rec, 4)
    run = open_run(tmp_path / "run")
    assert list(run.handles) == ["outputs[good]"]  # no trace of the refused ones, not even empty
    f = run["outputs[good]"]["outputs.0"]
    assert f.steps.tolist() == [0, 1, 2, 3]
    assert all(f[i].shape == (2, 4) for i in range(4))


def test_recorder_refuses_control_characters_in_hook_names(tmp_path):
    model = _Net()
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        with pytest.raises(InvalidArgumentError, match=r"recorder hook name 'out\\x1bs'.*name= to rec.hook"):
            rec.hook("outputs", name="out\x1bs")
        with pytest.raises(InvalidArgumentError, match=r"hook function name 'o\\x00'.*hook_fn_name="):
            mgr.register_forward_hook(rec.outputs, hook_fn_name="o\x00", good=model.good)
        with pytest.raises(InvalidArgumentError, match="handle id .* characters long"):
            mgr.register_forward_hook(rec.outputs, hook_fn_name="o" * 600, **{"m" * 600: model.good})
        mgr.register_forward_hook(rec.outputs, good=model.good)
        _train(model, rec, 2)
    assert open_run(tmp_path / "run")["outputs[good]"]["outputs.0"].steps.tolist() == [0, 1]


def test_plain_hooks_keep_any_module_name():
    """The rule is about what a run stores: a hook that records nothing keeps TackleBox's freedom."""
    model = _Net()
    mgr = HookManager()
    seen = []
    mgr.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__), **{BAD_NAMES["esc"]: model.good})
    model(torch.randn(1, 3))
    assert seen == ["Linear"]


# --------------------------------------------------------------------------------------------
# case 5: what a run holds never reaches the terminal raw
# --------------------------------------------------------------------------------------------
EVIL_MODULE = "\x1b[31mred\x9b2J\x07"
EVIL_ID = f"outputs[{EVIL_MODULE}]"
EVIL_FIELD = "f\x1b[1mbold\x7f"
EVIL_TYPE = "torch.\x1b[5mBlink"
EVIL_META = "\x1b]0;owned\x07 and \x1b[2J"


def _hostile_run(run_dir: Path) -> Path:
    """A run whose handle id, module name and type, field name and meta hold control characters.

    The writer refuses such names now, so the run is written with clean ones and then edited the
    way a hand-made or old file could hold them: manifest, file attributes, dataset names.
    """
    with RunWriter(run_dir, meta={"note": EVIL_META}) as w:
        w.add_handle("outputs[good]", module_name="good", module_type="torch.nn.Linear",
                     category="forward_hook", hook_fn_name="outputs")
        w.add_handle("outputs[BAD]", module_name="BAD", module_type="torch.nn.Linear",
                     category="forward_hook", hook_fn_name="outputs")
        for s in range(3):
            w.write("outputs[good]", s, 0, {"outputs.0": np.full(4, s, np.float32)})
            w.write("outputs[BAD]", s, 0, {"FLD": np.full(4, s, np.float32)})
    m = json.loads((run_dir / "manifest.json").read_text())
    e = m["handles"].pop("outputs[BAD]")
    old = run_dir / e["file"]
    key = handle_key(EVIL_ID)
    e.update(key=key, file=key + ".h5", module_name=EVIL_MODULE, module_type=EVIL_TYPE,
             fields={EVIL_FIELD: e["fields"].pop("FLD")})
    m["handles"][EVIL_ID] = e
    (run_dir / e["file"]).parent.mkdir(parents=True, exist_ok=True)
    old.rename(run_dir / e["file"])
    (run_dir / "manifest.json").write_text(json.dumps(m))
    with h5py.File(run_dir / e["file"], "r+") as f:
        f.attrs.update(handle_id=EVIL_ID, key=key, module_name=EVIL_MODULE, module_type=EVIL_TYPE,
                       fields=json.dumps([EVIL_FIELD]))
        f.move("FLD", EVIL_FIELD)
        f.move("_index/FLD", "_index/" + EVIL_FIELD)
    assert open_run(run_dir)[EVIL_ID][EVIL_FIELD].steps.tolist() == [0, 1, 2]  # a readable run
    return run_dir


def _raw_controls(text: str, allowed: str = "\n") -> list[str]:
    """Characters a terminal would act on (controls, invisible format characters)."""
    return [ch for ch in text if ch not in allowed and unicodedata.category(ch) in ("Cc", "Cf")]


def _invoke(*args: object) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "250"})
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    return res.exit_code, res.output  # (stdout and stderr, interleaved)


@pytest.fixture
def hostile(tmp_path):
    return _hostile_run(tmp_path / "hostile")


ESCAPED_MODULE = r"\x1b[31mred\x9b2J\x07"
ESCAPED_FIELD = r"f\x1b[1mbold\x7f"


def test_show_escapes_handle_ids_types_fields_and_meta(hostile):
    code, out = _invoke("show", hostile)
    assert code == 0, out
    assert _raw_controls(out) == [], out
    assert f"outputs[{ESCAPED_MODULE}]" in out
    assert ESCAPED_FIELD in out and r"\x1b[5mBlink" in out
    assert r"\x1b]0;owned\x07 and \x1b[2J" in out  # run meta
    assert "outputs[good]" in out and "outputs.0" in out


def test_show_handle_escapes_its_header_and_fields(hostile):
    code, out = _invoke("show", hostile, EVIL_ID)
    assert code == 0, out
    assert _raw_controls(out) == [], out
    assert f"outputs[{ESCAPED_MODULE}] in" in out
    assert f"module {ESCAPED_MODULE} (torch.\\x1b[5mBlink)" in out
    assert out.count(ESCAPED_FIELD) == 2  # fields table and statistics table


def test_show_json_keeps_names_exact(hostile):
    code, out = _invoke("show", hostile, "--json")
    assert code == 0 and _raw_controls(out) == []
    d = json.loads(out)
    assert {h["handle"] for h in d["handles"]} == {"outputs[good]", EVIL_ID}
    assert d["meta"]["note"] == EVIL_META


def test_compare_escapes_handles_and_fields(hostile):
    code, out = _invoke("compare", hostile, hostile)
    assert code == 0, out
    assert _raw_controls(out) == [], out
    assert f"outputs[{ESCAPED_MODULE}]" in out and ESCAPED_FIELD in out


def test_export_escapes_what_it_prints(hostile, tmp_path):
    code, out = _invoke("export", hostile, EVIL_ID, EVIL_FIELD, "--format", "npy", "--out", tmp_path / "x.npy")
    assert code == 0, out
    assert _raw_controls(out) == [], out
    assert f"of outputs[{ESCAPED_MODULE}] {ESCAPED_FIELD} to" in out
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy")[:, 0], [0, 1, 2])


def test_verify_escapes_its_report(hostile):
    code, out = _invoke("verify", hostile)
    assert _raw_controls(out) == [], out
    assert f"outputs[{ESCAPED_MODULE}]" in out


@pytest.mark.parametrize("args", [
    ("show", "{run}", EVIL_ID + "x"),  # unknown handle: the message lists the run's handles
    ("export", "{run}", EVIL_ID, "nope\x1b[0m", "--format", "npy", "--out", "{tmp}/y.npy"),
    ("export", "{run}", EVIL_ID, EVIL_FIELD, "--format", "npy", "--out", "{tmp}/y.npy", "--steps", "7"),
])
def test_error_messages_that_quote_the_run_are_escaped(hostile, tmp_path, args):
    args = [a.format(run=hostile, tmp=tmp_path) for a in args]
    code, out = _invoke(*args)
    assert code == 1, out
    assert out.startswith("Error:") and len(out.strip().splitlines()) == 1, out
    assert _raw_controls(out) == [], out
    assert ESCAPED_MODULE in out


def test_runs_escapes_mlflow_run_names(sqlite_tracking_uri):
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    run = client.create_run("0", run_name="\x1b[31mevil\x07", tags={"hookline.version": "0.1.0"})
    code, out = _invoke("runs", "--tracking-uri", sqlite_tracking_uri)
    assert code == 0, out
    assert _raw_controls(out) == [], out
    assert r"\x1b[31mevil\x07" in out and run.info.run_id in out


def test_safe_text_escapes_controls_and_keeps_printable_unicode():
    assert safe_text("blöck 層 👍 a\\b [bold]") == "blöck 層 👍 a\\b [bold]"
    assert safe_text("\x1b[2J\x00\x7f\x9b\t\n\r") == r"\x1b[2J\x00\x7f\x9b\t\n\r"
    assert safe_text("a\u202eb\u2028c\ud800") == r"a\u202eb\u2028c\ud800"
    assert safe_text("line\nnext\x1b", keep="\n") == "line\nnext\\x1b"
    assert safe_text(3) == "3"
