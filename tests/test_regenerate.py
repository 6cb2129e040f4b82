import json
from pathlib import Path

import pytest
import torch

from conftest import load_script  # tests/ is on sys.path under pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_regenerate.yaml")
DATA = ROOT / "tests" / "data" / "tiny_prompts.jsonl"
IDS = ["t0", "t1", "t2", "tiny_prompts.jsonl:4", "t4"]


@pytest.fixture(scope="module")
def regenerate():
    return load_script("train/regenerate.py")


def run(regenerate, output, *overrides):
    return regenerate.main([RECIPE, f"data={DATA}", f"output={output}", *overrides])


def read_rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def greedy_answer(model, tokenizer, messages, max_new_tokens=8):
    # Reference: batch 1, no padding, the same text round trip as the script.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=[2], pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    new = new[: new.index(2)] if 2 in new else new
    return tokenizer.decode(new, skip_special_tokens=True)


def prompt_length(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_regenerates_every_assistant_turn(regenerate, tmp_path, tiny_llama):
    output = tmp_path / "out" / "regen.jsonl"
    stats = run(regenerate, output)
    rows = read_rows(output)
    assert [r["id"] for r in rows] == IDS and stats.written == 5
    assert [r["source"] for r in rows] == ["demo", "demo", str(DATA), str(DATA), "demo"]
    multi = rows[1]["conversations"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in multi if m["role"] != "assistant"] == [
        "Answer briefly.", "Name a colour.", "Another one?"]

    model, tokenizer = tiny_llama
    assert rows[0]["conversations"][1]["content"] == greedy_answer(
        model, tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    # the 2nd user turn is asked after the target's own 1st answer, not the dataset's
    assert multi[4]["content"] == greedy_answer(model, tokenizer, multi[:4])
    assert 0 < stats.tokens <= 8 * 6 and stats.seconds > 0


def test_resume_skips_written_rows_and_drops_a_truncated_line(regenerate, tmp_path):
    output = tmp_path / "regen.jsonl"
    run(regenerate, output, "limit=3")
    assert [r["id"] for r in read_rows(output)] == IDS[:3]

    stats = run(regenerate, output)
    assert (stats.resumed, stats.written) == (3, 2)
    complete = output.read_text()
    assert [r["id"] for r in read_rows(output)] == IDS

    lines = complete.splitlines(keepends=True)
    output.write_text("".join(lines[:-1]) + lines[-1][:20])  # crash in the middle of the last row
    stats = run(regenerate, output)
    assert (stats.resumed, stats.written) == (4, 1)
    assert output.read_text() == complete  # greedy: the re-generated row is the same


def test_corrupt_row_in_the_middle_is_an_error(regenerate, tmp_path):
    output = tmp_path / "regen.jsonl"
    output.write_text('{"id": "t0"}\nnot json\n{"id": "t1"}\n')
    with pytest.raises(ValueError, match="regen.jsonl:2: not a row written by regenerate"):
        run(regenerate, output)


def test_sampling_is_seeded(regenerate, tmp_path):
    first = run(regenerate, tmp_path / "a.jsonl", "temperature=0.8", "top_p=0.9", "seed=1")
    run(regenerate, tmp_path / "b.jsonl", "temperature=0.8", "top_p=0.9", "seed=1")
    assert first.written == 5
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_prompt_length_limit_ends_conversations(regenerate, tmp_path, tiny_llama):
    _, tokenizer = tiny_llama
    system, first_question = ({"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "Name a colour."})
    limit = prompt_length(tokenizer, [system, first_question])
    stats = run(regenerate, tmp_path / "c.jsonl", f"max_prompt_length={limit}")
    rows = {r["id"]: r["conversations"] for r in read_rows(tmp_path / "c.jsonl")}
    assert [m["role"] for m in rows["t1"]] == ["system", "user", "assistant"]  # 2nd turn too long
    assert set(rows) == set(IDS)
    assert sum(stats.skipped.values()) == 1

    question = [{"role": "user", "content": "What is 2+2?"}]
    limit = prompt_length(tokenizer, question)
    stats = run(regenerate, tmp_path / "d.jsonl", f"max_prompt_length={limit}")
    # only "Say hi." is shorter than "What is 2+2?"; the other conversations are not written
    assert [r["id"] for r in read_rows(tmp_path / "d.jsonl")] == ["t0", "t2"]
    assert stats.skipped == {"prompt longer than max_prompt_length (conversation ends before it)": 3}


def test_bad_settings_are_recipe_errors(regenerate, tmp_path):
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        run(regenerate, tmp_path / "x.jsonl", "top_p=1.5")
    with pytest.raises(ValueError, match="'prompt'"):
        run(regenerate, tmp_path / "x.jsonl", "fmt=alpaca")


def test_server_settings_are_checked_before_anything_runs(regenerate, tmp_path):
    for override, message in [("concurrency=0", "concurrency=0 must be >= 1"),
                              ("request_timeout=0", "request_timeout=0.0 must be > 0"),
                              ("gguf=q4_k", "gguf='q4_k': choose auto, shipped, f32, f16, q8_0 or a path"),
                              ("engine=server", "engine=server needs url=")]:
        with pytest.raises(ValueError, match=message):
            run(regenerate, tmp_path / "x.jsonl", override)
    with pytest.raises(ValueError, match="url=http://127.0.0.1:9 is a server, but engine=in-process"):
        run(regenerate, tmp_path / "x.jsonl", "url=http://127.0.0.1:9")
    assert not (tmp_path / "x.jsonl").exists()


def test_no_server_at_the_url_is_one_sentence(regenerate, tmp_path):
    from drafters.engines.llama_cpp import free_port
    from drafters.engines.openai_api import ServerError

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServerError, match=r"/v1/models did not answer \(connection.*is an OpenAI-compatible server "
                                          "running there"):
        run(regenerate, tmp_path / "x.jsonl", f"url={url}", "engine=auto", "retries=1", "backoff=0.01")
    assert not (tmp_path / "x.jsonl").exists()


def test_a_second_run_into_the_same_output_is_refused(regenerate, tmp_path):
    import subprocess
    import sys

    from drafters.files import InUseError

    output = tmp_path / "regen.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from drafters.files import hold_lock; "
                               f"hold_lock({str(tmp_path / '.regen.jsonl.lock')!r}, 'x'); print('held', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InUseError, match=rf"output={output} is in use by another run \(PID {holder.pid}"):
            run(regenerate, output)
    finally:
        holder.kill()
        holder.wait()
    assert run(regenerate, output, "limit=1").written == 1  # the holder is gone, and its lock with it


def test_a_server_with_a_larger_vocabulary_is_refused_by_the_probe(regenerate, tmp_path):
    # ids past the target's vocabulary crashed the probe with IndexError in the target's embedding (issue 38, fault 9)
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from drafters.engines.openai_api import ServerError

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, out):
            body = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /v1/models: named like the target
            self.answer({"data": [{"id": "tiny-random-llama"}]})

        def do_POST(self):  # a reply in another tokenizer's ids: 300 and 70000 are past the tiny target's 259
            self.rfile.read(int(self.headers["Content-Length"]))
            content = [{"id": i, "logprob": -0.1} for i in (65, 300, 70000)]
            self.answer({"choices": [{"text": "abc", "finish_reason": "length", "logprobs": {"content": content}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 3}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServerError, match=r"token ids \[300, 70000\] outside the target's vocabulary of 259"):
            run(regenerate, tmp_path / "x.jsonl", f"url=http://127.0.0.1:{server.server_address[1]}",
                "engine=auto", "retries=1", "backoff=0.01")
    finally:
        server.shutdown()
        server.server_close()
    assert not (tmp_path / "x.jsonl").exists()


def test_the_templates_variables_render_the_prompt(tmp_path):
    # chat_template_kwargs reach the template that renders each prompt (a thinking switch opens the think block)
    from drafters.tiny import CHATML_TEMPLATE, build_tiny_tokenizer
    from drafters.training.regenerate import Stats, prompt_ids

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE.replace(
        "assistant\n' }}", "assistant\n' }}{% if enable_thinking %}{{ '<think>\n' }}{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tokenizer.decode(prompt_ids(tokenizer, messages, Stats(), {"enable_thinking": True}))
    plain = tokenizer.decode(prompt_ids(tokenizer, messages, Stats()))
    assert thinking == plain + "<think>\n" and plain.endswith("assistant\n")


def test_tool_call_conversations_are_a_counted_skip(regenerate, tmp_path):
    from test_data import TOOL_ROW

    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({"id": "tool", **TOOL_ROW}) + "\n" + json.dumps(
        {"id": "plain", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    stats = regenerate.main([RECIPE, f"data={data}", f"output={tmp_path / 'out.jsonl'}"])
    assert stats.written == 1 and [r["id"] for r in read_rows(tmp_path / "out.jsonl")] == ["plain"]
    assert stats.skipped == {"tool calls (their results depend on the calls; train on the row as it is)": 1}


@pytest.mark.parametrize("fault, reason", [("HTTP 500", "HTTP 500"), ("empty body", "empty reply"),
                                           ("empty reply", "empty reply"), ("connection", "connection")])
def test_a_server_failing_every_completion_stops_the_run_early(regenerate, tmp_path, fault, reason):
    # a server whose /v1/models answers but whose every completion fails was asked every conversation, retries and
    # backoff included, before exit 3: ~15 s per conversation per worker, hours over a data set (issue 60, fault 4).
    # BROKEN_AFTER_FAILURES conversations in a row given up, whatever the failure, stop the run, the rows kept
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from drafters.engines.openai_api import ServerError
    from drafters.training.regenerate import BROKEN_AFTER_FAILURES

    answered, lock, asked = 5, threading.Lock(), []  # the first 5 conversations are answered, then it breaks

    class Broken(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status, out):
            body = b"" if out is None else json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # /v1/models: named like the target
            self.answer(200, {"data": [{"id": "tiny-random-llama"}]})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = {"choices": [{"text": "abc", "finish_reason": "stop",
                                  "logprobs": {"content": [{"id": 65, "logprob": -0.1}]}}],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
            if "logprobs" in request:  # the probe's requests (only they ask for log-probs): answered
                return self.answer(200, reply)
            with lock:
                asked.append(self.path)
                n = len(asked)
            if n <= answered:
                return self.answer(200, reply)
            if fault == "HTTP 500":
                return self.answer(500, {"error": {"code": 500, "message": "broken"}})
            if fault == "empty body":
                return self.answer(200, None)
            if fault == "empty reply":
                reply["choices"][0]["text"] = ""
                return self.answer(200, reply)
            self.close_connection = True  # connection: closed without a reply

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(50)))
    output = tmp_path / "regen.jsonl"
    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    concurrency, retries = 2, 1
    try:
        with pytest.raises(ServerError, match=rf"looks broken: {BROKEN_AFTER_FAILURES} conversations in a row failed "
                                              rf"after {retries} retries each \({BROKEN_AFTER_FAILURES} {reason}\), "
                                              rf"the last with {reason}.*; {answered} rows were written to "
                                              r".*regen.jsonl and are kept: check the server"):
            regenerate.main([RECIPE, f"data={data}", f"output={output}", "engine=auto",
                             f"url=http://127.0.0.1:{server.server_address[1]}", f"retries={retries}", "backoff=0.01", "request_timeout=5",
                             f"concurrency={concurrency}", "probe_agreement=0"])
    finally:
        server.shutdown()
        server.server_close()
    # at most the conversations in flight when the run stopped were asked besides: not all 50, each with its retries
    assert len(asked) <= answered + (BROKEN_AFTER_FAILURES + concurrency) * (retries + 1)
    text = output.read_text()
    assert text.endswith("\n") and sorted(json.loads(line)["conversations"][-1]["content"]
                                          for line in text.splitlines()) == ["abc"] * answered
