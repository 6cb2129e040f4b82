"""Subprocess entry for tests/test_resume.py: runs train/eagle.py and SIGKILLs itself right after
optimizer step N (after that step's checkpoint, if any): `python kill_after_step.py N RECIPE [k=v ...]`."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest.load_script
from conftest import load_script  # noqa: E402
from drafters.training import loop  # noqa: E402  (fit calls loop.train_loop: patched there)

eagle = load_script("train/eagle.py")
kill_at, inner = int(sys.argv[1]), loop.train_loop


def train_loop(run, *args, **kwargs):
    periodic = run.periodic

    def then_kill(step, total, position):
        periodic(step, total, position)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    run.periodic = then_kill
    return inner(run, *args, **kwargs)


loop.train_loop = train_loop
eagle.main(sys.argv[2:])
