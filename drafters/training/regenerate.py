"""Re-answering the user turns of a dataset with the target (train/regenerate.py is its command line),
so drafters learn the target's own replies.

Keeps each conversation's system and user turns and generates every assistant turn with the
target, in order (the 2nd user turn is asked after the target's own 1st answer). Writes one JSON
line per conversation, {"id", "source", "conversations": [{"role", "content"}, ...], "generator":
{engine, model, api, sampling}}, appended and flushed as soon as the conversation is done (in the
order they finish). Resumable: ids already in the output are skipped on restart (rows without an
"id" field are identified by file name and row number), and a last line cut short by a crash is
dropped. One run at a time per output (a lock beside it).
Where the replies come from (`engine`):
- `server` (any `url=`): an OpenAI-compatible server (llama-server, vLLM, SGLang), `concurrency`
  conversations in flight. The prompt is rendered here with the target's own chat template and sent
  to /v1/completions as token ids, so the server applies neither its template nor its tokenizer
  (api=chat sends messages plus the template, and refuses a server whose prompt token count shows it
  used another). Transient failures (connection, timeout, HTTP 429/5xx, malformed JSON, an empty
  reply) are retried with exponential backoff; a conversation that still fails is not written, and
  is counted and named in the report (re-running retries it); BROKEN_AFTER_FAILURES conversations in a
  row given up, whatever the failure, stop the run early (the server is hung or broken), the rows
  written so far kept. Before any row is written, the
  server must serve the target: by name (/v1/models) and by a probe (its greedy replies to three
  fixed prompts, scored token by token against the in-process target's argmax).
- `llama-server`: starts the project's llama.cpp build (`bash .ci/llama-cpp`) on a free loopback
  port with `concurrency` slots, serving the target's GGUF (`gguf`: llama.cpp's F32 conversion of
  the weights trained against by default, cached; or the shipped file, f16, q8_0, a path), then as
  `server`; stopped at the end, on error and on Ctrl-C.
- `in-process`: Hugging Face `generate`, batched with left padding (`batch_size`).
- `auto` (default): `server` when a url is given, else `llama-server` when the build exists, else
  `in-process` (it says so).
Knows nothing about drafter families: it makes conversations.
"""

import hashlib
import json
import os
import queue
import re
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from drafters.dtypes import DtypeName
from drafters.engines import llama_cpp
from drafters.engines.openai_api import OpenAIServer, Rejected, RowFailure, ServerError, with_retries
from drafters.errors import UserError
from drafters.export.llama_cpp import TARGET_WEIGHTS, target_gguf
from drafters.files import check_writable, hold_lock
from drafters.targets import load_target
from drafters.training.data import DataError, RowError, load_conversations, render
from drafters.training.recipe import RecipeError

PROBE_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
                   "Explain recursion in one sentence.")
PROBE_TOKENS = 16


@dataclass
class Recipe:
    target: str  # short name, model directory, .gguf file or hub id (drafters.targets)
    data: str  # JSON / JSONL file, save_to_disk folder or dataset name (drafters.training.data)
    output: str  # JSONL, appended to: re-running resumes
    fmt: Literal["auto", "sharegpt", "openai", "prompt"] = "auto"  # see drafters.training.data
    split: str = "train"
    limit: int | None = None  # the first N input conversations (done or not)
    max_new_tokens: int = 256
    max_prompt_length: int = 2048  # tokens; a longer prompt ends its conversation there
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # variables for the chat template (rendered here, or sent as chat_template_kwargs with api=chat): e.g.
    # {enable_thinking: true}, so that a thinking model reasons and its reasoning is kept
    chat_template_kwargs: dict | None = None
    report: str | None = None  # also write this run's counts and tokens/s here as JSON
    seed: int = 0  # server: conversation c's turn k is sampled with seed + k + a hash of c's id
    engine: Literal["auto", "server", "llama-server", "in-process"] = "auto"  # see the module docstring
    # a server (engine=server, or llama-server started here)
    url: str | None = None  # e.g. http://127.0.0.1:8000 (the /v1 suffix is optional)
    api: Literal["completions", "chat"] = "completions"  # completions: token ids rendered here
    served_model: str | None = None  # the name the server serves the target under; None: matched to `target`
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key, if the server wants one
    concurrency: int = 4  # conversations in flight (and the local llama-server's slots)
    retries: int = 4  # per request, after the first try
    backoff: float = 1.0  # seconds before the first retry; doubled each time (capped at 30)
    request_timeout: float = 300  # seconds per request
    probe_agreement: float = 0.6  # the least fraction of the probe's tokens that must be the target's argmax
    # the local llama-server (engine=llama-server)
    gguf: str = "auto"  # auto = f32 (the exact weights trained against), shipped, f16, q8_0 or PATH.gguf
    server_threads: int = 0  # 0 = `threads`, else torch's count ($OMP_NUM_THREADS, else every core)
    # in-process generation (engine=in-process)
    batch_size: int = 16
    dtype: Literal["auto", DtypeName] = "float32"  # auto: bf16 only where native (drafters.dtypes)
    threads: int = 0  # torch CPU threads; 0 = torch's default


