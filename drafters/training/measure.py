"""A recipe's `measure:`: what the trained drafter is worth, printed when its training ends.

    measure:
      bench: mt_bench        # eval/tau.py's --bench
      limit: 80              # questions, every turn of each
      max_new_tokens: 32     # per turn
      tree: chain:3
      llama_cpp: true        # also export it for llama.cpp (GGUF), where the project's build is

Once every stage is trained (train/train.py, the main process), the final drafter is decoded by our own decoder
(drafters.decode.evaluate.measure, what eval/tau.py runs), greedy and without the plain-generate baseline: tau and
the acceptance at each depth, into output_dir/measure-<bench>.json. The drafter is then exported as a GGUF through
llama.cpp's converter (drafters.export.dispatch, what `eval/export.py --format llama.cpp` runs) into
output_dir/export-llama.cpp, with the line that serves it. Each result is kept: the same command run again after
training finished measures nothing twice, unless the checkpoint changed since (a newer checkpoint-final).
"""

import json
from pathlib import Path

from drafters.training.schema import Measure


def measure_trained(target: str, checkpoint: Path, output_dir: Path, measure: Measure, threads: int, say) -> dict:
    """Measure `checkpoint` as `measure` says -> {"tau", "per_depth_acceptance", "json", "llama_cpp"} (printed)."""
    from drafters.decode.evaluate import Options
    from drafters.decode.evaluate import measure as decode_measure
    from drafters.engines import llama_cpp

    checkpoint, output_dir = Path(checkpoint).resolve(), Path(output_dir)
    bench_name = Path(measure.bench).stem if measure.bench.endswith(".jsonl") else measure.bench
    report = output_dir / f"measure-{bench_name}.json"
    built = (checkpoint / "model.safetensors").stat().st_mtime
    if not report.is_file() or report.stat().st_mtime < built:
        say(f"measure: decoding {measure.bench} ({measure.limit or 'all'} questions, every turn, "
            f"{measure.max_new_tokens} tokens a turn, {measure.tree}, greedy) with the trained drafter")
        decode_measure(Options(target=target, proposer=str(checkpoint), bench=measure.bench, tree=measure.tree,
                               temperature=0.0, limit=measure.limit, max_new_tokens=measure.max_new_tokens,
                               threads=threads or None, json=str(report), no_baseline=True))
    result = json.loads(report.read_text())
    depths = " ".join(f"{a:.3f}" for a in result["per_depth_acceptance"])
    say(f"measure: {measure.bench}, {measure.tree}, greedy: tau {result['tau']:.3f}, acceptance by depth "
        f"[{depths}] (first draft {result['per_depth_acceptance'][0]:.3f}); {report}")
    found = {"tau": result["tau"], "per_depth_acceptance": result["per_depth_acceptance"], "json": str(report),
             "llama_cpp": None}
    if measure.llama_cpp:
        found["llama_cpp"] = export_llama_cpp(target, checkpoint, output_dir / "export-llama.cpp", built, say,
                                              llama_cpp.available(), llama_cpp.BUILD_COMMAND)
    return found


def export_llama_cpp(target: str, checkpoint: Path, out: Path, built: float, say, available: bool,
                     build_command: str) -> str | None:
    from drafters.export.common import ExportError
    from drafters.export.dispatch import export_checkpoint
    from drafters.targets import load_target

    if not available:
        say(f"measure: no llama.cpp export: the project's llama.cpp build is missing ({build_command} makes it)")
        return None
    done = out / "llama-cpp.json"
    if not done.is_file() or done.stat().st_mtime < built:
        try:
            export_checkpoint(checkpoint, "llama.cpp", out, target=load_target(target, dtype="float32"),
                              overwrite=True)
        except ExportError as error:  # the drafter is trained and measured: say why there is no GGUF, and go on
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            why = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
            say(f"measure: no llama.cpp export: {why} (eval/export.py {checkpoint} --format llama.cpp "
                f"--target {target} --out {out} tries again)")
            return None
    manifest = json.loads(done.read_text())
    gguf = out / manifest["drafter"]
    say(f"measure: llama.cpp export {gguf}: llama-server -m <the target's GGUF> --spec-draft-model {gguf} "
        f"--spec-type {manifest['spec_type']} --spec-draft-n-max {manifest['draft_n_max']} (eval/llama_cpp.py "
        "serves and measures it)")
    return str(gguf)
