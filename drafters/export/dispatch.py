"""Export a native drafter checkpoint in the layouts serving engines load.

    sglang  SGLang / official EAGLE-3 / SpecForge: config.json (LlamaForCausalLMEagle3) +
            model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d
    vllm    vLLM speculators: config.json (speculators_model_type eagle3) + model.safetensors
            with layers.0.* instead of midlayer.*, plus the target's embed_tokens (with --target)
    native  a validated copy of the drafters checkpoint (any family)
    medusa  Medusa / TGI: config.json (medusa_num_heads, ...) + medusa_lm_head.safetensors; medusa
            checkpoints only (writer and independent reader: drafters.export.medusa)
    eagle1  official EAGLE-1 layout: config.json + fc.*, layers.0.*; eagle1 checkpoints trained on
            normed features only (writer and independent reader: drafters.export.eagle1)
    mtp     the target's own checkpoint with its native MTP layer replaced by the trained one (drafters.export.mtp)
llama.cpp  a GGUF drafter for llama.cpp (--spec-type draft-eagle3 / draft-dflash), written by llama.cpp's own
           converter and read back (drafters.export.llama_cpp); EAGLE-3 and DFlash checkpoints
A dflash checkpoint exports to sglang (SGLang's DFlashDraftModel) and vllm (speculators' `dflash`) in the
DFlash layouts instead (writer and independent reader: drafters.export.dflash); a dspark checkpoint to vllm
(speculators' `dspark`, also what llama.cpp's converter reads) and llama.cpp; a peagle checkpoint to vllm
(speculators' `peagle`: drafters.export.peagle); an eagle4 checkpoint to vllm (speculators' layout plus the candidate
head, LlamaForCausalLMEagle4: drafters.export.eagle4), and never to sglang or llama.cpp (REFUSED: no candidate head);
a dflash2 checkpoint to sglang (z-lab's DFlash2DraftModel: drafters.export.dflash2), never to vllm or llama.cpp
(REFUSED).


Knows nothing about training, targets' weights or decoding. Every format refuses, before anything
lands in the output directory, what an engine would load and then run with collapsed acceptance,
writes into a temporary sibling directory, has its independent reader reload the files and compare
draft logits with the source checkpoint, and only then renames the directory into place
(drafters.export.common).
"""

import json
from pathlib import Path

import torch

from drafters.checkpoint import save_checkpoint
from drafters.dtypes import DTYPES
from drafters.export.eagle3_reader import check_export  # the independent reader of sglang / vllm / native
from drafters.export.common import (ExportError, ExportResult, cast_floats, check_out_dir, export_dtype, exported_files,
                                    load_source, write_staged)
from drafters.export.dflash import export_dflash
from drafters.export.dflash2 import export_dflash2
from drafters.export.eagle1 import export_eagle1
from drafters.export.eagle3 import preflight, write_eagle3
from drafters.export.eagle4 import export_eagle4
from drafters.export.llama_cpp import export_llama_cpp
from drafters.export.medusa import export_medusa
from drafters.export.mtp import export_mtp
from drafters.export.peagle import export_peagle
from drafters.registry import FAMILIES

FORMATS = ("sglang", "vllm", "native", "medusa", "eagle1", "llama.cpp", "mtp")
FORMAT_HOLDS = {
    "sglang": "sglang holds EAGLE-3, DFlash and DFlash2 drafters",
    "vllm": "vllm holds EAGLE-3, DFlash, DSpark, P-EAGLE and EAGLE-4 drafters",
    "llama.cpp": "llama.cpp serves EAGLE-3, DFlash and DSpark drafters (--spec-type draft-eagle3 / draft-dflash / "
                 "draft-dspark)",
    "medusa": "the Medusa layout holds Medusa heads only; Blockwise heads share one hidden layer d -> K*f -> K*d "
              "across heads, which no Medusa loader builds",
    "eagle1": "the official EAGLE-1 layout holds EAGLE-1 drafters only",
    "mtp": "the mtp format is a target checkpoint with its native MTP layer replaced: MTP drafters only",
}