@dataclass
class Stats:
    engine: str = ""  # what generated the rows: transformers, llama-server, server
    written: int = 0
    tokens: int = 0  # generated, end-of-turn token included, padding not
    seconds: float = 0.0  # generating: inside generate, or the wall time from the first request to the last
    cut: int = 0  # answers that hit max_new_tokens
    resumed: int = 0  # input conversations already in the output
    skipped: Counter = field(default_factory=Counter)
    retried: Counter = field(default_factory=Counter)  # reason -> retried requests that later succeeded or not
    given_up: Counter = field(default_factory=Counter)  # reason -> conversations not written
    given_up_ids: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def regenerate(recipe: Recipe, stats: Stats) -> Stats:
    """Every conversation of recipe.data not yet in recipe.output, answered by the engine the recipe chooses,
    counted into `stats` as it goes (so a caller interrupted by Ctrl-C still knows what was written)."""
    check(recipe)
    check_writable(recipe.output, "output=", directory=False)  # before the target, the server and the probe
    if recipe.report:  # written after every row: refused now, not once hours of rows are done
        check_writable(recipe.report, "report=", directory=False)
    engine = choose_engine(recipe)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)

    target = load_target(recipe.target, dtype=recipe.dtype)
    if target.tokenizer.chat_template is None:
        raise DataError(f"target {target.name} has no chat template: regeneration answers chat turns, so give it "
                        f"one first (python train/chat_target.py {target.name} DIR: the plain User:/Assistant: "
                        "text our benches prompt base models with) and name DIR as the target")
    conversations, report = load_conversations(recipe.data, split=recipe.split, fmt=recipe.fmt,
                                               limit=recipe.limit, require_assistant=False)
    print(report.summary())
    output = Path(recipe.output)
    hold_lock(output.with_name(f".{output.name}.lock"), f"output={output}")  # two runs would write rows twice
    todo = select_todo(conversations, read_done_ids(output), stats)
    stats.engine = engine
    if not todo:
        print(f"regenerate: nothing to do, all {stats.resumed} conversations are in {output}")
    elif engine == "in-process":
        run_in_process(target, todo, recipe, output, stats)
    elif engine == "server":
        client = OpenAIServer(recipe.url, api_key=os.environ.get(recipe.api_key_env), timeout=recipe.request_timeout)
        run_server(client, target, todo, recipe, output, stats, where=recipe.url)
    else:
        gguf = local_gguf(recipe, target)
        threads = recipe.server_threads or recipe.threads or torch.get_num_threads()  # OMP_NUM_THREADS or all cores
        ctx = recipe.concurrency * (recipe.max_prompt_length + recipe.max_new_tokens + 8)  # per slot: ctx/slots
        print(f"regenerate: starting llama-server on {gguf.name} ({recipe.concurrency} slots, {threads} threads)")
        with tempfile.TemporaryDirectory(prefix="regenerate-") as tmp:
            extra = ()
            if recipe.api == "chat":  # the server applies the target's own template (checked by the probe)
                (Path(tmp) / "template.jinja").write_text(target.tokenizer.chat_template)
                extra = ("--jinja", "--chat-template-file", str(Path(tmp) / "template.jinja"))
            with llama_cpp.LlamaServer(gguf, threads=threads, ctx=ctx, slots=recipe.concurrency,
                                       alias=served_name(target.name), extra=extra) as server:
                client = OpenAIServer(server.url, timeout=recipe.request_timeout)
                run_server(client, target, todo, recipe, output, stats, where=f"llama-server ({gguf})",
                           alive=server.alive, log_tail=server.log_tail, weights=gguf.name)
    return stats


