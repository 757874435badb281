"""Environment families. ``FAMILIES`` maps a family name to its class.

A family gets into ``FAMILIES`` in one of four ways, none of which needs an edit to this package:

* built in (``grid``, ``search``, ``store``, ``shell``): every public module of this package that is
  not protocol or tooling (:data:`NOT_FAMILIES`) is imported below, so a new family is one file;
* adapters, registered on first use by name: ``rg_<reasoning-gym dataset>``, ``toytext_frozenlake``,
  ``toytext_taxi`` (:mod:`apprentice.envs.adapters`);
* modules listed in ``params.yaml`` under ``envs.modules`` (imported when the config loads, so DVC's
  and Prefect's subprocesses see them too); the module calls :func:`register` on its class;
* installed packages declaring an entry point in the group ``apprentice.envs`` (``name = "pkg.mod:Class"``
  or ``"pkg.mod"``), loaded the first time an unknown family is asked for (:func:`resolve`).

What a family must provide is in :mod:`apprentice.envs.base` (the protocol) and the README section
"Adding an environment"; ``python -m apprentice check-env FAMILY`` checks it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

from apprentice.envs.base import (
    DifficultyAxis,
    Environment,
    ProblemSpec,
    ToolCall,
    replay,
    tool,
    trl_environment,
)

FAMILIES: dict[str, type[Environment]] = {}


#: The protocol's names before tools were marked explicitly (a family written then defines these).
_OLD_PROTOCOL = {"_build": "build", "_oracle": "oracle", "_turn_budget": "turn_budget", "_execute": "execute"}


def register(cls: type[Environment]) -> type[Environment]:
    """Add ``cls`` to :data:`FAMILIES`. A family without a ``@tool`` is refused here: it would register
    fine and then fail every episode with "unknown tool" (the usual cause: a family written before tools
    were marked, whose tools are plain public methods and whose protocol is underscored)."""
    old = [f"{o} -> {n}" for o, n in _OLD_PROTOCOL.items() if o in vars(cls)]
    if old or not cls.tool_names():
        fix = f"rename {', '.join(old)}; " if old else ""
        raise TypeError(f"environment family '{cls.family}' ({cls.__module__}.{cls.__qualname__}) has no tools: "
                        f"{fix}mark each method the agent may call with @tool (from apprentice.envs import tool); "
                        f"`python -m apprentice check-env {cls.family}` lists what else is missing")
    FAMILIES[cls.family] = cls
    return cls


ENTRY_POINT_GROUP = "apprentice.envs"
_entry_points_loaded = False


def load_modules(modules: Iterable[str]) -> None:
    """Import the plugin modules ``modules`` (``envs.modules`` in params): each registers its families."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"environment module '{name}' (envs.modules) cannot be imported: {e}; "
                             "install it or put its folder on PYTHONPATH") from None


def load_entry_points() -> list[str]:
    """Register the families installed packages declare in the ``apprentice.envs`` entry-point group
    (once per process); return the names of the entry points loaded."""
    global _entry_points_loaded
    from importlib.metadata import entry_points

    if _entry_points_loaded:
        return []
    _entry_points_loaded = True
    names = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()  # a module registers itself on import; a class is registered here
        if inspect.isclass(obj) and issubclass(obj, Environment) and obj.family not in FAMILIES:
            register(obj)
        names.append(ep.name)
    return names


def resolve(family: str) -> type[Environment]:
    """The class of ``family``: a registered family, an adapter family (``rg_<dataset>``,
    ``toytext_*``) registered on first use, or one an installed package declares in the
    ``apprentice.envs`` entry-point group. Raises ``ValueError`` naming the known families and the fix."""
    if family in FAMILIES:
        return FAMILIES[family]
    if family.startswith(("rg_", "toytext_")):
        from apprentice.envs.adapters import ensure

        return ensure(family)
    load_entry_points()
    if family in FAMILIES:
        return FAMILIES[family]
    raise ValueError(f"unknown environment family '{family}'; known: {sorted(FAMILIES)} (plus "
                     "rg_<reasoning-gym dataset>, toytext_frozenlake, toytext_taxi). A family of your own: list "
                     f"its module in params.yaml envs.modules, or declare an '{ENTRY_POINT_GROUP}' entry point "
                     "in its package (README: Adding an environment)")


def env_for(spec: ProblemSpec) -> Environment:
    """A fresh environment already reset on ``spec``."""
    cls = resolve(spec.family)
    env = cls()
    env.reset(spec=spec)
    return env


#: Modules of this package that hold the protocol and tooling, not families. Every other module
#: (not ``_private``) is a built-in family and is imported here: adding one is adding its file.
NOT_FAMILIES = frozenset({"adapters", "base", "check", "evolve"})


def builtin_modules() -> list[str]:
    """The built-in family modules: every public module of this package but :data:`NOT_FAMILIES`."""
    import pkgutil

    return [m.name for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_") and m.name not in NOT_FAMILIES and not m.ispkg]


def _load_builtin() -> None:
    for mod in builtin_modules():
        try:
            importlib.import_module(f"apprentice.envs.{mod}")
        except ModuleNotFoundError as e:  # a family under construction must not break the others
            if e.name != f"apprentice.envs.{mod}":
                raise


_load_builtin()

__all__ = ["FAMILIES", "DifficultyAxis", "Environment", "ProblemSpec", "ToolCall", "env_for", "load_entry_points", "load_modules",
           "register", "replay", "resolve", "tool", "trl_environment"]
