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


# ---------------------------------------------------------------- a port another server holds

CLASHING = """
import socket, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
time.sleep(0.5)  # llama-server sets up its backends before it binds the port
try:
    socket.create_server(("127.0.0.1", port)).listen()
except OSError:
    print(f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}", file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="which process holds a port is read from /proc")
@pytest.mark.parametrize("binary", ["stand-in", "llama-server"])
def test_a_foreign_server_on_our_port_serving_the_same_model_is_not_taken_for_ours(tmp_path, monkeypatch, binary):
    # a llama-server already on the port, serving the same GGUF, was taken for ours: ours died on the clash and
    # completions came from the other one, undrafted (draft_n 0) yet measured as ours (issue 60, fault 1)
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from drafters.engines import llama_cpp
    from drafters.engines.llama_cpp import LlamaCppError

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # never loaded: the clash comes first (llama-server binds before it loads)
    if binary == "llama-server":
        built = llama_cpp.build_dir() / "bin" / "llama-server"
        if not built.is_file():
            pytest.skip("no llama.cpp build: bash .ci/llama-cpp")
        build = tmp_path / "build"
        (build / "bin").mkdir(parents=True)
        (build / "bin" / "llama-server").symlink_to(built)
    else:
        build = tmp_path / "stand-in"
        (build / "bin").mkdir(parents=True)
        (build / "clashing_server.py").write_text(CLASHING)
        server = build / "bin" / "llama-server"
        server.write_text(f"#!/bin/sh\nexec {sys.executable} {build / 'clashing_server.py'} \"$@\"\n")
        server.chmod(0o755)
    monkeypatch.setenv("DRAFTERS_LLAMA_CPP", str(build))

    asked = []

    class Foreign(BaseHTTPRequestHandler):  # what a llama-server on the same GGUF answers
        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(self.path)
            out = {"/health": {"status": "ok"},
                   "/props": {"model_path": str(model.absolute()), "model_alias": "model", "total_slots": 1},
                   "/v1/models": {"object": "list", "data": [{"id": "model", "object": "model"}]}}.get(self.path)
            body = json.dumps(out or {"error": "not found"}).encode()
            self.send_response(200 if out else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # a completion without drafts
            asked.append(self.path)
            body = json.dumps({"tokens": [1, 2], "timings": {"predicted_ms": 1.0, "draft_n": 0}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    foreign = ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    port = foreign.server_address[1]
    monkeypatch.setattr(llama_cpp, "free_port", lambda: port)  # every port picked is the one the other server holds
    try:
        with pytest.raises(LlamaCppError, match=rf"^llama-server could not start: port {port} is held by another "
                                                rf"process \(pid {os.getpid()}: .*\), not by the llama-server started "
                                                r"here, so its answers would not be ours \(tried 3 ports\)"):
            with llama_cpp.LlamaServer(model, ready_timeout=20, stop_grace=0.5) as server:
                server.complete([1, 2, 3], 2)  # today: answered by the other server
    finally:
        foreign.shutdown()
        foreign.server_close()
    assert "/completion" not in asked
