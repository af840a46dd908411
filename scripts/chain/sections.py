"""A chain config's stage sections, typed at load (scripts/chain/config.py `config_from_dict`): `train`, `tokenize`
and `eval` alike, each its kernel's settings as the config gives them (`settings`: what the kernel is built with),
those settings with every default filled (`config`: what the chain reads them from), and the stage's chain-only keys
(its parts, inputs, machine, ...). `raw()` is the section as a config file writes it, which loads back to it."""

from __future__ import annotations

import dataclasses

from scripts.chain.limits import MACHINE_SHAPES
from shared.config import EvalConfig, TokenizeConfig, TrainConfig

STAGES = ("train", "tokenize", "eval")  # the ChainConfig fields that are stage sections


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """A config's `train`, typed: the train kernel's settings as the config gives them, with its checkpoints placed
    by the chain (`settings`: what each train session is built with, before the run's total_steps and the session's
    own), and with every default filled and the run's total_steps (`config`: the TrainConfig a session gets)."""

    settings: dict
    config: TrainConfig

    @classmethod
    def of(cls, raw: dict, total_steps: int) -> TrainSection:
        settings = dict(raw.get("settings", {}))
        return cls(settings=settings, config=TrainConfig.from_dict({**settings, "total_steps": total_steps}))

    def raw(self) -> dict:
        return {"settings": dict(self.settings)}


@dataclasses.dataclass(frozen=True)
class TokenizeSection:
    """A config's `tokenize`, typed: how many parts, their kernel settings as the config gives them (`settings`, what
    each part is built with) and with every default filled (`config`, part 0's), the datasets they read, their
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

    def raw(self) -> dict:
        return {"parts": self.parts, "settings": dict(self.settings), "inputs": list(self.inputs),
                "accelerator": self.accelerator, "hf_token": self.hf_token}


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

    def raw(self) -> dict:
        return {"enabled": self.enabled, "settings": dict(self.settings), "inputs": list(self.inputs),
                "accelerator": self.accelerator, "session_limit_s": self.session_limit_s}

    @property
    def kind(self) -> str:
        return MACHINE_SHAPES.get(self.accelerator, "cpu")


def section_keys(section: type) -> set[str]:
    """The keys a config file's section may hold: the typed section's fields but the config built from them."""
    return {f.name for f in dataclasses.fields(section)} - {"config"}
