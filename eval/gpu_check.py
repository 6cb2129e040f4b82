"""The prepared GPU check: every family on CUDA, then training throughput and memory and the verify cost on a
random-weight Llama-3.1-8B-shaped target. One command, one JSON file, one printed table (README "On a GPU"):

    python eval/gpu_check.py --out outputs/gpu_check            # a CUDA machine, about 5 minutes on an H100
    python eval/gpu_check.py --cpu --out /tmp/gpu_check         # the same check at tiny shapes, seconds (tests)

1. correctness   every registered family's tiny recipe trains 4 steps on the device; a copy of the run stopped
                 after checkpoint-2 resumes to the same weights (bitwise); its proposer decodes greedily as
                 `generate` on a chain and a tree in float32, and in bf16 up to near-ties (the parting token's
                 relative logit gap, as the llama.cpp referee reports it)
2. training      one optimizer step of the real objective (EAGLE-3 TTT 7 and 3, DFlash block 16; draft vocabulary
                 32k) on the 8B shape in bf16 at sequence 2048: tokens/s, time per phase, FLOPs counted per token,
                 MFU against the card's bf16 dense peak, peak memory
3. limits        the same at sequence 8,192 and 32,768 and at Qwen's vocabulary 151,936: a setting that does not
                 fit is a row "out of memory at N GB" naming what it asked for and the largest live tensors
4. verify cost   our decoder's tree forward over 1, 2, 4, ..., 64 tokens after a 1,000-token prompt, relative to
                 one token, and the PROJECTED speedup tau / round cost of chains and a tree (not measured decoding)

Runs on the device image (torch 2.11, transformers 5.17, no deepspeed / datasets / wandb): it imports none of
those three; the transformers the project pins travels as a wheel (README "On a GPU"). Exit status 0 when every
correctness row passes; the throughput rows are measurements, not pass / fail.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the resume check

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from drafters.checkpoint import load_checkpoint  # noqa: E402
from drafters.decode.autotree import time_verify  # noqa: E402
from drafters.decode.decoder import speculative_generate  # noqa: E402
from drafters.decode.proposers.loading import load_proposer  # noqa: E402
from drafters.decode.referee import parting  # noqa: E402
from drafters.decode.tree import parse_tree_spec  # noqa: E402
from drafters.registry import FAMILIES  # noqa: E402
from drafters.targets import load_target  # noqa: E402
from drafters.timing import synced_clock  # noqa: E402
from drafters.training.families import load_recipe, train  # noqa: E402
from drafters.training.scale import (  # noqa: E402
    SHAPES,
    StepResult,
    StepSetting,
    measure_step,
    predicted_seconds,
    random_target,
    release,
)

ROOT = Path(__file__).resolve().parents[1]
TREES = ("chain:3", "static:[[0],[1],[0,0],[0,1],[0,0,0]]")
NEW_TOKENS = 16
TIE = 0.01  # relative logit gap under which a bf16 parting counts as a near tie (eval/regen_fidelity.py's default)
# bf16 dense tensor-core peak without sparsity, FLOP/s, by device name (NVIDIA's data sheets, SXM parts)
PEAKS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}
# acceptance per depth (fraction of rounds accepting >= d drafts) our best SmolLM2 EAGLE-3 drafter reaches on
# MT-bench, chain of 3 (report/acceptance/e3long-mt_bench.json), and the published EAGLE-3 tree on Llama-3.1-8B
OURS_MT_BENCH = (0.303, 0.086, 0.030)
PUBLISHED_TREE = {"tau": 6.13, "nodes": 60, "source": "EAGLE-3 on LLaMA-3.1-8B-Instruct, MT-bench, 60-token tree"}

# What runs at each scale: (step settings at the user's scale, the limits sweep, verify context, verify sizes).
GPU_SCALE = {
    "shape": "llama-3.1-8b",
    "training": [StepSetting("eagle3", 2048, ("ttt_steps=7",)), StepSetting("eagle3", 2048, ("ttt_steps=3",)),
                 StepSetting("dflash", 2048, ("dflash.block_size=16", "dflash.num_layers=1", "dflash.anchors=128"))],
    "limits": [StepSetting("eagle3", 8192, ("ttt_steps=7",)), StepSetting("eagle3", 32768, ("ttt_steps=7",)),
               StepSetting("dflash", 8192, ("dflash.block_size=16", "dflash.num_layers=1", "dflash.anchors=512")),
               StepSetting("dflash", 32768, ("dflash.block_size=16", "dflash.num_layers=1", "dflash.anchors=2048"))],
    "qwen_vocab": 151936,
    "budget_s": 40,  # per limits setting
    "context": 1000,
    "verify": (1, 2, 4, 8, 16, 32, 64),
}
CPU_SCALE = {
    "shape": "tiny",
    "training": [StepSetting("eagle3", 64, ("ttt_steps=7",), draft_vocab=128),
                 StepSetting("eagle3", 64, ("ttt_steps=3",), draft_vocab=128),
                 StepSetting("dflash", 64, ("dflash.block_size=16", "dflash.num_layers=1", "dflash.anchors=4"),
                             draft_vocab=128)],
    "limits": [StepSetting("eagle3", 256, ("ttt_steps=7",), draft_vocab=128)],
    "qwen_vocab": 1024,
    "budget_s": 40,
    "context": 100,
    "verify": (1, 2, 4, 8),
}


class CheckError(Exception):
    """A refusal before anything runs, as one sentence."""


# ---- 1. correctness ---------------------------------------------------------------------------------------


def train_tiny(family: str, out: Path, *extra: str):
    argv = [str(ROOT / "recipes" / f"{family}_tiny.yaml"), "max_steps=4", "save_every=2", "eval_every=0",
            f"output_dir={out}", *extra]
    return train(load_recipe(argv), family)


def resumed_equals_whole(family: str, whole: Path) -> dict:
    # the run's directory as a stop right after checkpoint-2 leaves it, then resume_from=latest
    stopped = whole.with_name(whole.name + "-stopped")
    shutil.copytree(whole, stopped, ignore=shutil.ignore_patterns("checkpoint-final", ".run.lock"))
    train_tiny(family, stopped, "resume_from=latest")
    a, b = (load_checkpoint(d / "checkpoint-final").state_dict for d in (whole, stopped))
    diff = max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)
    return {"resume_bitwise": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "resume_max_abs_diff": diff}


def greedy(target, prompt: torch.Tensor) -> list[int]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return target.model.generate(prompt[None], generation_config=config)[0].tolist()


def decode_rows(checkpoint: Path, target, prompts: list[torch.Tensor]) -> list[dict]:
    rows = []
    for tree in TREES:
        proposer = load_proposer(str(checkpoint), target, parse_tree_spec(tree))
        for i, prompt in enumerate(prompts):
            prompt = prompt.to(target.device)
            ours = speculative_generate(target, proposer, prompt, max_new_tokens=NEW_TOKENS)[0].tolist()
            plain = greedy(target, prompt)
            n = prompt.numel()
            part = parting(target, prompt.tolist(), plain[n:], ours[n:])
            rows.append({"tree": tree, "prompt": i, "identical": part is None,
                         **({} if part is None else {"parted_at": part.at, "relative_gap": part.relative_gap,
                                                     "near_tie": part.near_tie(TIE)})})
    return rows


def correctness(device: torch.device, work: Path, say) -> list[dict]:
    prompts = list(torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(0)))
    loaded = {}  # target name -> {dtype: Target on device}: each family decodes against its tiny recipe's target

    def targets(name: str) -> dict:
        if name not in loaded:
            loaded[name] = {dtype: load_target(name, dtype=dtype) for dtype in ("float32", "bfloat16")}
            for target in loaded[name].values():
                target.model.to(device)
        return loaded[name]

    rows = []
    for family in sorted(FAMILIES):
        start = time.perf_counter()
        try:
            row = check_family(family, device, work, targets, prompts)
        except Exception as err:  # a failure is this family's row; the other families and sections still run
            row = {"family": family, "device": str(device), "passed": False, "error": failure(err)}
            say(f"correctness {family:10s} FAILED: {row['error']}")
        finally:
            torch.use_deterministic_algorithms(False)
        row["seconds"] = round(time.perf_counter() - start, 1)
        if "error" not in row:
            say(f"correctness {family:10s} {'ok' if row['passed'] else 'FAILED'}  "
                f"resume bitwise {row['resume_bitwise']}"
                f"  fp32 {row['fp32_identical']}/{row['decodes']} == generate  bf16 {row['bf16_identical']}/"
                f"{row['decodes']} (+{len(row['bf16_near_ties'])} at near ties)  {row['seconds']} s")
        rows.append(row)
    return rows


def check_family(family: str, device: torch.device, work: Path, targets, prompts: list) -> dict:
    # training and resume with deterministic kernels (cuBLAS workspace set at import; memory-efficient attention's
    # backward is deterministic only in the strict mode); an op without a deterministic kernel is named in the row
    # and the run is repeated in the warn-only mode
    row = {"family": family, "device": str(device)}
    for strict in (True, False):
        torch.use_deterministic_algorithms(True, warn_only=not strict)
        whole = work / f"{family}-{'strict' if strict else 'warn'}"
        try:
            summary = train_tiny(family, whole)
            row |= {"steps": summary.steps, **resumed_equals_whole(family, whole), "deterministic": strict}
            break
        except RuntimeError as err:
            if not strict or "deterministic" not in str(err):
                raise
            row["nondeterministic_op"] = str(err).splitlines()[0][:300]
    torch.use_deterministic_algorithms(False)
    on_device = targets(summary.target.name)  # tiny-random-llama, or the MTP family's tiny-mtp-deepseek_v3
    fp32 = decode_rows(summary.checkpoint, on_device["float32"], prompts)
    bf16 = decode_rows(summary.checkpoint, on_device["bfloat16"], prompts)
    row |= {"fp32_identical": sum(r["identical"] for r in fp32), "decodes": len(fp32),
            "bf16_identical": sum(r["identical"] for r in bf16),
            "bf16_near_ties": [r for r in bf16 if not r["identical"]],
            "fp32_partings": [r for r in fp32 if not r["identical"]]}
    row["passed"] = (row["resume_bitwise"] and row["fp32_identical"] == len(fp32)
                     and all(r["near_tie"] for r in bf16 if not r["identical"]))
    return row


def failure(err: BaseException) -> str:
    # the exception and the innermost frame of the project's code that raised it
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "drafters" in f.filename or "eval" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(err).__name__}: {str(err)[:300]}{where}"


# ---- 2, 3. training throughput and memory --------------------------------------------------------------


def at_scale(scale: dict, sections: list[str], device: torch.device, peak: float | None, say) -> dict:
    """Sections 2-4 on one random target of the scale's shape (built once), then the last limits row on a target
    with Qwen's vocabulary, built after the first is released so both rows see the same free memory."""
    report = {}
    target = random_target(SHAPES[scale["shape"]], dtype=torch.bfloat16, device=device)
    say(f"{target.name}: {sum(p.numel() for p in target.model.parameters()) / 1e9:.2f}B parameters, bf16, "
        "random weights")
    if "verify" in sections:
        try:
            report["verify"] = verify_cost(scale, target, say)
        except Exception as err:  # recorded; training still runs
            report["verify"] = {"error": failure(err)}
            say(f"verify: FAILED: {report['verify']['error']}")
    if "training" in sections:
        report["training"] = [step_row(setting, target, peak, say) for setting in scale["training"]]
        report["limits"] = [limit_row(setting, report["training"], scale, target, peak, say)
                            for setting in scale["limits"]]
        del target
        release(device)
        target = random_target(SHAPES[scale["shape"]], dtype=torch.bfloat16, device=device,
                               vocab_size=scale["qwen_vocab"])
        report["limits"].append(step_row(scale["training"][0], target, peak, say))
    return report


