"""Benchmark: cost of hookline's managed hooks (SPEC §8, hook rows).

Run: ``python tests/benchmarks/bench_hooks.py [--repeats 21] [--steps 10] [--per-call 500]``

Prints, per model (a 20-layer Linear MLP and a small ResNet-style conv net, no-op hook
functions on every leaf module, one step = forward + backward on CPU with
``torch.set_num_threads(1)`` so that timings are not thread-scheduling noise):

(a) backward hooks: hookline step time / torch ``register_full_backward_hook`` step time
    (target <= 1.3x), and each one's overhead over the no-hook step;
(b) registered but deactivated hookline hooks: step time / no-hook step time (target <= 1.02x);
(c) forward hooks: hookline forward-hook step time / no-hook step time, and per hooked call.

Variants run in shuffled order within every repeat; each ratio is the median over repeats of
the ratio of the two variants' mean step times (over ``--steps`` steps, after warmup) within the
same repeat, so slow drift cancels. Step times are process CPU time (``time.process_time``; with
one thread this is the step's compute, not inflated by other processes competing for the cores).
The ResNet uses out-of-place ReLU and residual add because torch's full backward hook raises on
in-place ones.

``--per-call N`` instead measures what each hooked call adds, in us, on a compute-bound MLP
(4 x ``Linear(1024)`` + ReLU, batch 64): N iterations each run one step of every variant in
turn, forward and backward timed apart (wall clock), and the medians of the per-iteration
differences to the no-hook step are printed per hooked module. Interleaving single steps
resolves costs far below the noise of block timings; the big matmuls make the caches cold, as
in real training (docs/performance.md, "cold caches"). The row "same, identity node" runs the
same backward hooks with single-op calls off (docs/hooks.md), so the two rows show what that
path saves.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from hookline.tracker import HookManager


def mlp(layers: int = 20, width: int = 256) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


def resnet(blocks: int = 4, c: int = 16) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), *[Block(c) for _ in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if not list(m.children())}


def noop(*args: object) -> None:
    return None


def measure(model: nn.Module, x: torch.Tensor, variants: dict[str, tuple[Callable, Callable]],
            repeats: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per variant (a (setup, teardown) pair): median seconds per step, and the median over
    repeats of its step time divided by the first variant's step time in the same repeat."""
    def step() -> None:
        model(x).sum().backward()

    times: dict[str, list[float]] = {k: [] for k in variants}
    for setup, teardown in variants.values():  # warmup
        setup()
        for _ in range(3):
            step()
        teardown()
    order = list(variants.items())
    for _ in range(repeats):
        random.shuffle(order)
        for name, (setup, teardown) in order:
            setup()
            t0 = time.process_time()
            for _ in range(steps):
                step()
            times[name].append((time.process_time() - t0) / steps)
            teardown()
    base = times[next(iter(variants))]
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratios = {k: statistics.median(a / b for a, b in zip(v, base)) for k, v in times.items()}
    return medians, ratios


def torch_full_backward_hooks(targets: dict[str, nn.Module]) -> tuple[Callable, Callable]:
    """``(on, off)``: register / remove torch's no-op full backward hook on every target."""
    handles: list = []

    def on() -> None:
        handles.extend(m.register_full_backward_hook(noop) for m in targets.values())

    def off() -> None:
        while handles:
            handles.pop().remove()

    return on, off


