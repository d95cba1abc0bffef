"""The engine flags (vLLM names) of every command that builds an engine: run, worker, bench and sweep.

They are derived from EngineConfig's fields (their `_flag` metadata), so the dataclass is the one list
of engine settings. Unset flags stay None so EngineConfig's defaults (per device) apply."""

from __future__ import annotations

import typing
from dataclasses import fields

import click

from engine.config import EngineConfig


def _flagged() -> list:
    return [f for f in fields(EngineConfig) if "help" in f.metadata]


ENGINE_FIELDS = tuple(f.name for f in _flagged())


def flag_name(name: str) -> str:
    """The command-line flag of an EngineConfig field."""
    meta = next(f.metadata for f in _flagged() if f.name == name)
    return meta.get("flag", "--" + name.replace("_", "-"))


def _option(f, hints: dict):
    meta, flag = f.metadata, flag_name(f.name)
    kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
    if kind is bool:  # on by default: --x/--no-x; off by default: a plain switch
        decl = f"{flag}/--no-{flag[2:]}" if f.default else flag
        return click.option(decl, f.name, is_flag=True if not f.default else None, default=None,
                            help=meta["help"])
    click_type = click.Choice(list(meta["choices"])) if "choices" in meta else kind
    return click.option(flag, f.name, type=click_type, default=None, help=meta["help"])


def engine_options(f):
    """Decorate a click command with every engine flag."""
    hints = typing.get_type_hints(EngineConfig)
    for field_ in reversed(_flagged()):
        f = _option(field_, hints)(f)
    return f


def given_engine_flags(opts: dict) -> dict:
    """The engine fields a command line set (unset flags are None)."""
    return {k: opts[k] for k in ENGINE_FIELDS if opts.get(k) is not None}


def engine_config(opts: dict, **base) -> EngineConfig:
    """An EngineConfig from `base` (e.g. a job's recorded config) overridden by the engine flags given;
    a bad value is a usage error naming the flag."""
    try:
        return EngineConfig(**{**base, **given_engine_flags(opts)})
    except (TypeError, ValueError) as exc:
        raise click.UsageError(f"engine flags: {exc}") from None