def limit_row(setting: StepSetting, measured: list[dict], scale: dict, target, peak, say) -> dict:
    """One step after one warm-up (peak memory is the point), unless the same family's first row predicts it would
    take longer than the scale's per-setting budget: then a row saying so, with the prediction."""
    ref = next((r for r in measured if r["setting"].split()[0] == setting.family and r["status"] == "ok"), None)
    seconds = predicted_seconds(StepResult(**ref), setting.seq_len, scale["training"][0].seq_len) if ref else None
    if seconds is not None and seconds > scale["budget_s"]:
        say(f"  {setting.name:60s} not run: {seconds:.0f} s per step predicted (> {scale['budget_s']} s)")
        return {"setting": setting.name, "status": "not run", "predicted_s": seconds, "peak_gb": None,
                "detail": f"predicted {seconds:.0f} s per step from {ref['setting']} (attention x (T/T0)^2, the rest "
                          f"x T/T0) exceeds this check's budget of {scale['budget_s']} s per setting"}
    return step_row(setting, target, peak, say, steps=1, warmup=1, count=False)


def step_row(setting: StepSetting, target, peak: float | None, say, **how) -> dict:
    try:
        row = measure_step(setting, target, peak_flops=peak, **how).__dict__
        row["setting"] += f" V={target.vocab_size}"
    except Exception as err:  # recorded; the next setting still runs
        row = {"setting": setting.name, "target": target.name, "status": "error", "peak_gb": None,
               "detail": failure(err)}
        release(target.device)
    if row["status"] == "ok":
        ms = ", ".join(f"{k} {v:.1f}" for k, v in row["ms"].items())
        say(f"  {row['setting']:60s} {row['tokens_per_s']:9.0f} tok/s  ms: {ms}  "
            f"{row['flops_per_token'].get('step', 0):.3g} FLOP/token  MFU {fmt(row['mfu'], '.1%')}  "
            f"peak {fmt(row['peak_gb'], '.1f')} GB")
    else:
        say(f"  {row['setting']:60s} {row['status']} at {fmt(row['peak_gb'], '.1f')} GB: {row['detail']}")
    return row


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# ---- 4. verify cost and projected speedup -------------------------------------------------------------


