"""The chain's config: one dataclass read from JSON or TOML and checked field by field, so a mistake is a
one-line error before anything is pushed. It flows one way: the stages read it, and the client gets its slice
(`ChainConfig.client`). Its train, tokenize and eval sections are typed at load, alike (scripts/chain/sections.py):
each holds its kernel's settings as the file gives them (a kernel is built with the settings the user set, not every
default), the same with every default filled, and the stage's own keys. A config changed after load is loaded again
(`ChainConfig.with_train`), so it is checked like any other."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from scripts.chain.build import check_settings
from scripts.chain.checkpoint_room import (
    check_checkpoint_room,
    checkpoint_uploads,
    checkpoints_in_temp,
    keeps_stable,
    placed_settings,
    publish_needs_s,
    publish_words,
)
from scripts.chain.limits import MACHINE_SHAPES, MIDWAY_PUBLISH_MIN_S, SESSION_MAX_S, TPU_STARTUP_MARGIN_S
from scripts.chain.sections import STAGES, EvalSection, TokenizeSection, TrainSection, section_keys
from shared.config import NINE_HOURS
from shared.errors import UserError
from shared.flags import check_field_types
from shared.train_sections import flatten_sections

# --smoke's sizes and limits; a config's `smoke` section may change any of them (scripts/chain/smoke.py)
SMOKE_DEFAULTS = {
    "tokens": 50_000_000,  # the tokenize part
    "shard_size": 10_000_000,  # so the part has a validation shard and a few training shards
    # each train session: Kaggle stops it there (sessionTimeoutSeconds); 0: startup_margin_s + the publish margin +
    # train_s, so a larger model's longer upload never eats its training
    "session_limit_s": 0.0,
    "train_s": 240.0,  # training time in each train session, where session_limit_s is 0
    "eval_session_limit_s": 0.0,  # the eval's (0: session_limit_s); never more than the config's eval limit
    # start-up to the end of the first step: the probes' budget, the step's compile, the baseline eval, the rest
    # (scripts/chain/limits.py TPU_STARTUP_S); a train session's deadline leaves it before its train_s
    "startup_margin_s": TPU_STARTUP_MARGIN_S,
    # 0: 60 s + the checkpoint's upload at the assumed rate (+ the 600-s wait for a version of checkpoints kept in
    # /kaggle/temp), at least 120 s (scripts/chain/checkpoint_room.py publish_needs_s)
    "publish_margin_s": 0.0,
    "val_tokens": 1_048_576,  # the eval's subset
    "hellaswag_examples": 200,
    "profile_steps": 3,  # each train session traces this many compiled steps (train.profile_steps; 0: none)
}

def one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:400] if lines else ""


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """What the Kaggle client needs: how it retries a transient failure and how it polls."""

    retry_attempts: int
    retry_base_s: float
    poll_initial_s: float
    poll_max_s: float


@dataclasses.dataclass
class ChainConfig:
    """One chain: the model and how long it trains (`train`, `total_steps`), where its tokens come from
    (`tokenize`, `token_datasets`, `token_kernels`), the machines and session limits, the eval kernel, and how
    patiently the client talks to Kaggle. A config file's keys are these fields."""

    name: str = "gpt2"  # prefix of every slug
    user: str = ""  # Kaggle user owning the kernels and datasets ('': the API credentials' user)
    total_steps: int = 19073  # optimizer steps of the whole run
    # machine_shape of train (and eval) sessions ("" for CPU): TPU v5e-8, the TPU of Kaggle's Sep 2026 list
    # (kaggle-cli docs/kernels.md @13dad8ee); TpuV6E8 where offered.
    accelerator: str = "TpuV5E8"
    kernel_type: str = "script"  # script or notebook
    session_limit_s: float = NINE_HOURS  # a session's time limit (Kaggle: 9 h)
    # start-up to the end of the first step (imports, data, the attention probes, compiles, the baseline eval): a
    # TPU's, by part, in scripts/chain/limits.py TPU_STARTUP_S
    startup_margin_s: float = TPU_STARTUP_MARGIN_S
    publish_margin_s: float = 0  # the final checkpoint's upload (0: sized from the checkpoint, at least 1200 s)
    # Size each train session from what its sessions measured instead (0: each trains session_limit_s less both
    # margins): this much training (more where 10 steps at the step time measured need it), counted from the end of
    # its first step, whatever start-up takes, then publish_margin_s, within session_limit_s; the first, before
    # anything is measured, 10 steps (scripts/chain/sizing.py). For local runs (the demo, tests), whose start-up is
    # most of a session; startup_margin_s is then the plan's guess at it.
    session_train_s: float = 0
    max_train_sessions: int = 0  # stop training after this many sessions, then evaluate (0: until total_steps)
    max_failed_sessions: int = 3  # consecutive sessions without progress before the chain gives up
    # Versions kept in each of the two checkpoint datasets (0: as many as the quota holds); a publish that would
    # exceed it deletes its dataset's older ones at its create (Kaggle deletes only all older versions at once:
    # docs/kaggle-api.md, Checkpoint dataset versions), while the other dataset holds the newest proven checkpoint.
    keep_dataset_versions: int = 2
    # The account's private-dataset quota, in GB: the chain keeps its checkpoint versions under it (fewer kept, or no
    # midway publish, where needed: scripts/chain/storage.py). Kaggle's figure is not verified (a 2023 book says
    # "over 100 GB"); set yours from your account's settings page.
    dataset_quota_gb: float = 100.0
    # Size the run to the session (0: total_steps as given): where --smoke measured this machine's tokens/s (or
    # plan_tokens_per_s is set), total_steps becomes what fills this share of one session (e.g. 0.85), evals
    # included, up to fill_passes passes over the tokens the tokenize parts make, and the parts make no more than that
    # (scripts/chain/fill.py). Fixed in the chain's state at its first start.
    fill_session: float = 0.0
    # The most passes over the training tokens the tokenize parts can make that a filled run may read (1: one
    # pass). Repeating up to ~4 epochs costs little (Muennighoff et al. 2023, arXiv 2305.16264); the validation
    # shard is never trained on (its own split, shared/data.py find_shards).
    fill_passes: float = 1.0
    # Training tokens/s that `--plan` counts sessions with (0: the newest --smoke measurement on this accelerator
    # and preset, else an estimate from the TPU's peak: scripts/chain/plan.py).
    plan_tokens_per_s: float = 0
    # settings: the train kernel's (model, batch, lr, ...; scripts/chain/sections.py TrainSection). A file may give
    # them directly as `train` too, the older shape (`_stage_dicts`).
    train: TrainSection = dataclasses.field(kw_only=True)
    # parts, settings, inputs, accelerator, hf_token (scripts/chain/sections.py TokenizeSection)
    tokenize: TokenizeSection = dataclasses.field(kw_only=True)
    token_datasets: list = dataclasses.field(default_factory=list)  # existing datasets of shards (instead/as well)
    token_kernels: list = dataclasses.field(default_factory=list)  # existing kernels whose output holds shards
    # enabled, settings, inputs, accelerator, session_limit_s (the eval session's limit; default session_limit_s):
    # scripts/chain/sections.py EvalSection
    eval: EvalSection = dataclasses.field(kw_only=True)
    slugs: dict = dataclasses.field(default_factory=dict)  # tokenize, train, eval, checkpoints
    smoke: dict = dataclasses.field(default_factory=dict)  # --smoke's sizes and limits (scripts/chain/smoke.py)
    # HellaSwag for the train sessions' evals: download, demo, a local jsonl, or "" (none); the chain uploads it as
    # a dataset once (scripts/chain/hellaswag.py) and the sessions score train.hellaswag_examples of it
    hellaswag: str = ""
    poll_initial_s: float = 10.0
    poll_max_s: float = 120.0
    # A finished status read before the pushed version was ever seen queued or running may still be the
    # previous version's (the status call names no version): it counts only this long after the push.
    stale_status_s: float = 600.0
    retry_attempts: int = 6
    retry_base_s: float = 5.0

    @property
    def train_settings(self) -> dict:
        """A train session's settings before the session's own (its data, folders, clock): the config's train
        settings, as loading placed its checkpoints, and the run's total_steps."""
        return {**self.train.settings, "total_steps": self.total_steps}

    def raw(self) -> dict:
        """The config as a file gives it (each stage section in the one shape: `settings` and the stage's keys),
        built (its checkpoints placed, its publish margin sized): what `config_from_dict` loads back to it."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in STAGES}
        return {**fields, **{stage: getattr(self, stage).raw() for stage in STAGES}}

    def with_train(self, where: str = "config", **changes) -> ChainConfig:
        """This config with its train settings changed, loaded again: checked and built as a file's would be."""
        return config_from_dict({**self.raw(), "train": {"settings": {**self.train.settings, **changes}}}, where)

    def slug(self, what: str) -> str:
        """The slug of a kernel (tokenize, train, eval; `tokenize-part-N`: part N's notebook) or of a checkpoint
        dataset (checkpoints; checkpoints-b, the second one: `<checkpoints>-b`)."""
        if what.startswith("tokenize-part-"):
            return f"{self.slug('tokenize')}-part-{what.removeprefix('tokenize-part-')}"
        if what == "checkpoints-b":  # the second checkpoint dataset, used in turn with the first
            return f"{self.slug('checkpoints')}-b"
        default = {"tokenize": f"{self.name}-tokens", "train": f"{self.name}-train", "eval": f"{self.name}-eval",
                   "checkpoints": f"{self.name}-checkpoints"}[what]
        return self.slugs.get(what) or default

    def dataset_room(self, taken: int = 0) -> int:
        """Checkpoint versions that fit the private-dataset quota at once (each the newest checkpoint and, for a wsd
        run, the stable-phase one beside it), less `taken` bytes (the user's other private datasets). Fewer than
        three is an error: the version each of the two checkpoint datasets keeps, and the next one, made before the
        older ones of its dataset are deleted (scripts/chain/storage.py)."""
        size = self.version_bytes
        room = max(0, int(self.dataset_quota_gb * 1e9) - taken) // size
        if room < 3:
            others = f" less the {taken / 1e9:.1f} GB your other private datasets take" if taken else ""
            raise UserError(f"a checkpoint version is {size / 1e9:.1f} GB: three (the one each checkpoint dataset "
                            f"keeps, and the next) do not fit the {self.dataset_quota_gb:g} GB private-dataset "
                            f"quota (dataset_quota_gb){others}; raise it if your account has more, free space on "
                            "Kaggle, or train a smaller model")
        return room

    @property
    def time_budget(self) -> float:
        """A session's training time, checkpoint writes included (scripts/chain/sizing.py training_s takes them
        out): session_train_s where sessions are sized from measured start-up, else the limit less both margins."""
        return self.session_train_s or self.session_limit_s - self.startup_margin_s - self.publish_margin_s

    def midway_publish_s(self, limit_s: float) -> float:
        """When a train session of `limit_s` publishes a checkpoint midway too, in seconds from its start (0: it
        does not): half its deadline, in sessions of MIDWAY_PUBLISH_MIN_S or more. Where Kaggle starts its clock is
        not verified and a kill discards the output, so a long session that is killed early still leaves that
        checkpoint (shared/kaggle/publish.py MidwayPublish); a short one has little to lose."""
        return (limit_s - self.publish_margin_s) / 2 if limit_s >= MIDWAY_PUBLISH_MIN_S else 0.0

    def session_clock(self, limit_s: float, train_s: float = 0) -> dict:
        """A train session's time settings, for a session of `limit_s`: training stops by the limit less the publish
        margin counted from the session's start (--session-deadline), and, in a session of the fixed length, after
        the limit less both margins of training (--time-budget, which the trainer counts from the end of the first
        step). So start-up never eats the training the plan counted: a start-up within its margin leaves the whole
        budget, one past it is cut by the deadline alone; a session trains what was planned and ends, rather than
        training on to the deadline for however long start-up happened to leave (the smoke's quota, a run sized to
        one session's decay), and the margin start-up did not use is slack before Kaggle's kill, whose clock may
        start before the process (not verified). A session sized from what its sessions measured (session_train_s)
        trains `train_s` from the end of its first step, or until the deadline where it has none (the first)."""
        deadline = limit_s - self.publish_margin_s
        fixed = limit_s - self.startup_margin_s - self.publish_margin_s
        budget = (train_s or deadline) if self.session_train_s else fixed
        return {"time_budget": budget, "session_deadline": deadline}

    @property
    def accelerator_kind(self) -> str:
        return MACHINE_SHAPES.get(self.accelerator, "cpu")

    @property
    def eval_kind(self) -> str:
        return self.eval.kind

    @property
    def eval_session_limit_s(self) -> float:
        """The eval session's limit: its own where set, since an eval's length is its work, not a training
        budget (a demo whose train sessions last 1.5-2.5 minutes still needs its eval to finish); else
        session_limit_s."""
        return self.eval.session_limit_s

    @property
    def client(self) -> ClientConfig:
        return ClientConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ClientConfig)})

    @property
    def checkpoint_bytes(self) -> int:
        return self.train.config.model.shape.checkpoint_bytes()

    @property
    def version_bytes(self) -> int:
        """A checkpoint dataset version's size: the newest checkpoint and, for a wsd run, the stable-phase one."""
        return checkpoint_uploads(self.train.config) * self.checkpoint_bytes


