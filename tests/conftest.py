import importlib.util
import os
from pathlib import Path

# Torch's OpenMP threads spin-wait; on a 2-core machine shared with other processes one thread per
# test process is fastest and keeps timings stable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from drafters.tiny import build_tiny_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
    """Import an entry script (train/*.py, eval/*.py: not a package) as a module, for in-process tests."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def untied_llama():
    """The tiny random Llama with an untied head: varied greedy continuations (see build_tiny_target), so drafts
    can be right or wrong."""
    from drafters.targets import Target

    return Target(*build_tiny_target("tiny-random-llama", untied_head_seed=1), "tiny-random-llama")


def greedy_reference(model, prompts, max_new_tokens):
    """Plain greedy `generate` on (B, T) prompts -> (B, T + n): what speculative decoding must reproduce."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.generate(prompts, generation_config=config)


def target_features(model, ids, layers):
    """One target forward on (T,) ids -> drafters.targets.TargetFeatures at `layers`, the last hidden state, logits."""
    from drafters.targets import TargetFeatures

    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return TargetFeatures({i: out.hidden_states[i] for i in layers}, out.hidden_states[-1], None, out.logits)


# Test tiers: `pytest -m "not slow"` is the inner loop (under two minutes on one core); CI runs everything.
# Slow = marked `slow` by hand (subprocesses, training runs end to end, distribution checks with many samples), or
# needing a real target, llama.cpp or the consumers' venv, or a module whose every test starts processes.
SLOW_MARKERS = ("real", "llama_cpp", "consumers")
SLOW_MODULES = ("test_distributed",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES or any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def default_signal_handlers():
    # Tests that send SIGINT / SIGTERM to a training loop expect the interactive defaults, whatever the
    # launcher set (a shell's background job, as CI may be, starts with SIGINT ignored).
    import signal

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny_target("tiny-random-llama")


@pytest.fixture(scope="session")
def tiny_gemma3():
    return build_tiny_target("tiny-random-gemma3")


@pytest.fixture(scope="session")
def trainer():
    """The training entry point (train/train.py, every family), imported once."""
    return load_script("train/train.py")


def train_tiny(tmp_path_factory, recipe: str, *overrides: str):
    """One run of `recipe` through train/train.py into a fresh directory named after it -> (Summary, output_dir): the
    module-scoped golden run of each family's test module."""
    out = tmp_path_factory.mktemp(Path(recipe).stem)
    return load_script("train/train.py").main([recipe, f"output_dir={out}", *overrides]), out