def verify_cost(scale: dict, target, say) -> dict:
    context = torch.randint(3, target.vocab_size, (scale["context"],), generator=torch.Generator().manual_seed(0))
    ms = time_verify(target.model, context, scale["verify"], hidden_states=True, warmup=2, repeats=5)
    ratio = {n: ms[n] / ms[1] for n in ms}
    say("verify: one tree forward after a " + f"{scale['context']}-token prompt, ms (x one token): " +
        ", ".join(f"{n}: {ms[n]:.2f} ({ratio[n]:.2f}x)" for n in ms))
    plain = generate_ms(target, context)
    weights_gb = sum(p.numel() * p.element_size() for p in target.model.parameters()) / 1e9
    say(f"verify: plain greedy generate {plain:.2f} ms per token on the same prompt (Hugging Face's own loop); "
        f"reading the {weights_gb:.1f} GB of weights once per token is the memory-bound floor")
    return {"context": scale["context"], "ms": ms, "relative": ratio, "generate_ms_per_token": plain,
            "weights_gb": weights_gb, "projected": project(ratio, say)}


@torch.no_grad()
def generate_ms(target, context: torch.Tensor, new: int = 16) -> float:
    """ms per new token of plain greedy generate after `context`: (t(1 + new) - t(1)) / new, medians of 3."""
    ids = context[None].to(target.device)

    def run(n: int) -> float:
        start = synced_clock(target.device)
        target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        return synced_clock(target.device) - start

    run(2)
    pairs = sorted((run(1 + new) - run(1)) for _ in range(3))
    return 1e3 * max(pairs[1], 1e-9) / new


