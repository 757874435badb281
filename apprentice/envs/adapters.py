"""Adapters: outside problem sources behind the same :class:`Environment` protocol.

* **Reasoning Gym** (``reasoning-gym``): any of its ~100 procedural datasets becomes a family
  ``rg_<dataset>``. A single-turn question becomes an episode with one tool, ``submit(answer)``,
  and feedback for a limited number of retries. The difficulty vector is the dataset's own
  *curriculum* levels (``reasoning_gym.create_curriculum``: e.g. basic_arithmetic's ``num_terms``,
  ``num_digits``) plus ``retries`` (fewer is harder: the harness direction). Scoring is the
  dataset's own ``score_answer``; the oracle submits the dataset's reference answer, and a spec is
  accepted only if that answer scores 1.0.
* **Gymnasium toy-text** (``gymnasium``): FrozenLake (deterministic, random maps) and Taxi as
  families ``toytext_frozenlake`` / ``toytext_taxi``: text observations, one ``act(action)`` tool.
  The oracle is a breadth-first search over the environment's own transition table
  (``env.unwrapped.P``), so it is exact for these deterministic versions.

Why adapters and not copies: both libraries are maintained generators with verifiers; the adapter
only maps spec -> (config, seed) and question/answer -> tools. Families are registered on demand
(:func:`register_reasoning_gym`, :func:`register_toytext`, or :func:`ensure` for a family name)
because importing reasoning_gym costs seconds and the built-in families must stay light.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, ClassVar

from apprentice.envs import FAMILIES, register
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool

__all__ = ["ensure", "register_reasoning_gym", "register_toytext"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _level_difficulty(axes: tuple[DifficultyAxis, ...], rng: Any, level: int | None,
                      easier_when_higher: tuple[str, ...]) -> dict[str, int]:
    """Like Environment.sample_difficulty, but axes where more is easier start high and fall with level."""
    out = {}
    for ax in axes:
        if level is None:
            out[ax.name] = rng.randint(ax.low, ax.high)
        elif ax.name in easier_when_higher:
            out[ax.name] = max(ax.low, ax.high - level)
        else:
            out[ax.name] = min(ax.high, ax.low + level)
    return out


# ---- Reasoning Gym ------------------------------------------------------------------------------
class ReasoningGymEnv(Environment):
    """Base of the generated ``rg_<dataset>`` classes (``dataset`` and ``axes`` set per subclass)."""

    dataset: ClassVar[str] = ""
    curriculum_axes: ClassVar[tuple[str, ...]] = ()
    system_prompt: ClassVar[str] = "Solve the problem. Give your final answer with the submit tool."

    def __init__(self) -> None:
        super().__init__()
        self._entry: dict[str, Any] = {}
        self._ds: Any = None
        self._left = 0

    @classmethod
    def sample_difficulty(cls, rng: Any, level: int | None = None) -> dict[str, int]:
        return _level_difficulty(cls.axes, rng, level, ("retries",))

    @classmethod
    def _dataset_for(cls, spec: ProblemSpec) -> Any:
        import reasoning_gym as rg
        from reasoning_gym import factory

        d = {k: int(v) for k, v in spec.difficulty.items()}
        if cls.curriculum_axes:
            cur = factory.create_curriculum(cls.dataset)
            for name in cls.curriculum_axes:
                cur.set_attr_level(name, d[name])
            cfg = cur.generate_configuration({"seed": spec.seed, "size": 1})
            return rg.create_dataset(cls.dataset, **{k: v for k, v in vars(cfg).items()})
        return rg.create_dataset(cls.dataset, seed=spec.seed, size=1)

    def build(self, spec: ProblemSpec) -> str:
        self._ds = self._dataset_for(spec)
        self._entry = self._ds[0]
        self._left = int(spec.difficulty["retries"]) + 1
        return f"{self._entry['question']}\n\nSubmit your final answer with submit(answer). Attempts: {self._left}."

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("submit", {"answer": str(self._entry["answer"])})]

    def turn_budget(self) -> int:
        return int(self.spec.difficulty["retries"]) + 1 if self.spec else 1

    @tool
    def submit(self, answer: str) -> str:
        """Submit your final answer.

        Args:
            answer: The answer, exactly in the format the question asks for.
        """
        if self.done:
            return "Error: the episode is over."
        score = float(self._ds.score_answer(answer=str(answer), entry=self._entry) or 0.0)
        self._left -= 1
        if score >= 1.0:
            self.reward, self.done = 1.0, True
            return "Correct."
        if self._left <= 0:
            self.done = True
            return "Incorrect. No attempts left."
        close = " It is close (partial credit)." if score > 0 else ""
        return f"Incorrect.{close} Attempts left: {self._left}."


def register_reasoning_gym(dataset: str, max_retries: int = 2) -> type[Environment]:
    """Register ``rg_<dataset>`` (idempotent) and return its class."""
    from reasoning_gym import factory

    family = f"rg_{dataset}"
    if FAMILIES.registered(family):  # not ``in FAMILIES``: that resolves, i.e. calls this
        return FAMILIES[family]
    if dataset not in factory.DATASETS:
        raise ValueError(f"reasoning-gym has no dataset '{dataset}'; choose from {sorted(factory.DATASETS)}")
    probe = factory.create_dataset(dataset, seed=0, size=1)[0]
    if probe.get("answer") is None:
        raise ValueError(f"reasoning-gym dataset '{dataset}' carries no reference answer (many answers are "
                         "valid), so the adapter has no oracle for it; pick a dataset with reference answers")
    axes: list[DifficultyAxis] = []
    names: tuple[str, ...] = ()
    if factory.has_curriculum(dataset):
        cur = factory.create_curriculum(dataset)
        for name, attr in cur.attributes.items():
            axes.append(DifficultyAxis(name, 0, len(attr.levels) - 1, attr.description))
        names = tuple(cur.attributes)
    axes.append(DifficultyAxis("retries", 0, max_retries, "extra submissions after a wrong one (more is easier)"))
    cls = type(f"RG_{dataset}", (ReasoningGymEnv,), {"family": family, "dataset": dataset,
                                                       "axes": tuple(axes), "curriculum_axes": names,
                                                       "__module__": __name__})
    return register(cls)


# ---- Gymnasium toy-text -------------------------------------------------------------------------
class ToyTextEnv(Environment):
    """Deterministic gymnasium toy-text episode; subclasses give the gym env, actions and text."""

    actions: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._gym: Any = None
        self._state = 0
        self._plan: list[ToolCall] = []
        self._budget = 0

    @classmethod
    def sample_difficulty(cls, rng: Any, level: int | None = None) -> dict[str, int]:
        return _level_difficulty(cls.axes, rng, level, ("budget_slack",))

    def _make(self, spec: ProblemSpec) -> Any:
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    def build(self, spec: ProblemSpec) -> str:
        self._gym = self._make(spec)
        self._state, _ = self._gym.reset(seed=spec.seed)
        self._plan = self._bfs()
        self._budget = len(self._plan) + int(spec.difficulty["budget_slack"])
        return f"{self._goal_text()}\n{self._describe()}"

    def _goal_text(self) -> str:
        return ""

    def _bfs(self) -> list[ToolCall]:
        """Shortest action sequence to a terminating transition with positive reward (empty if none)."""
        P = self._gym.unwrapped.P
        start = int(self._state)
        prev: dict[int, tuple[int, int] | None] = {start: None}
        q = deque([start])
        while q:
            s = q.popleft()
            for a, outcomes in P[s].items():
                _, nxt, r, term = outcomes[0]
                if term and r > 0:
                    path = [a]
                    while prev[s] is not None:
                        s, a0 = prev[s]  # type: ignore[misc]
                        path.append(a0)
                    return [ToolCall("act", {"action": self.actions[x]}) for x in reversed(path)]
                if not term and nxt not in prev:
                    prev[nxt] = (s, a)
                    q.append(nxt)
        return []

    def oracle(self) -> list[ToolCall]:
        return list(self._plan)

    def turn_budget(self) -> int:
        return self._budget

    def _step(self, action: Any) -> str:
        if self.done:
            return "Error: the episode is over."
        name = str(action).strip().lower()
        if name not in self.actions:
            self.turns += 1
            return f"Error: unknown action '{action}'; use one of {', '.join(self.actions)}."
        self._state, r, term, trunc, _ = self._gym.step(self.actions.index(name))
        self.turns += 1
        if term:
            self.done = True
            self.reward = 1.0 if r > 0 else 0.0
            return "You reached the goal!" if r > 0 else f"The episode ended.\n{self._describe()}"
        if self.turns >= self._budget:
            self.done = True
            return f"Out of actions.\n{self._describe()}"
        return self._describe()


class FrozenLakeEnv(ToyTextEnv):
    """FrozenLake (not slippery) on a random map; reach G without stepping into a hole H."""

    family: ClassVar[str] = "toytext_frozenlake"
    actions: ClassVar[tuple[str, ...]] = ("left", "down", "right", "up")
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("size", 4, 8, "side of the lake"),
        DifficultyAxis("holes", 0, 3, "hole density step (frozen probability 0.9 - 0.05 * holes)"),
        DifficultyAxis("budget_slack", 0, 4, "extra actions beyond the shortest path (more is easier)"),
    )
    system_prompt: ClassVar[str] = "Walk across the frozen lake to the goal G without falling into a hole H."

    def _make(self, spec: ProblemSpec) -> Any:
        import gymnasium as gym
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        d = spec.difficulty
        desc = generate_random_map(size=int(d["size"]), p=0.9 - 0.05 * int(d["holes"]), seed=spec.seed)
        return gym.make("FrozenLake-v1", desc=desc, is_slippery=False)

    def _goal_text(self) -> str:
        return "Reach G. Each act(action) moves you one cell; stepping on H ends the episode."

    def _describe(self) -> str:
        desc = [[c.decode() for c in row] for row in self._gym.unwrapped.desc]
        n = len(desc[0])
        r, c = divmod(int(self._state), n)
        desc[r][c] = "A"
        return "\n".join("".join(row) for row in desc) + f"\nYou (A) are at row {r}, column {c}."

    @tool
    def act(self, action: str) -> str:
        """Move one cell.

        Args:
            action: One of "left", "down", "right", "up".
        """
        return self._step(action)


class TaxiEnv(ToyTextEnv):
    """Taxi: drive to the passenger, pick up, drive to the destination, drop off."""

    family: ClassVar[str] = "toytext_taxi"
    actions: ClassVar[tuple[str, ...]] = ("south", "north", "east", "west", "pickup", "dropoff")
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("budget_slack", 0, 6, "extra actions beyond the shortest plan (more is easier)"),
    )
    system_prompt: ClassVar[str] = "Drive the taxi: pick up the passenger and drop them at the destination."
    _LOCS = "RGYB"

    def _make(self, spec: ProblemSpec) -> Any:
        import gymnasium as gym

        return gym.make("Taxi-v4")

    def _goal_text(self) -> str:
        return ("Pick up the passenger and drop them off at the destination (R, G, Y, B are the stands; "
                "'|' is a wall, row 0 is the top).")

    def _describe(self) -> str:
        row, col, pas, dest = self._gym.unwrapped.decode(int(self._state))
        where = "in the taxi" if pas == 4 else f"at {self._LOCS[pas]}"
        grid = _ANSI.sub("", "\n".join(b"".join(r).decode() for r in self._gym.unwrapped.desc))
        return f"{grid}\nTaxi at row {row}, column {col}. Passenger {where}. Destination {self._LOCS[dest]}."

    @tool
    def act(self, action: str) -> str:
        """Drive or handle the passenger.

        Args:
            action: One of "south", "north", "east", "west", "pickup", "dropoff".
        """
        return self._step(action)


def register_toytext() -> list[type[Environment]]:
    return [register(c) for c in (FrozenLakeEnv, TaxiEnv) if not FAMILIES.registered(c.family)]


def ensure(family: str) -> type[Environment]:
    """The class of ``family``, registering an adapter family (``rg_*``, ``toytext_*``) on first use."""
    if FAMILIES.registered(family):  # not ``in FAMILIES``: that resolves, which calls this
        return FAMILIES[family]
    if family.startswith("toytext_"):
        register_toytext()
    elif family.startswith("rg_"):
        register_reasoning_gym(family[3:])
    if not FAMILIES.registered(family):
        from apprentice.envs import UnknownFamily

        raise UnknownFamily(f"unknown environment family '{family}'; known: {sorted(FAMILIES)}")
    return FAMILIES[family]
