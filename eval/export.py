"""Export a trained drafter checkpoint for a serving engine, then validate the export.

    python eval/export.py runs/eagle3-smollm2/checkpoint-final --format sglang \
        --out exports/sglang --target smollm2-135m-instruct --dtype bf16

    sglang  SGLang / official EAGLE-3 layout (--speculative-algorithm EAGLE3
            --speculative-draft-model-path DIR)
    vllm    vLLM speculators layout (--speculative-config '{"model": "DIR", ...}')
    native  a validated copy of the drafters checkpoint
    medusa  Medusa / TGI layout (config.json + medusa_lm_head.safetensors), Medusa heads only
    eagle1  official EAGLE-1 layout (config.json + fc.*, layers.0.*), EAGLE-1 drafters trained with
            eagle1.feature=normed only
    llama.cpp  a GGUF drafter (EAGLE-3 or DFlash) written by llama.cpp's own converter, --dtype f32, f16 or
            q8_0, --target required; needs the project's llama.cpp build (bash .ci/llama-cpp). Serve it with
            eval/llama_cpp.py or llama-server --spec-draft-model DIR/drafter-f32.gguf --spec-type (DIR/llama-cpp.json)
A dflash checkpoint goes to sglang (SGLang's DFlash drafter: --speculative-algorithm DFLASH; full-vocabulary
drafters only) or vllm (speculators' `dflash`; --target needed with a reduced vocabulary).

Nothing is written when the checkpoint would load in the engine but lose acceptance (context
length, vocabulary or layer ids that do not match the target, missing d2t / t2d, another
drafter family). The export is reloaded by an independent reader and its draft logits compared
with the checkpoint's before it is moved into --out.
"""

import argparse
import sys

from drafters.checkpoint import CheckpointError
from drafters.engines.llama_cpp import OUTTYPES, LlamaCppError
from drafters.export.common import EXPORT_DTYPE_SPELLINGS, ExportError, describe
from drafters.export.dispatch import FORMATS, export_checkpoint
from drafters.export.reading import ExportCheckError
from drafters.files import OutputError
from drafters.targets import TargetError, load_target

LLAMA_CPP_ONLY = OUTTYPES  # GGUF types (--format llama.cpp)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="native drafter checkpoint directory (drafter.json)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output directory (must not exist, see --overwrite)")
    p.add_argument("--target", default=None,
                   help="load this target and validate against it (short name, HF dir, .gguf)")
    p.add_argument("--dtype", default="fp32", choices=[*EXPORT_DTYPE_SPELLINGS, *LLAMA_CPP_ONLY],
                   help="fp32 = float32, bf16 = bfloat16; llama.cpp: f32 (= fp32), f16 or q8_0")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="vllm: proposal_methods[0].speculative_tokens (default: 3, vLLM's default depth, for "
                        "EAGLE-3; block_size - 1 for DFlash)")
    p.add_argument("--verifier", default=None,
                   help="vllm: verifier name_or_path to record; medusa: base_model_name_or_path "
                        "(default: the target's name, or its Hub id for the shipped targets)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out that an earlier export wrote (never a directory "
                        "holding the checkpoint, a training run or files the export did not write)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dtype in LLAMA_CPP_ONLY and args.format != "llama.cpp":
        print(f"--dtype {args.dtype} is a GGUF type: only --format llama.cpp writes it", file=sys.stderr)
        return 2
    try:
        target = load_target(args.target) if args.target else None
        result = export_checkpoint(args.checkpoint, args.format, args.out, target=target,
                                   dtype=args.dtype, speculative_tokens=args.speculative_tokens,
                                   verifier=args.verifier, overwrite=args.overwrite)
    except (ExportError, ExportCheckError, CheckpointError, TargetError, LlamaCppError, OutputError) as err:
        print(f"export failed, nothing written to {args.out}:\n{err}", file=sys.stderr)
        return 1
    print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
