"""``search``: multi-hop question answering over a procedurally generated fictional encyclopedia.

PhantomEnvironments-style: a rule-only world of invented people, organisations,
cities and countries, rendered as one short templated article per entity. Nothing in it exists in
any pretraining corpus, so the only way to the answer is through the tools, and the world costs
nothing to regenerate from the spec.

An episode asks for the end of a relation chain that starts at a person *described*, not named:
"What is the home city of the mentor of the painter from Quellport?". The optimal plan is to
``search`` the description (the one person matching both words ranks first), ``open`` that article,
``open`` each next name the article gives ("Mentor: Amira Velt"), and ``answer`` with the last one.
Articles are one line of "Field: value" sentences whose field names repeat the question's wording,
so each hop is a copy a 135M model can learn.

Difficulty axes: ``hops`` (relations to follow, 1-4), ``corpus`` (world size step), ``distractors``
(people sharing the profession or the home city of the start person, who crowd the search results),
``budget_slack`` (extra actions beyond the oracle's; *more is easier*). Every tool call counts as
one action against the budget, including errors.

Why hand-written: no maintained offline library generates such worlds (the Search-R1-style
question-answering datasets need downloads); the generator is ~100 lines of seeded sampling.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from apprentice.envs import register
from apprentice.envs._text import clip, norm, words
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool

PROFESSIONS = ("painter", "baker", "sailor", "scholar", "healer", "smith", "weaver", "miner", "poet",
               "judge", "farmer", "scribe")
ORG_KINDS = ("guild", "company", "order", "academy", "bank", "society")
# relation -> (phrase in questions, field label in articles)
RELATIONS: dict[str, tuple[str, str]] = {
    "home": ("home city", "Home city"),
    "mentor": ("mentor", "Mentor"),
    "employer": ("employer", "Employer"),
    "hq": ("headquarters", "Headquarters"),
    "founder": ("founder", "Founder"),
    "country": ("country", "Country"),
    "capital": ("capital", "Capital"),
}
KIND_RELATIONS = {"person": ("home", "mentor", "employer"), "org": ("hq", "founder"),
                  "city": ("country",), "country": ("capital",)}
STOPWORDS = frozenset(["a", "an", "and", "the", "of", "from", "is", "in", "what", "who", "which", "whose", "to", "for", "on", "at", "by", "with"])
PERSONS_BY_CORPUS = (5, 8, 12, 18, 26)
TOP_K = 3

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr",
           "st", "th", "tr", "sh", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "k", "m")
_RESERVED = frozenset(PROFESSIONS) | frozenset(ORG_KINDS) | STOPWORDS | {
    w for phrase, _ in RELATIONS.values() for w in phrase.split()} | {"city", "country", "person"}

# level -> difficulty vector, easy to hard: one axis step at a time (a hop, then a bigger and more crowded
# world, then a tighter budget), so that some level is always near the frontier of a learning model.
LEVELS: tuple[dict[str, int], ...] = (
    {"hops": 1, "corpus": 0, "distractors": 0, "budget_slack": 2},
    {"hops": 1, "corpus": 1, "distractors": 1, "budget_slack": 2},
    {"hops": 2, "corpus": 1, "distractors": 1, "budget_slack": 2},
    {"hops": 2, "corpus": 2, "distractors": 2, "budget_slack": 1},
    {"hops": 3, "corpus": 2, "distractors": 2, "budget_slack": 1},
    {"hops": 3, "corpus": 3, "distractors": 3, "budget_slack": 1},
    {"hops": 4, "corpus": 3, "distractors": 3, "budget_slack": 0},
    {"hops": 4, "corpus": 4, "distractors": 4, "budget_slack": 0},
)


@dataclass
class _Entity:
    title: str
    kind: str  # person | org | city | country
    desc: str = ""  # profession or organisation kind
    rel: dict[str, str] = field(default_factory=dict)  # relation -> title

    def article(self) -> str:
        what = {"person": self.desc, "org": self.desc, "city": "city", "country": "country"}[self.kind]
        art = "an" if what[0] in "aeiou" else "a"
        facts = " ".join(f"{RELATIONS[r][1]}: {self.rel[r]}." for r in KIND_RELATIONS[self.kind])
        return f"{self.title} is {art} {what}. {facts}"


class _Names:
    """Unique invented words; no word is shared between two names, so keyword search is unambiguous."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set(_RESERVED)

    def word(self, suffix: str = "") -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(2))
            w = (w + (suffix or self.rng.choice(_CODAS))).capitalize()
            if w.lower() not in self.used:
                self.used.add(w.lower())
                return w


