"""The settings of every kernel, in one light module (standard library only): `TokenizeConfig`, `TrainConfig`
(its sections in shared/train_sections.py, the model's shape in shared/model_shape.py) and `EvalConfig`;
shared/flags.py makes a command line of each.

A kernel's flags are generated from its config's fields, so a new setting is one new field with a default and a
help string. Each config checks itself in `__post_init__` (types and ranges), so every way of building one is
checked the same way: the kernel's flags, a Kaggle build's baked settings, and the chain's config file on the
laptop (scripts/chain/config.py), which builds these same classes before anything is pushed. Only what needs the
machine waits for it: `TrainConfig.validate(num_devices)`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

from shared.errors import UserError
from shared.flags import at_least, check_field_types, check_known, one_of, positive
from shared.train_sections import (
    AUTO,
    BACKENDS,
    RENAMED,
    TRAIN_SECTIONS,
    DataSettings,
    EvalSettings,
    LoggingSettings,
    ModelSettings,
    OptimizerSettings,
    ScheduleSettings,
    SessionSettings,
    StepSettings,
    flatten_sections,
    section_fields,
)

SHARD_HEADER_BYTES = 256 * 4  # llm.c's shard header: 256 int32 (shared/data.py)
MANIFEST_SLACK = 4096  # room kept in a tokenize part's budget for the manifest growing by one shard entry
GB = 1e9
HELLASWAG_VALIDATION_EXAMPLES = 10042  # HellaSwag's validation split (hellaswag_val.jsonl), the eval's full set
# GPT-2 tokens in the FineWeb-Edu samples, as their names state; sample-10BT is also build-nanogpt's "100M tokens per
# shard, total of 100 shards" (karpathy/build-nanogpt fineweb.py:20 @69cb21f). Approximate: a part that starts past
# the end fails, so the chain checks against these before anything runs.
CORPUS_TOKENS = {("HuggingFaceFW/fineweb-edu", "sample-10BT"): 10_000_000_000,
                 ("HuggingFaceFW/fineweb-edu", "sample-100BT"): 100_000_000_000,
                 ("HuggingFaceFW/fineweb-edu", "sample-350BT"): 350_000_000_000}


NINE_HOURS = 9 * 3600.0


def _section(cls: type):
    return field(default_factory=cls)


def _by_section(flat: dict) -> dict[str, dict]:
    """Settings by setting name (each one section's, checked by the caller), grouped under their sections' names."""
    owner = section_fields()
    by_section: dict[str, dict] = {name: {} for name in TRAIN_SECTIONS}
    for key, value in flat.items():
        by_section[owner[key]][key] = value
    return by_section


@dataclass
class TrainConfig:
    """One train session's settings, one object per section (TRAIN_SECTIONS): `cfg.optim.lr`,
    `cfg.lr_schedule.total_steps`, the model's shape `cfg.model.shape`. Each setting is a flag (`--optim.lr`, alias
    `--lr`) and a key of a chain config's `train`, nested or flat (`from_dict`, the one reader of settings as JSON).
    Checked in `__post_init__`, however the config is built: each section's own checks, then those that span
    sections."""

    model: ModelSettings = _section(ModelSettings)
    data: DataSettings = _section(DataSettings)
    optim: OptimizerSettings = _section(OptimizerSettings)
    lr_schedule: ScheduleSettings = _section(ScheduleSettings)
    step: StepSettings = _section(StepSettings)
    session: SessionSettings = _section(SessionSettings)
    evals: EvalSettings = _section(EvalSettings)
    logging: LoggingSettings = _section(LoggingSettings)

    SECTIONS: ClassVar[dict[str, type]] = TRAIN_SECTIONS
    RENAMED: ClassVar[dict[str, str]] = RENAMED  # old name -> field: read from configs, kept as flag aliases

    @classmethod
    def from_dict(cls, settings: dict, where: str = "train") -> TrainConfig:
        """Settings as JSON writes them: nested by section (`to_dict`), flat (`{"lr": ...}`, as configs and
        checkpoints before the sections were objects), or both, under current names or old (`flatten_sections`)."""
        by_section = _by_section(flatten_sections(settings, where))
        return cls(**{name: TRAIN_SECTIONS[name](**values) for name, values in by_section.items()})

    def replace(self, **changes) -> TrainConfig:
        """A copy with `changes` by setting name (`micro_batch=8`: each name is one section's), checked again. Every
        section is copied, so setting a field of the copy's leaves this config as it is."""
        check_known(changes, section_fields(), "TrainConfig.replace", "train")
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **values)
                                            for name, values in _by_section(changes).items()})

    @property
    def tokens_per_micro_step(self) -> int:
        if self.step.micro_batch == AUTO:
            raise UserError("--micro-batch auto is chosen once the runtime is up (shared/tpu.py micro_batch_for)")
        return self.step.micro_batch * self.model.shape.block_size

    @property
    def grad_accum_steps(self) -> int:
        per_micro, total = self.tokens_per_micro_step, self.step.total_batch_tokens
        if total % per_micro:
            raise UserError(
                f"--total-batch-tokens {total} is not a multiple of "
                f"micro-batch x seq-len = {self.step.micro_batch} x {self.model.shape.block_size} = {per_micro}"
            )
        return total // per_micro

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Every section's own checks (types, then its `check`), then those that span sections."""
        for name, section in TRAIN_SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, section):
                raise UserError(f"train.{name}: expected a {section.__name__}, got {value!r}")
            check_field_types(value)
            value.check()
        if self.step.micro_batch != AUTO:
            self.grad_accum_steps  # noqa: B018 - raises unless the batch is a whole number of micro-batches

    def validate(self, num_devices: int = 1) -> None:
        """Every check again (a field may have been set since), then what needs the machine: the micro-batch is
        split evenly over its devices."""
        self.check()
        total, micro_batch = self.step.total_batch_tokens, self.step.micro_batch
        block_size = self.model.shape.block_size
        if micro_batch == AUTO:  # auto picks a multiple of the devices that divides the batch: one must exist
            smallest = num_devices * block_size
            if total % smallest:
                raise UserError(f"--total-batch-tokens {total} is not a multiple of {num_devices} "
                                f"devices x seq-len {block_size} = {smallest}, so no micro-batch fits it")
        elif micro_batch % num_devices:
            raise UserError(f"--micro-batch {micro_batch} must be a multiple of the {num_devices} devices")

    def to_dict(self) -> dict:
        """The settings nested by section, `{"model": {...}, "optim": {...}, ...}`: what `from_dict` reads."""
        return dataclasses.asdict(self)


