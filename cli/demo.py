"""``hookline demo``: train a toy model twice, record, log to MLflow, compare, plot."""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Any

import click

from .options import (
    CONTEXT_SETTINGS,
    console,
    esc,
    human_bytes,
    output_path,
    progress_bar,
    quiet_mlflow_logs,
    quiet_option,
)

#: How long the demo takes, as every text says it (``demo --help``, docs/quickstart.md; checked by
#: tests/cli/test_rough_edges.py). Measured on a busy 2-core machine: 10.8-35 s with MLflow's
#: sqlite store (most of it importing MLflow and creating the store), 9.8-15 s without.
RUN_TIME = "10-40 seconds"
#: The same with ``--no-mlflow``.
RUN_TIME_NO_MLFLOW = "10-20 seconds"

EXPERIMENT = "hookline-demo"
DEMO_TAG = "hookline.demo"
LAYERS = ("fc1", "fc2", "head")
SETTINGS = (("A", 0.01), ("B", 0.1))


def _new_session_dir(out: Path) -> Path:
    """A new timestamped folder inside ``out`` (created, with ``out`` itself if need be)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = out / stamp
    d, k = base, 1
    while True:
        try:
            d.mkdir(parents=True, exist_ok=False)
            return d
        except FileExistsError:
            k += 1
            d = out / f"{stamp}-{k}"


def _model():
    import torch
    from collections import OrderedDict

    return torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(16, 64), act1=torch.nn.Tanh(),
        fc2=torch.nn.Linear(64, 64), act2=torch.nn.Tanh(),
        head=torch.nn.Linear(64, 1),
    ))


def train_one(run_dir: Path, lr: float, steps: int, every: int, *, mlflow_run_id: str | None,
              tracking_uri: str | None, advance=lambda n=1: None) -> tuple[list[float], Any, str | None]:
    """Train the demo MLP with SGD(lr) on a fixed synthetic regression stream, recording the
    Linear layers' outputs and gradients every ``every`` steps. Returns (losses, summary, error)."""
    import torch

    from hookline.tracker import HookManager, Recorder, select

    # A model this small trains fastest on one thread; more threads only contend with the
    # recorder's background writer (10-40x slower on a 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(run_dir, lr, steps, every, mlflow_run_id=mlflow_run_id, tracking_uri=tracking_uri,
                      advance=advance, HookManager=HookManager, Recorder=Recorder, select=select)
    finally:
        torch.set_num_threads(threads)


def _train(run_dir, lr, steps, every, *, mlflow_run_id, tracking_uri, advance, HookManager, Recorder, select):
    import torch

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 1, generator=gen)
    mgr = HookManager()
    losses: list[float] = []
    error: str | None = None
    rec = Recorder(run_dir, every=every, mlflow_run_id=mlflow_run_id, tracking_uri=tracking_uri,
                   meta={"demo": True, "lr": lr})
    summary = None
    try:
        layers = select(model, "*", types=torch.nn.Linear)
        mgr.register_forward_hook(rec.outputs, **layers)
        mgr.register_backward_hook(rec.grads, **layers)
        for step in range(steps):
            x = torch.randn(64, 16, generator=gen)
            y = torch.sin(0.5 * x @ w_true) + 0.05 * torch.randn(64, 1, generator=gen)
            with rec.step(step):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
            opt.step()
            losses.append(loss.item())
            advance(1)
    finally:
        try:
            summary = rec.close()
        except Exception as e:  # MLflow upload failed: local data are complete
            from hookline.storage.errors import StorageError

            if mlflow_run_id is None or isinstance(e, StorageError):
                raise
            error = " ".join(str(e).split()) or type(e).__name__
            summary = rec.summary()
    return losses, summary, error


def _mlflow_setup(tracking_uri: str | None) -> tuple[Any, str, str]:
    quiet_mlflow_logs()
    from hookline.storage.mlflow.client import connect

    client = connect(tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)
    return client, exp_id, client.tracking_uri


def _log_run_extras(client: Any, run_id: str, lr: float, losses: list[float], steps: int, every: int) -> None:
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    params = [Param("lr", str(lr)), Param("steps", str(steps)), Param("record_every", str(every)),
              Param("model", "MLP 16-64-64-1 (tanh)"), Param("optimizer", "SGD momentum 0.9")]
    metrics = [Metric("loss", v, now, i) for i, v in enumerate(losses)]
    client.log_batch(run_id, params=params)
    for k in range(0, len(metrics), 900):
        client.log_batch(run_id, metrics=metrics[k:k + 900])


def _finish_run(client: Any, run_id: str) -> None:
    """Mark the run finished. (MLflow prints "View run ... at: URL" lines on stdout when a run on a
    tracking server ends; the demo prints its own MLflow section with the links instead.)"""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        client.set_terminated(run_id, "FINISHED")