def _world(rng: random.Random, corpus: int, distractors: int) -> list[_Entity]:
    names = _Names(rng)
    n_p = PERSONS_BY_CORPUS[corpus]
    n_c = max(3, n_p // 3)
    countries = [_Entity(names.word(rng.choice(("ia", "land", "mark"))), "country") for _ in range(max(2, n_c // 3))]
    cities = [_Entity(names.word(rng.choice(("port", "ford", "holm", "wick", "dale", "mere"))), "city")
              for _ in range(n_c)]
    for i, c in enumerate(cities):
        c.rel["country"] = countries[i].title if i < len(countries) else rng.choice(countries).title
    for k in countries:
        k.rel["capital"] = rng.choice([c.title for c in cities if c.rel["country"] == k.title])
    persons = [_Entity(f"{names.word()} {names.word()}", "person", rng.choice(PROFESSIONS)) for _ in range(n_p)]
    orgs = [_Entity(f"{names.word()} {kind.capitalize()}", "org", kind)
            for kind in (rng.choice(ORG_KINDS) for _ in range(max(2, n_p // 3)))]
    for o in orgs:
        o.rel["hq"], o.rel["founder"] = rng.choice(cities).title, rng.choice(persons).title
    for p in persons:
        p.rel["home"] = rng.choice(cities).title
        p.rel["mentor"] = rng.choice([q.title for q in persons if q is not p])
        p.rel["employer"] = rng.choice(orgs).title
    # persons[0] starts the chain; distractors share one of its two describing words, never both
    s = persons[0]
    others = persons[1:]
    n_d = min(distractors, len(others) // 2)
    for p in others[:n_d]:
        p.desc = s.desc
        p.rel["home"] = rng.choice([c.title for c in cities if c.title != s.rel["home"]])
    for p in others[n_d:2 * n_d]:
        p.desc = rng.choice([x for x in PROFESSIONS if x != s.desc])
        p.rel["home"] = s.rel["home"]
    for p in others[2 * n_d:]:
        if p.desc == s.desc and p.rel["home"] == s.rel["home"]:
            p.desc = rng.choice([x for x in PROFESSIONS if x != s.desc])
    return [*persons, *orgs, *cities, *countries]


def _chain(rng: random.Random, ents: dict[str, _Entity], start: _Entity, hops: int) -> list[str] | None:
    """Relations of a walk from ``start`` visiting no entity twice; the first is never 'home' (the
    question already names the start's home city)."""
    for _ in range(50):
        cur, seen, rels = start, [start.title], []
        for i in range(hops):
            opts = [r for r in KIND_RELATIONS[cur.kind]
                    if not (i == 0 and r == "home") and cur.rel[r] not in seen and cur.rel[r] != start.rel["home"]]
            if not opts:
                break
            r = rng.choice(opts)
            rels.append(r)
            cur = ents[cur.rel[r]]
            seen.append(cur.title)
        if len(rels) == hops:
            return rels
    return None


@register
class SearchEnv(Environment):
    family: ClassVar[str] = "search"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("hops", 1, 4, "relations to follow from the described person"),
        DifficultyAxis("corpus", 0, 4, f"world size step: {PERSONS_BY_CORPUS} people"),
        DifficultyAxis("distractors", 0, 4, "people sharing the profession or the home city of the start"),
        DifficultyAxis("budget_slack", 0, 4, "extra actions beyond the oracle's (more is easier)"),
    )
    system_prompt: ClassVar[str] = (
        "Answer a question about a fictional world. search finds article titles, open reads one; "
        "follow the names the articles give, then call answer with the name asked for. "
        "Each call costs one action."
    )

    def __init__(self) -> None:
        super().__init__()
        self._docs: dict[str, str] = {}
        self._doc_words: dict[str, frozenset[str]] = {}
        self._by_norm: dict[str, str] = {}
        self._answer = ""
        self._query = ""
        self._path: list[str] = []
        self._budget = 0

    # ---- generation ---------------------------------------------------------------------------
    @classmethod
    def top_level(cls) -> int:
        return len(LEVELS) - 1

    @classmethod
    def sample_difficulty(cls, rng: random.Random, level: int | None = None) -> dict[str, int]:
        """The level table (easy to hard) for a fixed level; else uniform over the axes."""
        if level is not None:
            return dict(LEVELS[min(max(level, 0), len(LEVELS) - 1)])
        return super().sample_difficulty(rng, None)

    # ---- episode ------------------------------------------------------------------------------
    def build(self, spec: ProblemSpec) -> str:
        d = {k: int(v) for k, v in spec.difficulty.items()}
        rng = spec.rng()
        world = _world(rng, d["corpus"], d["distractors"])
        ents = {e.title: e for e in world}
        self._docs = {e.title: e.article() for e in world}
        self._doc_words = {t: frozenset(words(f"{t} {a}")) for t, a in self._docs.items()}
        self._by_norm = {norm(t): t for t in self._docs}
        start = world[0]
        rels = _chain(rng, ents, start, d["hops"]) or []
        phrase = f"the {start.desc} from {start.rel['home']}"
        path = [start.title]
        for r in rels:
            phrase = f"the {RELATIONS[r][0]} of {phrase}"
            path.append(ents[path[-1]].rel[r])
        self._query = f"{start.desc} from {start.rel['home']}"
        # the oracle opens what search ranks first: a ranking bug makes replay fail, not the oracle lie
        top = self._search(self._query)
        self._path = [top[0] if top else "", *path[1:-1]] if rels else []
        self._answer = path[-1] if rels else ""
        self._budget = len(self._path) + 2 + d["budget_slack"]
        who = "Who" if rels and ents[path[-1]].kind == "person" else "What"
        return f"Question: {who} is {phrase}? You have {self._budget} actions."

    def oracle(self) -> list[ToolCall]:
        if not self._path:
            return []
        return [ToolCall("search", {"query": self._query}),
                *(ToolCall("open", {"title": t}) for t in self._path),
                ToolCall("answer", {"text": self._answer})]

    def turn_budget(self) -> int:
        return self._budget

    def ungrounded(self, call: ToolCall, seen: str) -> str:
        """``open`` and ``answer`` take names: each must come from the question or an earlier
        result or article (a teacher that opens the oracle's next title unseen is guessing or cheating)."""
        if call.name not in ("open", "answer"):
            return ""
        arg = call.arguments.get("title" if call.name == "open" else "text")
        shown = set(words(seen))
        missing = [w for w in words(arg) if w not in shown and w not in STOPWORDS]
        if missing:
            return f"{call.name}({clip(arg)}) names {missing[0]!r}, which no earlier observation showed"
        return ""

    def _search(self, query: str) -> list[str]:
        q = [w for w in dict.fromkeys(words(query)) if w not in STOPWORDS]
        scored = [(-len(self._doc_words[t].intersection(q)), t) for t in self._docs]
        return [t for s, t in sorted(scored) if s < 0][:TOP_K]

    def _spend(self) -> str | None:
        """Count one action; the message to return instead if the episode is already over."""
        if not self._docs:
            return "Error: call reset() first."
        if self.done:
            return "The episode is over."
        self.turns += 1
        return None

    def _after(self, text: str) -> str:
        if not self.done and self.turns >= self._budget:
            self.done = True
            return f"{text} Out of actions; the episode is over."
        return text

    # ---- tools (marked @tool: what the agent may call) ----------------------------------------
    @tool
    def search(self, query: str) -> str:
        """
        Search the encyclopedia by keywords.

        Args:
            query: Words to look for, e.g. "painter from Quellport".

        Returns:
            Up to three article titles, best match first.
        """
        if (over := self._spend()) is not None:
            return over
        if not [w for w in words(query) if w not in STOPWORDS]:
            return self._after(f"Error: no keywords in {clip(query)}; search with words from the question.")
        hits = self._search(str(query))
        return self._after(f"Results: {'; '.join(hits)}." if hits else "No results.")

    @tool
    def open(self, title: str) -> str:
        """
        Read the article with this title.

        Args:
            title: An article title, e.g. one returned by search or named in an article.

        Returns:
            The article text.
        """
        if (over := self._spend()) is not None:
            return over
        key = norm(title)
        found = self._by_norm.get(key)
        if found is None and key:  # a unique title containing every word the model wrote
            q = key.split()
            cands = [t for n, t in self._by_norm.items() if all(w in n.split() for w in q)]
            found = cands[0] if len(cands) == 1 else None
        if found is None:
            return self._after(f"Error: no article titled {clip(title)}; open a title from search results.")
        return self._after(self._docs[found])

    @tool
    def answer(self, text: str) -> str:
        """
        Give the final answer; this ends the episode.

        Args:
            text: The name asked for by the question.

        Returns:
            A confirmation that the episode is over.
        """
        if (over := self._spend()) is not None:
            return over
        self.done = True
        self.reward = 1.0 if norm(text) == norm(self._answer) and self._answer else 0.0
        return "Answer recorded; the episode is over."
