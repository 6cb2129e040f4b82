"""Every drafter family by name: how to build one from a stored config and weights, and the one check
that a drafter fits a target. Native checkpoints, exports and the trainer's resume all come through
here, so a new family (one file at the top of drafters/) is wired in by one entry below.

    config = drafter_config("eagle3", checkpoint.config, where)    # the family's config class
    drafter = build_drafter("eagle3", config, state, where)         # weights loaded, strict
    check_fits(config, target, where)                               # or fit_problems(...) -> [str]

A drafter fits a target when the shapes it reads and writes are the target's: hidden size and
vocabulary for every family; the position range for the families with rotary attention (a drafter
built for a shorter context drifts in serving engines); and the family's own reads (EAGLE-3's
auxiliary layers exist in the target, EAGLE-1's feature is one it knows, DFlash's, DSpark's and P-EAGLE's
layers and mask token). The target's identity
(name, layer count) recorded in a checkpoint is drafters.checkpoint.check_target's business.
"""

from dataclasses import dataclass
from typing import Callable

from torch import nn

from drafters.blockwise import BlockwiseConfig, BlockwiseHeads
from drafters.checkpoint import CheckpointError
from drafters.dflash import DFlashConfig, DFlashDrafter
from drafters.draft_vocab import DraftVocab
from drafters.dspark import DSparkConfig, DSparkDrafter
from drafters.eagle1 import FEATURES, Eagle1Config, Eagle1Drafter
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.medusa import MedusaConfig, MedusaHeads
from drafters.peagle import PEagleConfig, PEagleDrafter


@dataclass(frozen=True)
class Family:
    config: type
    build: Callable  # (config, state) -> nn.Module, weights not yet loaded
    fit_keys: tuple[str, ...]  # config fields that must equal the target's text config's
    own_problems: Callable = lambda config, text_config: []  # family-specific (config, text) -> [str]


def _eagle3(config: Eagle3Config, state: dict) -> Eagle3Drafter:
    vocab = DraftVocab.from_state_dict(state, source="state dict", draft_vocab_size=config.draft_vocab_size,
                                       target_vocab_size=config.vocab_size)
    return Eagle3Drafter(config, vocab)


def _aux_layers_exist(config, text) -> list[str]:
    if all(0 <= i <= text.num_hidden_layers for i in config.aux_layers):
        return []
    return [f"aux_layers {config.aux_layers} outside 0..{text.num_hidden_layers} (target layer count)"]


def _dflash(config: DFlashConfig, state: dict) -> DFlashDrafter:
    # the LM head is the target's (frozen, never stored): the caller attaches it (DFlashDrafter.attach_head)
    vocab = DraftVocab.from_state_dict(state, source="state dict", draft_vocab_size=config.draft_vocab_size,
                                       target_vocab_size=config.vocab_size)
    return DFlashDrafter(config, vocab)


def _dspark(config: DSparkConfig, state: dict) -> DSparkDrafter:
    vocab = DraftVocab.from_state_dict(state, source="state dict", draft_vocab_size=config.draft_vocab_size,
                                       target_vocab_size=config.vocab_size)
    return DSparkDrafter(config, vocab)


def _peagle(config: PEagleConfig, state: dict) -> PEagleDrafter:
    vocab = DraftVocab.from_state_dict(state, source="state dict", draft_vocab_size=config.draft_vocab_size,
                                       target_vocab_size=config.vocab_size)
    return PEagleDrafter(config, vocab)


def _peagle_reads(config, text) -> list[str]:
    problems = _aux_layers_exist(config, text)
    if not 0 <= config.mask_token_id < text.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is not a token id of the target (vocab {text.vocab_size})")
    return problems


def _dflash_reads(config, text) -> list[str]:
    problems = _aux_layers_exist(config, text)
    if not 0 <= config.mask_token_id < text.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is not a token id of the target (vocab {text.vocab_size})")
    return problems


def _known_feature(config, text) -> list[str]:
    return [] if config.feature in FEATURES else [f"feature {config.feature!r} is none of {', '.join(FEATURES)}"]


FAMILIES: dict[str, Family] = {
    "eagle3": Family(Eagle3Config, _eagle3, ("hidden_size", "vocab_size", "max_position_embeddings"),
                     _aux_layers_exist),
    "eagle1": Family(Eagle1Config, lambda c, s: Eagle1Drafter(c), ("hidden_size", "vocab_size",
                                                                   "max_position_embeddings"), _known_feature),
    "medusa": Family(MedusaConfig, lambda c, s: MedusaHeads(c), ("hidden_size", "vocab_size")),
    "blockwise": Family(BlockwiseConfig, lambda c, s: BlockwiseHeads(c), ("hidden_size", "vocab_size")),
    "dflash": Family(DFlashConfig, _dflash, ("hidden_size", "vocab_size", "max_position_embeddings"), _dflash_reads),
    "dspark": Family(DSparkConfig, _dspark, ("hidden_size", "vocab_size", "max_position_embeddings"), _dflash_reads),
    "peagle": Family(PEagleConfig, _peagle, ("hidden_size", "vocab_size", "max_position_embeddings"), _peagle_reads),
}
NAMES = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1", "medusa": "Medusa", "blockwise": "Blockwise", "dflash": "DFlash",
         "dspark": "DSpark", "peagle": "P-EAGLE"}


def family_of(config) -> str:
    for name, family in FAMILIES.items():
        if type(config) is family.config:
            return name
    raise TypeError(f"{type(config).__name__} is no registered drafter config")


def _family(name: str, where) -> Family:
    if name not in FAMILIES:
        raise CheckpointError(f"{where}: unknown drafter family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def drafter_config(name: str, raw: dict, where):
    """The family's config from a stored dict; a CheckpointError naming `where` if it does not fit."""
    cls = _family(name, where).config
    try:
        return cls(**raw)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: drafter config does not fit {cls.__name__} ({err})") from None


def build_drafter(name: str, config, state: dict, where) -> nn.Module:
    """-> the family's module with `state` loaded strictly (float32, CPU, as stored)."""
    try:
        drafter = _family(name, where).build(config, state)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{where}: weights do not match the drafter config: {err}") from None
    return drafter


def load_drafter(checkpoint, families: tuple[str, ...] | None = None) -> nn.Module:
    """A native drafters.checkpoint.Checkpoint -> its drafter, weights loaded; `families` restricts
    which families the caller can use."""
    if families is not None and checkpoint.family not in families:
        raise CheckpointError(f"{checkpoint.path}: a {checkpoint.family!r} checkpoint, not "
                              f"{' / '.join(families)}")
    config = drafter_config(checkpoint.family, checkpoint.config, checkpoint.path)
    return build_drafter(checkpoint.family, config, checkpoint.state_dict, checkpoint.path)


def fit_problems(config, text_config) -> list[str]:
    """Every way a drafter config does not fit a target's text config (`config.get_text_config()`)."""
    family = FAMILIES[family_of(config)]
    problems = [f"{key}: drafter {getattr(config, key)} vs target {getattr(text_config, key)}"
                for key in family.fit_keys if getattr(config, key) != getattr(text_config, key)]
    return problems + family.own_problems(config, text_config)


def check_fits(config, target, where) -> None:
    """The one fit check: raises a CheckpointError listing every mismatch with `target`."""
    wrong = fit_problems(config, target.config.get_text_config())
    if wrong:
        raise CheckpointError(f"{where}: this {NAMES[family_of(config)]} drafter does not fit target "
                              f"{target.name!r}: " + "; ".join(wrong) + ". Train or convert a drafter for this target")