@dataclass
class TokenizeConfig:
    dataset: str = field(default="HuggingFaceFW/fineweb-edu", metadata={"help": "Hugging Face dataset to stream"})
    config: str = field(default="sample-10BT", metadata={"help": "dataset config (subset) name; '' for none"})
    split: str = field(default="train", metadata={"help": "dataset split"})
    revision: str = field(
        default="", metadata={"help": "dataset revision ('': newest, pinned in the manifest; part K>0: part K-1's)"}
    )
    text_column: str = field(default="text", metadata={"help": "column holding each document's text"})
    data_files: str = field(
        default="", metadata={"help": "local parquet or jsonl files (glob, comma-separated) instead of --dataset"}
    )
    out_dir: str = field(default="data/fineweb-edu", metadata={"help": "output: shards and manifest.json"})
    part: int = field(default=0, metadata={"help": "which part of the corpus this run makes (0, 1, ...)"})
    prev_dir: str = field(default="", metadata={"help": "directory holding part K-1's manifest.json (part K > 0)"})
    tokens_per_part: int = field(
        default=9_400_000_000, metadata={"help": "tokens in a part (ends at the next document boundary)"}
    )
    shard_size: int = field(default=100_000_000, metadata={"help": "tokens per shard"})
    max_output_gb: float = field(default=19.0, metadata={"help": "most the output directory may hold (1 GB = 1e9 B)"})
    prefix: str = field(default="fineweb", metadata={"help": "shard names: PREFIX_val_000000.bin, PREFIX_train_..."})
    processes: int = field(default=0, metadata={"help": "tokenizer processes (0: one per CPU core)"})
    batch_docs: int = field(default=256, metadata={"help": "documents per task sent to a tokenizer process"})
    tmp_dir: str = field(default="", metadata={"help": "where shards are written before moving in ('': system temp)"})
    ranks_path: str = field(
        default="", metadata={"help": "local GPT-2 ranks file (gpt2.tiktoken); '': $GPT2_TIKTOKEN_RANKS or cache"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    session_deadline: float = field(default=41_400.0, metadata={"help": "seconds after the session's start at which "
                                    "the part ends cleanly (Kaggle stops a CPU session at 12 h); 0: none"})
    retry_wait_s: float = field(default=5.0, metadata={"help": "first wait before reopening a stream the Hub broke "
                                "off (doubling up to 5 minutes, or what a 429 asks)"})
    retry_total_s: float = field(default=1800.0, metadata={"help": "most time a part waits on Hub faults in all"})

    def __post_init__(self) -> None:
        check_field_types(self)
        at_least(self, 0, "part", "processes", "max_output_gb", "session_deadline", "retry_wait_s", "retry_total_s")
        positive(self, "tokens_per_part", "shard_size", "batch_docs")
        if self.shard_size >= 2**31:
            raise UserError(f"--shard-size {self.shard_size} does not fit a shard header (< 2^31 tokens)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", self.prefix):
            raise UserError(f"--prefix {self.prefix!r}: use letters, digits, '.' and '-' only")
        if not self.text_column:
            raise UserError("--text-column is empty")
        need = SHARD_HEADER_BYTES + 2 * self.shard_size + MANIFEST_SLACK
        if self.max_output_gb * GB < need:
            raise UserError(f"--max-output-gb {self.max_output_gb:g} is smaller than one shard of {self.shard_size} "
                            f"tokens ({need / GB:.6g} GB with its manifest)")

    @property
    def corpus_tokens(self) -> int | None:
        """About how many tokens the whole corpus holds, where known (None: local files or another dataset)."""
        return None if self.data_files else CORPUS_TOKENS.get((self.dataset, self.config))

    def tokens_in_parts(self, parts: int) -> int:
        """Tokens that `parts` parts make: each `tokens_per_part`, the last cut short where the corpus ends."""
        made = parts * self.tokens_per_part
        return min(made, self.corpus_tokens) if self.corpus_tokens else made

    def check_parts(self, parts: int) -> None:
        """Refuse `parts` parts where one would start past the corpus's end: it would stop with "already reached
        the end of the stream". The known sizes are rounded, so a part must start clearly (5%) past the end."""
        corpus = self.corpus_tokens
        if corpus and (parts - 1) * self.tokens_per_part > 1.05 * corpus:
            useful = math.ceil(corpus / self.tokens_per_part)
            raise UserError(f"tokenize.parts {parts} x {self.tokens_per_part / 1e9:g}B tokens: {self.dataset} "
                            f"{self.config} holds about {corpus / 1e9:g}B, so part {useful} would start past its "
                            f"end; use at most {useful} part(s) (a run longer than the corpus repeats it) or a "
                            "larger config")


@dataclass
class EvalConfig:
    checkpoint: str = field(default="", metadata={
        "help": "a checkpoint (step_NNNNNN), a checkpoints/ root or a run dir; '' on Kaggle: the newest under "
                "/kaggle/input"})
    hf_model: str = field(default="", metadata={"help": "evaluate a Hugging Face GPT-2 folder instead"})
    data_dir: str = field(default="", metadata={
        "help": "directory searched for *_val_*.bin shards ('' on Kaggle: /kaggle/input; 'off': no val loss)"})
    out_dir: str = field(default="runs/eval", metadata={"help": "report, plots, metrics and the HF export go here"})
    val_tokens: int = field(default=10_485_760, metadata={"help": "validation tokens to score (0: the whole split)"})
    micro_batch: int = field(default=16, metadata={"help": "sequences per validation batch over all devices"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast, as in training"})
    hellaswag: str = field(default="auto", metadata={
        "help": "a HellaSwag jsonl file, 'download' (GitHub, else the HF hub), 'auto' (download when online, else "
                "skip), 'demo' (a small offline set from the demo corpus) or 'off'"})
    hellaswag_examples: int = field(default=0, metadata={"help": "evaluate the first N examples (0: all)"})
    hellaswag_batch: int = field(default=64, metadata={"help": "rows (4 per example) per forward pass"})
    prompts: str = field(default="Hello, I'm a language model,|The meaning of life is|In a shocking finding,",
                         metadata={"help": "sample prompts separated by '|' ('': no samples)"})
    samples_per_prompt: int = field(default=2, metadata={"help": "samples per prompt"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens per sample"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (0: greedy)"})
    top_k: int = field(default=50, metadata={"help": "sample from the k likeliest tokens (0: all)"})
    seed: int = field(default=42, metadata={"help": "sampling seed"})
    export: bool = field(default=True, metadata={"help": "write the model as a Hugging Face folder (out_dir/hf)"})
    kaggle_model: str = field(default="", metadata={
        "help": "upload the export as a new version of owner/model/framework/variation ('': no upload)"})
    wandb_project: str = field(default="", metadata={"help": "W&B project ('': the training run's, if any)"})
    ranks_path: str = field(default="", metadata={"help": "GPT-2 tiktoken ranks file ('': the default lookup)"})
    backend: str = field(default="auto", metadata={"help": "xla (TPU or torch_xla CPU devices), cuda, cpu, auto"})

    def __post_init__(self) -> None:
        check_field_types(self)
        at_least(self, 0, "val_tokens", "hellaswag_examples", "samples_per_prompt", "max_new_tokens", "temperature",
                 "top_k")
        positive(self, "micro_batch", "hellaswag_batch")
        one_of(self, "backend", BACKENDS)
        if self.kaggle_model and (len(self.kaggle_model.split("/")) != 4 or not all(self.kaggle_model.split("/"))):
            raise UserError(f"--kaggle-model {self.kaggle_model!r}: expected owner/model/framework/variation")


# The settings class of each kernel (scripts/chain builds them from a config file to check it).
KERNEL_SETTINGS: dict[str, type] = {"tokenize": TokenizeConfig, "train": TrainConfig, "eval": EvalConfig}
