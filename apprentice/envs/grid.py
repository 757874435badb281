"""``grid``: multi-turn navigation with obstacles and key/door pairs; oracle by breadth-first search.

Why the observations look the way they do: a small model learns a state-dependent action only when
the mapping from observation to action is *local*: given absolute coordinates it stays at chance,
given relative offsets it learns the task. So every observation lists what matters as
offsets in the action words themselves ("goal: 2 right, 1 up") plus which moves are blocked, and
the oracle breaks ties between equally short plans in favour of the move a reader of that line
would pick (toward the nearest key still to fetch, else the goal; larger offset first).

World: an ``n x n`` board. With ``keys = k`` it is cut by k full walls into k + 1 regions, each wall
with one door; key A (in region 0) opens door A, key B (region 0 or 1) opens door B, and the goal
sits in the last region, so every key is needed. Obstacles are sprinkled on top and the whole board
is turned by a random symmetry (walls end up vertical or horizontal, the goal on any side).
A door opens when the agent walks into it holding its key and stays open. The search state is
(position, keys held, doors opened).

Difficulty axes: ``size`` (board side), ``obstacles`` (density step), ``keys`` (0..2 doors), and
``budget_slack`` (extra actions allowed beyond the oracle's; *more is easier*). Every tool call
counts as one action against the budget, including errors.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from apprentice.envs import register
from apprentice.envs._text import clip, words
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool

Pos = tuple[int, int]
State = tuple[Pos, int, int]  # position, bitmask of keys held, bitmask of doors opened

DIRS: dict[str, Pos] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ALIASES = {
    "u": "up", "north": "up", "n": "up",
    "d": "down", "south": "down", "s": "down",
    "l": "left", "west": "left", "w": "left",
    "r": "right", "east": "right", "e": "right",
}
_ACTIONS = ("up", "down", "left", "right", "pick_up")
LETTERS = "AB"

# level -> difficulty vector, easy to hard (levels past the end repeat the last one). The steps are small
# (one axis at a time where possible) so that the frontier controller finds a level the model half solves:
# a longer walk, then a door, then two; the oracle's plan grows with the level (`check-env grid`).
LEVELS: tuple[dict[str, int], ...] = (
    {"size": 4, "obstacles": 0, "keys": 0, "budget_slack": 4},
    {"size": 5, "obstacles": 1, "keys": 0, "budget_slack": 3},
    {"size": 6, "obstacles": 2, "keys": 0, "budget_slack": 3},
    {"size": 7, "obstacles": 3, "keys": 0, "budget_slack": 2},
    {"size": 5, "obstacles": 1, "keys": 1, "budget_slack": 2},
    {"size": 6, "obstacles": 2, "keys": 1, "budget_slack": 2},
    {"size": 6, "obstacles": 2, "keys": 2, "budget_slack": 1},
    {"size": 7, "obstacles": 3, "keys": 2, "budget_slack": 0},
)


@dataclass(frozen=True)
class _Board:
    n: int
    walls: frozenset[Pos]
    start: Pos
    goal: Pos
    keys: tuple[Pos, ...]  # keys[i] opens doors[i]
    doors: tuple[Pos, ...]

    def step(self, s: State, action: str) -> tuple[State, str]:
        """Apply one action; returns the new state and what happened (the one transition function
        shared by the tools and the solver, so the oracle can never disagree with the game)."""
        pos, held, opened = s
        if action == "pick_up":
            for i, k in enumerate(self.keys):
                if k == pos and not held >> i & 1:
                    return (pos, held | 1 << i, opened), f"picked:{i}"
            return s, "nothing"
        dr, dc = DIRS[action]
        nxt = (pos[0] + dr, pos[1] + dc)
        if not (0 <= nxt[0] < self.n and 0 <= nxt[1] < self.n):
            return s, "edge"
        if nxt in self.walls:
            return s, "wall"
        if nxt in self.doors:
            i = self.doors.index(nxt)
            if not opened >> i & 1:
                if not held >> i & 1:
                    return s, f"locked:{i}"
                return (nxt, held, opened | 1 << i), f"opened:{i}"
        return (nxt, held, opened), "moved"


def _symmetry(rng: random.Random, n: int):
    """One of the 8 symmetries of the square, as a function on positions."""
    t, fr, fc = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5

    def f(p: Pos) -> Pos:
        r, c = (p[1], p[0]) if t else p
        return (n - 1 - r if fr else r, n - 1 - c if fc else c)

    return f


def _layout(rng: random.Random, n: int, n_keys: int, obstacles: int) -> _Board | None:
    """One random board in canonical orientation (walls are columns), or None if k walls don't fit."""
    if n_keys and n < 2 * n_keys + 1:
        return None
    if n_keys == 1:
        wall_cols = [rng.randint(1, n - 2)]
    elif n_keys == 2:
        w1 = rng.randint(1, n - 4)
        wall_cols = [w1, rng.randint(w1 + 2, n - 2)]
    else:
        wall_cols = []
    bounds = [-1, *wall_cols, n]
    regions = [[(r, c) for c in range(bounds[j] + 1, bounds[j + 1]) for r in range(n)]
               for j in range(len(bounds) - 1)]
    doors = tuple((rng.randrange(n), wc) for wc in wall_cols)
    walls = {(r, wc) for wc in wall_cols for r in range(n)} - set(doors)
    start = rng.choice(regions[0])
    if n_keys == 0:
        far = [p for p in regions[0] if abs(p[0] - start[0]) + abs(p[1] - start[1]) >= 2]
        goal = rng.choice(far)
    else:
        goal = rng.choice(regions[-1])
    keys: list[Pos] = []
    for i in range(n_keys):
        pool = [p for j in range(i + 1) for p in regions[j] if p != start and p not in keys]
        keys.append(rng.choice(pool))
    fixed = {start, goal, *keys, *doors, *((r, c + dc) for r, c in doors for dc in (-1, 1))}
    free = [p for reg in regions for p in reg if p not in fixed]
    n_obst = round(obstacles * 0.06 * len(free))
    walls |= set(rng.sample(free, min(n_obst, len(free))))
    return _Board(n, frozenset(walls), start, goal, tuple(keys), doors)


