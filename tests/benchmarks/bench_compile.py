"""What a sampled step costs under torch.compile (SPEC §10), as ratios measured in one run.

Run:  python tests/benchmarks/bench_compile.py [--rounds 20] [--width 512] [--backend inductor]
                                               [--device cpu|cuda] [--quick]

The model (an MLP of 4 ``Linear(width)`` + GELU, batch 64, a training step: forward, backward,
SGD) is compiled once; every row runs that compiled model, hooked as the row says, and its step
time is divided by the step time of the compiled model without hooks, paired within rounds
(``bench_capture.paired_ratio``: random order, a warm-up step per row, an A/A control):

* ``outputs (in graph)``: ``rec.outputs`` on every Linear, every step sampled: the records are
  taken by ``hookline::record`` ops inside the compiled graph (no graph break);
* ``outputs + grads``: ``rec.grads`` too: each module with gradient capture runs its hooks
  outside Dynamo (a graph break before and after it) on sampled steps;
* ``not sampled (every=10**9)``: the same recorder, no step sampled: the compiled graph of a
  model without hooks (must be ~1.00x: no recompilation, no graph break);
* ``eager: outputs + grads`` / ``eager: no hooks``: the same capture on the eager model,
  for scale.

Each row's first timed step after switching may hit Dynamo's cache for another hook set: the
graphs of every row are compiled before timing (one warm-up pass), so the numbers are steady
state. ``--device cuda`` runs the model on the GPU (each step ends with a
``torch.cuda.synchronize()`` of the benchmark's own, outside hooks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import paired_ratio  # noqa: E402

from hookline.tracker import HookManager, Recorder, select  # noqa: E402


def mlp(width: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row and round")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="3 rounds (smoke run)")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the writer gets the other core (docs/capture.md)
    torch._dynamo.config.recompile_limit = 64  # graph-break frames compile once per hooked module
    torch.manual_seed(0)
    model = mlp(args.width).to(dev)
    x = torch.randn(64, args.width, device=dev)
    compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    lin = select(model, "*", types=torch.nn.Linear)
    tmp = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    active: dict[str, Recorder] = {}
    use = {"model": compiled}

    def run(counter: list[int]) -> None:
        rec = active.get("rec")
        if rec is not None:
            rec.set_step(counter[0])
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        use["model"](x).square().mean().backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def recorder(name: str, every: int, grads: bool, eager: bool = False):
        rec = Recorder(tmp / name, every=every)
        mgr = HookManager()
        mgr.register_forward_hook(rec.outputs, **lin)
        if grads:
            mgr.register_backward_hook(rec.grads, **lin)
        rec.set_step(1)
        state = {"paused": rec.paused()}
        state["paused"].__enter__()

        def enter(counter):
            state["paused"].__exit__(None, None, None)
            active["rec"] = rec
            use["model"] = model if eager else compiled

        def leave():
            active.pop("rec", None)
            use["model"] = compiled
            state["paused"] = rec.paused()
            state["paused"].__enter__()

        return rec, (enter, leave)

    recs = {}
    variants = {}
    for name, every, grads, eager in (("outputs (in graph)", 1, False, False), ("outputs + grads", 1, True, False),
                                      ("not sampled (every=10**9)", 10**9, True, False),
                                      ("eager: outputs + grads", 1, True, True)):
        recs[name], variants[name] = recorder(name.split(":")[0].replace(" ", "_").replace("(", "").replace(")", "")
                                              .replace("*", "").replace("=", ""), every, grads, eager)

    def eager_enter(counter):
        use["model"] = model

    def eager_leave():
        use["model"] = compiled

    variants["eager: no hooks"] = (eager_enter, eager_leave)
    # compile every row's graphs before timing (steps 1, 2: not sampled under every=10**9)
    for _ in range(2):
        for enter, leave in [(None, None), *variants.values()]:
            if enter:
                enter([1])
            for step in (1, 2):
                run([step])
            if leave:
                leave()
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    res = paired_ratio(run, variants, rounds, args.steps)
    new_graphs = dynamo_utils.counters["stats"]["unique_graphs"] - graphs
    for rec in recs.values():
        rec.close()
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    print(f"MLP 4x Linear({args.width}) + GELU, batch 64, {dev.type}, torch.compile backend={args.backend}, "
          f"torch {torch.__version__}, {os.cpu_count()} cpus, {rounds} rounds x {args.steps} steps")
    print(f"compiled step without hooks: {res['base']['time'] * 1e3:.2f} ms; graphs compiled while timing: "
          f"{new_graphs}; graph breaks counted (all rows, compile included): {breaks}")
    print(f"{'row':32s} {'ms/step':>8s} {'ratio':>7s}  90% interval")
    for k, r in res.items():
        print(f"{k:32s} {r['time'] * 1e3:8.2f} {r['ratio']:7.3f}  [{r['lo']:.3f}, {r['hi']:.3f}]")


if __name__ == "__main__":
    main()
