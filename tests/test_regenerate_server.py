"""train/regenerate.py against a real llama-server on loopback: the tiny random Llama body with SmolLM2's tokenizer
(the one llama.cpp's converter knows), converted to an F32 GGUF by llama.cpp's own converter.

- a normal run through the llama-server the script starts itself, which is gone afterwards;
- the server killed mid-run, then a resume: every conversation exactly once, equal to an uninterrupted run's;
- a proxy in front of the real server answering HTTP 500, malformed JSON, empty replies, timeouts and HTTP 400:
  those requests are retried or the conversation is given up, counted and named, never written as garbage;
- a server serving another model: refused by name, and by the probe when the name is right but the weights are not;
- no build: the script says so and generates in-process.

Every request has a timeout of seconds and every server a ready timeout, so no test can hang.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import load_script  # tests/ is on sys.path under pytest
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.engines import llama_cpp
from drafters.engines.llama_cpp import LlamaServer
from drafters.engines.openai_api import ServerError
from drafters.export.llama_cpp import target_gguf
from drafters.targets import load_target
from drafters.training.regenerate import TOO_LONG_FOR_SERVER, Incomplete

if not llama_cpp.available() and not os.environ.get("DRAFTERS_REQUIRE_LLAMA_CPP"):
    pytest.skip("no llama.cpp build: bash .ci/llama-cpp", allow_module_level=True)

pytestmark = [pytest.mark.llama_cpp, pytest.mark.real]
ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_regenerate.yaml")
QUESTIONS = ["What is 2+2?", "Name a colour.", "Write a poem about autumn.", "Count to three.", "Say hi.",
             "Tell me a story about a fox.", "How do I sort a list in Python?", "What is 12 times 7?",
             "Why is the sky blue?", "Name three rivers."]
FAST = ["engine=auto", "retries=2", "backoff=0.05", "request_timeout=3", "max_new_tokens=12"]


@pytest.fixture(scope="module")
def regenerate():
    return load_script("train/regenerate.py")


def tiny_dir(root: Path, seed: int) -> Path:
    tokenizer = load_target("smollm2-135m-instruct").tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    path = root / f"tiny-smollm2-{seed}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target directory, its F32 GGUF, another model's F32 GGUF with the same tokenizer and architecture)"""
    root = tmp_path_factory.mktemp("tiny")
    cache = str(root / "cache")
    ours, other = tiny_dir(root, 0), tiny_dir(root, 1)
    return (ours, target_gguf(load_target(str(ours)), "f32", cache_dir=cache),
            target_gguf(load_target(str(other)), "f32", cache_dir=cache))


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    return path


def run(regenerate, target, data, output, *overrides):
    return regenerate.main([RECIPE, f"target={target}", f"data={data}", f"output={output}", *FAST, *overrides])


