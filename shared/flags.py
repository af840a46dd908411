"""Settings classes as command lines and checked values: a flag per dataclass field (`micro_batch` ->
`--micro-batch`), typed from its annotation, and the one-line checks every config's `__post_init__` runs
(shared/config.py). Standard library only."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from shared.errors import UserError


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_field_types(config, name=flag) -> None:
    """Each field holds its annotated type (bool, int, float, str): a JSON config's `"lr": "3e-4"` or
    `"micro_batch": 32.5` is one line here, not a TypeError deep in a session. An int is accepted for a float.
    `name(field)` is how the message names a field (a flag, by default)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        kind, value = hints[f.name], getattr(config, f.name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(config, f.name, float(value))  # frozen dataclasses too
            continue
        if kind in (bool, int, float, str) and not (isinstance(value, kind) and (kind is bool
                                                                                 or not isinstance(value, bool))):
            raise UserError(f"{name(f.name)}: expected {'a number' if kind is float else kind.__name__}, "
                            f"got {value!r}")


def check_known(settings, known, where: str, what: str) -> None:
    """Every key of `settings` is one of `known`: else one line naming the unknown ones and the known."""
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown {what} setting(s) {', '.join(unknown)}; known: {', '.join(known)}")


def at_least(config, minimum: float, *names: str) -> None:
    for name in names:
        if getattr(config, name) < minimum:
            raise UserError(f"{flag(name)} must be >= {minimum:g}, got {getattr(config, name)}")


def positive(config, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise UserError(f"{flag(name)} must be positive, got {getattr(config, name)}")


def one_of(config, name: str, allowed: tuple[str, ...]) -> None:
    if getattr(config, name) not in allowed:
        raise UserError(f"{flag(name)} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                        f"got {getattr(config, name)!r}")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (`micro_batch` -> `--micro-batch`), typed from the annotation. A class with
    `SECTIONS` ({name: section dataclass}, a field each) takes its sections' fields instead, listed in --help under
    each section's name and summary, each flag first by its place in a config file (`--optim.lr`,
    `--lr_schedule.total_steps`: the section and the key as JSON writes them), the short flag (`--lr`) an alias; a
    class with `RENAMED` keeps each old flag as an alias."""
    old_flags = {}
    for old, new in getattr(cls, "RENAMED", {}).items():  # a user's scripts keep working
        old_flags.setdefault(new, []).append(flag(old))
    sections = getattr(cls, "SECTIONS", None)
    if sections is None:
        _add_fields(parser, cls, [], old_flags)
    for name, section in (sections or {}).items():
        group = parser.add_argument_group(name, (section.__doc__ or "").split("\n\n")[0].replace("\n    ", " "))
        _add_fields(group, section, [name], old_flags)


def _add_fields(target, cls: type, section: list[str], old_flags: dict[str, list[str]]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        names = [*(f"--{name}.{f.name}" for name in section), flag(f.name), *old_flags.get(f.name, [])]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if kind is bool:
            target.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
        elif kind == int | str:  # a number, or a word such as auto
            target.add_argument(*names, dest=f.name, type=_int_or_word, default=f.default, help=help_text)
        else:
            target.add_argument(*names, dest=f.name, type=kind, default=f.default, help=help_text)


def _int_or_word(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def parse_dataclass(cls: type, argv: list[str] | None = None, description: str = "", defaults: dict | None = None):
    """Parse `argv` into an instance of `cls` (a class with sections by its `from_dict`); `defaults` (e.g. baked
    into a Kaggle build) override field defaults."""
    parser = argparse.ArgumentParser(description=description)
    add_dataclass_args(parser, cls)
    if defaults:  # under their current names (a build baked before a rename bakes the old ones)
        renamed = getattr(cls, "RENAMED", {})
        parser.set_defaults(**{renamed.get(key, key): value for key, value in defaults.items()})
    ns = parser.parse_args(argv)
    return cls.from_dict(vars(ns)) if hasattr(cls, "SECTIONS") else cls(**vars(ns))
