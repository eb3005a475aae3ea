"""Where the writer's cost to the training thread comes from (issue 35): the GIL, or the cores.

Run:  python tests/benchmarks/bench_contention.py [--models linear6,m1,m2,dispatch]
                                                  [--threads default,1] [--rounds 9] [--steps 4]
                                                  [--policies normal,nice,idle,burst] [--gil]
                                                  [--load] [--malloc default|tuned]

Models (every module's output and its gradient captured every step, ``loss.backward()``):
  linear6   6 x Linear(1024), batch 256 (~12 MiB a step; compute-bound);
  m1, m2    bench_peers.py's MLP of 8 x (Linear(1024) + GELU) and 4-layer TransformerEncoder;
  dispatch  200 x (Linear(32) + ReLU), batch 8: hundreds of tiny module calls a step, what a GPU
            training loop looks like to the CPU (Python dispatch-bound).

For each model and torch thread count (``default``: torch's own, one per core; ``1``), the
variants are timed in interleaved rounds (order shuffled per round) in this one process:
  none          no hooks;
  list          plain torch hooks appending ``.detach().clone()`` to lists (cleared per round);
  hl-normal     ``Recorder(writer_priority="normal")``: writer threads at the training thread's
                priority;
  hl-nice       ``writer_priority="nice"``: the writer threads at nice 19 (Linux, per thread);
  hl-idle       the writer threads put under ``SCHED_IDLE`` by this script (not a hookline
                option: this is the measurement that ruled it out);
  hl-burst      ``nice``, and the writer woken in fewer, larger batches: at 128 MiB queued or
                2 s after the first record (the default: 16 MiB or 0.2 s), set on its queue
                by this script (not a hookline option: a measurement of batching).
Printed: step time / none (median over rounds, min-max), the training thread's CPU / none
("train": torch's own worker threads are not counted), and the CPU each variant adds per
captured GB (the training thread's added CPU plus, for hookline, its writer threads' CPU read
from their own /proc counters, so none of it lands in another variant's rounds) beside the
floor measured in the same run: a snapshot copy of the same tensors plus a plain ``pwrite``
loop of their bytes with the writer's writeback (32 MiB) and a final ``fsync`` (SPEC §8:
<= 1.3x).

``--gil`` adds, per model and thread count, how long the training thread waits for the GIL per
step while the writer runs (hl-normal): py-spy (``pip install py-spy``) samples this process's
threads with native frames at 200 Hz while the variant runs alone for a few seconds; a sample of
the training thread inside CPython's ``take_gil`` is a wait for the GIL. Printed as ms per step
and as a share of the added step time.

``--load`` starts one busy process per core beside the benchmark (no free core anywhere).

``--malloc tuned`` re-runs the script with bench_capture.py's glibc settings (freed memory kept
in the heap, no mmap below 32 MiB): with glibc's defaults torch returns freed activation memory to
the kernel and faults it back in every step, in a pattern any hook changes, and those faults land
in the training thread's CPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_peers import (INPUTS, HooklineVariant, Variant, _burn, build as build_peer,  # noqa: E402
                         interleave, make_step, modules, pwrite_kicked)



#: every model built stays alive: bench_peers caches each model's modules by ``id(model)``,
#: which a model built after another was freed could reuse
_BUILT: list[nn.Module] = []


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """Model ``name`` and its batch."""
    model, x = _build(name)
    _BUILT.append(model)
    return model, x


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    if name in ("m1", "m2"):
        return build_peer(name)
    torch.manual_seed(0)
    if name == "linear6":
        model, x = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]), torch.randn(256, 1024)
    elif name == "dispatch":
        layers: list[nn.Module] = []
        for _ in range(200):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        model, x = nn.Sequential(*layers), torch.randn(8, 32)
    else:
        raise SystemExit(f"unknown model {name!r}: pick linear6, m1, m2 or dispatch")
    INPUTS[id(model)] = x
    return model, x


class Lists(Variant):
    """Plain torch hooks keeping a clone of every output and output gradient (registered for its
    own steps only: a registered full backward hook costs every step, even one that keeps nothing)."""

    def arm(self, model, x, train, tmp):
        self.step = make_step(model, x, train)
        self.kept: list[torch.Tensor] = []
        self.mods = list(modules(model).values())

    def _fwd(self, mod, inp, out):
        if isinstance(out, torch.Tensor):
            self.kept.append(out.detach().clone())

    def _bwd(self, mod, gin, gout):
        if gout and isinstance(gout[0], torch.Tensor):
            self.kept.append(gout[0].detach().clone())

    def run(self, i):
        hs = [m.register_forward_hook(self._fwd) for m in self.mods]
        hs += [m.register_full_backward_hook(self._bwd) for m in self.mods]
        self.step()
        for h in hs:
            h.remove()

    def end_round(self):
        self.kept.clear()


#: ``hl-burst``: the writer's wake-up threshold and latency (8x and 10x the defaults).
BURST_BYTES = 128 << 20
BURST_LATENCY_S = 2.0


class Hookline(HooklineVariant):
    """bench_peers' Recorder of every module's outputs and grads, its writer threads at ``policy``."""

    def __init__(self, name: str, policy: str) -> None:
        super().__init__(name)
        self.policy = policy
        self.recorder_kw = {"writer_priority": {"idle": "normal", "burst": "nice"}.get(policy, policy)}

    def arm(self, model, x, train, tmp):
        before = set(threading.enumerate())
        super().arm(model, x, train, tmp)
        self.threads = [t.native_id for t in set(threading.enumerate()) - before]  # writer, compactor
        if self.policy == "idle":  # (threads they start later inherit it)
            for tid in self.threads:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        if self.policy == "burst":
            q = self.rec._writer._queue
            q.wake_bytes, q.wake_latency_s = BURST_BYTES, BURST_LATENCY_S

    def background_cpu(self) -> float:
        """CPU seconds the writer's threads used so far (their own counters: none of it is
        counted to another variant's rounds, whenever it runs)."""
        total = 0.0
        for tid in self.threads:
            try:
                f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        return total


