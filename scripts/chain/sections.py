"""A chain config's tokenize and eval sections, typed: built once from the dicts a config file gives (scripts/chain/
config.py ChainConfig.tokenize_section, .eval_section), so the stages read every default from one place."""

from __future__ import annotations

import dataclasses

from scripts.chain.limits import MACHINE_SHAPES
from shared.config import EvalConfig, TokenizeConfig


@dataclasses.dataclass(frozen=True)
class TokenizeSection:
    """A config's `tokenize`, typed: how many parts, their kernel settings as the config gives them (`settings`,
    what each part is built with) and with every default filled (`config`, part 0's), the datasets they read, their
    machine ('': CPU), and whether they read the HF_TOKEN secret."""

    parts: int
    settings: dict
    config: TokenizeConfig
    inputs: tuple
    accelerator: str
    hf_token: bool

    @classmethod
    def of(cls, raw: dict) -> TokenizeSection:
        settings = dict(raw.get("settings", {}))
        return cls(parts=int(raw.get("parts") or 0), settings=settings,
                   config=TokenizeConfig(**{**settings, "part": 0}), inputs=tuple(raw.get("inputs", [])),
                   accelerator=raw.get("accelerator", ""), hf_token=raw.get("hf_token", False))


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """A config's `eval`, typed: whether it runs, its kernel settings as the config gives them (`settings`) and
    with every default filled (`config`), the datasets it reads, and its machine and session limit (each the train
    sessions' where the config sets none)."""

    enabled: bool
    settings: dict
    config: EvalConfig
    inputs: tuple
    accelerator: str
    session_limit_s: float

    @classmethod
    def of(cls, raw: dict, accelerator: str, session_limit_s: float) -> EvalSection:
        settings = dict(raw.get("settings", {}))
        return cls(enabled=raw.get("enabled", True), settings=settings, config=EvalConfig(**settings),
                   inputs=tuple(raw.get("inputs", [])), accelerator=raw.get("accelerator", accelerator),
                   session_limit_s=float(raw.get("session_limit_s", session_limit_s)))

    @property
    def kind(self) -> str:
        return MACHINE_SHAPES.get(self.accelerator, "cpu")


def section_keys(section: type) -> set[str]:
    """The keys a config file's section may hold: the typed section's fields but the config built from them."""
    return {f.name for f in dataclasses.fields(section)} - {"config"}