def choose_engine(recipe: Recipe) -> str:
    if recipe.url is not None:
        if recipe.engine not in ("auto", "server"):
            raise RecipeError(f"url={recipe.url} is a server, but engine={recipe.engine}: drop one of them")
        return "server"
    if recipe.engine == "server":
        raise RecipeError("engine=server needs url=http://HOST:PORT (an OpenAI-compatible server)")
    if recipe.engine == "llama-server":
        llama_cpp.tool("llama-server")  # a missing build says how to make one
        return "llama-server"
    if recipe.engine == "auto" and not llama_cpp.available():
        print(f"regenerate: no llama.cpp build ({llama_cpp.BUILD_COMMAND} makes one), so generating in-process "
              "with Hugging Face generate, several times slower on a CPU")
        return "in-process"
    return "llama-server" if recipe.engine == "auto" else recipe.engine


def check(recipe: Recipe) -> None:
    problems = [f"{name}={getattr(recipe, name)} must be >= 1"
                for name in ("batch_size", "max_new_tokens", "max_prompt_length", "concurrency")
                if getattr(recipe, name) < 1]
    problems += [f"{name}={getattr(recipe, name)} must be >= 0" for name in ("retries", "backoff", "server_threads")
                 if getattr(recipe, name) < 0]
    if recipe.request_timeout <= 0:
        problems.append(f"request_timeout={recipe.request_timeout} must be > 0 (seconds)")
    if recipe.temperature < 0:
        problems.append(f"temperature={recipe.temperature} must be >= 0 (0 = greedy)")
    if not 0 < recipe.top_p <= 1:
        problems.append(f"top_p={recipe.top_p} must be in (0, 1]")
    if not 0 <= recipe.probe_agreement <= 1:
        problems.append(f"probe_agreement={recipe.probe_agreement} must be in [0, 1]")
    if recipe.gguf not in ("auto", *TARGET_WEIGHTS) and not recipe.gguf.endswith(".gguf"):
        problems.append(f"gguf={recipe.gguf!r}: choose auto, {', '.join(TARGET_WEIGHTS)} or a path to a .gguf file")
    if problems:
        raise RecipeError("; ".join(problems))


def run_in_process(target, todo, recipe: Recipe, output: Path, stats: Stats) -> None:
    eos_ids = sorted(target.eos_token_ids)
    generator = {"engine": "transformers", "model": target.name, "dtype": recipe.dtype,
                 "sampling": sampling(recipe, None)}
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out, tqdm(total=len(todo), unit="conv") as bar:
        for start in range(0, len(todo), recipe.batch_size):
            batch = todo[start : start + recipe.batch_size]
            for row in regenerate_batch(target, batch, recipe, eos_ids, stats):
                out.write(json.dumps({**row, "generator": generator}, ensure_ascii=False) + "\n")  # one write per row
                out.flush()
                stats.written += 1
            bar.update(len(batch))
            bar.set_postfix_str(f"{stats.tokens_per_second():.1f} generated tok/s")


def sampling(recipe: Recipe, seed: int | None) -> dict:
    """The request's sampling settings, recorded with each row. Sampled: temperature and top_p only, like
    `generate(top_k=0)` (top_k -1 and min_p 0 switch off llama-server's defaults of 40 and 0.05)."""
    if recipe.temperature == 0:
        return {"temperature": 0.0, "max_tokens": recipe.max_new_tokens}
    settings = {"temperature": recipe.temperature, "top_p": recipe.top_p, "top_k": -1, "min_p": 0.0,
                "max_tokens": recipe.max_new_tokens}
    return settings if seed is None else {**settings, "seed": seed}


def row_seed(recipe: Recipe, row_id: str) -> int:
    # the same on every run and resume, different per conversation (a server seeds each request alone)
    return (recipe.seed + int.from_bytes(hashlib.sha256(row_id.encode()).digest()[:4], "little")) % 2**31


# ---- a server: OpenAI-compatible, remote or the llama-server started here ----------------------------

def served_name(name: str) -> str:
    return Path(name).name.removesuffix(".gguf") or name


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", served_name(name).lower())