def _transform(b: _Board, f) -> _Board:
    return _Board(b.n, frozenset(f(p) for p in sorted(b.walls)), f(b.start), f(b.goal),
                  tuple(f(p) for p in b.keys), tuple(f(p) for p in b.doors))


def _solve(b: _Board) -> list[str]:
    """Shortest action list from the start to the goal (empty if unreachable), ties broken toward
    the move the observation suggests. BFS forward for the reachable graph, backward for distances."""
    start: State = (b.start, 0, 0)
    order, edges = [start], {}
    seen = {start}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        if s[0] == b.goal:
            continue  # terminal: the episode ends on arrival
        out = []
        for a in _ACTIONS:
            t, _ = b.step(s, a)
            if t != s:
                out.append((a, t))
                if t not in seen:
                    seen.add(t)
                    order.append(t)
                    queue.append(t)
        edges[s] = out
    rev: dict[State, list[State]] = {}
    for s in order:
        for _, t in edges.get(s, []):
            rev.setdefault(t, []).append(s)
    dist = {s: 0 for s in order if s[0] == b.goal}
    queue = deque(s for s in order if s[0] == b.goal)
    while queue:
        t = queue.popleft()
        for s in rev.get(t, []):
            if s not in dist:
                dist[s] = dist[t] + 1
                queue.append(s)
    if start not in dist:
        return []
    plan, s = [], start
    while s[0] != b.goal:
        good = {a: t for a, t in edges[s] if dist.get(t) == dist[s] - 1}
        a = next(a for a in _preference(b, s) if a in good)
        plan.append(a)
        s = good[a]
    return plan


def _preference(b: _Board, s: State) -> list[str]:
    pos, held, _ = s
    todo = [k for i, k in enumerate(b.keys) if not held >> i & 1]
    target = min(todo, key=lambda k: abs(k[0] - pos[0]) + abs(k[1] - pos[1])) if todo else b.goal
    dr, dc = target[0] - pos[0], target[1] - pos[1]
    vert = ["down" if dr > 0 else "up"] if dr else []
    horiz = ["right" if dc > 0 else "left"] if dc else []
    toward = vert + horiz if abs(dr) > abs(dc) else horiz + vert
    return ["pick_up", *toward, *(d for d in DIRS if d not in toward)]


def _direction(value: object) -> str | None:
    """'up', ' UP. ', 'u', 'north', 'move up' -> 'up'; None unless exactly one direction is meant."""
    ws = words(value)
    if len(ws) == 1:
        return _ALIASES.get(ws[0], ws[0]) if _ALIASES.get(ws[0], ws[0]) in DIRS else None
    found = {w for w in ws if w in DIRS}
    return found.pop() if len(found) == 1 else None


def _offset(frm: Pos, to: Pos) -> str:
    dr, dc = to[0] - frm[0], to[1] - frm[1]
    parts = []
    if dc:
        parts.append(f"{abs(dc)} {'right' if dc > 0 else 'left'}")
    if dr:
        parts.append(f"{abs(dr)} {'down' if dr > 0 else 'up'}")
    return ", ".join(parts) or "here"