def _run_link(tracking_uri: str | None, exp_id: str | None, run_id: str) -> str:
    """The run's page in the MLflow UI of an HTTP tracking server ('' for other stores)."""
    if not tracking_uri or not tracking_uri.startswith(("http://", "https://")):
        return ""
    import urllib.parse

    parts = urllib.parse.urlsplit(tracking_uri)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")  # (no credentials)
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    return f"{base}/#/experiments/{exp_id}/runs/{run_id}"


def _unavailable_note(e: BaseException) -> str:
    """The demo's warning when MLflow cannot be used: no MLflow run exists then, so it says how to
    get one instead of promising an upload into it."""
    reason = " ".join(str(e).split())
    reason = reason.split("; recorded files stay on disk")[0][:300]  # (that hint is for a recorder with a run)
    return (f"MLflow unavailable ({reason}); recording locally only, no MLflow run is created. To log the "
            "demo to MLflow, start the tracking server (or fix --tracking-uri) and run the demo again; to "
            "upload a run directory into a run you create, use `hookline sync RUN_DIR --run-id ID`")


def _search_filter(session: str) -> str:
    return f"tags.`{DEMO_TAG}` = '{session}'"


HELP = f"""Train a small model twice, record activations and gradients, compare the runs.

    Trains a 3-layer MLP on synthetic data on the CPU twice, identical except for the learning
    rate (A: 0.01, B: 0.1), recording the outputs and gradients of its Linear layers every
    --every steps with hookline's Recorder. Both runs are logged to MLflow (experiment
    "hookline-demo"). Then prints where the data is, the MLflow search filter that finds the
    runs, the per-layer gradient comparison, and writes compare.png. Takes {RUN_TIME} on a
    laptop-class CPU ({RUN_TIME_NO_MLFLOW} with --no-mlflow); re-running creates new runs and never
    overwrites old ones. The folder holding --out DIR must exist (the default runs/demo is created).

    \b
    Example:
      hookline demo
      hookline demo --out /tmp/demo --tracking-uri http://127.0.0.1:5000
      hookline demo --no-mlflow --steps 50
    """


@click.command(context_settings=CONTEXT_SETTINGS, help=HELP,
               short_help='Train a toy model twice, record, log to MLflow, compare, plot.')
@click.option("--out", "out", type=click.Path(file_okay=False), default="runs/demo", show_default=True,
              help="Parent directory; each demo writes a new timestamped folder inside it.")
@click.option("--tracking-uri", metavar="URI", default=None,
              help="MLflow tracking URI (default: MLflow's own resolution: $MLFLOW_TRACKING_URI, else "
                   "sqlite mlflow.db in the working directory).")
@click.option("--steps", "steps", type=click.IntRange(min=2), default=200, show_default=True,
              help="Training steps per run.")
@click.option("--every", "every", type=click.IntRange(min=1), default=10, show_default=True,
              help="Record every N-th step.")
@click.option("--no-mlflow", is_flag=True,
              help=f"Do not log to MLflow (local run directories only; takes {RUN_TIME_NO_MLFLOW}).")
@quiet_option
def demo(out: str, tracking_uri: str | None, steps: int, every: int, no_mlflow: bool, quiet: bool) -> None:
    # (the help is HELP: it quotes RUN_TIME)
    c = console()
    if click.get_current_context().get_parameter_source("out") != click.core.ParameterSource.DEFAULT:
        output_path(out, "--out")  # (the one rule for paths hookline writes; the default is created)
    session_dir = _new_session_dir(Path(out))
    client = exp_id = resolved_uri = None
    mlflow_note: str | None = None
    if not no_mlflow:
        try:
            client, exp_id, resolved_uri = _mlflow_setup(tracking_uri)
        except Exception as e:  # noqa: BLE001 - the demo still runs without MLflow
            mlflow_note = _unavailable_note(e)
            client = None
    c.print(f"hookline demo: training an MLP (16-64-64-1) twice on synthetic data, {steps} steps each, "
            f"recording outputs and gradients of {', '.join(LAYERS)} every {every} steps", soft_wrap=True)
    if mlflow_note:
        console(stderr=True).print(f"[yellow]warning:[/] {esc(mlflow_note)}", soft_wrap=True)

    t0 = time.perf_counter()
    runs = _train_both(session_dir, client, exp_id, tracking_uri, steps, every, quiet)
    _print_data(c, runs, time.perf_counter() - t0)
    if client is not None:
        _print_mlflow(c, runs, resolved_uri, session_dir.name, tracking_uri)
    _print_comparison(c, runs, session_dir)