def check_hellaswag_source(source: str, where: str) -> None:
    """At load: a known word, or a local file that exists."""
    if source in ("", "download", "demo"):
        return
    if not Path(source).is_file():
        raise UserError(f"{where}: hellaswag {source!r} is not download, demo or an existing jsonl file")


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> ChainConfig:
    """A chain config from JSON or TOML, checked field by field (one-line errors)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"--config {path}: cannot read it ({err.strerror})") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except ValueError as err:
        raise UserError(f"--config {path}: not valid {path.suffix.lstrip('.') or 'JSON'} ({one_line(err)})") from None
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # "_comment" keys
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return config_from_dict(raw, str(path))


def config_from_dict(raw: dict, where: str = "config") -> ChainConfig:
    """A checked ChainConfig from a dict of its fields: the fields as given are checked and each stage section is
    checked and typed (`_train`: its checkpoints placed), then the config is built (its publish margin sized:
    `_built`) and what needs the built config is checked; nothing is changed while it is checked. `where` starts
    every error message."""
    fields = {f.name: f for f in dataclasses.fields(ChainConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    sections = _stage_dicts(raw, where)
    # The fields but the stage sections (None until typed), checked first: typing the sections reads them
    # (total_steps, accelerator, session_limit_s).
    given = ChainConfig(**{k: v for k, v in raw.items() if k not in STAGES}, **dict.fromkeys(STAGES))
    _check_given(given, where)
    train = _train(given, sections["train"], where)
    tokenize, evals = _stage_sections(given, sections, where)
    cfg = _built(dataclasses.replace(given, train=train, tokenize=tokenize, eval=evals))
    _check_built(cfg, where)
    return cfg


def _stage_dicts(raw: dict, where: str) -> dict[str, dict]:
    """Each stage section as the file gives it, in the one shape (its kernel's `settings` and the stage's keys). The
    one converter of the older shape: a `train` without `settings` holds the train settings directly. Train settings
    written flat or in TrainConfig's sections are flat from here on."""
    sections = {}
    for stage in STAGES:
        section = raw.get(stage, {})
        if not isinstance(section, dict):
            raise UserError(f"{where}: {stage} must be a section ({{\"key\": value, ...}}), got {section!r}")
        sections[stage] = section
    train = sections["train"] if "settings" in sections["train"] else {"settings": sections["train"]}
    extra = sorted(set(train) - section_keys(TrainSection))
    if extra:
        raise UserError(f"{where}: unknown train key(s) {', '.join(extra)}; known: settings")
    settings = train["settings"]
    if not isinstance(settings, dict):
        raise UserError(f"{where}: train.settings must be a section ({{\"key\": value, ...}}), got {settings!r}")
    return {**sections, "train": {"settings": flatten_sections(settings, f"{where}: train")}}