def local_gguf(recipe: Recipe, target) -> Path:
    if recipe.gguf.endswith(".gguf"):
        path = Path(recipe.gguf).expanduser()
        if not path.is_file():
            raise RecipeError(f"gguf={recipe.gguf}: no such file")
        return path
    # auto: F32, llama.cpp's conversion of the very weights the drafter trains against. A quantised file
    # (SmolLM2's shipped Q4_1) also quantises activations, so its greedy replies part from the target's at near
    # ties within a few dozen tokens (eval/regen_fidelity.py); choose it, f16 or q8_0 for speed or size.
    return target_gguf(target, "f32" if recipe.gguf == "auto" else recipe.gguf)


def choose_model(client: OpenAIServer, recipe: Recipe, target, where: str) -> str:
    """The server's name for the target; refuses a server that serves it under no name we recognise."""
    try:
        served = with_retries(client.models, retries=recipe.retries, backoff=recipe.backoff)
    except RowFailure as err:
        raise ServerError(f"{where}: /v1/models did not answer ({err}); is an OpenAI-compatible server "
                          "running there?") from None
    if recipe.served_model is not None:
        if recipe.served_model not in served:
            raise ServerError(f"{where} serves {served}, not served_model={recipe.served_model!r}")
        return recipe.served_model
    matching = [m for m in served if _squash(target.name) in _squash(m) or _squash(m) in _squash(target.name)]
    if len(matching) != 1:
        raise ServerError(f"{where} serves {served}: {'none' if not matching else 'several'} of them named like the "
                          f"target {target.name!r}. If one of them is the target under another name, say which "
                          "with served_model=NAME (the probe still checks that it answers like the target)")
    return matching[0]


@torch.no_grad()
def probe(client: OpenAIServer, model: str, target, recipe: Recipe, where: str) -> float:
    """Refuse a server that is not the target: its greedy replies to fixed prompts, scored by the in-process target
    (teacher forcing: the fraction of reply tokens that are the target's argmax after the reply so far). The same
    weights score ~1 even where quantisation parts the texts; another model scores near 0. In chat mode the
    server's prompt token count must also equal the target's template's."""
    tokenizer, agree, total, gaps = target.tokenizer, 0, 0, []
    for question in PROBE_QUESTIONS:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer(render(tokenizer, messages, add_generation_prompt=True,
                                  template_kwargs=recipe.chat_template_kwargs), add_special_tokens=False)["input_ids"]
        greedy = {"temperature": 0.0, "max_tokens": PROBE_TOKENS}
        extras = {"logprobs": 1, "return_tokens_as_token_ids": True}  # ids and log-probs where the server gives them
        try:
            try:
                reply = with_retries(lambda: ask(client, model, recipe, target, messages, prompt, {**greedy, **extras}),
                                     retries=recipe.retries, backoff=recipe.backoff)
            except Rejected:  # a strict server refusing the extras: the plain request
                reply = with_retries(lambda: ask(client, model, recipe, target, messages, prompt, greedy),
                                     retries=recipe.retries, backoff=recipe.backoff)
        except RowFailure as err:
            raise ServerError(f"{where}: the probe request failed ({err})") from None
        if recipe.api == "chat" and reply.prompt_tokens != len(prompt):
            raise ServerError(f"{where} applied another chat template or tokenizer: its prompt for {question!r} has "
                              f"{reply.prompt_tokens} tokens, the target's template gives {len(prompt)}. Use "
                              "api=completions, which sends the target's own prompt token ids")
        # the server's own ids where it says them (llama-server, vLLM); else the text re-tokenised, which is the
        # same for a real model's fluent text but not for a random one's
        ids = list(reply.token_ids or tokenizer(reply.text, add_special_tokens=False)["input_ids"])[:PROBE_TOKENS]
        outside = [i for i in ids if not 0 <= i < target.vocab_size]
        if outside:  # another tokenizer's ids: not the target (and they would index past its embedding)
            raise ServerError(f"{where} serves {model!r}, whose reply to {question!r} holds token ids {outside[:3]} "
                              f"outside the target's vocabulary of {target.vocab_size}: another model or tokenizer. "
                              "Point url= at a server running the target")
        logits = target.model(torch.tensor([prompt + ids], device=target.device)).logits[0]  # (P + R, V)
        scored = logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)].float()  # (R, V): predicts ids[r]
        agree += sum(a == b for a, b in zip(scored.argmax(-1).tolist(), ids))
        total += len(ids)
        if reply.token_ids and reply.logprobs and len(reply.logprobs) >= len(ids):
            ours = scored.log_softmax(-1)[torch.arange(len(ids)), torch.tensor(ids)].tolist()
            gaps += [abs(a - b) for a, b in zip(ours, reply.logprobs)]
    fraction = agree / max(total, 1)
    if fraction < recipe.probe_agreement:
        raise ServerError(f"{where} serves {model!r}, which does not answer like the target {target.name}: "
                          f"{agree} of {total} probe tokens are the target's greedy choice (at least "
                          f"{recipe.probe_agreement:.0%} needed). Point url= at a server running the target")
    if gaps:
        print(f"regenerate: probe: mean |log p(server) - log p(target)| of its tokens {sum(gaps) / len(gaps):.3f} nats")
    return fraction