def project(ratio: dict, say) -> list[dict]:
    """PROJECTED speedup = tau / (cost of verifying n tokens relative to one), from acceptance measured elsewhere;
    the drafter's own cost is left out (it is not measured on this shape), so these are upper bounds."""
    rows = []
    for k in range(1, len(OURS_MT_BENCH) + 1):
        tau = 1 + sum(OURS_MT_BENCH[:k])
        cost = interpolate(ratio, k + 1)
        rows.append({"what": f"chain of {k}, our SmolLM2 EAGLE-3 acceptance on MT-bench", "tokens": k + 1,
                     "tau": tau, "round_cost": cost, "projected_speedup": tau / cost})
    cost = interpolate(ratio, PUBLISHED_TREE["nodes"] + 1)
    rows.append({"what": f"tree of {PUBLISHED_TREE['nodes']}, published tau ({PUBLISHED_TREE['source']})",
                 "tokens": PUBLISHED_TREE["nodes"] + 1, "tau": PUBLISHED_TREE["tau"], "round_cost": cost,
                 "projected_speedup": PUBLISHED_TREE["tau"] / cost})
    for r in rows:
        say(f"  PROJECTED {r['what']}: tau {r['tau']:.2f} / round cost {r['round_cost']:.2f}x = "
            f"{r['projected_speedup']:.2f}x (drafter cost not included)")
    return rows


