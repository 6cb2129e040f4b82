"""What the frozen target costs a trainer's process: peak memory of loading it whole against loading only what
training from a feature store reads (its embeddings, final norm and LM head: load_target(decoder=False)). A
benchmark, not a test.

    python eval/target_memory.py --target smollm2-135m-instruct --dtype bfloat16
    python eval/target_memory.py --random-llama 2048,16,8192,128256 --dtype bfloat16 --json target-memory.json
    python eval/target_memory.py --random-llama 2048,16,8192,128256 --dtype bfloat16 --split 2

--random-llama HIDDEN,LAYERS,INTERMEDIATE,VOCAB writes a random-weight Llama of that shape (safetensors, in --dtype)
to a temporary directory first (Llama-3.2-1B: 2048,16,8192,128256; Llama-3.1-8B: 4096,32,14336,128256) and
deletes it afterwards. --split N also loads it split across N processes (torchrun, gloo: split_target=true's
load, each process reading only its rows of the decoder layers). Each load runs in its own child process, so one
load's allocations never count in the other's:

    base     resident GB of the child after its imports, before the load
    peak     the child's maximum resident GB (VmHWM), the load included, after every held page was read once (a
             memory-mapped checkpoint is resident only where it is touched)
    load     peak - base: what the load itself added
    held     parameters the loaded target holds, and their GB in --dtype
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def peak_gb() -> float:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux keeps that across execve, so a
    child would report at least its parent's peak at the fork."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def child(target: str, dtype: str, decoder: bool) -> dict:
    import torch  # noqa: F401  (imported before the base is read: the interpreter's share is not the load's)
    import transformers  # noqa: F401

    from drafters.targets import load_target

    base = rss_gb()
    loaded = load_target(target, dtype=dtype, decoder=decoder)
    params = {id(p): p for p in loaded.model.parameters()}.values()
    # read every held value once, as training does: a memory-mapped checkpoint is resident only where touched
    # (every 512th value: each 4 kB page at least once, without a float32 copy of the embedding)
    checksum = sum(float(p.detach().reshape(-1)[::512].float().sum()) for p in params)
    peak = peak_gb()
    return {"decoder": decoder, "base_gb": base, "peak_gb": peak, "load_gb": peak - base,
            "held_params": sum(p.numel() for p in params),
            "held_gb": sum(p.numel() * p.element_size() for p in params) / 2**30, "checksum": checksum}


def split_child(target: str, dtype: str, out: str) -> None:
    """One of N processes (torchrun): the target loaded with its layers on the meta device, split across the N
    (drafters.training.launch.split_target, each reading its own rows), every held page read; writes its row."""
    import torch  # noqa: F401
    from accelerate import Accelerator

    from drafters.targets import load_target
    from drafters.training.launch import split_target

    accelerator = Accelerator(cpu=True)
    base = rss_gb()
    loaded = load_target(target, dtype=dtype, decoder="meta")
    held, whole = split_target(loaded, accelerator)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in loaded.model.parameters()]
    checksum = sum(float(t.detach().reshape(-1)[::512].float().sum()) for t in local)
    peak = peak_gb()
    row = {"decoder": f"split/{accelerator.num_processes}", "rank": accelerator.process_index, "base_gb": base,
           "peak_gb": peak, "load_gb": peak - base, "held_params": held,
           "held_gb": sum(t.numel() * t.element_size() for t in {id(t): t for t in local}.values()) / 2**30,
           "checksum": checksum, "whole_params": whole}
    Path(f"{out}.{accelerator.process_index}.json").write_text(json.dumps(row))


def write_random_llama(directory: Path, shape: str, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafters.dtypes import DTYPES
    from drafters.tiny import build_tiny_tokenizer

    hidden, layers, intermediate, vocab = (int(x) for x in shape.split(","))
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         vocab_size=vocab, num_attention_heads=max(1, hidden // 128),
                         num_key_value_heads=max(1, hidden // 512),
                         head_dim=128 if hidden >= 128 else hidden, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(DTYPES[dtype])
    with torch.no_grad():
        for p in model.parameters():  # random values, layer by layer (no full float32 copy)
            p.normal_(0, 0.02)
    model.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a target name or path (drafters.targets.load_target)")
    p.add_argument("--random-llama", help="HIDDEN,LAYERS,INTERMEDIATE,VOCAB: a random Llama written to a temp dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--split", type=int, default=0, help="also load it split across this many processes (torchrun)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--split-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.child[2] == "whole")))
        return
    if args.split_child:
        split_child(*args.split_child)
        return
    if bool(args.target) == bool(args.random_llama):
        p.error("give one of --target or --random-llama")
    with tempfile.TemporaryDirectory(prefix="target-memory.") as tmp:
        target = args.target or str(write_random_llama(Path(tmp), args.random_llama, args.dtype))
        rows = []
        for kind in ("whole", "outer"):
            out = subprocess.run([sys.executable, __file__, "--child", target, args.dtype, kind], capture_output=True,
                                 text=True, cwd=ROOT, check=True)
            rows.append({"target": args.target or f"random Llama {args.random_llama}", "dtype": args.dtype,
                         "loaded": kind, **json.loads(out.stdout.strip().splitlines()[-1])})
        if args.split > 1:
            prefix = Path(tmp) / "split-row"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.split),
                            __file__, "--split-child", target, args.dtype, str(prefix)], capture_output=True,
                           text=True, cwd=ROOT, check=True)
            for rank in range(args.split):
                row = json.loads(Path(f"{prefix}.{rank}.json").read_text())
                rows.append({"target": rows[0]["target"], "dtype": args.dtype,
                             "loaded": f"split over {args.split}, process {rank}", **row})
    print("| target | dtype | loaded | held parameters | held GB | base GB | peak GB | load GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['dtype']} | {r['loaded']} | {r['held_params'] / 1e6:,.1f}M | {r['held_gb']:.3f} "
              f"| {r['base_gb']:.3f} | {r['peak_gb']:.3f} | {r['load_gb']:.3f} |")
    print(f"outer / whole load: {rows[1]['load_gb'] / rows[0]['load_gb']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
