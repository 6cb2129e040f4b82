"""LlamaServer's lifecycle against a stand-in llama-server that ignores SIGTERM (tests/helpers/stubborn_server.py):
whatever ends the program that started it, no server is left running (issue 38, fault 5). Needs no llama.cpp build:
$DRAFTERS_LLAMA_CPP points at a folder whose bin/llama-server is the stand-in."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import sys, time
from drafters.engines.llama_cpp import LlamaServer
with LlamaServer(sys.argv[1], ready_timeout=30, stop_grace=0.5) as server:
    print(server.process.pid, flush=True)
    time.sleep(600)
"""


@pytest.fixture
def stand_in(tmp_path):
    (tmp_path / "bin").mkdir()
    server = tmp_path / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'helpers' / 'stubborn_server.py'} \"$@\"\n")
    server.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return tmp_path, model


def alive_after(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_no_server_outlives_the_program_that_started_it(stand_in, signal_name):
    build, model = stand_in
    env = {**os.environ, "DRAFTERS_LLAMA_CPP": str(build), "PYTHONPATH": str(ROOT)}
    program = subprocess.Popen([sys.executable, "-c", PROGRAM, str(model)], stdout=subprocess.PIPE, text=True, env=env)
    pid = int(program.stdout.readline())
    program.send_signal(getattr(signal, signal_name))
    # SIGTERM: the with block unwinds, stop() sends SIGTERM (ignored), then SIGKILL after stop_grace
    program.wait(timeout=30)
    alive = alive_after(pid, 2)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"the server {pid} outlived the program that started it ({signal_name})"
    assert program.returncode == (-9 if signal_name == "SIGKILL" else 143)
