"""llama.cpp, the serving engine that runs on CPUs, driven from outside as its users run it: the
project's pinned build (`bash .ci/llama-cpp`), its own converter (convert_hf_to_gguf.py), the GGUF
facts the project checks before running anything, and `LlamaServer`, a llama-server with a lifecycle
(free loopback port, wait for health, bounded requests, always stopped: on error and Ctrl-C too).

Knows nothing about drafter families, training or the project's decoder: it moves files, token ids
and llama.cpp's own counters.

Where the build is: $DRAFTERS_LLAMA_CPP, else `.llama.cpp` in the repository root; it holds `src/`
(llama.cpp's source tree from the llama-cpp-python 0.3.36 sdist: the converter and gguf-py) and `bin/`
(llama-server, llama-speculative-simple, llama-bench).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from drafters.errors import UserError

BUILD_COMMAND = "bash .ci/llama-cpp"
BUILD_ENV = "DRAFTERS_LLAMA_CPP"
VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp .ci/llama-cpp builds
OUTTYPES = ("f32", "f16", "q8_0")  # what the converter writes and the export offers
CONVERT_TIMEOUT_S = 1800


class LlamaCppError(UserError):
    pass


# ---- the build ----------------------------------------------------------------------------------

def build_dir() -> Path:
    env = os.environ.get(BUILD_ENV)
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / ".llama.cpp"


def tool(name: str) -> Path:
    """A llama.cpp binary of the pinned build; a missing build says how to make one."""
    path = build_dir() / "bin" / name
    if not path.is_file():
        raise LlamaCppError(f"no llama.cpp build: {path} is missing. Build it with `{BUILD_COMMAND}` "
                            f"(llama.cpp {VERSION} from PyPI, about 15 minutes on 2 cores), or point "
                            f"${BUILD_ENV} at a folder holding bin/{name} and src/")
    return path


def available() -> bool:
    """The build the project drives is there: llama-server and the converter."""
    return (build_dir() / "bin" / "llama-server").is_file() and (build_dir() / "src" / "convert_hf_to_gguf.py").is_file()


# ---- the converter ------------------------------------------------------------------------------

def as_arg(path) -> str:
    """A path as a command-line argument: absolute, so a name such as '-x.gguf' is never read as an option."""
    return str(Path(path).absolute())


def convert(model_dir: Path, out_file: Path, *, outtype: str, target_dir: Path | None = None,
            timeout: float = CONVERT_TIMEOUT_S) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a Hugging Face layout directory -> out_file. A drafter
    (EAGLE-3, DFlash) needs `target_dir`: the target's config.json and tokenizer. A failure raises
    with the converter's own last lines."""
    if outtype not in OUTTYPES:
        raise LlamaCppError(f"GGUF type {outtype!r}: choose one of {', '.join(OUTTYPES)}")
    script = build_dir() / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        tool("llama-server")  # raises the build message when the whole build is missing
        raise LlamaCppError(f"{script} is missing from the llama.cpp build; rebuild with `{BUILD_COMMAND}`")
    command = [sys.executable, str(script), as_arg(model_dir), "--outfile", as_arg(out_file), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", as_arg(target_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(build_dir() / "src" / "gguf-py"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"llama.cpp's converter did not finish on {model_dir} within {timeout:.0f} s") from None
    if done.returncode != 0 or not out_file.is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise LlamaCppError(f"llama.cpp's converter failed on {model_dir} (exit {done.returncode}):\n{tail}")
    return out_file


# ---- what a GGUF file says ----------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFFacts:
    path: Path
    architecture: str  # general.architecture: llama, eagle3, dflash, ...
    block_count: int
    embedding_length: int
    vocab_size: int  # tokenizer.ggml.tokens
    target_layers: tuple[int, ...]  # <arch>.target_layers (drafters): the layers whose inputs it reads
    tensors: dict  # name -> (shape, ggml type name)


def gguf_facts(path) -> GGUFFacts:
    from gguf import GGUFReader  # the `gguf` package: a dependency of drafters (targets load GGUF files)

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as err:
        raise LlamaCppError(f"{path}: not a readable GGUF file ({err})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else field(f"{arch}.vocab_size", 0)
    return GGUFFacts(
        path=path, architecture=arch, block_count=int(field(f"{arch}.block_count", 0)),
        embedding_length=int(field(f"{arch}.embedding_length", 0)), vocab_size=int(vocab),
        target_layers=tuple(int(i) for i in field(f"{arch}.target_layers", []) or []),
        tensors={t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors})


def check_pair(target_file, drafter_file) -> tuple[GGUFFacts, GGUFFacts]:
    """Refuse, before anything runs, a drafter GGUF that does not fit the target GGUF: llama.cpp would load
    both and draft over another vocabulary or capture layers the target does not have."""
    target, drafter = gguf_facts(target_file), gguf_facts(drafter_file)
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocabulary: drafter {drafter.vocab_size} ids, target {target.vocab_size}")
    beyond = [i for i in drafter.target_layers if not 0 <= i < target.block_count]
    if beyond:
        problems.append(f"the drafter reads the inputs of layers {list(drafter.target_layers)}, but the target has "
                        f"{target.block_count} layers")
    if drafter.embedding_length != target.embedding_length:
        problems.append(f"hidden size: drafter {drafter.embedding_length}, target {target.embedding_length}")
    if problems:
        raise LlamaCppError(f"{Path(drafter_file).name} was not trained for {Path(target_file).name}:\n  - "
                            + "\n  - ".join(problems))
    return target, drafter


# ---- llama-bench: what a target forward costs --------------------------------------------------

BENCH_TIMEOUT_S = 600


def bench_forward_ms(model, sizes, *, depth: int = 128, threads: int = 1, repetitions: int = 5,
                     decode_tokens: int = 32) -> tuple[dict[int, float], float]:
    """llama-bench on a GGUF, one process: ({n: ms of one forward over n new tokens after `depth` cached
    ones}, ms per token of plain decoding at the same depth). A forward over n tokens is what verifying a
    draft of n - 1 tokens costs the target; plain decoding is one forward over 1 token per token. Means
    over `repetitions` (llama-bench's own, after its warm-up run)."""
    if not Path(model).is_file():
        raise LlamaCppError(f"{model}: no such GGUF file")
    sizes = sorted({int(n) for n in sizes})
    command = [str(tool("llama-bench")), "-m", as_arg(model), "-p", ",".join(map(str, sizes)), "-n", str(decode_tokens),
               "-d", str(depth), "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"llama-bench did not finish on {model} within {BENCH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise LlamaCppError(f"llama-bench failed on {model} (exit {done.returncode}):\n{tail}")
    forward, decode = {}, None
    for test in json.loads(done.stdout):
        ms = float(test["avg_ns"]) / 1e6
        if test["n_gen"] == 0:
            forward[int(test["n_prompt"])] = ms
        elif test["n_prompt"] == 0:
            decode = ms / int(test["n_gen"])
    if decode is None or sorted(forward) != sizes:
        raise LlamaCppError(f"llama-bench on {model} did not report every test asked for: {done.stdout[:500]}")
    return forward, decode


# ---- llama-server with a lifecycle --------------------------------------------------------------

@dataclass
class Completion:
    tokens: list[int]  # generated ids (EOS included when it stopped there)
    predicted_ms: float  # llama.cpp's own decode time, prompt excluded
    draft_n: int  # tokens drafted (llama.cpp's counter; 0 without a speculator)
    draft_accepted: int


def _die_with_parent(parent: int) -> None:
    # Linux: the server is killed when the process that started it dies, even by SIGKILL (no orphan). SIGKILL, not
    # SIGTERM: llama-server with a request in flight ignored SIGTERM for seconds and went on answering
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before prctl took effect: nobody would signal us
            os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class PortTaken(Exception):
    """Another process answers on the port picked for a new llama-server (LlamaServer tries another)."""


# where a connection to 127.0.0.1 goes, as /proc/net/tcp and tcp6 write the local address: 127.0.0.1 and any
# address (IPv4); :: and ::ffff:127.0.0.1 (IPv6)
_LOOPBACK_V4 = {"0100007F", "00000000"}
_LOOPBACK_V6 = {"0" * 32, "0000000000000000FFFF00000100007F"}


def _listening(port: int) -> tuple[set[int], set[int]] | None:
    """(IPv4, IPv6) inodes of the TCP sockets listening where a connection to 127.0.0.1:port may go, from
    /proc/net; None where that cannot be read (not Linux)."""
    found, readable = ([], []), False
    for k, (table, addresses) in enumerate((("tcp", _LOOPBACK_V4), ("tcp6", _LOOPBACK_V6))):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and address.upper() in addresses:  # 0A: LISTEN
                found[k].append(int(fields[9]))
    return (set(found[0]), set(found[1])) if readable else None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def _sockets(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open (none where its fds cannot be read: another user's)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _holder(inodes: set[int]) -> str:
    """Which process holds one of these sockets, in words, for an error message."""
    for pid in _pids():
        if _sockets(pid) & inodes:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                command = b""
            command = command.decode(errors="replace").strip()
            return f"pid {pid}: {command[:120]}" if command else f"pid {pid}"
    return "a process of another user"


PORT_ATTEMPTS = 3


class LlamaServer:
    """`with LlamaServer(model, draft=..., spec_type="draft-eagle3", n_max=3) as server:` a llama-server
    on a free loopback port, ready when the block starts and stopped when it ends (its whole process
    group, also on error and Ctrl-C). Ready means ours: on Linux the socket answering on the port must be
    the process it started (/proc), so another server there, even one serving the same GGUF, is refused, and
    no request is sent once ours has exited. Requests take and return token ids, so both engines read the
    same input. With n_max, p_min is llama.cpp's --spec-draft-p-min: a round's drafting stops at the first
    draft whose probability (the drafter's top-1, renormalised over its top 10) is below it; 0 drafts all
    n_max, and a value above 1 drafts nothing while the drafter still runs its first step every round. `slots` requests are decoded in parallel, batched into one forward per step; `alias` is the
    model name it serves (/v1/models). spec_type: None (plain), draft-eagle3, draft-dflash, ngram-simple, ngram-mod, ...

    exact=True keeps every intermediate in float32 (KV caches of target and drafter in f32, flash
    attention off): llama.cpp's defaults store K and V in f16, which moves a random wide-logit target's
    top-2 logits by ~0.4% and parts its greedy text from torch's within a few tokens. The referee runs
    exact; speed is measured with the defaults users run.
    """

    def __init__(self, model, *, draft=None, spec_type: str | None = None, n_max: int | None = None,
                 p_min: float = 0.0, threads: int = 1, ctx: int = 4096, slots: int = 1, alias: str | None = None,
                 exact: bool = False, extra: tuple = (), ready_timeout: float = 180, stop_grace: float = 5.0):
        self.model, self.draft, self.spec_type, self.n_max = Path(model), draft, spec_type, n_max
        self.p_min = p_min
        self.exact, self.slots, self.alias = exact, slots, alias
        self.threads, self.ctx, self.extra, self.ready_timeout = threads, ctx, tuple(extra), ready_timeout
        self.stop_grace = stop_grace  # seconds stop() waits after SIGTERM before SIGKILL
        self.process, self.port, self.log, self.previous_sigterm = None, None, None, None

    def command(self) -> list[str]:
        command = [str(tool("llama-server")), "-m", as_arg(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.ctx), "-np", str(self.slots),
                   "--no-webui", "--metrics"]  # -c is shared: each of the `slots` parallel requests gets ctx/slots
        if self.alias is not None:
            command += ["--alias", self.alias]  # the model name /v1/models reports
        if self.draft is not None:
            command += ["--spec-draft-model", as_arg(self.draft), "--spec-draft-threads", str(self.threads),
                        "--spec-draft-threads-batch", str(self.threads)]
        if self.spec_type is not None:
            command += ["--spec-type", self.spec_type]
        if self.exact:
            command += ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
            if self.draft is not None:
                command += ["-ctkd", "f32", "-ctvd", "f32"]
        if self.n_max is not None:
            command += ["--spec-draft-n-max", str(self.n_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(self.p_min)]
        return command + list(self.extra)

    def __enter__(self) -> "LlamaServer":
        for path in (self.model, self.draft):
            if path is not None and not Path(path).is_file():
                raise LlamaCppError(f"{path}: no such GGUF file")
        self._stop_on_sigterm()
        try:
            return self._start()
        except BaseException:
            self._restore_sigterm()
            raise

    def _start(self) -> "LlamaServer":
        for attempt in range(PORT_ATTEMPTS):  # the port is free when picked, not necessarily when bound
            self.port = free_port()
            self.log = tempfile.TemporaryFile()  # no name: nothing is left behind, whatever ends this process
            self.process = subprocess.Popen(self.command(), stdout=self.log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=partial(_die_with_parent, os.getpid()))
            try:
                self._wait_ready()
                return self
            except PortTaken as taken:
                tail = self.log_tail()
                self.stop()
                if attempt + 1 == PORT_ATTEMPTS:
                    said = f"; llama-server's last lines:\n{tail}" if tail else ""
                    raise LlamaCppError(f"llama-server could not start: {taken} (tried {PORT_ATTEMPTS} ports)"
                                        f"{said}") from None
            except BaseException:
                self.stop()
                raise

    def __exit__(self, *exc) -> None:
        self.stop()
        self._restore_sigterm()

    def _wait_ready(self) -> None:
        # Ready when our port answers /health and /props with the model path we passed, and the socket listening
        # there is the process we started (its session: start_new_session). Another server on the port, even one
        # serving the same GGUF, is never taken for ours: ours dies on the clash, and every completion would come
        # from the other one (no drafts where a drafter was asked for), measured as ours
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                other = self._other_holder()
                if other is not None or self._answering() is not None:  # it lost the port to a server there first
                    raise PortTaken(self._taken(other or "its process id cannot be read here"))
                raise LlamaCppError(f"llama-server exited with status {self.process.returncode} before it was "
                                    f"ready ({' '.join(self.command()[1:])}):\n{self.log_tail()}")
            serving = self._answering()
            if serving is not None:
                other = self._other_holder()
                if other is not None:
                    raise PortTaken(self._taken(other, serving))
                if serving != as_arg(self.model):  # where /proc cannot say whose it is (not Linux)
                    raise PortTaken(self._taken("its process id cannot be read here", serving))
                if self._ours() and self.process.poll() is None:
                    return
            time.sleep(0.25)
        raise LlamaCppError(f"llama-server was not ready within {self.ready_timeout:.0f} s:\n{self.log_tail()}")

    def _taken(self, who: str, serving: str | None = None) -> str:
        serving = f", serving {serving}" if serving else ""
        return (f"port {self.port} is held by another process ({who}{serving}), not by the llama-server started "
                "here, so its answers would not be ours")

    def _other_holder(self) -> str | None:
        """The other process whose socket takes connections to our port, in words; None when there is none, or
        where that cannot be told (no /proc)."""
        listening = _listening(self.port)
        if listening is None:
            return None
        v4, v6 = listening
        mine = self._session_sockets()
        # a foreign IPv4 listener shares or takes 127.0.0.1:port (SO_REUSEPORT, or bound first); a foreign IPv6
        # one only matters while ours listens nowhere (once ours holds 127.0.0.1:port, connections go to it)
        others = (v4 - mine) | (v6 - mine if not (v4 | v6) & mine else set())
        return _holder(others) if others else None

    def _ours(self) -> bool:
        """The socket listening on our port is our process's (True where that cannot be told: no /proc)."""
        listening = _listening(self.port)
        if listening is None:
            return True
        return bool((listening[0] | listening[1]) & self._session_sockets())

    def _session_sockets(self) -> set[int]:
        """The sockets held by the process we started and any process it started (its session)."""
        inodes = _sockets(self.process.pid)
        for pid in _pids():
            if pid != self.process.pid and _session(pid) == self.process.pid:
                inodes |= _sockets(pid)
        return inodes

    def _stop_on_sigterm(self) -> None:
        # SIGTERM's default action ends Python without unwinding, so no `with` block stopped the server: while one
        # runs, a SIGTERM the program leaves at its default raises SystemExit(143) instead (main thread only)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self.previous_sigterm = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _restore_sigterm(self) -> None:
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None

    def _answering(self) -> str | None:
        """The model path the server on our port reports once it is ready (/health, then /props), else None."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                if response.status != 200:
                    return None
            with urllib.request.urlopen(f"{self.url}/props", timeout=5) as response:
                return str(json.loads(response.read()).get("model_path"))
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        self._check_alive(path)
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                out = json.loads(response.read())
            self._check_alive(path)  # an answer on our port after ours exited is another process's
            return out
        except urllib.error.HTTPError as err:
            raise LlamaCppError(f"llama-server refused {path}: {err.code} {err.read().decode(errors='replace')[:500]}") \
                from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise LlamaCppError(f"llama-server did not answer {path} ({err}):\n{self.log_tail()}") from None

    def _check_alive(self, path: str) -> None:
        if not self.alive():
            status = "was never started" if self.process is None else f"exited with status {self.process.returncode}"
            raise LlamaCppError(f"llama-server on port {self.port} {status}, so {path} is not asked: whatever "
                                f"answers there now is another process:\n{self.log_tail()}")

    def complete(self, prompt_ids: list[int], n_predict: int, timeout: float = 600) -> Completion:
        """Greedy (temperature 0) continuation of `prompt_ids`, stopped at EOS or n_predict tokens."""
        out = self.post("/completion", {
            "prompt": [int(i) for i in prompt_ids], "n_predict": int(n_predict), "temperature": 0.0,
            "cache_prompt": False, "return_tokens": True, "stream": False}, timeout)
        timings = out.get("timings", {})
        return Completion(tokens=[int(t) for t in out.get("tokens", [])],
                          predicted_ms=float(timings.get("predicted_ms", 0.0)),
                          draft_n=int(timings.get("draft_n", 0)), draft_accepted=int(timings.get("draft_n_accepted", 0)))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        if self.log is not None:
            self.log.close()
            self.log = None