@register
class GridEnv(Environment):
    family: ClassVar[str] = "grid"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("size", 4, 9, "side of the square board"),
        DifficultyAxis("obstacles", 0, 4, "obstacle density step (about 6 % of free cells each)"),
        DifficultyAxis("keys", 0, 2, "locked doors on the way to the goal (needs size >= 2*keys+1)"),
        DifficultyAxis("budget_slack", 0, 6, "extra actions beyond the oracle's (more is easier)"),
    )
    system_prompt: ClassVar[str] = (
        "Reach the goal on a grid: call move with up, down, left or right. Places are relative to you "
        "('goal: 2 right, 1 up'); 'blocked' lists moves into walls. A door opens when you walk into it "
        "holding its key; call pick_up on a key's cell. Each call costs one action."
    )

    def __init__(self) -> None:
        super().__init__()
        self._board: _Board | None = None
        self._state: State = ((0, 0), 0, 0)
        self._plan: list[str] = []
        self._budget = 0

    # ---- generation ---------------------------------------------------------------------------
    @classmethod
    def top_level(cls) -> int:
        return len(LEVELS) - 1

    @classmethod
    def sample_difficulty(cls, rng: random.Random, level: int | None = None) -> dict[str, int]:
        """The level table (easy to hard) for a fixed level; else uniform over boards that fit."""
        if level is not None:
            return dict(LEVELS[min(max(level, 0), len(LEVELS) - 1)])
        size = rng.randint(4, 9)
        return {"size": size, "obstacles": rng.randint(0, 4), "keys": rng.randint(0, min(2, (size - 1) // 2)),
                "budget_slack": rng.randint(0, 6)}

    # ---- episode ------------------------------------------------------------------------------
    def build(self, spec: ProblemSpec) -> str:
        d = {k: int(v) for k, v in spec.difficulty.items()}
        rng = spec.rng()
        board, plan = None, []
        for _ in range(40):  # deterministic in-spec retries: obstacles may cut the board
            board = _layout(rng, d["size"], d["keys"], d["obstacles"])
            if board is None:
                break
            board = _transform(board, _symmetry(rng, board.n))
            plan = _solve(board)
            if 0 < len(plan) <= 4 * board.n:  # long mazes cost thousands of tokens: redraw
                break
            plan = []
        if board is None:  # keys do not fit: an empty board that no plan solves (generate rejects it)
            board = _Board(d["size"], frozenset(), (0, 0), (0, 0), (), ())
        self._board, self._plan = board, plan
        self._state = (board.start, 0, 0)
        self._budget = len(plan) + d["budget_slack"] if plan else max(1, d["budget_slack"])
        return f"Grid {board.n}x{board.n}. Reach the goal within {self._budget} actions. {self._view()}"

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("pick_up", {}) if a == "pick_up" else ToolCall("move", {"direction": a})
                for a in self._plan]

    def turn_budget(self) -> int:
        return self._budget

    # ---- observations -------------------------------------------------------------------------
    def _view(self) -> str:
        b = self._board
        assert b is not None, "reset() first"
        pos, held, opened = self._state
        items = [f"key {LETTERS[i]}: {_offset(pos, k)}" for i, k in enumerate(b.keys) if not held >> i & 1]
        items += [f"door {LETTERS[i]}: {_offset(pos, p)}" for i, p in enumerate(b.doors) if not opened >> i & 1]
        items.append(f"goal: {_offset(pos, b.goal)}")
        blocked = [d for d in DIRS if b.step(self._state, d)[1].partition(":")[0] in ("edge", "wall", "locked")]
        items.append(f"blocked: {', '.join(blocked) or 'none'}")
        return ". ".join(items) + "."

    def _act(self, action: str | None, error: str = "") -> str:
        """Count one action, apply it, and describe the result; the episode ends at the goal or
        when the budget is spent."""
        if self.done or self._board is None:
            return "The episode is over." if self._board is not None else "Error: call reset() first."
        self.turns += 1
        if action is None:
            text = error
        else:
            self._state, event = self._board.step(self._state, action)
            kind, _, idx = event.partition(":")
            if kind == "picked":
                text = f"picked up key {LETTERS[int(idx)]}."
            elif kind == "nothing":
                text = "nothing to pick up here."
            elif kind == "locked":
                text = f"door {LETTERS[int(idx)]} is locked; you did not move."
            elif kind in ("edge", "wall"):
                text = f"{action} is blocked; you did not move."
            elif kind == "opened":
                text = f"opened door {LETTERS[int(idx)]} and moved {action}."
            else:
                text = f"moved {action}."
        if self._state[0] == self._board.goal:
            self.done, self.reward = True, 1.0
            return f"{text} You reached the goal!"
        if self.turns >= self._budget:
            self.done = True
            return f"{text} Out of actions; the episode is over."
        return f"{text} {self._view()}"

    # ---- tools (marked @tool: what the agent may call) ----------------------------------------
    @tool
    def move(self, direction: str) -> str:
        """
        Move one cell on the grid.

        Args:
            direction: One of "up", "down", "left" or "right".

        Returns:
            What happened, then where the keys, doors and goal are relative to you and which moves are blocked.
        """
        d = _direction(direction)
        if d is None:
            return self._act(None, f"Error: unknown direction {clip(direction)}; use up, down, left or right.")
        return self._act(d)

    @tool
    def pick_up(self) -> str:
        """
        Pick up the key on your cell.

        Returns:
            What happened, then where the keys, doors and goal are relative to you and which moves are blocked.
        """
        return self._act("pick_up")