def _train_both(session_dir: Path, client: Any, exp_id: str | None, tracking_uri: str | None, steps: int,
                every: int, quiet: bool) -> list[dict[str, Any]]:
    """Train and record the two settings; with MLflow, each in a run of its own."""
    runs: list[dict[str, Any]] = []
    with progress_bar("training", steps * len(SETTINGS), quiet=quiet) as advance:
        for label, lr in SETTINGS:
            run_dir = session_dir / f"lr{lr}"
            run_id = None
            if client is not None:
                r = client.create_run(exp_id, run_name=f"demo-{label}-lr{lr}",
                                      tags={DEMO_TAG: session_dir.name, "hookline.demo.setting": label})
                run_id = r.info.run_id
            losses, summary, err = train_one(run_dir, lr, steps, every, mlflow_run_id=run_id,
                                             tracking_uri=tracking_uri, advance=advance)
            if client is not None and run_id is not None:
                try:
                    _log_run_extras(client, run_id, lr, losses, steps, every)
                    _finish_run(client, run_id)
                except Exception as e:  # noqa: BLE001
                    err = err or " ".join(str(e).split())
            runs.append({"label": label, "lr": lr, "dir": run_dir, "run_id": run_id, "experiment_id": exp_id,
                         "losses": losses,
                         "summary": summary, "error": err})
    return runs


def _print_data(c: Any, runs: list[dict[str, Any]], elapsed: float) -> None:
    from hookline.storage.words import plural

    c.print(f"\n[bold]Data[/] (trained and recorded in {elapsed:.1f} s):", soft_wrap=True)
    for r in runs:
        s = r["summary"]
        # on disk, as `hookline show` and `hookline runs` count (the summary counts field bytes)
        size = human_bytes(sum(p.stat().st_size for p in Path(r["dir"]).rglob("*") if p.is_file()))
        nh = len(getattr(s, "handles", {}) or {}) if s is not None else "?"
        c.print(f"  run {r['label']} (lr={r['lr']}, final loss {r['losses'][-1]:.4f}): {r['dir']}  "
                f"[{plural(nh, 'handle') if isinstance(nh, int) else '? handles'}, {size}]", soft_wrap=True,
                highlight=False, markup=False)


def _print_mlflow(c: Any, runs: list[dict[str, Any]], resolved_uri: str | None, session: str,
                  tracking_uri: str | None) -> None:
    c.print(f"\n[bold]MLflow[/]: tracking URI {esc(resolved_uri)}, experiment \"{EXPERIMENT}\"", soft_wrap=True)
    for r in runs:
        line = f"  run {r['label']}: run id {r['run_id']}"
        link = _run_link(resolved_uri, r.get("experiment_id"), r["run_id"])
        if link:
            line += f"  {esc(link)}"
        if r["error"]:
            line += (f"  [yellow]upload failed: {esc(r['error'][:200])}[/]; local data are complete, "
                     f"upload later: hookline sync {esc(r['dir'])} --run-id {r['run_id']}")
        c.print(line, soft_wrap=True, highlight=False)
    filt = _search_filter(session)
    c.print("  find both runs with the search filter:", soft_wrap=True)
    c.print(f"    {filt}", soft_wrap=True, highlight=False, markup=False)
    c.print(f"  e.g. mlflow.search_runs(experiment_names=[\"{EXPERIMENT}\"], filter_string=\"{filt}\")",
            soft_wrap=True, highlight=False, markup=False)
    c.print(f"  or:  hookline runs --experiment {EXPERIMENT}"
            + (f" --tracking-uri {tracking_uri}" if tracking_uri else ""), soft_wrap=True, highlight=False,
            markup=False)


def _print_comparison(c: Any, runs: list[dict[str, Any]], session_dir: Path) -> None:
    """Compare the two runs' gradients: a table, a plot, and what to try next."""
    from hookline.storage import open_run
    from hookline.storage.compare import compare_runs

    from .compare import render_table
    from .plot import plot_comparison

    a, b = runs
    result = compare_runs(open_run(a["dir"]), open_run(b["dir"]), handles="grads[*]", fields="grad_out.0")
    c.print(f"\n[bold]Gradient comparison[/], per layer (gradient w.r.t. each Linear layer's output), "
            f"A = lr {a['lr']} vs B = lr {b['lr']}, on the {len(result.results[0].steps) if result.results else 0} "
            f"recorded steps:", soft_wrap=True)
    render_table(result.results, result.metrics)
    c.print("  cosine 1 / rel_l2 0 / norm_ratio 1 mean identical gradients; both runs start from the same "
            "weights and data, so they agree at step 0 and drift apart as the learning rates act.",
            soft_wrap=True)
    png = session_dir / "compare.png"
    plot_comparison(result.results, png, metrics=result.metrics,
                    title=f"hookline demo: gradients of run B (lr={b['lr']}) vs run A (lr={a['lr']}), per layer",
                    label_a=str(a["dir"]), label_b=str(b["dir"]))
    c.print(f"\n[bold]Plot[/]: {esc(png)}", soft_wrap=True, highlight=False)
    c.print("\nNext:", soft_wrap=True)
    c.print(f"  hookline show {a['dir']}\n  hookline show {a['dir']} 'grads[fc1]'\n"
            f"  hookline compare {a['dir']} {b['dir']} --handle 'outputs[*]' --plot outputs.png",
            soft_wrap=True, highlight=False, markup=False)
