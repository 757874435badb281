"""What the agent could know at each step of an episode: the secrets of a problem and when they
became observable.

Why not a length threshold or a list of tools: a hidden value is hidden whatever its type (an
integer id, a two-letter code, a name, a route), and a call may leak it through any argument of any
tool. A value is *secret* when the environment holds it back: it is a value of the oracle's plan
(integers, ids and strings alike, split into tokens) that the system prompt, tool schemas and task
do not show, but that an observation along the oracle's own path does show (an id a look-up returns,
a title a search lists, a name an article gives, a count a command prints). A plan value that no
observation ever shows (the answer of a self-contained puzzle) is not held back: the agent is meant
to derive it, so it is no secret. The oracle is replayed in a fresh environment only when some token
of the transcript is a candidate secret used before the transcript showed it, so an honest episode
costs one set lookup per token.

Derived values are not secrets: a number the agent writes as the result of arithmetic on numbers it
had seen (``-5 * 9 = -45``) counts as seen from then on.

A route is a secret as a sequence: each move word is in the system prompt, but three or more moves
of the oracle's plan in order, stated before they were made, are privileged unless the latest
observation's counts for one target explain them (``goal: 2 right, 1 up`` explains ``right, right, up``).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(r"[^\W_]+")
_NUMBER = r"-?\d+(?:\.\d+)?"
#: an arithmetic line: an expression of numbers and operators, "=", a number
_ARITH = re.compile(rf"((?:[-+*/×÷x()\s]|\d|\.)+?)\s*=\s*({_NUMBER})")
_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
                                               ast.Mod: operator.mod}
#: a move sequence shorter than this is not judged (two moves are a guess an honest agent makes)
MIN_ROUTE = 3


def tokens(text: Any) -> list[str]:
    """Case-folded alphanumeric tokens of ``text`` (numbers lose their sign: ``-45`` -> ``45``)."""
    return _TOKEN.findall(str(text).casefold())


def _values(value: Any) -> list[Any]:
    """Every scalar nested in an argument value (dict values, list items)."""
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _values(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _values(v)]
    if value is None or isinstance(value, bool):
        return []
    return [value]


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ValueError("not arithmetic")


def derived_numbers(text: str, known: set[str]) -> set[str]:
    """Number tokens ``text`` derives by arithmetic on ``known`` number tokens (``-5 * 9 = -45``
    gives ``45`` when 5 and 9 are known); each derived number is known for the next line."""
    out: set[str] = set()
    for line in re.split(r"[\n;,]", text):
        for m in _ARITH.finditer(line):
            expr = m.group(1).replace("×", "*").replace("÷", "/").strip()
            expr = re.sub(r"(?<=\d)\s*x\s*(?=[-\d(])", "*", expr)
            operands = re.findall(r"\d+(?:\.\d+)?", expr)
            if not operands or not re.search(r"\d\s*[-+*/]\s*[-\d(]", expr):
                continue
            if not all(set(tokens(o)) <= known | out for o in operands):
                continue
            try:
                value = _eval(ast.parse(expr, mode="eval"))
                claimed = float(m.group(2))
            except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
                continue
            if abs(value - claimed) <= 1e-9 * max(1.0, abs(claimed)):
                out.update(tokens(m.group(2)))
    return out


@dataclass
class Knowledge:
    """What the agent had seen by a point of the episode, and the problem's secrets.

    ``candidates`` are the tokens of the oracle's plan that the opening messages do not show;
    :meth:`secret` confirms one (the oracle's own observations show it) by replaying the plan once,
    through ``observe_plan``, the first time a candidate is used before it was seen."""

    opening: str
    plan: Sequence[tuple[str, Mapping[str, Any]]]
    observe_plan: Callable[[], str]
    seen: set[str] = field(default_factory=set)
    latest: str = ""
    _observable: set[str] | None = None

    def __post_init__(self) -> None:
        self.seen = set(tokens(self.opening))
        self.latest = self.opening
        self.candidates = {t for _, args in self.plan for v in _values(dict(args)) for t in tokens(v)} - self.seen
        self.phrases = [v for v in dict.fromkeys(" ".join(tokens(v)) for _, args in self.plan
                                                 for v in _values(dict(args))) if v]

    def show(self, text: str) -> None:
        """An observation (or format feedback) the agent read."""
        self.seen.update(tokens(text))
        self.latest = text

    def derive(self, text: str) -> None:
        """Numbers the agent derived by arithmetic in its own text become known."""
        self.seen |= derived_numbers(text, self.seen)

    def secret(self, token: str) -> bool:
        """Whether ``token`` is hidden from the agent now: a plan value the environment shows only along
        the way (not in the opening, not seen yet, not derived)."""
        if token not in self.candidates or token in self.seen:
            return False
        if self._observable is None:
            try:
                self._observable = set(tokens(self.observe_plan()))
            except Exception:  # noqa: BLE001 - a plan that does not replay hides nothing we can name
                self._observable = set()
        return token in self._observable

    def unseen_in(self, value: Any) -> list[str]:
        """The secret tokens of a call argument (any type, nested) that were not observable yet."""
        return [t for v in _values(value) for t in tokens(v) if self.secret(t)]

    def stated(self, text: str) -> str:
        """A whole plan value that ``text`` states while it is still secret ("" = none)."""
        words = tokens(text)
        if not words:
            return ""
        joined = f" {' '.join(words)} "
        for phrase in self.phrases:
            parts = phrase.split()
            if any(self.secret(p) for p in parts) and f" {phrase} " in joined:
                return phrase
        return ""

    def route(self, text: str) -> str:
        """A run of the plan's moves (:data:`MIN_ROUTE` or more, in order) that ``text`` states and that
        the latest observation's counts do not explain ("" = none)."""
        for tool, seq in _sequences(self.plan, self.seen | set(tokens(self.opening))).items():
            vocab = set(seq)
            said = [w for w in tokens(text) if w in vocab]
            if len(said) < MIN_ROUTE:
                continue
            targets = _stated_counts(self.latest)
            for n in range(len(seq), MIN_ROUTE - 1, -1):
                for start in range(len(seq) - n + 1):
                    window = seq[start:start + n]
                    if _contains(said, window) and not any(all(window.count(v) <= c.get(v, 0) for v in set(window))
                                                           for c in targets):
                        return f"{tool} route {', '.join(window)}"
        return ""


def _sequences(plan: Sequence[tuple[str, Mapping[str, Any]]], shown: set[str]) -> dict[str, list[str]]:
    """Per tool whose plan calls each take one argument from a shown vocabulary (a direction): the
    plan's values of that tool, in order."""
    out: dict[str, list[str]] = {}
    bad: set[str] = set()
    for name, args in plan:
        vals = _values(dict(args))
        toks = tokens(vals[0]) if len(vals) == 1 else []
        if len(toks) != 1 or toks[0] not in shown:
            bad.add(name)
            continue
        out.setdefault(name, []).append(toks[0])
    return {k: v for k, v in out.items() if k not in bad and len(v) >= MIN_ROUTE}


def _stated_counts(text: str) -> list[dict[str, int]]:
    """The counts each sentence of an observation states ("key B: 2 left, 3 down." -> left 2, down 3):
    a route is explained by one target's offsets, not by the largest count of each word over all targets
    (which would explain a walk to the key, through both doors and on to the goal)."""
    out = []
    for sentence in re.split(r"[.;\n]", text.casefold()):
        counts: dict[str, int] = {}
        for k, word in re.findall(r"(\d+)\s+([^\W\d_]+)", sentence):
            counts[word] = max(counts.get(word, 0), int(k))
        if counts:
            out.append(counts)
    return out


def _contains(seq: Sequence[str], window: Sequence[str]) -> bool:
    n = len(window)
    return any(list(seq[i:i + n]) == list(window) for i in range(len(seq) - n + 1))


def plan_calls(plan: Iterable[Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, arguments) of an oracle plan's :class:`~apprentice.envs.base.ToolCall` items."""
    return [(str(c.name), dict(c.arguments)) for c in plan]