def ask(client: OpenAIServer, model: str, recipe: Recipe, target, messages: list[dict], prompt: list[int],
        settings: dict):
    if recipe.api == "chat":
        return client.chat(model, messages, settings, chat_template=target.tokenizer.chat_template,
                           template_kwargs=recipe.chat_template_kwargs)
    return client.complete(model, prompt, settings)


def run_server(client: OpenAIServer, target, todo, recipe: Recipe, output: Path, stats: Stats, *, where: str,
               alive=lambda: True, log_tail=lambda: "", weights: str | None = None) -> None:
    """`concurrency` worker threads each take a whole conversation (its turns are sequential); the main thread
    writes each finished row with one write and counts failures. Rows are only written after the server passed
    the name check and the probe."""
    model = choose_model(client, recipe, target, where)
    agreement = probe(client, model, target, recipe, where)
    print(f"regenerate: {where} serves {model!r}; probe: {agreement:.0%} of its greedy tokens are the target's")
    generator = {"engine": "llama-server" if weights else "server", "model": model, "api": recipe.api}
    if weights:
        generator["weights"] = weights

    tasks, results, stop = queue.Queue(), queue.Queue(), threading.Event()
    for conversation in todo:
        tasks.put(conversation)

    def worker():
        while not stop.is_set():
            try:
                conversation = tasks.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((conversation, converse(client, model, target, conversation, recipe, stats, stop)))
            except BaseException as err:  # RowFailure: counted; anything else: re-raised by the main thread
                results.put((conversation, err))

    output.parent.mkdir(parents=True, exist_ok=True)
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(recipe.concurrency, len(todo)))]
    start = time.perf_counter()
    for thread in workers:
        thread.start()
    try:
        with open(output, "a", encoding="utf-8") as out, tqdm(total=len(todo), unit="conv") as bar:
            failed = Counter()  # reason -> conversations given up in a row after their retries (a row resets it)
            for _ in range(len(todo)):
                conversation, result = next_result(results, alive, where, log_tail, stats)
                if isinstance(result, RowFailure):
                    failed[result.reason] += 1
                    with stats.lock:
                        stats.given_up[result.reason] += 1
                        stats.given_up_ids.append(conversation.id)
                    if result.reason == "connection" and not reachable(client):
                        raise ServerError(f"{where} stopped answering ({result}); {stats.written} rows were written "
                                          f"to {output}: re-run the same command to continue where it stopped")
                    if failed.total() >= BROKEN_AFTER_FAILURES:  # stopped before the rest fail alike, retries and all
                        raise ServerError(broken(failed, result, where, recipe, output, stats, log_tail))
                elif isinstance(result, BaseException):
                    raise result
                elif result is not None:
                    row_generator = {**generator, "sampling": result.pop("sampling")}
                    out.write(json.dumps({**result, "generator": row_generator}, ensure_ascii=False) + "\n")
                    out.flush()  # a row and its newline are one write: a crash leaves whole rows only
                    stats.written += 1
                    failed.clear()
                stats.seconds = time.perf_counter() - start
                bar.update(1)
                bar.set_postfix_str(f"{stats.tokens_per_second():.1f} tok/s, {sum(stats.given_up.values())} given up")
    finally:
        stop.set()  # workers finish the request in flight and take no new one; they are daemons besides


class Incomplete(UserError):
    """A run that ended with conversations given up (not written): the rows it did write are whole and kept."""

    exit_code = 3
    label = "incomplete"

    def __init__(self, message: str, stats: "Stats"):
        super().__init__(message)
        self.stats = stats  # what the run did, as a complete run returns it


