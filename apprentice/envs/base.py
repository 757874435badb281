"""The one protocol every environment family implements.

Why a base class of our own: TRL's GRPOTrainer ``environment_factory`` contract is duck-typed (a no-arg
constructor, ``reset(**row) -> str``, public tool methods with Google-style docstrings, optional
``get_reward``). We add what TRL does not need but the pipeline does: a frozen, JSON-serialisable
:class:`ProblemSpec` that rebuilds an episode byte-for-byte, a difficulty vector, a privileged oracle,
and a generator that only accepts problems its oracle solves. The same instance serves the rollout
engine, evaluation and GRPO, so an environment is written once.

Rules for subclasses (``python -m apprentice check-env FAMILY`` checks them):
  * class attributes: ``family`` (unique name), ``axes`` (the difficulty vector: named integer ranges),
    ``system_prompt``;
  * **the level contract**: ``generate(seed, level)`` takes its difficulty from ``sample_difficulty``,
    which by default sets *every axis to* ``low + level`` (capped at ``high``); level 0 is the family's
    easiest problem and each level up is no easier. So every axis must be *harder when larger*: an
    axis that is easier when larger (spare turns, the largest allowed step, hints) makes higher levels
    easier; name it the other way round (a budget *cut*: spare turns ``high - cut``) or override
    ``sample_difficulty`` with a level table (``grid`` does). ``check-env`` fails a family whose axis
    documented "more is easier" grows with the level, or whose higher level a reference agent (the
    oracle wasting a quarter of its turns) solves more often (:func:`apprentice.envs.check.monotone_problems`);
  * optionally ``evolution_directions``: ``{"horizon" | "state" | "harness": [(axis, +1 | -1), ...]}``,
    which axes to move (and which way) to make the family harder in each direction
    (:mod:`apprentice.envs.evolve`); required only for families in ``curriculum.evolve.families``;
  * the protocol the pipeline calls (public, so every caller uses it without reaching into privates):
    ``build(spec) -> str`` builds all episode state from the spec and returns the task text;
    ``oracle() -> list[ToolCall]`` the privileged solution from the fresh state; ``turn_budget()`` the
    assistant turns allowed (>= the oracle's length); ``reset``, ``get_reward`` and ``execute(call)``
    come from this class;
  * tools are the methods marked with :func:`tool` (and only those): each has typed arguments and a
    Google-style docstring with an ``Args:`` section (the JSON schema the model sees is built from
    them). Any other public method is a mistake (a forgotten ``@tool``): mark it or make it
    ``_private``; classmethods are class-level API and allowed. Why marked, not "every public method":
    TRL's ``environment_factory`` exposes every public function of the class it gets as a tool, which
    would force the protocol methods to be private yet called from outside; so TRL gets a facade that
    holds the environment and has only ``reset``, ``get_reward`` and the marked tools
    (:func:`trl_environment`);
  * tools return a short observation string and never raise on bad input: bad input is an
    observation starting with ``Error`` (the rollout engine counts those as ``tool_errors``, the data
    gate keeps such episodes out of SFT data), which the agent can recover from;
  * rewards: ``self.reward`` in [0, 1]; an episode counts as solved at exactly 1.0 (``success``).
    Partial credit below 1.0 is allowed (GRPO uses the value, SFT and evaluation only ``success``); set
    ``self.done = True`` when the episode ends (solved or irrecoverably lost);
  * determinism: all randomness comes from ``spec.rng()`` (or seeds derived from ``spec.seed``);
    third-party generators (NumPy, gymnasium, reasoning-gym) get a seed derived from the spec, never
    the global RNG, so the same spec gives the same bytes in every process;
  * ``reset`` rebuilds *all* state: TRL pools and reuses instances;
  * optionally ``ungrounded(call, seen) -> str``: why a call refers to something no earlier
    observation showed (the data gate's "legal given only what was observed" check).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers.utils import get_json_schema


@dataclass(frozen=True)
class ProblemSpec:
    """Everything needed to rebuild one episode exactly. Same spec -> same bytes."""

    family: str
    seed: int
    difficulty: Mapping[str, int]
    generation: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "family": self.family,
                "seed": self.seed,
                "difficulty": dict(sorted(self.difficulty.items())),
                "generation": self.generation,
                "extra": dict(sorted(self.extra.items())),
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> ProblemSpec:
        d = json.loads(text) if isinstance(text, str) else dict(text)
        return cls(
            family=d["family"],
            seed=int(d["seed"]),
            difficulty={k: int(v) for k, v in d["difficulty"].items()},
            generation=int(d.get("generation", 0)),
            extra=dict(d.get("extra", {})),
        )

    @property
    def problem_id(self) -> str:
        """Stable content hash: identical specs share an id across runs and machines."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def rng(self) -> random.Random:
        """The one source of randomness for building this episode."""
        return random.Random(f"{self.family}:{self.seed}:{self.problem_id}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]

    def as_message_call(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an assistant message (OpenAI / HF chat-template shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass(frozen=True)
class DifficultyAxis:
    """One named component of the difficulty vector and its allowed range (inclusive)."""

    name: str
    low: int
    high: int
    doc: str = ""

    def check(self, value: int) -> None:
        if not self.low <= value <= self.high:
            raise ValueError(
                f"difficulty '{self.name}'={value} is outside [{self.low}, {self.high}]; {self.doc}"
            )


#: the attribute :func:`tool` sets on a method
_TOOL_MARK = "__apprentice_tool__"
#: the public instance methods of the protocol (not tools); check-env flags any other public method
#: that is not a tool
PROTOCOL_METHODS = frozenset({"reset", "get_reward", "build", "oracle", "turn_budget", "execute", "ungrounded"})


def tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an environment method as a tool the agent may call (and TRL exposes); returns it unchanged.

    The method needs typed arguments and a Google-style docstring with an ``Args:`` section: its
    JSON schema is built from them (:meth:`Environment.tool_schemas`)."""
    if not inspect.isfunction(fn):
        raise TypeError(f"@tool marks a plain method (def name(self, ...) -> str), not {fn!r}; "
                        "put @tool directly above the def")
    if fn.__name__.startswith("_") or fn.__name__ in PROTOCOL_METHODS:
        raise TypeError(f"@tool on '{fn.__name__}': a tool name must be public and not one of the protocol "
                        f"methods {sorted(PROTOCOL_METHODS)}; rename the method")
    setattr(fn, _TOOL_MARK, True)
    return fn


def is_tool(fn: Any) -> bool:
    """Whether ``fn`` (a function from a class) is marked with :func:`tool`."""
    return inspect.isfunction(fn) and getattr(fn, _TOOL_MARK, False) is True


#: the keys of an OpenAI tool's ``function`` object (anything else is rejected by strict servers)
_OPENAI_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


class Environment:
    """Base class; see the module docstring for the contract."""

    family: ClassVar[str] = ""
    axes: ClassVar[tuple[DifficultyAxis, ...]] = ()
    system_prompt: ClassVar[str] = "You are an agent. Use the tools to solve the problem."

    def __init__(self) -> None:
        self.spec: ProblemSpec | None = None
        self.done: bool = False
        self.reward: float = 0.0
        self.turns: int = 0

    # ---- generation -------------------------------------------------------------------------
    @classmethod
    def sample_difficulty(cls, rng: random.Random, level: int | None = None) -> dict[str, int]:
        """A difficulty vector: uniformly random within the axes, or for a fixed ``level`` in [0, 1, ...]
        every axis at ``low + level`` (capped at ``high``): the level contract (module docstring), which
        needs every axis harder when larger. Override it with a level table when an axis is not."""
        out = {}
        for ax in cls.axes:
            out[ax.name] = rng.randint(ax.low, ax.high) if level is None else min(ax.high, ax.low + level)
        return out

    @classmethod
    def top_level(cls) -> int:
        """The highest level with a difficulty of its own (levels above it repeat it): where every axis
        reaches ``high`` under the default ``low + level`` rule. A family with a level table returns its
        last index. The frontier controller never plans past it (:mod:`apprentice.curriculum.frontier`)."""
        return max((ax.high - ax.low for ax in cls.axes), default=0)

    @classmethod
    def make_spec(cls, seed: int, difficulty: Mapping[str, int], generation: int = 0) -> ProblemSpec:
        names = {ax.name for ax in cls.axes}
        if set(difficulty) != names:
            raise ValueError(
                f"{cls.family}: difficulty keys {sorted(difficulty)} must be exactly {sorted(names)}"
            )
        for ax in cls.axes:
            ax.check(int(difficulty[ax.name]))
        return ProblemSpec(cls.family, seed, dict(difficulty), generation)

    @classmethod
    def generate(cls, seed: int, level: int | None = None, generation: int = 0) -> ProblemSpec:
        """A spec at ``level`` (or a random difficulty) whose oracle earns 1.0 on replay."""
        return cls.generate_from(seed, cls.sample_difficulty(random.Random(seed), level), generation)

    @classmethod
    def generate_from(cls, seed: int, difficulty: Mapping[str, int], generation: int = 0) -> ProblemSpec:
        return generate_solvable(cls, seed, difficulty, generation)

    # ---- episode ----------------------------------------------------------------------------
    def reset(self, **row: Any) -> str:
        """Rebuild the episode from ``row['spec']`` (JSON or ProblemSpec) and return the task text.

        TRL passes the dataset row as keyword arguments; the rollout engine passes ``spec=``.
        """
        spec = row.get("spec")
        if spec is None:
            raise ValueError("reset() needs a 'spec' column holding a ProblemSpec JSON string")
        self.spec = spec if isinstance(spec, ProblemSpec) else ProblemSpec.from_json(spec)
        if self.spec.family != self.family:
            raise ValueError(f"spec family '{self.spec.family}' given to environment '{self.family}'")
        self.done, self.reward, self.turns = False, 0.0, 0
        return self.build(self.spec)

    def get_reward(self) -> float:
        return float(self.reward)

    # ---- to implement (the protocol the pipeline calls) -----------------------------------------
    def build(self, spec: ProblemSpec) -> str:
        """Build all episode state from ``spec``; return the first observation (the task)."""
        raise NotImplementedError

    def oracle(self) -> list[ToolCall]:
        """The optimal tool-call sequence from the freshly reset state (privileged)."""
        raise NotImplementedError

    def turn_budget(self) -> int:
        """Max assistant turns for this episode (from the difficulty vector, >= len(oracle))."""
        raise NotImplementedError

    def ungrounded(self, call: ToolCall, seen: str) -> str:
        """Why ``call`` uses something the agent was never shown ("" when it could have made it).

        ``seen`` is everything the agent had read before the call: the system prompt, the tool
        schemas, the task and every earlier observation. The data gate replays each teacher episode
        through this before every call, so a teacher acting on what only the oracle knows (opening an
        article no result named, using an id no observation gave) is caught even when the action
        itself succeeds. Optional: the default judges nothing; a family whose tools take references
        to things the agent must first discover overrides it (``search``, ``store``, ``shell`` do).
        """
        return ""

    # ---- helpers shared by all families ------------------------------------------------------
    @classmethod
    def tool_names(cls) -> list[str]:
        """The methods marked with :func:`tool`, sorted by name (the order TRL lists them in)."""
        return [n for n, m in inspect.getmembers(cls, predicate=inspect.isfunction) if is_tool(m)]

    def _tools(self) -> dict[str, Callable[..., str]]:
        return {n: getattr(self, n) for n in self.tool_names()}

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """JSON schemas of the tools, built from signatures + docstrings as TRL does, in the strict
        OpenAI function shape: transformers adds a non-standard ``return`` entry for a documented
        ``Returns:`` section, which strict OpenAI-compatible servers reject (HTTP 400), so it is dropped."""
        out = []
        for n in cls.tool_names():
            schema = get_json_schema(getattr(cls, n))
            fn = {k: v for k, v in schema.get("function", {}).items() if k in _OPENAI_FUNCTION_KEYS}
            out.append({"type": "function", "function": fn})
        return out

    def execute(self, call: ToolCall) -> str:
        """Execute one tool call; a wrong name or arguments becomes an error observation."""
        fn = self._tools().get(call.name)
        if fn is None:
            return f"Error: unknown tool '{call.name}'. Available tools: {', '.join(self.tool_names())}."
        try:
            return str(fn(**dict(call.arguments)))
        except TypeError as e:
            return f"Error: bad arguments for {call.name}: {e}"



def replay(env_cls: type[Environment], spec: ProblemSpec, calls: list[ToolCall]) -> float:
    """Reset a fresh environment on ``spec``, run ``calls`` in order, return the reward."""
    env = env_cls()
    env.reset(spec=spec)
    for c in calls:
        if env.done:
            break
        env.execute(c)
    return env.get_reward()


def derive_seed(seed: int, *parts: Any) -> int:
    """A new 63-bit seed from ``seed`` and labels, stable across runs, machines and Python versions."""
    text = ":".join(str(p) for p in (seed, *parts))
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def generate_solvable(env_cls: type[Environment], seed: int, difficulty: Mapping[str, int],
                      generation: int = 0, tries: int = 50) -> ProblemSpec:
    """The first spec from ``seed`` (then seeds derived from it) whose oracle earns reward 1.0 on replay.

    Shared by the families' ``generate`` classmethods: a problem is accepted only if its privileged
    solution provably works *through the public tools*, so a generator bug shows up as a rejected
    seed here (and a RuntimeError if every try fails) instead of as an unsolvable training problem.
    """
    for attempt in range(tries):
        s = seed if attempt == 0 else derive_seed(seed, "retry", attempt)
        spec = env_cls.make_spec(s, difficulty, generation)
        env = env_cls()
        env.reset(spec=spec)
        calls = env.oracle()
        if calls and len(calls) <= env.turn_budget() and replay(env_cls, spec, calls) == 1.0:
            return spec
    raise RuntimeError(
        f"{env_cls.family}: no solvable problem in {tries} seeds derived from {seed} at difficulty "
        f"{dict(difficulty)}; the generator cannot satisfy this difficulty vector, lower one of its axes"
    )


def spec_fields(spec: ProblemSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


_TRL_FACADES: dict[type[Environment], type] = {}


def _forward(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A facade method calling tool ``name`` on the held environment, with ``fn``'s name, docstring and
    signature (``functools.wraps``: TRL's schema builder reads them through ``__wrapped__``)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def acall(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.env, name)(*args, **kwargs)

        return acall

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.env, name)(*args, **kwargs)

    return call


def trl_environment(cls: type[Environment]) -> type:
    """The class to give TRL's ``environment_factory`` for ``cls`` (one per class, cached).

    TRL exposes every public function of the class it gets as a tool. An :class:`Environment` also has
    public protocol methods (``build``, ``oracle``, ``turn_budget``, ``execute``), so TRL gets this
    facade instead: a no-arg constructor holding a fresh ``cls()`` as ``.env``, ``reset(**row)``,
    ``get_reward()``, and one method per :func:`tool` that calls it on ``.env`` (same name, docstring
    and signature, so the same JSON schema). Its ``__name__`` is the environment's, so TRL's reward
    column stays ``rewards/<EnvClass>/mean``; ``.env`` is there for whoever reads an episode's state
    off TRL's instances (``trainer.environments``, reward functions' ``environments``)."""
    if cls in _TRL_FACADES:
        return _TRL_FACADES[cls]

    def __init__(self: Any) -> None:
        self.env = cls()

    def reset(self: Any, **row: Any) -> str:
        return self.env.reset(**row)

    def get_reward(self: Any) -> float:
        return self.env.get_reward()

    ns: dict[str, Any] = {
        "__init__": __init__, "reset": reset, "get_reward": get_reward, "env_class": cls,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": f"TRL's view of {cls.__qualname__}: reset, get_reward and its tools (see trl_environment).",
    }
    for name in cls.tool_names():
        ns[name] = _forward(name, getattr(cls, name))
    facade = type(cls.__name__, (), ns)
    _TRL_FACADES[cls] = facade
    return facade