def captured(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One step's outputs and output gradients of every captured module (what hookline records)."""
    got: list[torch.Tensor] = []
    hs = []
    for m in modules(model).values():
        hs.append(m.register_forward_hook(lambda m, i, o: got.append(o.detach().clone())
                                          if isinstance(o, torch.Tensor) else None))
        hs.append(m.register_full_backward_hook(lambda m, gi, go: got.append(go[0].detach().clone())
                                                if go and isinstance(go[0], torch.Tensor) else None))
    make_step(model, x, True)()
    for h in hs:
        h.remove()
    return got


def floor_cpu_per_gb(tensors: list[torch.Tensor], where: Path, steps: int = 20) -> float:
    """CPU seconds per GB of the least any recorder spends on these bytes: a snapshot copy of each
    tensor, a ``pwrite`` of its bytes, writeback every 32 MiB (start it, drop what is written),
    one ``fsync`` at the end."""
    fd = os.open(where / "floor.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    off = since = 0
    c0 = time.thread_time()
    for _ in range(steps):
        for t in tensors:
            b = t.clone(memory_format=torch.contiguous_format).numpy()
            since = pwrite_kicked(fd, b, off, since)
            off += b.nbytes
    os.fsync(fd)
    cpu = time.thread_time() - c0
    os.close(fd)
    os.unlink(where / "floor.bin")
    return cpu / (off / 2**30)


def variants(names: list[str], model: nn.Module, x: torch.Tensor, tmp: Path) -> list[Variant]:
    out: list[Variant] = []
    for n in names:
        v = Variant(n) if n == "none" else Lists(n) if n == "list" else Hookline(f"hl-{n}", n)
        (tmp / v.name).mkdir()
        v.arm(model, x, True, tmp / v.name)
        out.append(v)
    return out


def gil_wait(v: Variant, seconds: float = 4.0) -> tuple[float, int] | None:
    """(share of the training thread's samples waiting for the GIL, samples) under py-spy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return None
    out = Path(tempfile.mkdtemp()) / "spy.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--native", "--idle", "--threads",
                             "-r", "200", "-d", str(int(seconds)), "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # py-spy attaches
    i, t_end = 10_000, time.perf_counter() + seconds + 1
    while time.perf_counter() < t_end and proc.poll() is None:
        v.run(i)
        i += 1
    proc.wait()
    v.end_round()
    waits = total = 0
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack.startswith("thread (") or "): MainThread" not in stack.split(";", 1)[0]:
            continue
        total += int(n)
        # CPython 3.11-3.12's take_gil waits in pthread_cond_timedwait (its own frames are static
        # and unnamed); locks and queues wait in sem_*wait, torch's engine in pthread_cond_wait.
        if "pthread_cond_timedwait" in stack:
            waits += int(n)
    return (waits / total if total else 0.0, total)


def measure(model_name: str, threads: str, names: list[str], rounds: int, steps: int, gil: bool) -> None:
    torch.set_num_threads(os.cpu_count() if threads == "default" else int(threads))
    model, x = build(model_name)
    tensors = captured(model, x)
    step_bytes = sum(t.numel() * t.element_size() for t in tensors)
    with tempfile.TemporaryDirectory() as d:
        vs = variants(names, model, x, Path(d))
        floors: list[float] = []
        wall, cpu = interleave(vs, rounds, steps, time.thread_time,
                               lambda: floors.append(floor_cpu_per_gb(tensors, Path(d), steps=steps)))
        base_w, base_c = statistics.median(wall["none"]), statistics.median(cpu["none"])
        # the writer threads' CPU per captured step, from their own counters
        bg = {v.name: v.background_cpu() / (rounds * steps + 1) for v in vs if isinstance(v, Hookline)}
        floor = statistics.median(floors)
        gb = step_bytes / 2**30
        print(f"\n{model_name} torch threads {torch.get_num_threads()} ({threads}): no hooks "
              f"{base_w * 1e3:.1f} ms/step wall, {base_c * 1e3:.1f} ms CPU; {step_bytes / 2**20:.1f} MiB "
              f"captured a step; floor {floor:.2f} s CPU per GB")
        print(f"  {'variant':10s} {'step':>6s} {'(min-max)':>13s} {'train':>6s} {'s/GB':>6s} {'/floor':>6s}")
        for n in wall:
            rw = [w / base_w for w in wall[n]]
            per_gb = (statistics.median(cpu[n]) - base_c + bg.get(n, 0.0)) / gb
            extra = "" if n == "none" else f" {per_gb:6.2f} {per_gb / floor:6.2f}"
            print(f"  {n:10s} {statistics.median(rw):6.3f} ({min(rw):.2f}-{max(rw):.2f}) "
                  f"{statistics.median(cpu[n]) / base_c:6.3f}{extra}")
        if gil:
            for v in vs:
                if not isinstance(v, Hookline):
                    continue
                step_s = statistics.median(wall[v.name])
                got = gil_wait(v)
                if got is None:
                    print("  GIL wait: py-spy not found (pip install py-spy)")
                    break
                share, total = got
                added = step_s - base_w
                of_added = f"; {share * step_s / added:.0%} of the {added * 1e3:.1f} ms added" if added > 0 else ""
                print(f"  GIL wait ({v.name}): {share * step_s * 1e3:.2f} ms per step = {share:.1%} of the "
                      f"training thread's time ({total} samples){of_added}")
        for v in vs:
            v.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="linear6,m1,m2,dispatch")
    p.add_argument("--threads", default="default,1")
    p.add_argument("--policies", default="normal,nice,idle")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gil", action="store_true", help="also the GIL wait per step (needs py-spy)")
    p.add_argument("--load", action="store_true", help="keep every core busy with a CPU burner")
    p.add_argument("--malloc", choices=("default", "tuned"), default="default",
                   help="tuned: glibc keeps freed memory in the heap (bench_capture.py's TUNED_MALLOC)")
    a = p.parse_args(argv)
    if a.malloc == "tuned" and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        from bench_capture import TUNED_MALLOC  # (re-run with the settings: glibc reads them at start)

        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(os.cpu_count() or 1)] if a.load else []
    for b in burners:
        b.start()
    try:
        print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}{', with burners' if a.load else ''}, "
              f"malloc {a.malloc}")
        names = ["none", "list", *a.policies.split(",")]
        for m in a.models.split(","):
            for t in a.threads.split(","):
                measure(m, t, names, a.rounds, a.steps, a.gil)
    finally:
        for b in burners:
            b.terminate()


if __name__ == "__main__":
    main()