def interpolate(ratio: dict, n: int) -> float:
    # piecewise linear in the number of tokens between the measured sizes (the last one extended)
    xs = sorted(ratio)
    lo = max([x for x in xs if x <= n], default=xs[0])
    hi = min([x for x in xs if x >= n], default=xs[-1])
    return ratio[lo] if hi == lo else ratio[lo] + (ratio[hi] - ratio[lo]) * (n - lo) / (hi - lo)


# ---- the command ----------------------------------------------------------------------------------------


def check_environment(cpu: bool) -> torch.device:
    """The device, or one sentence naming what is missing, before anything runs."""
    if not cpu and not torch.cuda.is_available():
        raise CheckError("no CUDA GPU is visible to torch (torch.cuda.is_available() is False): run this on a GPU "
                         "machine, or pass --cpu for the same check at tiny shapes")
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 20) or major >= 6:
        raise CheckError(f"transformers {transformers.__version__} is installed; this project is tested with >=5.20,"
                         "<6 (pyproject.toml): install that wheel first (README 'On a GPU' shows how)")
    return torch.device("cpu" if cpu else "cuda")


def peak_flops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json (created)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU at tiny shapes (the test suite's mode)")
    p.add_argument("--sections", default="correctness,training,verify",
                   help="comma-separated, of: correctness, training (throughput and limits), verify")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's bf16 dense peak, if not in PEAKS")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - {"correctness", "training", "verify"})
    try:
        if unknown:
            raise CheckError(f"--sections: unknown {unknown}; choose from correctness, training, verify")
        device = check_environment(args.cpu)
    except CheckError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scale, peak = (CPU_SCALE if args.cpu else GPU_SCALE), peak_flops(device, args.peak_tflops)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "peak_flops": peak, "shape": scale["shape"], "sections": sections}
    say = print
    say(f"gpu_check: {report['device']}, torch {report['torch']}, transformers {report['transformers']}")
    start = time.perf_counter()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        if "correctness" in sections:
            report["correctness"] = correctness(device, Path(work), say)
    if {"training", "verify"} & set(sections):
        report |= at_scale(scale, sections, device, peak, say)
    report["seconds"] = round(time.perf_counter() - start, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [r["family"] for r in report.get("correctness", []) if not r["passed"]]
    failed += ["verify"] if "error" in report.get("verify", {}) else []
    failed += [r["setting"] for r in report.get("training", []) + report.get("limits", []) if r["status"] == "error"]
    say(f"gpu_check: {report['seconds']} s; wrote {out / 'gpu_check.json'}; "
        + (f"FAILED: {', '.join(failed)}" if failed else "every correctness row passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