def rows_by_id(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a conversation was written twice"
    return by_id


def server_processes(gguf: Path) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "llama-server" in cmdline and str(gguf) in cmdline:
            found.append(pid)
    return found


def test_local_llama_server_run(regenerate, tiny, tmp_path):
    target, gguf, _ = tiny
    output = tmp_path / "regen.jsonl"
    stats = run(regenerate, target, ROOT / "tests" / "data" / "tiny_prompts.jsonl", output, "engine=llama-server",
                f"gguf={gguf}", "concurrency=2", "server_threads=1")
    rows = rows_by_id(output)
    assert sorted(rows) == sorted(["t0", "t1", "t2", "tiny_prompts.jsonl:4", "t4"]) and stats.written == 5
    assert not server_processes(gguf), "the llama-server the script started is still running"
    assert stats.engine == "llama-server" and not stats.given_up and 0 < stats.tokens <= 12 * 6

    multi = rows["t1"]["conversations"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    generator = rows["t0"]["generator"]
    assert generator["engine"] == "llama-server" and generator["weights"] == gguf.name
    assert generator["sampling"] == {"temperature": 0.0, "max_tokens": 12}
    # the prompt is the target's chat template, as ids: llama-server's own greedy reply to those ids is the row's,
    # and the 2nd turn of t1 was asked after the target's own 1st answer
    tokenizer = load_target(str(target)).tokenizer
    with LlamaServer(gguf, ready_timeout=60) as server:
        for messages, answer in ((rows["t0"]["conversations"][:1], rows["t0"]["conversations"][1]),
                                 (multi[:4], multi[4])):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            tokens = server.complete(list(ids), 12).tokens
            assert answer["content"] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_server_killed_mid_run_then_resume(regenerate, tiny, tmp_path):
    target, gguf, _ = tiny
    data = tmp_path / "prompts.jsonl"  # 30 conversations of 64 tokens, so the kill lands mid-run
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{q} ({i})"}) + "\n"
                            for i, q in enumerate(QUESTIONS * 3)))
    output, outcome = tmp_path / "regen.jsonl", {}
    with LlamaServer(gguf, ready_timeout=60, alias=target.name) as server:
        def first_run():
            try:
                run(regenerate, target, data, output, f"url={server.url}", "concurrency=1", "max_new_tokens=64")
            except ServerError as err:
                outcome["error"] = str(err)

        worker = threading.Thread(target=first_run, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while worker.is_alive() and not (output.is_file() and output.read_text().count("\n") >= 2) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        server.stop()  # killed mid-run: its process group gets SIGTERM
        worker.join(timeout=60)
    assert not worker.is_alive(), "the run did not stop after its server went away"
    assert "stopped answering" in outcome.get("error", "") and "re-run the same command" in outcome["error"]
    partial = rows_by_id(output)
    assert 2 <= len(partial) < 30

    with LlamaServer(gguf, ready_timeout=60, alias=target.name) as server:
        stats = run(regenerate, target, data, output, f"url={server.url}", "concurrency=3", "max_new_tokens=64")
        assert stats.resumed == len(partial) and stats.written == 30 - len(partial)
        uninterrupted = tmp_path / "uninterrupted.jsonl"
        run(regenerate, target, data, uninterrupted, f"url={server.url}", "concurrency=1", "max_new_tokens=64")
    resumed, expected = rows_by_id(output), rows_by_id(uninterrupted)
    assert sorted(resumed) == sorted(expected) == sorted(f"q{i}" for i in range(30))
    assert {i: r["conversations"] for i, r in resumed.items()} == {i: r["conversations"] for i, r in expected.items()}


class FaultyProxy:
    """A loopback HTTP proxy in front of a real server: requests whose prompt contains a marker get that marker's
    faults, one per attempt, and then pass through."""

    def __init__(self, upstream: str, tokenizer, plan: dict[str, list[str]], hang: float):
        self.upstream, self.tokenizer, self.plan, self.hang = upstream, tokenizer, plan, hang
        self.attempts, self.lock = {}, threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.forward(self, None)

            def do_POST(self):
                proxy.forward(self, self.rfile.read(int(self.headers["Content-Length"])))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.http.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()

    def fault(self, body: bytes | None) -> str | None:
        if body is None:
            return None
        prompt = self.tokenizer.decode(json.loads(body).get("prompt", []))
        for marker, faults in self.plan.items():
            if marker in prompt:
                with self.lock:
                    k = self.attempts[marker] = self.attempts.get(marker, 0) + 1
                return faults[k - 1] if k <= len(faults) else None
        return None

    def forward(self, handler, body):
        fault = self.fault(body)
        try:
            if fault == "timeout":
                time.sleep(self.hang)
            if fault in ("500", "400"):
                return self.reply(handler, int(fault), b'{"error": "injected"}')
            if fault == "malformed":
                return self.reply(handler, 200, b'{"choices": [{"text": "cut sh')
            request = urllib.request.Request(self.upstream + handler.path, data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                payload = response.read()
            if fault == "empty":
                out = json.loads(payload)
                out["choices"][0]["text"] = ""
                payload = json.dumps(out).encode()
            self.reply(handler, 200, payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting (the timeout fault)

    @staticmethod
    def reply(handler, status, payload):
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)


def test_faulty_server_rows_are_retried_counted_and_never_garbage(regenerate, tiny, data, tmp_path):
    target, gguf, _ = tiny
    tokenizer = load_target(str(target)).tokenizer
    plan = {"2+2": ["500"], "colour": ["malformed"], "autumn": ["empty"], "three.": ["timeout"],
            "hi.": ["500"] * 10, "fox": ["400"]}
    with LlamaServer(gguf, ready_timeout=60, alias=target.name) as server:
        clean = tmp_path / "clean.jsonl"
        run(regenerate, target, data, clean, f"url={server.url}", "concurrency=2")
        output = tmp_path / "regen.jsonl"
        with FaultyProxy(server.url, tokenizer, plan, hang=4) as proxy:
            with pytest.raises(Incomplete, match="2 conversations were given up") as incomplete:  # exit status 3
                run(regenerate, target, data, output, f"url={proxy.url}", "concurrency=2")
        stats = incomplete.value.stats
        assert dict(stats.retried) == {"HTTP 500": 3, "malformed JSON": 1, "empty reply": 1, "timeout": 1}
        assert dict(stats.given_up) == {"HTTP 500": 1, "HTTP 400": 1}  # 3 tries of "hi.", one of "fox" (rejected)
        assert sorted(stats.given_up_ids) == ["q4", "q5"] and stats.written == len(QUESTIONS) - 2
        expected, written = rows_by_id(clean), rows_by_id(output)
        assert sorted(written) == sorted(set(expected) - {"q4", "q5"})
        assert all(written[i]["conversations"] == expected[i]["conversations"] for i in written)

        stats = run(regenerate, target, data, output, f"url={server.url}", "concurrency=2")  # the server recovered
    assert stats.written == 2 and stats.resumed == len(QUESTIONS) - 2
    assert {i: r["conversations"] for i, r in rows_by_id(output).items()} == \
        {i: r["conversations"] for i, r in expected.items()}


def test_a_server_that_hangs_stops_the_run_early_with_a_non_zero_exit(regenerate, tiny, data, tmp_path):
    # a server that accepts connections but answers nothing was tried until every conversation timed out, exit 0
    # (issue 38, fault 2): three conversations in a row timing out after their retries stop the run
    target, gguf, _ = tiny
    tokenizer = load_target(str(target)).tokenizer
    plan = {q.split()[-1]: ["timeout"] * 4 for q in QUESTIONS}  # every conversation hangs, the probe's do not
    output = tmp_path / "regen.jsonl"
    with LlamaServer(gguf, ready_timeout=60, alias=target.name) as server:
        with FaultyProxy(server.url, tokenizer, plan, hang=3) as proxy:
            start = time.monotonic()
            with pytest.raises(ServerError, match=r"stopped answering: 3 conversations in a row timed out \("
                                                  r"request_timeout=1.0 s, 1 retries each\); 0 rows were written"):
                run(regenerate, target, data, output, f"url={proxy.url}", "concurrency=1", "request_timeout=1",
                    "retries=1")
    assert time.monotonic() - start < 30  # not len(QUESTIONS) conversations' timeouts


def test_a_turn_longer_than_the_servers_context_ends_its_conversation_counted(regenerate, tiny, tmp_path):
    # HTTP 400 "exceeds the available context size" dropped the whole conversation, its answered first turn too,
    # with advice to re-run that cannot help (issue 38, fault 2): the conversation ends before that turn, counted
    target, gguf, _ = tiny
    long_turn = "Summarise this: " + "the quick brown fox jumps over the lazy dog " * 40  # ~400 tokens
    data = tmp_path / "two_turns.jsonl"
    data.write_text(json.dumps({"id": "c0", "conversations": [{"role": "user", "content": "Say hi."},
                                                              {"role": "user", "content": long_turn}]}) + "\n"
                    + json.dumps({"id": "c1", "prompt": "Name a colour."}) + "\n")
    output = tmp_path / "regen.jsonl"
    with LlamaServer(gguf, ready_timeout=60, alias=target.name, ctx=160) as server:  # one slot of 160 tokens
        stats = run(regenerate, target, data, output, f"url={server.url}", "fmt=auto")
    assert stats.written == 2 and not stats.given_up and stats.skipped[TOO_LONG_FOR_SERVER] == 1
    rows = rows_by_id(output)
    assert [m["role"] for m in rows["c0"]["conversations"]] == ["user", "assistant"]  # the first turn is kept


def test_a_server_serving_another_model_is_refused(regenerate, tiny, data, tmp_path):
    target, gguf, other = tiny
    output = tmp_path / "regen.jsonl"
    with LlamaServer(gguf, ready_timeout=60, alias="qwen3-0.6b") as server:
        with pytest.raises(ServerError, match=r"serves \['qwen3-0.6b'\]: none of them named like the target"):
            run(regenerate, target, data, output, f"url={server.url}")
    # the right name on other weights: the probe scores its greedy tokens against the target's argmax
    with LlamaServer(other, ready_timeout=60, alias=target.name) as server:
        with pytest.raises(ServerError, match="does not answer like the target"):
            run(regenerate, target, data, output, f"url={server.url}")
        with pytest.raises(ServerError, match="does not answer like the target"):
            run(regenerate, target, data, output, f"url={server.url}", f"served_model={target.name}")
    assert not output.exists(), "a refused server must not get a row written"


def test_no_build_falls_back_to_in_process(regenerate, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(llama_cpp.BUILD_ENV, str(tmp_path / "no-build"))
    output = tmp_path / "regen.jsonl"
    stats = regenerate.main([RECIPE, f"data={ROOT / 'tests' / 'data' / 'tiny_prompts.jsonl'}", f"output={output}",
                             "engine=auto", "limit=2"])
    assert "no llama.cpp build (bash .ci/llama-cpp makes one)" in capsys.readouterr().out
    assert stats.engine == "in-process" and stats.written == 2
    assert rows_by_id(output)["t0"]["generator"]["engine"] == "transformers"
    with pytest.raises(llama_cpp.LlamaCppError, match="no llama.cpp build"):
        regenerate.main([RECIPE, f"output={output}", "engine=llama-server"])


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; a scheduler's or kill's SIGTERM
def test_ctrl_c_stops_the_local_server_and_leaves_whole_rows(tiny, tmp_path, stop):
    target, gguf, _ = tiny
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{q} ({i})"}) + "\n"
                            for i, q in enumerate(QUESTIONS * 3)))
    output = tmp_path / "regen.jsonl"
    command = [sys.executable, str(ROOT / "train" / "regenerate.py"), RECIPE, f"target={target}", f"data={data}",
               f"output={output}", *FAST, "engine=llama-server", f"gguf={gguf}", "concurrency=1",
               "max_new_tokens=64", "server_threads=1"]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        deadline = time.monotonic() + 90
        while child.poll() is None and not (output.is_file() and output.read_text().count("\n") >= 1) \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server_processes(gguf), "the script's llama-server is not running mid-run"
        child.send_signal(stop)
        try:
            log, _ = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    assert child.returncode == 130 and "interrupted" in log and "Re-run the same command" in log
    deadline = time.monotonic() + 10
    while server_processes(gguf) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server_processes(gguf), "Ctrl-C left the llama-server running"
    assert 1 <= len(rows_by_id(output)) < 30  # whole rows only: every line parses


def test_chat_api_gets_the_targets_template_or_is_refused(regenerate, tiny, data, tmp_path):
    target, gguf, _ = tiny
    by_ids = tmp_path / "completions.jsonl"
    run(regenerate, target, data, by_ids, "engine=llama-server", f"gguf={gguf}", "server_threads=1")
    chat = tmp_path / "chat.jsonl"  # llama-server started with the target's template file (--jinja)
    stats = run(regenerate, target, data, chat, "engine=llama-server", f"gguf={gguf}", "server_threads=1", "api=chat")
    assert stats.written == len(QUESTIONS) and rows_by_id(chat)["q0"]["generator"]["api"] == "chat"
    assert {i: r["conversations"] for i, r in rows_by_id(chat).items()} == \
        {i: r["conversations"] for i, r in rows_by_id(by_ids).items()}
    # a server applying its own template (here: plain ChatML without SmolLM2's default system prompt) is refused
    with LlamaServer(gguf, ready_timeout=60, alias=target.name, extra=("--jinja", "--chat-template", "chatml")) as server:
        with pytest.raises(ServerError, match="applied another chat template or tokenizer"):
            run(regenerate, target, data, tmp_path / "refused.jsonl", f"url={server.url}", "api=chat")
    assert not (tmp_path / "refused.jsonl").exists()