# conversations in a row given up after their retries, whatever the failure (timeouts, HTTP 5xx, empty replies, reset
# connections...): the server is hung or broken, and the rest would fail alike, each after its retries and backoff
# (~15 s per conversation per worker by default: hours over a data set)
BROKEN_AFTER_FAILURES = 3


def broken(failed: Counter, last: RowFailure, where: str, recipe: Recipe, output: Path, stats: Stats, log_tail) -> str:
    rows = f"{stats.written} rows were written to {output} and are kept"
    if set(failed) == {"timeout"}:  # it accepts connections, answers nothing: a hung server
        return (f"{where} stopped answering: {failed.total()} conversations in a row timed out "
                f"(request_timeout={recipe.request_timeout} s, {recipe.retries} retries each); {rows}: re-run the "
                "same command to continue where it stopped once the server answers")
    kinds = ", ".join(f"{n} {reason}" for reason, n in failed.most_common())
    tail = log_tail()
    return (f"{where} looks broken: {failed.total()} conversations in a row failed after {recipe.retries} retries each "
            f"({kinds}), the last with {last}; {rows}: check the server (its log, one request to it by hand), then "
            "re-run the same command to continue where it stopped"
            + (f"\nthe server's last lines:\n{tail}" if tail else ""))


def next_result(results: queue.Queue, alive, where: str, log_tail, stats: Stats):
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            if not alive():
                raise ServerError(f"{where} exited during the run ({stats.written} rows written; re-run the same "
                                  f"command to continue):\n{log_tail()}") from None


def reachable(client: OpenAIServer) -> bool:
    try:
        client.models()
        return True
    except RowFailure:
        return False


TOO_LONG_FOR_SERVER = "prompt longer than the server's context (conversation ends before it)"
# what servers say when a prompt does not fit (llama-server, vLLM, SGLang, OpenAI)
CONTEXT_MESSAGES = ("exceed the available context", "exceeds the available context", "context size",
                    "maximum context length", "context length", "longer than the maximum")


def too_long(err: Rejected) -> bool:
    return err.reason in ("HTTP 400", "HTTP 413") and any(m in err.detail.lower() for m in CONTEXT_MESSAGES)


def converse(client: OpenAIServer, model: str, target, conversation, recipe: Recipe, stats: Stats, stop):
    """Every assistant turn of one conversation, in order -> its row, or None when not even the first prompt
    fits. Raises the RowFailure of a turn that failed after its retries: the conversation is not written."""
    pending = [m for m in conversation.messages if m["role"] != "assistant"]
    history, tokens, cut, turn, seed = [], 0, 0, 0, row_seed(recipe, conversation.id)
    while turns := next_user_turn(pending):
        with stats.lock:  # the tokenizer and the counters are shared by the workers
            prompt = prompt_ids(target.tokenizer, history + turns, stats, recipe.chat_template_kwargs)
            if prompt is not None and len(prompt) > recipe.max_prompt_length:
                stats.skipped["prompt longer than max_prompt_length (conversation ends before it)"] += 1
                prompt = None
        if prompt is None:
            break
        settings = sampling(recipe, seed + turn)
        messages = history + turns

        def retried(err):
            with stats.lock:
                stats.retried[err.reason] += 1

        try:
            reply = with_retries(lambda: ask(client, model, recipe, target, messages, prompt, settings),
                                 retries=recipe.retries, backoff=recipe.backoff, stop=stop.is_set, on_retry=retried)
        except Rejected as err:
            if not too_long(err):
                raise
            with stats.lock:  # a re-run gets the same answer: the conversation ends before this turn, counted
                stats.skipped[TOO_LONG_FOR_SERVER] += 1
            break
        turn += 1
        answer = {"role": "assistant", "content": reply.text}
        if reply.reasoning is not None:  # kept: a thinking model's drafter drafts its reasoning too (data.reasoning)
            answer["reasoning_content"] = reply.reasoning
        history += turns + [answer]
        tokens += reply.completion_tokens
        cut += reply.finish_reason == "length"
    if not history:
        return None
    with stats.lock:
        stats.tokens += tokens
        stats.cut += cut
    sampling_settings = sampling(recipe, seed if recipe.temperature > 0 else None)
    return {"id": conversation.id, "source": conversation.tag or conversation.source, "conversations": history,
            "sampling": sampling_settings}