def _check_given(cfg: ChainConfig, where: str) -> None:
    """The fields as given, but the stage sections."""
    try:
        check_field_types(cfg, name=str)
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{2,}", cfg.name):
        raise UserError(f"{where}: name {cfg.name!r} must be lowercase letters, digits and dashes (3+), a slug prefix")
    if cfg.total_steps <= 0:
        raise UserError(f"{where}: total_steps must be positive, got {cfg.total_steps}")
    if cfg.keep_dataset_versions < 0:  # its type was checked with the others above
        raise UserError(f"{where}: keep_dataset_versions must be a whole number >= 0, got {cfg.keep_dataset_versions}")
    if cfg.accelerator and cfg.accelerator not in MACHINE_SHAPES:
        raise UserError(f"{where}: unknown accelerator {cfg.accelerator!r}; valid: {', '.join(MACHINE_SHAPES)} "
                        "(or \"\" for CPU)")
    if cfg.kernel_type not in ("script", "notebook"):
        raise UserError(f"{where}: kernel_type must be script or notebook, not {cfg.kernel_type!r}")
    longest = SESSION_MAX_S[cfg.accelerator_kind]
    if cfg.session_limit_s > longest:
        raise UserError(f"{where}: session_limit_s {cfg.session_limit_s:g} is over the {longest / 3600:g} h Kaggle "
                        f"allows a {cfg.accelerator_kind.upper()} session ({cfg.accelerator or 'CPU'})")