def bench(label: str, model: nn.Module, x: torch.Tensor, repeats: int, steps: int) -> None:
    targets = leaves(model)
    mgr = HookManager()
    bwd = mgr.register_backward_hook(noop, hook_fn_name="bwd", activate=False, **targets)
    fwd = mgr.register_forward_hook(noop, hook_fn_name="fwd", activate=False, **targets)
    torch_on, torch_off = torch_full_backward_hooks(targets)
    nothing = (lambda: None, lambda: None)
    variants = {
        "none": nothing,
        # hookline hooks registered, all inactive: the state between the other variants. It
        # leaves no torch hook on any module, so it is "none" again; measured separately to show it.
        "deactivated": nothing,
        "torch_bwd": (torch_on, torch_off),
        "hookline_bwd": (lambda: mgr.activate_all_hooks(hook_types=[bwd]), mgr.deactivate_all_hooks),
        "hookline_fwd": (lambda: mgr.activate_all_hooks(hook_types=[fwd]), mgr.deactivate_all_hooks),
    }
    t, r = measure(model, x, variants, repeats, steps)
    mgr.remove_all_hooks()
    calls = len(targets)
    base = t["none"]

    def per_call(name: str) -> str:
        return f"{(r[name] - 1) * base / calls * 1e6:.1f} us per hooked call"

    print(f"\n== {label}: {calls} hooked modules, no-hook step {base * 1e3:.2f} ms")
    print(f"(a) backward hooks: hookline / torch full backward hook = "
          f"{r['hookline_bwd'] / r['torch_bwd']:.3f}x   (target <= 1.3x)")
    print(f"    overhead over no hooks: hookline {(r['hookline_bwd'] - 1) * 100:+.1f}% "
          f"({per_call('hookline_bwd')}), torch {(r['torch_bwd'] - 1) * 100:+.1f}% ({per_call('torch_bwd')})")
    print(f"(b) deactivated hooks / no hooks = {r['deactivated']:.3f}x   (target <= 1.02x)")
    print(f"(c) forward hooks / no hooks = {r['hookline_fwd']:.3f}x  ({per_call('hookline_fwd')})")


def per_call(iterations: int, width: int = 1024) -> None:
    """Forward / backward / step time added per hooked module call (see the module docstring)."""
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(64, width)
    targets = {name: m for name, m in model.named_children() if isinstance(m, nn.Linear)}
    fwd, bwd = HookManager(), HookManager()
    fwd.register_forward_hook(noop, **targets)
    bwd.register_backward_hook(noop, **targets)
    fwd.deactivate_all_hooks()
    bwd.deactivate_all_hooks()
    torch_on, torch_off = torch_full_backward_hooks(targets)

    def identity_node(on: bool) -> Callable[[], None]:
        """The same backward hooks with single-op calls off (every call through the identity
        node, as before 2026-11-24): what the single-op path saves, in the same process."""
        def switch() -> None:
            (bwd.activate_all_hooks if on else bwd.deactivate_all_hooks)()
            for slot in bwd._slots.values():
                slot._single_op = not on
        return switch

    variants: dict[str, tuple[Callable, Callable]] = {
        "no hooks": (lambda: None, lambda: None),
        "hookline forward hook": (fwd.activate_all_hooks, fwd.deactivate_all_hooks),
        "hookline backward hook": (bwd.activate_all_hooks, bwd.deactivate_all_hooks),
        "  same, identity node": (identity_node(True), identity_node(False)),
        "torch full backward hook": (torch_on, torch_off),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(iterations):
        for name, (on, off) in variants.items():
            on()
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            off()
            times[name].append((t1 - t0, t2 - t1))
    base = times["no hooks"]
    f0, b0 = (statistics.median(t[k] for t in base) for k in (0, 1))
    print(f"per hooked call, MLP 4 x Linear({width}) + ReLU, batch 64: no-hook forward {f0 * 1e3:.2f} ms, "
          f"backward {b0 * 1e3:.2f} ms; median of {iterations} interleaved iterations")
    for name in list(variants)[1:]:
        d = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(times[name], base)]
        df, db, dt = (statistics.median(k) * 1e6 / len(targets)
                      for k in ([v[0] for v in d], [v[1] for v in d], [v[0] + v[1] for v in d]))
        print(f"  {name:<26} forward +{df:6.1f} us  backward +{db:6.1f} us  step +{dt:6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-call", type=int, default=0, metavar="N",
                        help="instead: us added per hooked Linear(1024) call, N interleaved iterations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.per_call:
        per_call(args.per_call)
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats} repeats x {args.steps} steps")
    bench("MLP 20 x Linear(256, 256) + ReLU, batch 64", mlp(), torch.randn(64, 256, requires_grad=True),
          args.repeats, args.steps)
    bench("ResNet-ish: 4 basic blocks, 16 channels, 32x32, batch 8", resnet(),
          torch.randn(8, 3, 32, 32, requires_grad=True), args.repeats, args.steps)


if __name__ == "__main__":
    main()