# ---- in-process: Hugging Face generate ---------------------------------------------------------------

def read_done_ids(path: Path) -> set[str]:
    """Ids of the rows already written; a last line cut short by a crash is removed from the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1  # a row and its newline are one write: a row without one is cut
    if complete < len(data):
        print(f"{path}: dropping a truncated last line ({len(data) - complete} bytes) from a previous run")
        with open(path, "r+b") as f:
            f.truncate(complete)
    ids = set()
    for line_number, line in enumerate(data[:complete].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{line_number}: not a row written by regenerate ({err!r}); "
                            "fix or remove that line, or choose another output file") from err
    return ids


def select_todo(conversations, done: set[str], stats: Stats) -> list:
    todo, seen = [], set()
    for conversation in conversations:
        if conversation.id in done:
            stats.resumed += 1
            continue
        if conversation.id in seen:
            stats.skipped["duplicate id"] += 1
            continue
        seen.add(conversation.id)
        if not any(m["role"] == "user" for m in conversation.messages):
            stats.skipped["no user turn"] += 1
            continue
        if any(m["role"] == "tool" or m.get("tool_calls") for m in conversation.messages):
            # the tools' results answer the calls in the data, not the calls the target would make
            stats.skipped["tool calls (their results depend on the calls; train on the row as it is)"] += 1
            continue
        todo.append(conversation)
    return todo


def regenerate_batch(target, conversations, recipe: Recipe, eos_ids: list[int], stats: Stats):
    # Round k asks the k-th user turn of every conversation that has one, after its own answers.
    queues = [[m for m in c.messages if m["role"] != "assistant"] for c in conversations]
    histories = [[] for _ in conversations]
    while True:
        asking, prompts = [], []
        for i, pending in enumerate(queues):
            turns = next_user_turn(pending)
            if not turns:
                continue
            prompt = prompt_ids(target.tokenizer, histories[i] + turns, stats, recipe.chat_template_kwargs)  # None: counted
            if prompt is not None and len(prompt) > recipe.max_prompt_length:
                stats.skipped["prompt longer than max_prompt_length (conversation ends before it)"] += 1
                prompt = None
            if prompt is None:
                pending.clear()  # the conversation ends with its last answered turn, if any
                continue
            histories[i].extend(turns)
            asking.append(i)
            prompts.append(prompt)
        if not asking:
            break
        for i, answer in zip(asking, generate(target, prompts, recipe, eos_ids, stats)):
            histories[i].append({"role": "assistant", "content": answer})
    return [{"id": c.id, "source": c.tag or c.source, "conversations": history}
            for c, history in zip(conversations, histories) if history]


def next_user_turn(pending: list[dict]) -> list[dict]:
    # Pops any system turns plus the next user turn; [] once no user turn is left.
    for k, message in enumerate(pending):
        if message["role"] == "user":
            turns = pending[: k + 1]
            del pending[: k + 1]
            return turns
    pending.clear()
    return []


def prompt_ids(tokenizer, messages: list[dict], stats: Stats, template_kwargs: dict | None = None) -> list[int] | None:
    try:
        text = render(tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs)
    except RowError as err:
        stats.skipped[err.reason] += 1
        return None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate(target, prompts: list[list[int]], recipe: Recipe, eos_ids: list[int], stats: Stats):
    tokenizer = target.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)  # (B, T) left-padded
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompts):
        input_ids[b, T - len(prompt) :] = torch.tensor(prompt)
        attention_mask[b, T - len(prompt) :] = 1
    if recipe.temperature > 0:  # top_k=0: only temperature and top_p shape the distribution
        settings = dict(do_sample=True, temperature=recipe.temperature, top_p=recipe.top_p, top_k=0)
    else:
        settings = dict(do_sample=False)
    start = time.perf_counter()
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
        max_new_tokens=recipe.max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id, **settings,
    )  # (B, T + new)
    stats.seconds += time.perf_counter() - start
    answers = []
    for new in out[:, T:].tolist():
        end = next((t for t, token in enumerate(new) if token in eos_ids), None)
        stats.tokens += len(new) if end is None else end + 1
        stats.cut += end is None
        answers.append(tokenizer.decode(new[:end], skip_special_tokens=True))
    return answers