def _train(given: ChainConfig, raw: dict, where: str) -> TrainSection:
    """The train section as given, checked, then typed with its checkpoints placed (scripts/chain/checkpoint_room.py:
    checked that they can be)."""
    settings = raw["settings"]
    for key in ("data_dir", "out_dir", "resume_from", "total_steps", "time_budget", "session_deadline", "wandb_run_id"):
        if key in settings:
            raise UserError(f"{where}: train.{key} is set by the chain; remove it")
    check_settings("train", {**settings, "total_steps": given.total_steps}, f"{where}: train", given.accelerator)
    train = TrainSection.of(raw, given.total_steps)
    size = train.config.model.shape.checkpoint_bytes()
    check_checkpoint_room(train.config, settings, size, where)
    return TrainSection.of({"settings": placed_settings(settings, train.config, size)}, given.total_steps)


def _built(cfg: ChainConfig) -> ChainConfig:
    """`cfg` with, where 0, its publish margin sized from the checkpoint's upload: 600 s + what publishing needs, at
    least 1200 s."""
    if cfg.publish_margin_s:
        return cfg
    needed = publish_needs_s(cfg.train.config, cfg.checkpoint_bytes)
    return dataclasses.replace(cfg, publish_margin_s=max(1200.0, 600.0 + needed))