def export_checkpoint(ckpt_dir, fmt: str, out_dir, *, target=None, dtype: str = "fp32",
                      speculative_tokens: int | None = None, verifier: str | None = None,
                      overwrite: bool = False) -> ExportResult:
    """target: a loaded drafters Target to validate against (else the checkpoint's target info).
    speculative_tokens (vllm): None = 3 for EAGLE-3 (vLLM's default depth), block_size - 1 for DFlash."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    family = _family(ckpt_dir)
    if (family, fmt) in REFUSED:
        raise ExportError(REFUSED[family, fmt])
    # an unreadable drafter.json (family None) goes on to load_source, which says what is wrong with it
    writer = EXPORTERS.get((family, fmt), _eagle3_layout if fmt == "native" or family is None else None)
    if writer is None:
        raise ExportError(f"export of a {family} checkpoint to {fmt} is not supported ({FORMAT_HOLDS[fmt]}); use "
                          f"--format {' or '.join(EXPORT_FORMATS.get(family, ('native',)))}")
    return writer(ckpt_dir, fmt, out_dir, target=target, dtype=dtype, speculative_tokens=speculative_tokens,
                  verifier=verifier, overwrite=overwrite)


def _eagle3_layout(ckpt_dir, fmt, out_dir, *, target, dtype, speculative_tokens, verifier, overwrite):
    """EAGLE-3's sglang / vllm layouts, and the native copy of any family: written, read back by the independent
    reader (drafters.export.eagle3_reader), renamed into place."""
    speculative_tokens = 3 if speculative_tokens is None else speculative_tokens
    canonical = export_dtype(dtype)  # float32 | bfloat16
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens={speculative_tokens} must be >= 1")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    expected = preflight(ckpt, fmt, target)
    state = cast_floats(ckpt.state_dict, DTYPES[canonical])

    def write(payload: Path):
        config = _write(fmt, ckpt, state, payload, expected, canonical, speculative_tokens,
                        verifier or expected["name"], _embedding(fmt, target, DTYPES[canonical]))
        return config, check_export(payload, fmt, target=expected, reference=ckpt)

    config, report = write_staged(out_dir, ckpt_dir, fmt, write, overwrite)
    return ExportResult(path=out_dir, fmt=fmt, dtype=dtype, config=config, check=report,
                        files=exported_files(out_dir))


def _medusa(ckpt_dir, fmt, out_dir, *, target, dtype, verifier, overwrite, **_):
    # --verifier names the base model (base_model_name_or_path)
    return export_medusa(ckpt_dir, out_dir, target=target, dtype=dtype, base_model=verifier, overwrite=overwrite)


def _eagle1(ckpt_dir, fmt, out_dir, *, target, dtype, overwrite, **_):
    return export_eagle1(ckpt_dir, out_dir, target=target, dtype=dtype, overwrite=overwrite)


def _llama_cpp(ckpt_dir, fmt, out_dir, *, target, dtype, overwrite, **_):
    # via the vllm (EAGLE-3, DSpark) or sglang (DFlash) layout, then llama.cpp's own converter
    return export_llama_cpp(ckpt_dir, out_dir, target=target, export_checkpoint=export_checkpoint, dtype=dtype,
                            overwrite=overwrite)


# The export layer's one table: (family, format) -> its writer, each of which reads its files back with the
# family's independent reader before they land (EAGLE-3 and native: drafters.export.eagle3_reader; DFlash and DSpark:
# drafters.export.dflash; P-EAGLE: drafters.export.peagle; Medusa: drafters.export.medusa; EAGLE-1:
# drafters.export.eagle1; llama.cpp: drafters.export.llama_cpp). Every family exports `native`.
EXPORTERS = {
    ("eagle3", "sglang"): _eagle3_layout, ("eagle3", "vllm"): _eagle3_layout, ("eagle3", "llama.cpp"): _llama_cpp,
    ("dflash", "sglang"): export_dflash, ("dflash", "vllm"): export_dflash, ("dflash", "llama.cpp"): _llama_cpp,
    ("dspark", "vllm"): export_dflash, ("dspark", "llama.cpp"): _llama_cpp,  # speculators' dspark layout
    ("peagle", "vllm"): export_peagle,  # speculators' peagle layout
    ("eagle4", "vllm"): export_eagle4,  # speculators' layout + the candidate head (LlamaForCausalLMEagle4)
    ("dflash2", "sglang"): export_dflash2,  # z-lab's DFlash2DraftModel layout (SGLang's and vLLM's DFlash2)
    ("eagle1", "eagle1"): _eagle1,
    ("medusa", "medusa"): _medusa,
    ("mtp", "mtp"): export_mtp,  # the target's own checkpoint, its MTP layer replaced (drafters.export.mtp)
    **{(family, "native"): _eagle3_layout for family in FAMILIES},
}
# (family, format) an engine would load without what the family drafts with: one sentence each, before any work
REFUSED = {
    ("eagle4", "sglang"): "an EAGLE-4 drafter cannot be exported to sglang: SGLang's LlamaForCausalLMEagle3 has no "
                          "candidate head, so it would draft with the full head and drop the rank-r factors; use "
                          "--format vllm (LlamaForCausalLMEagle4) or native",
    ("eagle4", "llama.cpp"): "an EAGLE-4 drafter cannot be exported to llama.cpp: its EAGLE-3 graph has no candidate "
                             "head, so it would draft with the full head and drop the rank-r factors; use --format "
                             "vllm (LlamaForCausalLMEagle4) or native",
    ("dflash2", "vllm"): "a DFlash2 drafter cannot be exported to vllm: speculators' DFlash layout has no dynamic "
                         "convolution or path selector, so vLLM would draft DFlash's independent slots; use --format "
                         "sglang (DFlash2DraftModel) or native",
    ("dflash2", "llama.cpp"): "a DFlash2 drafter cannot be exported to llama.cpp: the pinned converter and its DFlash "
                              "graph have no dynamic convolution or path selector, so it would draft without both; "
                              "use --format sglang (DFlash2DraftModel) or native",
}
# keyed as drafters.registry.FAMILIES (tests/test_families.py): the formats each family's checkpoints export to
EXPORT_FORMATS = {family: tuple(fmt for (f, fmt) in EXPORTERS if f == family) for family in FAMILIES}


def _family(ckpt_dir) -> str | None:
    # the checkpoint's family from its drafter.json; None when unreadable (load_source then says why)
    try:
        return json.loads((Path(ckpt_dir) / "drafter.json").read_text()).get("family")
    except (OSError, ValueError, AttributeError):
        return None


def _embedding(fmt: str, target, dtype: torch.dtype):
    # vllm: the target's token embedding goes into the export (as speculators' own saves hold
    # it). speculators 0.9 fills a missing one from the verifier only if it is still NaN, which
    # it no longer is under transformers 5.x: it would draft on uninitialised memory. vLLM uses
    # the file's embedding when there is one: the same values. Without a target it is left out.
    return target.embed_tokens.weight.to(dtype) if fmt == "vllm" and target is not None else None


def _write(fmt, ckpt, state, payload: Path, expected, dtype, speculative_tokens, verifier,
           embedding=None) -> dict:
    if fmt == "native":
        save_checkpoint(payload, family=ckpt.family, config=ckpt.config, target=ckpt.target,
                        state_dict=state, extra=ckpt.extra)
        return json.loads((payload / "drafter.json").read_text())
    return write_eagle3(fmt, ckpt, state, payload, expected, dtype, speculative_tokens, verifier, embedding)
