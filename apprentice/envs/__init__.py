"""Environment families. ``FAMILIES`` maps a family name to its class; register new ones here."""

from __future__ import annotations

from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, replay

FAMILIES: dict[str, type[Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    FAMILIES[cls.family] = cls
    return cls


def env_for(spec: ProblemSpec) -> Environment:
    """A fresh environment already reset on ``spec``."""
    try:
        cls = FAMILIES[spec.family]
    except KeyError:
        raise ValueError(f"unknown environment family '{spec.family}'; known: {sorted(FAMILIES)}") from None
    env = cls()
    env.reset(spec=spec)
    return env


def _load_builtin() -> None:
    import importlib

    for mod in ("grid", "search", "store", "shell"):
        try:
            importlib.import_module(f"apprentice.envs.{mod}")
        except ModuleNotFoundError as e:  # a family under construction must not break the others
            if e.name != f"apprentice.envs.{mod}":
                raise


_load_builtin()

__all__ = ["FAMILIES", "DifficultyAxis", "Environment", "ProblemSpec", "ToolCall", "env_for", "register", "replay"]
