"""Prove our EAGLE-3 exports with the code that consumes them, not with our own reader.

    bash .ci/consumers-venv                     # once: .venv-speculators (speculators 0.9.0)
    python eval/check_consumers.py --targets tiny-random-llama smollm2-135m-instruct

For each target:
  vllm -> speculators   a drafter is exported with --format vllm; speculators' own loader
                        (`Eagle3DraftModel.from_pretrained`) reads it in its own virtual
                        environment and runs its forward (3 TTT steps) on the same target features
                        and tokens; its logits must equal our drafter's (fp32, max |diff| <= 1e-4),
                        and every config field it reads must equal what our reader reads.
  dspark -> speculators a DSpark drafter (two layers, Markov head, confidence head, reduced draft
                        vocabulary) is exported with --format vllm; speculators' `DSparkDraftModel`
                        reads it and runs its forward on blocks at every anchor of the prompt: its
                        logits of slots 1 .. B-1 (Markov bias included) and its confidence logits must
                        equal ours (slot 0 predicts nothing: sample_from_anchor false).
  peagle -> speculators a P-EAGLE drafter is exported with --format vllm; speculators' `PEagleDraftModel`
                        runs its forward on one drafting pass (the prompt's pairs, the root pair, K-1
                        mask slots) and on a training layout of drop-token chains; its logits must equal
                        our drafter's `draft` and `parallel_unroll`.
  speculators -> here   speculators builds and saves its own drafters (`from_training_args`), one
                        plain and one with its training defaults (norm_output, norm_before_fc,
                        norm_before_residual, a sliding-window layer); each loads here as a
                        proposer (the exported-directory path of eval/tau.py) and must draft the
                        same greedy chain as speculators' forward.
  sglang                our --format sglang export against what SGLang reads (consumer_sglang.py):
                        its config through the transformers SGLang pins, its weight names through
                        the name mapping of its `LlamaForCausalLMEagle3.load_weights`.

speculators pins transformers <= 5.19, this project >= 5.20, so the consumers run in a separate
virtual environment (.ci/consumers-venv) and never import drafters: the two sides exchange
safetensors and JSON files in --work. Run before every release of the export code (README).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafters.checkpoint import load_checkpoint, save_checkpoint, target_info
from drafters.draft_vocab import build_draft_vocab
from drafters.dflash import block_prev_ids
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter, fuse_features
from drafters.layers import DraftKVCache, shift_left
from drafters.export.dispatch import export_checkpoint
from drafters.export.eagle3_reader import read_eagle3_export
from drafters.export.dflash import read_dflash_export
from drafters.export.peagle import read_peagle_export
from drafters.peagle import PEagleConfig, PEagleDrafter, sample_chains
from drafters.registry import load_drafter
from drafters.decode.proposers.loading import load_proposer
from drafters.decode.sampling import SamplingConfig
from drafters.targets import load_target
from drafters.decode.tree import parse_tree_spec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".venv-speculators"
TOLERANCE = 1e-4  # fp32 max |logit diff|
STEPS = 3  # TTT steps compared; also the greedy chain depth
DRAFT_VOCAB = {"tiny-random-llama": 64}  # else 4096
BLOCK, MARKOV_RANK = 4, 8  # the DSpark drafter's block (3 drafts per pass) and Markov rank
DEPTH = 4  # the P-EAGLE drafter's K (tokens drafted per pass)
MASK_TOKEN_ID = 3  # DSpark's and P-EAGLE's mask token (any target id)
PROMPT = "Write a haiku about the sea, then explain it in one sentence."


class ConsumerError(RuntimeError):
    pass


def consumer_python(venv: Path) -> Path:
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise ConsumerError(f"no consumer virtual environment at {venv}: create it with "
                            f"`bash .ci/consumers-venv {venv}` (installs speculators 0.9.0)")
    return python


def run_consumer(venv: Path, script: str, *args) -> None:
    # PYTHONPATH is dropped so the consumer side cannot import drafters even by accident
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               TORCH_COMPILE_DISABLE="1")  # speculators compiles its DSpark / P-EAGLE forward where CUDA is
    done = subprocess.run([str(consumer_python(venv)), str(ROOT / "eval" / script), *map(str, args)],
                          env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if done.returncode:
        raise ConsumerError(f"{script} {' '.join(map(str, args))} failed:\n{done.stderr[-4000:]}")


# ---- our side: a target, a drafter with every weight off its init, the verifier files --------------

def write_verifier(target, path: Path) -> Path:
    """What a consumer reads from the verifier (target): its config.json and the embedding, final
    norm and LM head under their Hugging Face names (speculators loads these three by name)."""
    path.mkdir(parents=True, exist_ok=True)
    target.config.to_json_file(path / "config.json")
    tensors = {"model.embed_tokens.weight": target.embed_tokens.weight, "model.norm.weight": target.final_norm.weight}
    if not target.config.tie_word_embeddings:
        tensors["lm_head.weight"] = target.lm_head.weight
    save_file({k: v.detach().float().contiguous().clone() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def save_drafter(target, path: Path, norms: dict | None = None) -> Path:
    size = DRAFT_VOCAB.get(target.name, 4096)
    config = Eagle3Config.from_target_config(target.config, draft_vocab_size=size, **(norms or {}))
    return save_perturbed(target, path, "eagle3", Eagle3Drafter, config)


def save_perturbed(target, path: Path, family: str, drafter_class, config) -> Path:
    """A checkpoint of an untrained drafter with every weight off its init, over a reduced draft vocabulary."""
    counts = (torch.arange(target.vocab_size) * 7919) % 101  # a non-trivial kept-id set
    torch.manual_seed(0)
    drafter = drafter_class(config, build_draft_vocab(counts, target.vocab_size, config.draft_vocab_size))
    with torch.no_grad():  # norms off 1.0: a swapped or dropped norm changes the logits; DSpark's W2 off 0
        for param in drafter.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return save_checkpoint(path, family=family, config=asdict(config), target=target_info(target),
                           state_dict=drafter.state_dict())


def prompt_ids(target) -> torch.Tensor:
    ids = target.tokenizer(PROMPT, return_tensors="pt").input_ids  # (1, T)
    return ids[:, :48]


def features(target, ids: torch.Tensor, layers) -> torch.Tensor:
    return fuse_features(target.features(ids, layers=layers, logits=False).hidden_states, layers)  # (1, T, n*h)


def vllm_export(target, ckpt: Path, work: Path, corrupt=None) -> Path:
    """The checkpoint exported for speculators (its verifier written beside it); corrupt(export_dir), where tests
    pass one, plants a fault before the consumer reads it."""
    verifier = write_verifier(target, work / "verifier")
    export = export_checkpoint(ckpt, "vllm", work / "vllm", target=target, verifier=str(verifier)).path
    if corrupt is not None:
        corrupt(export)
    return export


# ---- vllm export -> speculators --------------------------------------------------------------------

def check_vllm_export(target, work: Path, venv: Path, corrupt=None, norms: dict | None = None) -> dict:
    # corrupt(export_dir): tests plant a fault there before the consumer reads it; norms: the drafter's norm
    # options (drafters.eagle3.Eagle3Config), which speculators must apply as we do
    ckpt = save_drafter(target, work / "ckpt", norms)
    export = vllm_export(target, ckpt, work, corrupt)
    source = load_checkpoint(ckpt)
    drafter = Eagle3Drafter(Eagle3Config(**source.config))
    drafter.load_state_dict(source.state_dict)
    ids = prompt_ids(target)
    fused = features(target, ids, drafter.config.aux_layers)
    T = ids.shape[1]
    with torch.no_grad():
        # step i's draft logits at positions t = 0 .. T-2-i (what speculators' forward returns)
        ours = [drafter.eval().compute_logits(hidden[:, :T - 1 - i])
                for i, hidden in drafter.ttt_unroll(fused, ids, target.embed_tokens, STEPS)]
    save_file({"hidden_states": fused.contiguous(), "input_ids": shift_left(ids, 1),
               "position_ids": torch.arange(T)[None], "steps": torch.tensor(STEPS)}, work / "inputs.safetensors")
    run_consumer(venv, "consumer_speculators.py", "load", export, work / "inputs.safetensors", work / "speculators")
    theirs = load_file(work / "speculators" / "logits.safetensors")
    diffs = [float((ours[i] - theirs[f"logits.{i}"][:, : ours[i].shape[1]]).abs().max()) for i in range(STEPS)]
    read = json.loads((work / "speculators" / "read.json").read_text())
    return {"max_abs_logit_diff_per_step": diffs, "max_abs_logit_diff": max(diffs),
            "field_differences": [] if corrupt else field_differences(read, export, target),
            "never_loaded": read["never_loaded"], "speculators_read": read}


def field_differences(read: dict, export: Path, target) -> list[str]:
    """Fields speculators read that differ from what our reader reads from the same files."""
    ours, _, _, _ = read_eagle3_export(export, "vllm", target=target_info(target))
    mine = {**asdict(ours), "eagle_aux_hidden_state_layer_ids": ours.aux_layers,  # asdict: the norm options
            "target_vocab_size": ours.vocab_size, "target_hidden_size": ours.hidden_size, "num_hidden_layers": 1,
            "tie_word_embeddings": False, "sliding_layers": ours.sliding_layers, "sliding_window": ours.sliding_window}
    return differences(read, mine)


def differences(read: dict, mine: dict) -> list[str]:
    return [f"{key}: speculators {read[key]!r}, ours {mine[key]!r}" for key in sorted(read.keys() & mine.keys())
            if read[key] != mine[key]]


# ---- dspark vllm export -> speculators' DSparkDraftModel ---------------------------------------------

def save_dspark(target, path: Path) -> Path:
    config = DSparkConfig.from_target_config(target.config, DRAFT_VOCAB.get(target.name, 4096),
                                             mask_token_id=MASK_TOKEN_ID, num_layers=2, block_size=BLOCK,
                                             markov_rank=MARKOV_RANK, confidence_head=True)
    return save_perturbed(target, path, "dspark", DSparkDrafter, config)


def check_dspark_export(target, work: Path, venv: Path, corrupt=None) -> dict:
    # corrupt(export_dir): tests plant a fault there before the consumer reads it
    ckpt = save_dspark(target, work / "ckpt")
    export = vllm_export(target, ckpt, work, corrupt)
    drafter = load_drafter(load_checkpoint(ckpt)).eval().attach_head(target.lm_head.weight)
    ids = prompt_ids(target)
    fused = features(target, ids, drafter.config.aux_layers)
    T, bk = ids.shape[1], drafter.config.block_size
    anchors = torch.arange(T - bk + 1)  # (N,) every block inside the prompt (speculators gathers ids a .. a+Bk-1)
    with torch.no_grad():
        normed = drafter.block_unroll(fused, ids, target.embed_tokens, anchors[None],
                                      torch.ones(1, anchors.numel(), dtype=torch.bool))  # (1, N, Bk, h)
        prev = block_prev_ids(ids, anchors[None], bk)  # (1, N, Bk-1): token a+j-1, teacher-forced
        ours = drafter.slot_logits(normed[:, :, 1:], prev)  # (1, N, Bk-1, Vd)
        confidence = drafter.confidence_logits(normed[:, :, 1:], prev)  # (1, N, Bk-1)
    save_file({"hidden_states": fused.contiguous(), "input_ids": ids, "anchors": anchors}, work / "inputs.safetensors")
    run_consumer(venv, "consumer_speculators.py", "dspark", export, work / "inputs.safetensors", work / "speculators")
    theirs = load_file(work / "speculators" / "logits.safetensors")
    # speculators' slot j of block n is row n*Bk + j; its slot 0 drafts nothing (sample_from_anchor false)
    logits = theirs["logits"].view(1, anchors.numel(), bk, -1)[:, :, 1:]  # (1, N, Bk-1, Vd)
    diffs = [float((ours[:, :, j] - logits[:, :, j]).abs().max()) for j in range(bk - 1)]
    confidence_diff = float((confidence - theirs["confidence"].view(1, -1, bk)[:, :, 1:]).abs().max())
    read = json.loads((work / "speculators" / "read.json").read_text())
    return {"max_abs_logit_diff_per_slot": diffs, "max_abs_logit_diff": max(diffs),
            "max_abs_confidence_diff": confidence_diff,
            "field_differences": [] if corrupt else dspark_field_differences(read, export, target),
            "never_loaded": read["never_loaded"], "speculators_read": read}


def dspark_field_differences(read: dict, export: Path, target) -> list[str]:
    ours = read_dflash_export(export, "vllm", target=target_info(target))[0]  # a DSparkConfig
    mine = {**asdict(ours), "aux_hidden_state_layer_ids": ours.aux_layers, "target_hidden_size": ours.hidden_size,
            "enable_confidence_head": ours.confidence_head, "confidence_head_with_markov": True,
            "sample_from_anchor": False, "layer_model_type": "qwen3", "attention_bias": False,
            "rope_type": (ours.rope_scaling or {}).get("rope_type", "default"),
            "layer_types": ["full_attention"] * ours.num_hidden_layers, "speculators_model_type": "dspark"}
    return differences(read, mine)


# ---- peagle vllm export -> speculators' PEagleDraftModel ---------------------------------------------

def save_peagle(target, path: Path, norms: dict | None = None) -> Path:
    config = PEagleConfig.from_target_config(target.config, DRAFT_VOCAB.get(target.name, 4096), depth=DEPTH,
                                             mask_token_id=MASK_TOKEN_ID, **(norms or {}))
    return save_perturbed(target, path, "peagle", PEagleDrafter, config)


def check_peagle_export(target, work: Path, venv: Path, corrupt=None, norms: dict | None = None) -> dict:
    # corrupt(export_dir): tests plant a fault there before the consumer reads it; norms: the drafter's norm
    # options (drafters.eagle3.Eagle3Config), which speculators must apply as we do
    ckpt = save_peagle(target, work / "ckpt", norms)
    export = vllm_export(target, ckpt, work, corrupt)
    drafter = load_drafter(load_checkpoint(ckpt)).eval()
    ids = prompt_ids(target)
    fused = features(target, ids, drafter.config.aux_layers)
    T, k = ids.shape[1], drafter.config.depth
    with torch.no_grad():
        pending = target.model(ids).logits[:, -1:].argmax(-1)  # (1, 1) the target's next token: the root
        # one drafting pass as the proposer runs it: the committed pairs (feature t, token t+1), t < T-1, into
        # the cache, then the root pair (feature T-1, pending) and K-1 mask slots -> (1, K, Vd)
        cache = DraftKVCache()
        drafter.prefill(fused[:, :-1], ids[:, 1:], target.embed_tokens, cache)
        _, draft = drafter.draft(fused[:, -1:], pending, target.embed_tokens, cache)
        # the training layout: every position at depth 0, drop-token chains at depths 1..K-1
        starts, keep = sample_chains(torch.ones_like(ids), k, 0.7, 0.2, torch.Generator().manual_seed(0))
        unrolled = drafter.compute_logits(drafter.parallel_unroll(fused, ids, target.embed_tokens, starts, keep))
    deeper, chain = keep[0].nonzero(as_tuple=True)  # (M,) each: the kept slots, depth deeper+1 of chain
    n = starts.shape[1]
    layouts = {  # speculators' slots: anchor_pos, depth (S,); our logits in the same slot order
        0: (torch.cat([ids[:, 1:], pending], 1), torch.cat([torch.arange(T), torch.full((k - 1,), T - 1)]),
            torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, k)]), draft),
        1: (shift_left(ids, 1), torch.cat([torch.arange(T), starts[0, chain]]),
            torch.cat([torch.zeros(T, dtype=torch.long), deeper + 1]),
            unrolled[:, torch.cat([torch.arange(T), T + deeper * n + chain])]),
    }
    save_file({"hidden_states": fused.contiguous(), "layouts": torch.tensor(len(layouts)),
               **{f"{name}.{i}": x.contiguous() for i, layout in layouts.items()
                  for name, x in zip(("input_ids", "anchor_pos", "depth"), layout)}}, work / "inputs.safetensors")
    run_consumer(venv, "consumer_speculators.py", "peagle", export, work / "inputs.safetensors", work / "speculators")
    theirs = load_file(work / "speculators" / "logits.safetensors")
    # the pass: slot T-1 drafts token T+1 (the root's children), mask slot d drafts token T+1+d
    pass_logits = theirs["logits.0"][:, T - 1:]  # (1, K, Vd)
    diffs = [float((layouts[0][3][:, d] - pass_logits[:, d]).abs().max()) for d in range(k)]
    training = float((layouts[1][3] - theirs["logits.1"]).abs().max())
    read = json.loads((work / "speculators" / "read.json").read_text())
    return {"max_abs_logit_diff_per_depth": diffs, "max_abs_logit_diff_training_layout": training,
            "max_abs_logit_diff": max(*diffs, training),
            "field_differences": [] if corrupt else peagle_field_differences(read, export, target),
            "never_loaded": read["never_loaded"], "speculators_read": read}


def peagle_field_differences(read: dict, export: Path, target) -> list[str]:
    ours = read_peagle_export(export, target=target_info(target))[0]  # a PEagleConfig
    mine = {**asdict(ours), "eagle_aux_hidden_state_layer_ids": ours.aux_layers, "target_hidden_size": ours.hidden_size,
            "layer_model_type": "llama", "num_hidden_layers": 1, "attention_bias": False,
            "rope_type": (ours.rope_scaling or {}).get("rope_type", "default"), "speculative_tokens": [ours.depth],
            "speculators_model_type": "peagle", "layer_types": list(ours.layer_types or [])}
    return differences(read, mine)


# ---- a drafter speculators created and saved -> a proposer here ------------------------------------

def check_speculators_drafter(target, work: Path, venv: Path, corrupt=None) -> dict:
    verifier = write_verifier(target, work / "verifier")
    ids = prompt_ids(target)
    layers = [2, target.num_layers // 2, target.num_layers - 3]  # speculators' default ids (HF indices)
    fused = features(target, ids, layers)
    pending = int(target.model(ids).logits[0, -1].argmax())  # the target's next token: the root
    save_file({"hidden_states": fused.contiguous(), "input_ids": shift_left(ids, 1), "pending": torch.tensor(pending),
               "steps": torch.tensor(STEPS), "draft_vocab_size": torch.tensor(DRAFT_VOCAB.get(target.name, 4096))},
              work / "inputs.safetensors")
    run_consumer(venv, "consumer_speculators.py", "create", verifier, work / "inputs.safetensors", work / "speculators")
    result = {}
    for name, key in (("drafter", ""), ("drafter-cli-defaults", "cli_defaults_")):
        # the second: speculators' training defaults (norm_output, norm_before_fc, norm_before_residual, a window)
        theirs = load_file(work / "speculators" / f"{name}.safetensors")
        proposer = load_proposer(str(work / "speculators" / name), target, parse_tree_spec(f"chain:{STEPS}"))
        proposer.reset(ids[0], target.features(ids, layers=layers, logits=False))
        tree = proposer.propose(ids[0], pending, SamplingConfig(temperature=0.0))
        logits, chain_logits = drafter_logits(proposer, fused, ids, theirs["chain"])
        result |= {f"{key}speculators_chain": theirs["chain"].tolist(), f"{key}our_chain": tree.tokens.tolist(),
                   f"{key}same_chain": tree.tokens.tolist() == theirs["chain"].tolist(),
                   f"{key}max_abs_logit_diff": max(float((logits - theirs["logits"]).abs().max()),
                                                   float((chain_logits - theirs["chain_logits"]).abs().max()))}
    return {**result, "max_abs_logit_diff": max(result["max_abs_logit_diff"],
                                                 result["cli_defaults_max_abs_logit_diff"])}


@torch.no_grad()
def drafter_logits(proposer, fused, ids, chain):
    # the loaded drafter's own inference path: prefill the prompt pairs and the root (pending), then
    # one cached step per draft of speculators' chain -> ((1, T, Vd), (K, Vd) at chain depths 0..K-1)
    drafter, cache = proposer.drafter, DraftKVCache()
    hidden, logits = drafter.prefill(fused, torch.cat([ids[:, 1:], chain[None, :1]], 1), proposer.embed, cache)
    steps, last = [logits[0, -1]], hidden[:, -1:]
    for token in chain[1:-1]:
        last, step = drafter.step(last, token.view(1, 1), proposer.embed, cache)
        steps.append(step[0, -1])
    return logits, torch.stack(steps)


# ---- sglang export -> what SGLang reads -------------------------------------------------------------

def check_sglang_export(target, work: Path, venv: Path, corrupt=None) -> dict:
    ckpt = save_drafter(target, work / "ckpt")
    export = export_checkpoint(ckpt, "sglang", work / "sglang", target=target).path
    if corrupt is not None:
        corrupt(export)
    run_consumer(venv, "consumer_sglang.py", export, work / "sglang_read.json")
    read = json.loads((work / "sglang_read.json").read_text())
    aux = load_checkpoint(ckpt).config["aux_layers"]
    problems = list(read["problems"])
    if read.get("captured_hf_indices") != aux:
        problems.append(f"SGLang captures HF hidden states {read.get('captured_hf_indices')}, trained on {aux}")
    return {**read, "problems": problems}


CHECKS = {"vllm->speculators": check_vllm_export, "dspark->speculators": check_dspark_export,
          "peagle->speculators": check_peagle_export, "speculators->here": check_speculators_drafter,
          "sglang": check_sglang_export}


def failures(name: str, result: dict) -> list[str]:
    if name == "speculators->here":
        bad = [f"{what}chains differ: {result}" for what, key in (("", ""), ("training defaults: ", "cli_defaults_"))
               if not result[f"{key}same_chain"]]
    elif name == "sglang":
        return result["problems"]
    else:
        bad = result["field_differences"] + [f"never loaded: {n}" for n in result["never_loaded"]]
        if not result["speculators_read"]["embedding_is_verifiers"]:
            bad.append("speculators drafts with another token embedding than the target's")
        if not result["speculators_read"].get("mask_hidden_loaded", True):
            bad.append("speculators drafts the mask slots with another mask_hidden than the export's")
    if not result["max_abs_logit_diff"] <= TOLERANCE:  # NaN fails too
        bad.append(f"max |logit diff| {result['max_abs_logit_diff']:.2e} > {TOLERANCE}")
    if not result.get("max_abs_confidence_diff", 0.0) <= TOLERANCE:
        bad.append(f"max |confidence logit diff| {result['max_abs_confidence_diff']:.2e} > {TOLERANCE}")
    return bad


def check_target(name: str, work: Path, venv: Path, checks=tuple(CHECKS)) -> dict:
    target = load_target(name)
    return {check: CHECKS[check](target, work / name / check.replace(">", ""), venv) for check in checks}


def report(name: str, results: dict) -> list[str]:
    """Prints one line per check; -> the failures."""
    bad = []
    for check, result in results.items():
        problems = failures(check, result)
        bad += [f"{name} {check}: {p}" for p in problems]
        diff = result.get("max_abs_logit_diff")
        print(f"{name:24s} {check:20s} {'FAIL' if problems else 'ok':4s}"
              + (f"  max |logit diff| {diff:.2e}" if diff is not None else "")
              + (f"  (importing sglang stops at {result['import_stops_at']})" if result.get("import_stops_at") else ""))
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=["tiny-random-llama", "smollm2-135m-instruct"])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the consumer virtual environment")
    p.add_argument("--work", type=Path, default=None, help="exchange directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write every result here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = args.work or Path(tempfile.mkdtemp(prefix="check-consumers-"))
    results, bad = {}, []
    consumer_python(args.venv)  # fail before any work if the consumers' venv is missing
    for name in args.targets:
        results[name] = check_target(name, work, args.venv)
        bad += report(name, results[name])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(bad) if bad else f"all consumer checks passed (work files in {work})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
