"""The recipe sections every family shares (`Data`, `Optim`, `TrainRecipe`; the feature-level families'
`FeatureRecipe` and `DraftVocabRecipe`; EAGLE-3's and P-EAGLE's `DrafterNorms`) and their checks.

Each family's recipe is its own subclass in its training module (drafters.training.eagle3.Eagle3Recipe,
drafters.training.heads.MedusaRecipe, ...), holding its own options in its own section (`eagle3:`, `dflash:`, ...)
and checking them in `problems()`, named by its TrainingFamily entry; load_train_recipe reads a YAML recipe plus
key=value overrides into one and names every problem at once; move_old_keys moves the keys an earlier release read at
the top level into their sections. Knows nothing about drafters, targets or the loop.
"""

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from drafters.dtypes import DtypeName
from drafters.training.recipe import RecipeError, build_overridden, check_override_key, read_recipe


@dataclass
class Data:
    path: str  # JSON / JSONL file, save_to_disk folder or Hugging Face dataset name (drafters.training.data)
    fmt: Literal["auto", "sharegpt", "openai", "text"] = "auto"
    split: str = "train"
    max_length: int = 2048  # tokens; longer conversations are cut
    limit: int | None = None  # read the first N usable rows only
    eval_rows: int | None = None  # held-out rows; overrides eval_fraction
    eval_fraction: float = 0.02
    seed: int = 0  # of the train / held-out split
    # train on N rows of the training split only (drawn by the same permutation; the held-out rows stay the full
    # data's): fewer distinct tokens, e.g. to compare epochs over them with one pass over more; null = all
    train_rows: int | None = None
    # assistant turns' reasoning (reasoning_content, or a leading <think> block): "train" = as the model emits it,
    # a think block before the answer; "answer_only" = dropped, the answer alone is trained (said in the data report)
    reasoning: Literal["train", "answer_only"] = "train"
    # variables for the chat template, as a serving engine's chat_template_kwargs: the thinking switch of a model
    # that has one ({enable_thinking: true} for Qwen3 / DeepSeek-R1-style templates), so turns render as served
    chat_template_kwargs: dict | None = None
    # training batches leave out of the loss each answer token that ends an n-token span already ended earlier in
    # the example's answers (the target looping: drafters.training.data.repeat_mask); null = every answer token.
    # Held-out metrics count every token either way
    drop_repeats: int | None = None
    # training batches are right-padded to a multiple of this many tokens (capped at max_length), so step shapes
    # repeat: the allocator reuses freed blocks and oneDNN its primitives instead of fragmenting the heap under a
    # new length every step (SmolLM2, 150 offline steps: peak RSS 2.97 -> 1.52 GB at 64). Padding is never
    # scored and the losses do not change (the positions normalisation counts the unpadded length). 1 = off
    pad_multiple: int = 1

    def problems(self) -> list[str]:
        found = []
        if self.pad_multiple < 1:
            found.append(f"data.pad_multiple={self.pad_multiple} must be >= 1 (1 = pad to the longest row only)")
        if self.drop_repeats is not None and self.drop_repeats < 2:
            found.append(f"data.drop_repeats={self.drop_repeats} must be >= 2 (a span of n tokens) or null (keep "
                         "every answer token)")
        if self.max_length < 3:
            found.append(f"data.max_length={self.max_length} must be >= 3 (a label needs 2 tokens of context)")
        if self.train_rows is not None and self.train_rows < 1:
            found.append(f"data.train_rows={self.train_rows} must be >= 1 or null (the whole training split)")
        if self.limit is not None and self.limit < 1:
            found.append(f"data.limit={self.limit} must be >= 1 or null (all rows)")
        if not 0 <= self.eval_fraction < 1 or (self.eval_rows is not None and self.eval_rows < 0):
            found.append(f"data.eval_fraction={self.eval_fraction} must be in [0, 1), data.eval_rows >= 0")
        return found


