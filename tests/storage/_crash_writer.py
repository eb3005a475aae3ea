"""Subprocess for the SIGKILL test: writes deterministic records forever in sessions.

Each session opens a RunWriter on the run dir (continuing it), writes records with periodic
flushes and closes it (merge). After each flush/close it appends the durable record count of the
handle to PROGRESS (one line, flushed), so the parent knows what must survive a kill.

usage: python _crash_writer.py RUN_DIR PROGRESS SEED
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np

from hookline.storage import RunWriter

HID = "outputs[blocks.0]"


def fields(i: int) -> dict:
    f = {"outputs.0": np.full((16, 64), i, np.float32) + np.arange(64, dtype=np.float32),
         "outputs.1": np.arange(i % 7 + 1, dtype=np.int64) + i}
    if i % 2 == 0:
        f["grad_out.0"] = (np.full(33, i % 65536, np.uint16), "bfloat16")
    return f


def main() -> None:
    run_dir, progress, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    i = 0
    if os.path.exists(os.path.join(run_dir, "manifest.json")):
        from hookline.storage import open_run

        i = len(open_run(run_dir)[HID])  # continue where the killed process's durable data ends
    with open(progress, "a") as prog:
        while True:
            w = RunWriter(run_dir, max_buffer_mb=8, fsync=False)
            w.add_handle(HID, module_name="blocks.0", category="forward_hook", hook_fn_name="outputs")
            for _ in range(rng.randint(20, 120)):
                w.write(HID, i, 0, fields(i))
                i += 1
                if rng.random() < 0.15:
                    w.flush()
                    prog.write(f"{i}\n")
                    prog.flush()
            w.close()
            prog.write(f"{i}\n")
            prog.flush()


if __name__ == "__main__":
    main()