def _check_built(cfg: ChainConfig, where: str) -> None:
    """What needs the config built (the publish margin, the versions the quota holds, the training time), then the
    rest of it."""
    size, train = cfg.checkpoint_bytes, cfg.train.config
    needed = publish_needs_s(train, size)
    if cfg.publish_margin_s < needed:
        # The session is killed mid-upload with its output unsaved: the session's training is lost.
        raise UserError(f"{where}: publish_margin_s {cfg.publish_margin_s:g} is shorter than publishing takes: "
                        f"{publish_words(train, size)}, ~{needed:.0f} s; raise it or set 0 (sized for you)")
    if not 0 <= cfg.fill_session <= 1:
        raise UserError(f"{where}: fill_session must be a share of the session between 0 (off) and 1, got "
                        f"{cfg.fill_session:g}")
    if not 1 <= cfg.fill_passes <= 4:
        raise UserError(f"{where}: fill_passes must be between 1 and 4 passes over the tokenized data (past 4, "
                        f"repeated data costs more: arXiv 2305.16264), got {cfg.fill_passes:g}")
    if cfg.dataset_quota_gb <= 0:
        raise UserError(f"{where}: dataset_quota_gb must be a number of GB > 0, got {cfg.dataset_quota_gb:g}")
    try:
        cfg.dataset_room()
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    if train.lr_schedule.extend and not keeps_stable(train):
        why = ("the checkpoints of a model this large live in /kaggle/temp, where none is kept"
               if checkpoints_in_temp(train) else "train.keep_stable is false")
        raise UserError(f"{where}: train.extend trains on from the checkpoint where the stable phase ended, and {why}; "
                        "before the decay starts, raise total_steps instead (docs/recipe.md section 6)")
    if cfg.time_budget <= 0:
        raise UserError(f"{where}: session_limit_s {cfg.session_limit_s:g} leaves no training time after "
                        f"startup_margin_s {cfg.startup_margin_s:g} + publish_margin_s {cfg.publish_margin_s:g}")
    if cfg.session_train_s < 0 or (cfg.session_train_s and cfg.session_train_s + cfg.startup_margin_s
                                   + cfg.publish_margin_s > cfg.session_limit_s):
        raise UserError(f"{where}: session_train_s {cfg.session_train_s:g} must be >= 0, and with startup_margin_s "
                        f"{cfg.startup_margin_s:g} + publish_margin_s {cfg.publish_margin_s:g} fit session_limit_s "
                        f"{cfg.session_limit_s:g}, the longest a session may be made")
    if not cfg.tokenize.parts and not cfg.token_datasets and not cfg.token_kernels:
        raise UserError(f"{where}: no training data: set tokenize.parts, token_datasets or token_kernels")
    unknown_slugs = sorted(set(cfg.slugs) - {"tokenize", "train", "eval", "checkpoints"})
    if unknown_slugs:
        raise UserError(f"{where}: unknown slugs key(s) {', '.join(unknown_slugs)}")
    check_hellaswag_source(cfg.hellaswag, where)
    unknown_smoke = sorted(set(cfg.smoke) - set(SMOKE_DEFAULTS))
    if unknown_smoke:
        raise UserError(f"{where}: unknown smoke key(s) {', '.join(unknown_smoke)}; known: {', '.join(SMOKE_DEFAULTS)}")


