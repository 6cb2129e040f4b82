"""drafters.engines.openai_api against real HTTP servers on loopback: where the API key may go."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from drafters.engines.openai_api import OpenAIServer, ServerError


class Recorder(BaseHTTPRequestHandler):
    """Answers /v1/models; `redirect_to` (a base URL): answers 307 there instead. Records what it was sent."""

    redirect_to: str | None = None
    seen: list

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        if self.redirect_to and not self.path.startswith("/moved"):
            self.send_response(307)
            self.send_header("Location", self.redirect_to + self.path)
            self.end_headers()
            return
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # a chat reply; the request body is recorded
        self.seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "4."}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(redirect_to=None):
    handler = type("Handler", (Recorder,), {"redirect_to": redirect_to, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    if redirect_to == "self":  # to another path on this very server
        handler.redirect_to = url + "/moved"
    return server, handler.seen, url


@pytest.fixture
def servers():
    started = []

    def start(redirect_to=None):
        server, seen, url = serve(redirect_to)
        started.append(server)
        return seen, url

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_another_host_is_not_followed_with_the_key(servers):
    # a 307 from url= delivered 'Bearer <key>' to another address (issue 38, fault 6)
    elsewhere_seen, elsewhere = servers()
    seen, url = servers(redirect_to=elsewhere)
    with pytest.raises(ServerError, match=r"answered HTTP 307, redirecting to http://127\.0\.0\.1:\d+/v1/models: "
                                          r"another host, not followed"):
        OpenAIServer(url, api_key="secret").models()
    assert seen == [("/v1/models", "Bearer secret")] and elsewhere_seen == []


def test_a_redirect_within_the_same_server_is_followed(servers):
    seen, url = servers(redirect_to="self")
    assert OpenAIServer(url, api_key="k").models() == ["m"]
    assert seen == [("/v1/models", "Bearer k"), ("/moved/v1/models", "Bearer k")]


def test_another_port_on_the_same_host_is_another_server(servers):
    seen, url = servers()
    front_seen, front = servers(redirect_to=url)
    with pytest.raises(ServerError, match="another host, not followed"):
        OpenAIServer(front, api_key="k").models()
    assert seen == []


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])  # vLLM / SGLang / llama-server; newer vLLM
def test_a_chat_reply_keeps_the_reasoning_the_server_split_off(field):
    from drafters.engines.openai_api import Transient, _reply

    def answer(content, reasoning, finish="stop"):
        message = {"role": "assistant", "content": content, **({field: reasoning} if reasoning is not None else {})}
        return {"choices": [{"message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 9}}

    reply = _reply(answer("4.", "2 plus 2 is 4."), chat=True)
    assert (reply.text, reply.reasoning) == ("4.", "2 plus 2 is 4.")
    assert _reply(answer("4.", None), chat=True).reasoning is None
    # cut while thinking: no answer yet, but the reasoning is the model's output and is kept
    cut = _reply(answer(None, "Let me think", finish="length"), chat=True)
    assert (cut.text, cut.reasoning, cut.finish_reason) == ("", "Let me think", "length")
    with pytest.raises(Transient, match="empty reply"):
        _reply(answer("", None), chat=True)


def test_chat_sends_the_templates_variables_where_engines_read_them(servers):
    # vLLM, SGLang and llama-server take the template's variables (a thinking switch) as chat_template_kwargs
    seen, url = servers()
    client = OpenAIServer(url)
    messages = [{"role": "user", "content": "2+2?"}]
    assert client.chat("m", messages, {"max_tokens": 4}, template_kwargs={"enable_thinking": True}).text == "4."
    client.chat("m", messages, {"max_tokens": 4})
    (first_path, first), (_, second) = seen[-2:]
    assert first_path == "/v1/chat/completions" and first["chat_template_kwargs"] == {"enable_thinking": True}
    assert "chat_template_kwargs" not in second  # nothing sent where nothing was asked
