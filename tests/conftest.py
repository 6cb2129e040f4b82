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


def continuations(target, prompt_len: int, new_tokens: int = 40, rows: int = 6, seed: int = 0):
    """The target's own greedy continuations of `rows` random prompts -> (sequences (R, P + n), loss mask: 1 on the
    continuation): what the decoding tests fit a drafter to, so that its drafts are often accepted."""
    prompts = torch.randint(3, target.vocab_size, (rows, prompt_len), generator=torch.Generator().manual_seed(seed))
    sequences = greedy_reference(target.model, prompts, new_tokens)
    loss_mask = torch.zeros_like(sequences)
    loss_mask[:, prompt_len:] = 1
    return sequences, loss_mask


def fused_batch(target, sequences, loss_mask, aux_layers):
    """One target forward on `sequences` (B, T) -> the FeatureBatch that EAGLE-3, DFlash, DSpark and P-EAGLE train on:
    the fused aux layers (B, T, n*h), the target's logits (B, T, V), no grad."""
    from drafters.eagle3 import fuse_features
    from drafters.training.loop import FeatureBatch

    with torch.no_grad():
        out = target.model(sequences, output_hidden_states=True)
    return FeatureBatch(fuse_features(out.hidden_states, aux_layers), sequences, out.logits, loss_mask,
                        target.embed_tokens)


def fit_drafter(drafter, loss, steps: int, lr: float = 3e-3):
    """The decoding tests' few seconds of training: `steps` AdamW steps at `lr` on loss(step), a scalar of the
    drafter's current weights -> the drafter, in eval mode."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    for step in range(steps):
        value = loss(step)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    return drafter.eval()


def save_drafter(path, family: str, drafter, target, **extra) -> Path:
    """`drafter` as the native checkpoint of a `family` drafter for `target` (drafters.checkpoint) -> its path."""
    from dataclasses import asdict

    from drafters.checkpoint import save_checkpoint, target_info

    return save_checkpoint(path, family=family, config=asdict(drafter.config), target=target_info(target),
                           state_dict=drafter.state_dict(), extra=extra or None)


def target_features(model, ids, layers):
    """One target forward on (T,) ids -> drafters.targets.TargetFeatures at `layers`, the last hidden state, logits."""
    from drafters.targets import TargetFeatures

    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return TargetFeatures({i: out.hidden_states[i] for i in layers}, out.hidden_states[-1], None, out.logits)


# Test tiers: `pytest -m "not slow"` is the inner loop (under two minutes on one core); CI runs everything.
# Slow = marked `slow` by hand (subprocesses, training runs end to end, distribution checks with many samples), or
# needing a real target, llama.cpp, the consumers' or a peer's venv, or a module whose every test starts processes.
SLOW_MARKERS = ("real", "llama_cpp", "consumers", "peers")
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


# ---- the peer adapters' tests (tests/test_peer_*.py): one tiny EAGLE-3 store, read back row by row ----------------
PEER_SETTINGS = {"kind": "matched", "num_layers": 1, "ttt_steps": 3, "step_weight": 0.8, "draft_vocab": 64, "lr": 1e-3,
                 "schedule": "cosine", "warmup_steps": 0, "dtype": "bfloat16", "batch_size": 1, "epochs": 1,
                 "max_length": 128, "seed": 0, "threads": 1}  # eval/peers.py's matched settings on the tiny target


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """train/features.py's EAGLE-3 store of the tiny recipe's 20 conversations."""
    directory = tmp_path_factory.mktemp("features") / "eagle3"
    load_script("train/features.py").main([str(ROOT / "recipes" / "eagle3_tiny.yaml"),
                                           f"data.path={ROOT / 'tests' / 'data' / 'tiny_conversations.jsonl'}",
                                           f"features.dir={directory}"])
    return directory


def stored(store):
    """[(data row, input_ids, loss_mask, label_hidden (T, h), features (T, 3h))] in store order."""
    from safetensors import safe_open

    from drafters.training.features import FeatureStore, stored_examples

    examples = []
    for name, _ in FeatureStore.open(store).shards:
        with safe_open(store / name, framework="pt") as shard:
            label, features = shard.get_tensor("label_hidden"), shard.get_tensor("features")
            for (row, _), ids, mask, (a, b) in stored_examples(store / name):
                examples.append((row, ids, mask, label[a:b], features[a:b]))
    return examples