def _stage_sections(given: ChainConfig, sections: dict, where: str) -> tuple[TokenizeSection, EvalSection]:
    """The tokenize and eval sections as given (their keys, their kernels' settings), then typed and checked."""
    for section, typed in (("tokenize", TokenizeSection), ("eval", EvalSection)):
        keys = section_keys(typed)
        extra = sorted(set(sections[section]) - keys)
        if extra:
            raise UserError(f"{where}: unknown {section} key(s) {', '.join(extra)}; known: {', '.join(sorted(keys))}")
    check_settings("tokenize", sections["tokenize"].get("settings", {}), f"{where}: tokenize.settings")
    evals = _eval(given, sections["eval"], where)
    return _tokenize(sections["tokenize"], where), evals


def _tokenize(raw: dict, where: str) -> TokenizeSection:
    """The tokenize section as given (its settings were checked), then typed."""
    parts = raw.get("parts", 0)
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 0:
        raise UserError(f"{where}: tokenize.parts must be a whole number >= 0, got {parts!r}")
    tok = TokenizeSection.of(raw)
    try:
        tok.config.check_parts(parts)
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    if not isinstance(tok.hf_token, bool):
        raise UserError(f"{where}: tokenize.hf_token must be true or false (the parts read the Hub with the "
                        f"HF_TOKEN secret), got {tok.hf_token!r}")
    if tok.accelerator and tok.accelerator not in MACHINE_SHAPES:
        raise UserError(f"{where}: unknown tokenize.accelerator {tok.accelerator!r}")
    return tok


def _eval(given: ChainConfig, raw: dict, where: str) -> EvalSection:
    """The eval section as given, then typed: its session's limit on its machine (the train sessions' where the
    section sets none)."""
    if "session_limit_s" in raw:  # else the train sessions', checked with the fields
        limit = raw["session_limit_s"]
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
            raise UserError(f"{where}: eval.session_limit_s must be a number of seconds > 0, got {limit!r}")
    if not isinstance(raw.get("enabled", True), bool):
        raise UserError(f"{where}: eval.enabled must be true or false, got {raw['enabled']!r}")
    check_settings("eval", raw.get("settings", {}), f"{where}: eval.settings")
    ev = EvalSection.of(raw, given.accelerator, given.session_limit_s)
    longest = SESSION_MAX_S[ev.kind]
    if ev.session_limit_s > longest:
        raise UserError(f"{where}: eval.session_limit_s {ev.session_limit_s:g} is over the {longest / 3600:g} h Kaggle "
                        f"allows a {ev.kind.upper()} session ({ev.accelerator or 'CPU'})")
    return ev
