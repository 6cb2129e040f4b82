"""A client for the OpenAI-compatible HTTP API that serving engines speak (llama-server, vLLM, SGLang):
`/v1/models`, `/v1/completions` and `/v1/chat/completions`, with every failure sorted into one of two kinds:

- `Transient`: worth asking again (connection refused or reset, a timeout, HTTP 408 / 429 / 5xx, a body that is
  not the JSON the API promises, an empty reply). `with_retries` asks again with exponential backoff.
- `Rejected`: asking again gets the same answer (HTTP 400 / 404 / 413 / 422 ...: a prompt longer than the
  server's context, a model name it does not serve).

A reply is only returned when it is a whole one: text, the server's token counts and why it stopped. Knows
nothing about drafters, datasets or which engine is behind the URL; standard library only.
"""

import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace

from drafters.errors import UserError

RETRY_STATUS = {408, 409, 425, 429}  # plus every 5xx


class ServerError(UserError):
    """The server cannot be used at all (unreachable at start, serves another model, another chat template)."""


class RowFailure(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail  # reason: a short label the caller counts by


class Transient(RowFailure):
    pass


class Rejected(RowFailure):
    pass


@dataclass(frozen=True)
class Reply:
    text: str
    prompt_tokens: int  # as the server counted them (its tokenizer, its template in chat mode)
    completion_tokens: int
    finish_reason: str  # "stop" (end of turn or a stop string) or "length" (max_tokens reached)
    token_ids: tuple[int, ...] | None = None  # the generated ids, where the server says them (see reply_ids)
    logprobs: tuple[float, ...] | None = None  # the server's log-probability of each generated token, likewise
    # chat mode: the reasoning a server split off the answer (vLLM's and SGLang's reasoning parsers, llama-server's
    # --reasoning-format), under the message's reasoning_content (or reasoning); None where it sent none
    reasoning: str | None = None


def origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to url='s own scheme, host and port: the API key is never sent anywhere else
    (urllib's default handler forwards every header, Authorization included, to wherever it is sent)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if origin(newurl) != origin(req.full_url):
            raise ServerError(f"{req.full_url} answered HTTP {code}, redirecting to {newurl}: another host, not "
                              "followed, so the API key is not sent there; set url= to the server that answers")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


OPENER = urllib.request.build_opener(SameOriginRedirects)


class OpenAIServer:
    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 300):
        url = url.rstrip("/")
        self.base = url if url.endswith("/v1") else url + "/v1"
        self.api_key, self.timeout = api_key, timeout

    def request(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with OPENER.open(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300].strip()
            kind = Transient if err.code in RETRY_STATUS or err.code >= 500 else Rejected
            raise kind(f"HTTP {err.code}", detail) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            label = "timeout" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else "connection"
            raise Transient(label, str(reason)) from None
        if not raw.strip():
            raise Transient("empty reply", f"HTTP {response.status} with an empty body")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Transient("malformed JSON", raw[:120].decode(errors="replace")) from None

    def models(self) -> list[str]:
        out = self.request("/models", timeout=min(self.timeout, 30))
        try:
            return [str(m["id"]) for m in out["data"]]
        except (KeyError, TypeError):
            raise Transient("malformed JSON", f"/v1/models answered {str(out)[:120]}") from None

    def complete(self, model: str, prompt: list[int], sampling: dict) -> Reply:
        """/v1/completions on token ids: the server applies no template and no tokenizer to the prompt."""
        out = self.request("/completions", {"model": model, "prompt": [int(i) for i in prompt], **sampling})
        return _reply(out, chat=False)

    def chat(self, model: str, messages: list[dict], sampling: dict, chat_template: str | None = None,
             template_kwargs: dict | None = None) -> Reply:
        """/v1/chat/completions; `chat_template` is sent for servers that apply one per request (vLLM does,
        llama-server uses the one it was started with): the caller checks `prompt_tokens` to see which."""
        body = {"model": model, "messages": messages, **sampling}
        if chat_template is not None:
            body["chat_template"] = chat_template
        if template_kwargs:  # vLLM, SGLang and llama-server read the template's variables from here
            body["chat_template_kwargs"] = template_kwargs
        return _reply(self.request("/chat/completions", body), chat=True)


def _reply(out: dict, chat: bool) -> Reply:
    try:
        choice = out["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        usage = out.get("usage") or {}
        reply = Reply(text=text, prompt_tokens=int(usage.get("prompt_tokens", -1)),
                      completion_tokens=int(usage.get("completion_tokens", -1)),
                      finish_reason=str(choice.get("finish_reason")))
    except (KeyError, IndexError, TypeError, ValueError):
        raise Transient("malformed JSON", f"no reply text in {str(out)[:120]}") from None
    ids, logprobs = reply_ids(choice.get("logprobs"))
    if ids is not None:
        reply = replace(reply, token_ids=ids, logprobs=logprobs)
    message = choice.get("message") if chat else None
    reasoning = (message.get("reasoning_content") or message.get("reasoning")) if isinstance(message, dict) else None
    if isinstance(reasoning, str) and reasoning.strip():
        reply = replace(reply, reasoning=reasoning, text=reply.text if isinstance(reply.text, str) else "")
    if not isinstance(reply.text, str) or not (reply.text.strip() or reply.reasoning):
        raise Transient("empty reply", f"finish_reason={reply.finish_reason}")
    return reply


def reply_ids(logprobs) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
    """Generated token ids and their log-probabilities from a reply asked with `logprobs: 1`: llama-server lists
    {"id", "logprob"} per token under "content"; vLLM, asked with `return_tokens_as_token_ids: true`, lists
    "token_id:N" strings under "tokens". (None, None) where the reply says neither."""
    try:
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            content = logprobs["content"]
            return tuple(int(t["id"]) for t in content), tuple(float(t["logprob"]) for t in content)
        if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            ids = tuple(int(t.removeprefix("token_id:")) for t in logprobs["tokens"])
            return ids, tuple(float(x) for x in logprobs.get("token_logprobs", []))
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    return None, None


def with_retries(call, *, retries: int, backoff: float, stop=lambda: False, on_retry=lambda err: None):
    """call() until it returns; a Transient failure is retried `retries` times after backoff * 2^k seconds
    (k = 0, 1, ...; capped at 30 s, with +-25% jitter so concurrent workers do not retry in step). A Rejected
    failure, the last Transient one, or stop() turning true while waiting re-raises; on_retry(err) sees each
    failure that is retried."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Transient as err:
            if attempt == retries or stop():
                raise
            on_retry(err)
            deadline = time.monotonic() + min(backoff * 2 ** attempt, 30) * random.uniform(0.75, 1.25)
            while time.monotonic() < deadline:
                if stop():
                    raise
                time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
