"""The architecture matrix: every architecture of drafters.tiny.TINY_ARCHITECTURES (a tiny random model of
transformers' own config class, saved to a directory as a user's model would be) through the steps a user takes.

    python eval/architectures.py [--only llama,qwen3_next] [--families eagle3,dflash] [--json out.json]

Steps, each ok or the first line of what stopped it:
    labels   the soft labels (drafters.targets.FrozenHead on the final hidden state) against the model's own
             softmax(forward): mean total variation, which must be below 1e-4 (logit scales and softcaps applied)
    train    the family's tiny recipe (recipes/{family}_tiny.yaml) on the model's directory, 2 optimizer steps
    decode   the trained drafter in the tree decoder, greedy, on a chain of 3 and a 4-node static tree: equal to
             `generate`, token for token, on 2 prompts of 24 tokens
    export   every engine format of the family but llama.cpp, read back by the decoder's loader: the same first tree
A step after a failed one is not run; "refused" marks a step the project declines in one sentence by design
(a layout the decoder cannot verify, an export an engine would load and lose acceptance with). Prints the matrix; --json writes it. tests/test_architectures.py runs the
same steps (drafters.tiny.TINY_ARCHITECTURES is the one list).
"""

import argparse
import json
import tempfile
import traceback
from pathlib import Path

import torch

from drafters.decode.decoder import speculative_generate
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.decode.tree import parse_tree_spec
from drafters.export.dispatch import EXPORT_FORMATS, export_checkpoint
from drafters.targets import FrozenHead, TargetFeatures, load_target
from drafters.tiny import TINY_ARCHITECTURES, build_tiny_architecture
from drafters.training.families import load_recipe, train

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("labels", "train", "decode", "export")
TREES = ("chain:3", "static:[[0],[1],[0,0]]")
NEW = 12


def save_model(arch: str, directory: Path) -> Path:
    model, tokenizer = build_tiny_architecture(arch)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def label_gap(target) -> float:
    """Mean total variation between the label head's distribution and the model's own, on random ids."""
    ids = torch.randint(3, target.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
        labels = FrozenHead.from_target(target, "normed")(out.hidden_states[-1])
    return float((labels.float().softmax(-1) - out.logits.float().softmax(-1)).abs().sum(-1).mean() / 2)


def greedy(target, prompt):
    config = target.model.generation_config
    out = target.model.generate(prompt[None], max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=config.pad_token_id)
    return out[0]


def first_tree(proposer, target, prompt) -> list[int]:
    with torch.no_grad():
        out = target.model(prompt[None], output_hidden_states=True)
    needs = proposer.needs
    features = TargetFeatures({i: out.hidden_states[i] for i in needs.layers}, out.hidden_states[-1], None,
                              out.logits) if needs.any else None
    proposer.reset(prompt, features)
    return proposer.propose(prompt, int(out.logits[0, -1].argmax()), SamplingConfig()).tokens.tolist()


def run_steps(arch: str, family: str, work: Path) -> dict[str, str]:
    """{step: "ok" or what stopped it} for one architecture and family (drafters.tiny.TINY_ARCHITECTURES)."""
    result, state = {}, {}
    prompts = [torch.randint(3, 259, (24,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def labels():
        state["dir"] = save_model(arch, work / "model")
        state["target"] = target = load_target(str(state["dir"]))
        gap = label_gap(target)
        if not gap < 1e-4:
            raise AssertionError(f"labels differ from the model's softmax: mean total variation {gap:.3g}")

    def train_step():
        argv = [str(ROOT / "recipes" / f"{family}_tiny.yaml"), f"target={state['dir']}", "max_steps=2",
                "eval_every=0", "data.eval_rows=2", f"output_dir={work / family}", "threads=1"]
        state["checkpoint"] = train(load_recipe(argv)).checkpoint

    def decode():
        target = state["target"]
        for tree in TREES:
            proposer = load_proposer(str(state["checkpoint"]), target, parse_tree_spec(tree))
            for prompt in prompts:
                out, _ = speculative_generate(target, proposer, prompt, max_new_tokens=NEW)
                if out.tolist() != greedy(target, prompt).tolist():
                    raise AssertionError(f"{tree}: greedy decoding differs from generate")

    def export():
        target, tree = state["target"], parse_tree_spec("chain:3")
        expected = first_tree(load_proposer(str(state["checkpoint"]), target, tree), target, prompts[0])
        for fmt in [f for f in EXPORT_FORMATS[family] if f not in ("llama.cpp", "native")]:
            path = export_checkpoint(state["checkpoint"], fmt, work / "export" / fmt, target=target).path
            if first_tree(load_proposer(str(path), target, tree), target, prompts[0]) != expected:
                raise AssertionError(f"--format {fmt}: read back, it drafts another first tree")

    for step, call in zip(STEPS, (labels, train_step, decode, export)):
        try:
            call()
            result[step] = "ok"
        except Exception as err:  # the matrix reports what stopped each step; the traceback is printed
            traceback.print_exc(limit=-3)
            said = " ".join(str(err).split())
            refused = isinstance(err, NotImplementedError) or said.startswith("refusing")  # one sentence, by design
            result[step] = f"{'refused' if refused else 'FAILED'} ({type(err).__name__}): {said[:300]}"
            if not refused or step in ("labels", "train"):  # a refused decode leaves export to run
                break
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated names of drafters.tiny.TINY_ARCHITECTURES")
    p.add_argument("--families", default="eagle3,dflash")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    archs = args.only.split(",") if args.only else list(TINY_ARCHITECTURES)
    unknown = [a for a in archs if a not in TINY_ARCHITECTURES]
    if unknown:
        raise SystemExit(f"unknown architectures {unknown}; choose from {', '.join(TINY_ARCHITECTURES)}")
    matrix = {}
    for arch in archs:
        for family in args.families.split(","):
            with tempfile.TemporaryDirectory() as work:
                matrix[f"{arch} / {family}"] = run_steps(arch, family, Path(work))
            print(f"{arch} / {family}: {matrix[f'{arch} / {family}']}", flush=True)
    print("\n| architecture / family | " + " | ".join(STEPS) + " |\n|---|" + "---|" * len(STEPS))
    for name, steps in matrix.items():
        print(f"| {name} | " + " | ".join(steps.get(s, "not run") for s in STEPS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(matrix, indent=1))
    return matrix


if __name__ == "__main__":
    main()
