"""Environment families. ``FAMILIES`` maps a family name to its class; register new ones here."""

from __future__ import annotations

from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, replay

FAMILIES: dict[str, type[Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    FAMILIES[cls.family] = cls
    return cls


def resolve(family: str) -> type[Environment]:
    """The class of ``family``: a registered family, or an adapter family (``rg_<dataset>``,
    ``toytext_*``) registered on first use. Raises ``ValueError`` naming the known families."""
    if family in FAMILIES:
        return FAMILIES[family]
    if family.startswith(("rg_", "toytext_")):
        from apprentice.envs.adapters import ensure

        return ensure(family)
    raise ValueError(f"unknown environment family '{family}'; known: {sorted(FAMILIES)} "
                     "(plus rg_<reasoning-gym dataset> and toytext_frozenlake/toytext_taxi)")


def env_for(spec: ProblemSpec) -> Environment:
    """A fresh environment already reset on ``spec``."""
    cls = resolve(spec.family)
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

__all__ = ["FAMILIES", "DifficultyAxis", "Environment", "ProblemSpec", "ToolCall", "env_for", "register", "replay", "resolve"]