@dataclass
class Optim:
    name: str = "adamw"  # adamw | muon (drafters.training.optimizers: Muon on hidden matrices, AdamW on the rest)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0  # linear from lr / warmup_steps up to lr
    schedule: Literal["cosine", "constant"] = "cosine"  # after warmup; cosine decays to 0
    max_grad_norm: float | None = 0.5  # null = no clipping (the norm is still logged)
    clip_value: float | None = None  # clip each gradient element to [-v, v] first (official EAGLE: 0.5)
    momentum: float = 0.95  # Muon's (optim.name=muon only)

    def problems(self) -> list[str]:
        found = []
        if self.lr <= 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            found.append(f"optim.lr={self.lr} must be > 0, warmup_steps and weight_decay >= 0")
        if self.name not in ("adamw", "muon"):
            found.append(f"optim.name={self.name!r} is not an optimizer this trainer builds: use adamw or muon")
        if not 0 <= self.momentum < 1:
            found.append(f"optim.momentum={self.momentum} must be in [0, 1)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            found.append(f"optim.betas={self.betas} must be two numbers in [0, 1)")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            found.append(f"optim.max_grad_norm={self.max_grad_norm} must be > 0 or null (no clipping)")
        if self.clip_value is not None and self.clip_value <= 0:
            found.append(f"optim.clip_value={self.clip_value} must be > 0 or null (no clipping by value)")
        return found


@dataclass
class Measure:
    """What train/train.py measures once the recipe is trained (drafters.training.measure): our decoder's tau and
    acceptance by depth, greedy, and a llama.cpp export."""

    bench: str = "mt_bench"  # mt_bench | humaneval | a JSONL file of prompts (eval/tau.py --bench)
    limit: int | None = 80  # the first N questions, every turn of each; null = all
    max_new_tokens: int = 32  # per turn
    tree: str = "chain:3"  # eval/tau.py --tree
    llama_cpp: bool = True  # also export the drafter as GGUF for llama.cpp (where the project's build is)

    def problems(self) -> list[str]:
        found = []
        if self.limit is not None and self.limit < 1:
            found.append(f"measure.limit={self.limit} must be >= 1 or null (every question)")
        if self.max_new_tokens < 1:
            found.append(f"measure.max_new_tokens={self.max_new_tokens} must be >= 1")
        return found


@dataclass(kw_only=True)
class TrainRecipe:
    """What every training script's recipe has; each script's Recipe adds its family's fields."""

    # {a key an earlier release read at the top level: the section that holds it now} (EAGLE-3's options, now under
    # `eagle3:`): move_old_keys moves them there, with a deprecation line, for one release
    moved_keys: ClassVar[dict[str, str]] = {}
    target: str  # short name, model directory, .gguf file or Hub id (drafters.targets)
    data: Data
    optim: Optim = field(default_factory=Optim)
    batch_size: int = 1  # per process
    grad_accum: int = 1
    epochs: int | None = 1
    max_steps: int | None = None  # optimizer steps; with epochs, whichever comes first
    seed: int = 0
    # auto = bf16 where the hardware computes it (GPUs, CPUs with avx512_bf16 / AMX), else float32 / no:
    # emulated bf16 (e.g. an AVX2 CPU) is ~50x slower than float32 (drafters.targets.resolve_precision)
    dtype: Literal["auto", DtypeName] = "float32"  # the target's weights (drafters.dtypes)
    # true: the frozen target's decoder layers are sharded across the launch's processes (FSDP2 over frozen
    # parameters, gathered a layer at a time in its forward): each process holds 1/N of them (data parallel
    # launches only; drafters.training.launch.split_target)
    split_target: bool = False
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "no"  # autocast of the drafter (accelerate)
    threads: int = 0  # torch CPU threads; 0 = torch's default
    log_every: int = 10  # optimizer steps between metrics flushes (host syncs)
    save_every: int = 0  # 0 = only checkpoint-final; checkpoint-<step> directories also resume
    keep_last: int = 0  # keep only the newest N checkpoint-<step> directories; 0 = all
    eval_every: int = 0  # 0 = only at the end
    resume_from: str | None = None  # null | latest (newest checkpoint-<step> in output_dir) | a directory
    allow_recipe_changes: bool = False  # resume even though the recipe differs from the checkpoint's
    # null | a native checkpoint of this family and target: its weights (and draft vocabulary) start the run, whose
    # optimizer, schedule and step start fresh: a drafter fine-tuned on other data (drafters.training.resume)
    init_from: str | None = None
    # refuse, before the first step, a step whose estimated memory exceeds the device's free memory
    # (drafters/training/memory.py: EAGLE-3, DFlash, DSpark)
    check_memory: bool = True
    trust_checkpoint: bool = False  # resume_from outside output_dir: its trainer state is unpickled, which can run
    #                                 code (accelerate, DeepSpeed, FSDP): say that the checkpoint is trusted
    overwrite_output_dir: bool = False  # a new run into an output_dir holding an earlier run: remove that run's
    #                                     checkpoint-<step>/final, metrics.jsonl and eval.jsonl first (else refused)
    wandb_project: str | None = None  # also log to Weights & Biases (WANDB_MODE=offline works); null = off
    wandb_name: str | None = None  # the wandb run name; null = wandb's
    # training passes run in order, each a mapping of `name` and the recipe keys it changes (data.path, epochs,
    # optim.lr, features.dir, ...), trained into output_dir/stage-<i>-<name>/ from the previous stage's
    # checkpoint-final, resumable as a whole (drafters.training.stages); null = one run into output_dir
    stages: list[dict] | None = None
    # what the final drafter is worth, printed once training ends: tau and acceptance by depth in our decoder, and
    # its llama.cpp export (drafters.training.measure); null = nothing
    measure: Measure | None = None

    def problems(self) -> list[str]:
        """Every problem with the fields all training scripts share (batching, steps, checkpoints,
        logging, data, optim); each script adds only its own fields' (load_train_recipe)."""
        found = [f"{name}={getattr(self, name)} must be >= 1" for name in ("batch_size", "grad_accum", "log_every")
                 if getattr(self, name) < 1]
        found += [f"{name}={getattr(self, name)} must be >= 0 (0 = off)" for name in
                  ("save_every", "eval_every", "threads", "keep_last") if getattr(self, name) < 0]
        found += [f"{name}={getattr(self, name)} must be >= 1 or null" for name in
                  ("epochs", "max_steps") if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.epochs is None and self.max_steps is None:
            found.append("set epochs or max_steps (or both: whichever ends first)")
        return found + self.data.problems() + self.optim.problems() + (self.measure.problems() if self.measure else [])


@dataclass
class Features:  # offline target features (drafters.training.features; written by train/features.py)
    dir: str | None = None  # null = online (a target forward per batch); set = stream the features from here
    dtype: DtypeName = "bfloat16"  # storage dtype (train/features.py)
    shard_rows: int = 512  # examples per safetensors shard (train/features.py)
    # train/features.py on a store written for other data (rows appended, some edited): true keeps every shard whose
    # rows are still tokenized exactly as stored and computes the rest; false refuses, saying how many would be kept
    update: bool = False
    # target: the target's hidden states and distributions (online, or from dir); text: EAGLE-3 only, a cheap pass
    # over raw text in which the target never runs: its embedding stands in for the fused layers and the data's next
    # token for its distribution (drafters.training.eagle3.text_inputs), a pretraining stage before distillation
    source: Literal["target", "text"] = "target"
    # true: training whose dir holds no finished store makes it first (drafters.training.store.make_store, as
    # train/features.py does, resumably), so a recipe with a store is one command; false: such a run is refused,
    # naming the train/features.py command
    make: bool = False


@dataclass(kw_only=True)
class FeatureRecipe(TrainRecipe):
    """The families trained on the target's hidden states, online or from a store (EAGLE-1, EAGLE-3, DFlash,
    DSpark, P-EAGLE)."""

    layers: list[int] | None = None  # HF hidden_states indices of the fused aux layers; null = [2, L//2, L-3]
    features: Features = field(default_factory=Features)  # offline features (train/features.py)
    # whether the family trains from features.source=text (drafters.training.eagle3.text_inputs): EAGLE-3's says so
    reads_text: ClassVar[bool] = False

    def problems(self) -> list[str]:
        found = super().problems()
        if self.features.shard_rows < 1:
            found.append(f"features.shard_rows={self.features.shard_rows} must be >= 1")
        source = self.features.source  # target or text: the recipe's reader refuses any other value
        if source == "text" and not self.reads_text:
            found.append(f"features.source=text pretrains EAGLE-3 only; drafter={getattr(self, 'drafter', None)} "
                         "trains on the target's features: set features.source=target")
        elif source == "text" and self.features.dir:
            found.append(f"features.source=text reads no store (the target never runs), but features.dir="
                         f"{self.features.dir} is set: set features.dir=null for this run or stage")
        return found


@dataclass(kw_only=True)
class DraftVocabRecipe(FeatureRecipe):
    """The feature-level families that draft over a reduced vocabulary (drafters.draft_vocab)."""

    draft_vocab_size: int = 32000  # capped at the target vocab (with a printed line)
    # set (0 < c <= 1): draft_vocab_size = the smallest vocabulary whose ids cover this fraction of the
    # supervised training tokens (drafters.draft_vocab.size_for_coverage); the coverage is printed either way
    draft_vocab_coverage: float | None = None
    # with init_from: true = this run's vocabulary is counted on its own data as the two fields above say, always
    # holding the checkpoint's ids; their LM-head rows carry over, the new ids' rows start at zero
    # (drafters.training.resume.widened_state). false = the checkpoint's vocabulary is kept as it is.
    grow_vocab: bool = False

    def problems(self) -> list[str]:
        found = super().problems()
        if self.grow_vocab and self.init_from is None:
            found.append("grow_vocab=true widens the draft vocabulary of init_from's checkpoint: set init_from, or "
                         "drop grow_vocab (a fresh run counts its vocabulary from draft_vocab_size / "
                         "draft_vocab_coverage anyway)")
        if self.draft_vocab_size < 1:
            found.append(f"draft_vocab_size={self.draft_vocab_size} must be >= 1")
        if self.draft_vocab_coverage is not None and not 0 < self.draft_vocab_coverage <= 1:
            found.append(f"draft_vocab_coverage={self.draft_vocab_coverage} must be in (0, 1] or null "
                         "(null = draft_vocab_size as given)")
        return found


@dataclass(kw_only=True)
class DrafterNorms:
    """The optional norms of an EAGLE-3 layer (drafters.eagle3.Eagle3Config; speculators' / vLLM's names), read by
    EAGLE-3 and P-EAGLE. llama.cpp runs norm_before_fc and norm_before_residual; fc_norm (EAGLE-3.1) only vLLM /
    speculators / SGLang."""

    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False

    def norms(self) -> dict[str, bool]:  # drafters.eagle3.NORM_OPTIONS: these fields, by these names
        return {f.name: getattr(self, f.name) for f in fields(DrafterNorms)}

    def norm_problems(self) -> list[str]:
        if self.norm_before_fc and self.fc_norm:
            return ["norm_before_fc and fc_norm are both set: they are two ways to norm the fused features before "
                    "fc; keep one"]
        return []


def load_train_recipe(argv: list[str], schema, own_problems=None, raw: dict | None = None):
    """argv = [RECIPE.yaml, key=value ...] read into `schema` (`raw`: the recipe already read, overrides
    applied). Every check runs once, on one list: the recipe's own (schema.problems(), its family's fields and
    the shared sections') and the caller's (own_problems(recipe) -> [str]); one RecipeError names them all. Which
    schema a recipe needs is drafters.training.families.load_recipe's business."""
    raw = read_recipe(argv[0], argv[1:]) if raw is None else raw
    for override in argv[1:]:
        check_override_key(schema, override)
    recipe = build_overridden(schema, raw, argv[0], argv[1:])
    check_recipe(recipe, own_problems)
    return recipe


def check_recipe(recipe: TrainRecipe, own_problems=None) -> None:
    problems = recipe.problems() + (own_problems(recipe) if own_problems else [])
    if problems:
        raise RecipeError("recipe: " + "; ".join(problems))


def move_old_keys(raw: dict, moved: dict[str, str], where: str) -> list[str]:
    """The keys of `moved` that `raw` holds at its top level, moved (in place) into their sections -> their names.
    A key given in both places is refused: which of the two was meant is not the loader's to guess."""
    found = [key for key in raw if key in moved and isinstance(raw.get(moved[key], {}), dict)]
    for key in found:
        section = raw.setdefault(moved[key], {})
        if key in section:
            raise RecipeError(f"{where}: {key} is given both at the top level and under {moved[key]}:, keep the one "
                              f"under {moved[key]}: (the top level is where an earlier release read it)")
        section[key] = raw.pop(key)
    return found


def moved_override(override: str, moved: dict[str, str]) -> str:
    """An override of a key `moved` into a section, written in the section: ttt_steps=3 -> eagle3.ttt_steps=3."""
    key, sep, value = override.partition("=")
    key = key.strip()
    return f"{moved[key]}.{key}={value}" if sep and key in moved else override


def deprecation(where: str, keys: list[str], moved: dict[str, str]) -> str:
    """The one line said when a recipe still holds `moved` keys at its top level."""
    sections = " / ".join(dict.fromkeys(f"`{moved[key]}:`" for key in keys))
    one = len(keys) == 1
    return (f"warning: {where}: {', '.join(keys)} at the top level {'is' if one else 'are'} deprecated: move "
            f"{'it' if one else 'them'} under {sections} (on the command line: {moved[keys[0]]}.{keys[0]}=...); this "
            "release still reads the top level, the next will refuse it")
