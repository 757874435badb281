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

What a family must provide is in :mod:`apprentice.envs.base` (the protocol) and docs/environments.md,
"Adding an environment"; ``python -m apprentice check-env FAMILY`` checks it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

from apprentice.envs.base import (
    DifficultyAxis,
    Environment,
    ProblemSpec,
    ToolCall,
    replay,
    tool,
    trl_environment,
)


class UnknownFamily(KeyError, ValueError):
    """A family name no registration path knows (a ``KeyError`` for dict users, a ``ValueError`` for
    the config validators); its message names the known families and the fix."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class _Registry(dict[str, type[Environment]]):
    """``FAMILIES``: a dict whose lookups of an unknown name go through :func:`resolve` (adapters on
    first use, then installed entry points), so ``FAMILIES[name]``, ``name in FAMILIES`` and
    ``FAMILIES.get(name)`` see a plugin family wherever a family name is resolved (the rollout engine,
    the benchmark, evaluation, evolution, the gates) and not only where ``synth.families`` was read."""

    def registered(self, family: str) -> bool:
        """Whether ``family`` is registered already (the plain dict lookup: no loading, no recursion)."""
        return dict.__contains__(self, family)

    def __missing__(self, family: str) -> type[Environment]:
        return resolve(family)

    def __contains__(self, family: object) -> bool:
        if self.registered(family):  # type: ignore[arg-type]
            return True
        if not isinstance(family, str):
            return False
        try:
            resolve(family)
        except (ValueError, ImportError):  # UnknownFamily, or an adapter name its library does not have
            return False
        return self.registered(family)

    def get(self, family: str, default: Any = None) -> Any:
        return self[family] if family in self else default  # noqa: SIM401 - dict.get would skip __missing__


FAMILIES = _Registry()


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
#: entry points that failed to import, already reported (a broken unrelated plugin warns once)
_loaded_entry_points: set[str] = set()


def load_modules(modules: Iterable[str]) -> None:
    """Import the plugin modules ``modules`` (``envs.modules`` in params): each registers its families."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"environment module '{name}' (envs.modules) cannot be imported: {e}; "
                             "install it or put its folder on PYTHONPATH") from None


def load_entry_points(family: str | None = None) -> list[str]:
    """Register the families installed packages declare in the ``apprentice.envs`` entry-point group
    that are not registered; return the names of the entry points loaded. Scanning the installed
    distributions takes milliseconds and importing a loaded module is free, so this runs on every
    lookup of an unknown family (a package installed, or put on ``sys.path``, after the first lookup is
    still found). An entry point that cannot be imported raises when it is the one asked for
    (``family``), and is otherwise skipped with a warning, so one broken plugin cannot hide the others."""
    import logging
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != family and FAMILIES.registered(ep.name):
            continue
        try:
            obj = ep.load()  # a module registers itself on import; a class is registered here
        except ImportError as e:
            msg = (f"entry point '{ep.name} = {ep.value}' ({ENTRY_POINT_GROUP}) cannot be imported: {e}; "
                   "reinstall its package or uninstall it")
            if ep.name == family:
                raise ImportError(msg) from None
            if ep.value not in _loaded_entry_points:
                _loaded_entry_points.add(ep.value)
                logging.getLogger(__name__).warning(msg)
            continue
        if inspect.isclass(obj) and issubclass(obj, Environment) and not FAMILIES.registered(obj.family):
            register(obj)
        names.append(ep.name)
    return names


def source_of(family: str) -> dict[str, str]:
    """Where family ``family``'s code comes from, for fingerprints and DVC deps: ``{}`` for a built-in
    or adapter family (the project's own code digest covers those), else ``{"module", "path",
    "version", "source"}``: the top-level package (or module file) holding its class, the installed
    distribution's name and version (``""`` for a module on ``PYTHONPATH``) and a SHA-256 of every
    ``.py`` file under that path, so editing a plugin changes every fingerprint that includes it."""
    cls = resolve(family)
    top = cls.__module__.split(".")[0]
    if top == "apprentice":
        return {}
    try:
        return dict(_plugin_source(top))
    except (ImportError, TypeError, OSError):  # a class defined in __main__ or a notebook: its own source
        try:
            text = inspect.getsource(cls)
        except (TypeError, OSError):
            text = ""
        import hashlib

        return {"module": cls.__module__, "path": "", "version": "", "metadata": "",
                "source": hashlib.sha256(text.encode()).hexdigest()[:16]}


def plugin_sources(families: Iterable[str]) -> dict[str, dict[str, str]]:
    """``{family: {module, version, source}}`` of every plugin family among ``families``, for the
    stages' fingerprints (built-in and adapter families are covered by the project's code digest and
    library versions, so they are left out and a fingerprint without plugins is unchanged)."""
    out = {}
    for fam in sorted({str(f) for f in families}):
        src = source_of(fam)
        if src:
            out[fam] = {"module": src["module"], "version": src["version"], "source": src["source"]}
    return out


def _plugin_source(top: str) -> tuple[tuple[str, str], ...]:
    import hashlib
    import importlib.metadata as md
    from pathlib import Path

    mod = importlib.import_module(top)
    if getattr(mod, "__file__", None) is None and getattr(mod, "__path__", None):  # a namespace package
        path = Path(next(iter(mod.__path__)))
    else:
        origin = Path(inspect.getsourcefile(mod) or mod.__file__ or "")
        if not origin.is_file():
            raise OSError(f"no source file for {top}")
        path = origin.parent if origin.name == "__init__.py" else origin
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(path.parent).as_posix().encode())
        h.update(f.read_bytes())
    dists = md.packages_distributions().get(top) or []
    version, meta = "", ""
    if dists:
        dist = md.distribution(dists[0])
        version = f"{dists[0]}=={dist.version}"
        located = getattr(dist, "_path", None)  # the .dist-info folder (PathDistribution), if on disk
        meta = str(Path(located) / "METADATA") if located and (Path(located) / "METADATA").is_file() else ""
    return (("module", top), ("path", str(path)), ("version", version), ("metadata", meta),
            ("source", h.hexdigest()[:16]))


def resolve(family: str) -> type[Environment]:
    """The class of ``family``: a registered family, an adapter family (``rg_<dataset>``,
    ``toytext_*``) registered on first use, or one an installed package declares in the
    ``apprentice.envs`` entry-point group. Raises ``ValueError`` naming the known families and the fix."""
    if FAMILIES.registered(family):
        return FAMILIES[family]
    if family.startswith(("rg_", "toytext_")):
        from apprentice.envs.adapters import ensure

        return ensure(family)
    load_entry_points(family)
    if FAMILIES.registered(family):
        return FAMILIES[family]
    raise UnknownFamily(f"unknown environment family '{family}'; known: {sorted(FAMILIES)} (plus "
                     "rg_<reasoning-gym dataset>, toytext_frozenlake, toytext_taxi). A family of your own: list "
                     f"its module in params.yaml envs.modules, or declare an '{ENTRY_POINT_GROUP}' entry point "
                     "in its package (docs/environments.md: Adding an environment)")


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

__all__ = ["FAMILIES", "DifficultyAxis", "UnknownFamily", "plugin_sources", "source_of", "Environment", "ProblemSpec", "ToolCall", "env_for", "load_entry_points", "load_modules",
           "register", "replay", "resolve", "tool", "trl_environment"]
