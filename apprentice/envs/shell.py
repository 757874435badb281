"""``shell``: terminal tasks solved with a POSIX shell and coreutils, run in a Docker sandbox.

Terminal agents are the largest family of tool-using agents in the field's research, and their
actions are arbitrary commands: every episode therefore runs in its own container
(:mod:`apprentice.infra.sandbox`: no network, read-only root, small tmpfs work dir, non-root, memory / CPU /
pids limits, per-command timeout, truncated output). Nothing an agent types reaches the host.

A problem is 1-3 *subtasks*, each generated from the spec's seed (Python computes the expected
result; no shell runs at generation time except the oracle's replay, which must earn 1.0):

  * ``logs``      count ERROR lines per service in a log and write a sorted report;
  * ``table``     filter and sort the rows of a CSV file (awk, sort);
  * ``organise``  move the files of a directory into one directory per extension;
  * ``fix``       repair a broken shell script, then save its output.

The verifier checks the sandbox's *final state* (a tar of /work, plus running the repaired script on
fresh data, so a hard-coded answer fails); it runs when the agent calls ``submit`` or runs out of
actions. Difficulty axes: ``tasks`` (subtasks, the horizon), ``size`` (rows / files), ``noise``
(look-alike lines, boundary rows, files that must stay, more bugs) and ``budget_slack`` (extra
actions beyond the oracle's; *more is easier*). ``evolution_directions`` maps them to the evolution
operators (apprentice/envs/evolve.py reads the attribute).

The container is acquired on the first tool call (not at ``reset``: synthesis and evolution reset
environments only to read the task and the oracle plan) and released when the episode ends.
"""

from __future__ import annotations

import contextlib
import random
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from apprentice.envs import register
from apprentice.envs._text import as_text, clip
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool
from apprentice.infra.sandbox import Sandbox, SandboxError

SERVICES = ("auth", "billing", "cache", "gateway", "mailer", "search", "storage", "worker")
NAMES = ("Ada", "Bela", "Cyra", "Dario", "Edda", "Femi", "Goran", "Hana", "Ivo", "Jun", "Kai", "Lena",
         "Milo", "Nora", "Oskar", "Pia", "Quin", "Rosa", "Sven", "Tara", "Uma", "Vik", "Wen", "Xia",
         "Yara", "Zeno")
SURNAMES = ("Berg", "Cole", "Diaz", "Endo", "Falk", "Gray", "Holm", "Ilic", "Jost", "Kern")
CITIES = ("Arden", "Brell", "Corvo", "Dunmere", "Elst", "Fenwick")
EXTS = ("txt", "csv", "log", "md", "json")
ITEMS = ("apple", "bolt", "cable", "drill", "easel", "fuse", "glue", "hinge", "ink", "jar", "knob", "lamp")
ROWS = (6, 10, 16, 24, 40)
FILES = (3, 5, 7, 9, 12)
KINDS = ("logs", "table", "organise", "fix")

LEVELS: tuple[dict[str, int], ...] = (
    {"tasks": 1, "size": 0, "noise": 0, "budget_slack": 3},
    {"tasks": 1, "size": 1, "noise": 1, "budget_slack": 2},
    {"tasks": 2, "size": 2, "noise": 1, "budget_slack": 2},
    {"tasks": 2, "size": 3, "noise": 2, "budget_slack": 1},
    {"tasks": 3, "size": 4, "noise": 3, "budget_slack": 0},
)


def _norm(text: str | bytes) -> str:
    """Final-state comparison ignores trailing spaces and trailing blank lines (what `echo` adds)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


Check = Callable[[dict[str, bytes], Sandbox], str | None]  # None when satisfied, else why not


@dataclass
class _Subtask:
    kind: str
    text: str
    files: dict[str, str]
    oracle: list[ToolCall]
    check: Check
    outputs: list[str] = field(default_factory=list)


# ---- generators (pure Python: the expected result is computed here, never by a shell) -------------
def _logs(rng: random.Random, size: int, noise: int) -> _Subtask:
    services = sorted(rng.sample(SERVICES, 3 + min(size, 4) // 2 + (1 if noise >= 2 else 0)))
    lines, errors = [], dict.fromkeys(services, 0)
    for _ in range(ROWS[size] * 2):
        svc, level = rng.choice(services), rng.choice(("INFO", "INFO", "WARN", "ERROR", "DEBUG"))
        if level == "ERROR":
            errors[svc] += 1
            msg = rng.choice(("request failed", "timeout talking to db", "bad checksum", "disk full"))
        elif noise >= 1 and rng.random() < 0.3:  # the word ERROR outside the level field
            msg = rng.choice(("upstream ERROR rate high", "retrying after ERROR", "ERROR budget at 80%"))
        else:
            msg = rng.choice(("ok", "started", "cache hit", "user login", "job done"))
        lines.append(f"2026-03-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
                     f"{rng.randint(0, 59):02d} {level} {svc}: {msg}")
    if not any(errors.values()):
        svc = services[0]
        errors[svc] = 1
        lines.append(f"2026-03-28 23:59:59 ERROR {svc}: request failed")
    files = {"logs/app.log": "\n".join(lines) + "\n"}
    if noise >= 3:
        files["logs/app.log.1"] = f"2026-02-01 00:00:00 ERROR {services[-1]}: rotated, not counted\n" * 3
    want = "\n".join(f"{s} {n}" for s, n in sorted(errors.items()) if n)
    text = ("Count the lines of logs/app.log whose level (the third field) is ERROR, per service (the "
            "fourth field, without its colon). Write report.txt with one line per service that has "
            "errors: the service, a space, the count; sorted by service.")
    cmd = ("awk '$3==\"ERROR\" {sub(\":\", \"\", $4); print $4}' logs/app.log | sort | uniq -c "
           "| awk '{print $2\" \"$1}' > report.txt")

    def check(snap: dict[str, bytes], box: Sandbox) -> str | None:
        got = snap.get("report.txt")
        return None if got is not None and _norm(got) == want else "report.txt is missing or wrong"

    return _Subtask("logs", text, files, [ToolCall("run", {"command": cmd})], check, ["report.txt"])


def _table(rng: random.Random, size: int, noise: int) -> _Subtask:
    people = [f"{n} {s}" for n in NAMES for s in SURNAMES]
    rng.shuffle(people)
    city, age = rng.choice(CITIES), rng.randint(25, 45)
    rows = []
    for name in people[: ROWS[size]]:
        rows.append((name, rng.randint(18, 70), rng.choice(CITIES)))
    rows[0] = (rows[0][0], age + rng.randint(1, 20), city)  # at least one match
    if noise >= 1 and len(rows) > 2:
        rows[1] = (rows[1][0], age, city)  # on the boundary: "older than" excludes it
    if noise >= 2 and len(rows) > 3:
        rows[2] = (rows[2][0], age + 5, city + "ville")  # a look-alike city
    want = "\n".join(sorted(n for n, a, c in rows if c == city and a > age))
    files = {"data/people.csv": "name,age,city\n" + "".join(f"{n},{a},{c}\n" for n, a, c in rows)}
    text = (f"data/people.csv has a header and the columns name,age,city. Write names.txt with the names "
            f"of the people who live in {city} and are older than {age}, sorted, one per line.")
    cmd = f"awk -F, 'NR>1 && $3==\"{city}\" && $2>{age} {{print $1}}' data/people.csv | sort > names.txt"

    def check(snap: dict[str, bytes], box: Sandbox) -> str | None:
        got = snap.get("names.txt")
        return None if got is not None and _norm(got) == want else "names.txt is missing or wrong"

    return _Subtask("table", text, files, [ToolCall("run", {"command": cmd})], check, ["names.txt"])


def _organise(rng: random.Random, size: int, noise: int) -> _Subtask:
    files: dict[str, str] = {}
    stems = rng.sample([w for w in ITEMS], min(FILES[size], len(ITEMS)))
    for i, stem in enumerate(stems):
        ext = EXTS[i % len(EXTS)] if i < len(EXTS) else rng.choice(EXTS)
        files[f"inbox/{stem}.{ext}"] = f"{stem} {rng.randint(100, 999)}\n"
    keep = []
    if noise >= 1:
        keep = [f"inbox/README{'' if k == 0 else k}" for k in range(1 + noise // 2)]
        for k in keep:
            files[k] = "files without an extension stay here\n"
    expected = {}
    for path, data in files.items():
        name = path.split("/", 1)[1]
        expected[path if "." not in name else f"{name.rsplit('.', 1)[1]}/{name}"] = data
    dirs = {p.split("/", 1)[0] for p in expected} | {"inbox"}
    text = ("Move every file in inbox/ that has an extension into a directory named after the extension, "
            "at the top of the work dir (inbox/a.txt goes to txt/a.txt)."
            + (" Files without an extension stay in inbox/." if keep else ""))
    cmd = 'cd inbox && for f in *.*; do d="../${f##*.}"; mkdir -p "$d" && mv "$f" "$d/"; done'

    def check(snap: dict[str, bytes], box: Sandbox) -> str | None:
        got = {p: v.decode("utf-8", "replace") for p, v in snap.items() if p.split("/", 1)[0] in dirs}
        return None if got == expected else "the files are not where they should be"

    return _Subtask("organise", text, files, [ToolCall("run", {"command": cmd})], check)


_FIXED = """#!/bin/sh
# Print the total quantity sold: the sum of the second column of data/sales.txt.
total=0
while read -r item qty price; do
  total=$((total + qty))
done < data/sales.txt
echo "$total"
"""
_BUGS = (("total + qty", "total + price"), ("done < data/sales.txt", "done < data/sale.txt"),
         ("total=0", "total=1"))


def _fix(rng: random.Random, size: int, noise: int) -> _Subtask:
    def sales(r: random.Random) -> tuple[str, int]:
        rows = [(r.choice(ITEMS), r.randint(1, 20), r.randint(2, 99)) for _ in range(ROWS[size])]
        return "".join(f"{i} {q} {p}\n" for i, q, p in rows), sum(q for _, q, _ in rows)

    data, total = sales(rng)
    fresh, fresh_total = sales(random.Random(rng.random()))
    broken = _FIXED
    for good, bad in rng.sample(_BUGS, min(1 + noise // 2, len(_BUGS))):
        broken = broken.replace(good, bad)
    files = {"data/sales.txt": data, "scripts/total.sh": broken}
    if noise >= 1:
        files["data/sales.bak"] = sales(random.Random(rng.random()))[0]
    text = ("scripts/total.sh should print the total quantity sold (the sum of the second column of "
            "data/sales.txt) but it is broken. Fix the script, then save its output in total.txt.")
    oracle = [ToolCall("write_file", {"path": "scripts/total.sh", "content": _FIXED}),
              ToolCall("run", {"command": "sh scripts/total.sh > total.txt"})]

    def check(snap: dict[str, bytes], box: Sandbox) -> str | None:
        if _norm(snap.get("total.txt", b"")) != str(total):
            return "total.txt is missing or wrong"
        # the script must compute, not print a constant: run it on fresh data
        b64 = shlex.quote(fresh)
        r = box.run(f"printf %s {b64} > data/sales.txt && sh scripts/total.sh")
        return None if _norm(r.output) == str(fresh_total) else "scripts/total.sh is still wrong"

    return _Subtask("fix", text, files, oracle, check, ["total.txt"])


_MAKERS = {"logs": _logs, "table": _table, "organise": _organise, "fix": _fix}


@register
class ShellEnv(Environment):
    family: ClassVar[str] = "shell"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (
        DifficultyAxis("tasks", 1, 3, "subtasks in one problem (logs, table, organise, fix)"),
        DifficultyAxis("size", 0, 4, f"rows per file {ROWS} / files to organise {FILES}"),
        DifficultyAxis("noise", 0, 3, "look-alike lines, boundary rows, files that stay, more bugs"),
        DifficultyAxis("budget_slack", 0, 4, "extra actions beyond the oracle's (more is easier)"),
    )
    evolution_directions: ClassVar[dict[str, list[tuple[str, int]]]] = {
        "horizon": [("tasks", 1)],
        "state": [("size", 1)],
        "harness": [("noise", 1), ("budget_slack", -1)],
    }
    system_prompt: ClassVar[str] = (
        "You are in a Linux terminal (busybox sh and coreutils) in the directory /work, without network. "
        "run executes a shell command, read_file and write_file read and write files; call submit when the "
        "task is done. Each call costs one action."
    )

    def __init__(self) -> None:
        super().__init__()
        self._subtasks: list[_Subtask] = []
        self._files: dict[str, str] = {}
        self._budget = 0
        self._box: Sandbox | None = None
        self.failures: list[str] = []  # why the verifier refused (for debugging and tests)

    # ---- generation ---------------------------------------------------------------------------
    @classmethod
    def top_level(cls) -> int:
        return len(LEVELS) - 1

    @classmethod
    def sample_difficulty(cls, rng: random.Random, level: int | None = None) -> dict[str, int]:
        if level is not None:
            return dict(LEVELS[min(max(level, 0), len(LEVELS) - 1)])
        return super().sample_difficulty(rng, None)

    @classmethod
    def generate_from(cls, seed: int, difficulty: Mapping[str, int], generation: int = 0) -> ProblemSpec:
        """A problem is accepted only after its oracle replays in a sandbox: without an engine every seed
        would look unsolvable, so say what is missing instead."""
        from apprentice.infra.sandbox import engine_available

        ok, why = engine_available()
        if not ok:
            raise SandboxError(f"shell problems are generated and verified in Docker sandboxes: {why}")
        return super().generate_from(seed, difficulty, generation)

    # ---- episode ------------------------------------------------------------------------------
    def build(self, spec: ProblemSpec) -> str:
        self._release()
        d = {k: int(v) for k, v in spec.difficulty.items()}
        rng = spec.rng()
        kinds = rng.sample(KINDS, d["tasks"])
        self._subtasks = [_MAKERS[k](rng, d["size"], d["noise"]) for k in kinds]
        self._files = {p: c for t in self._subtasks for p, c in t.files.items()}
        self.failures = []
        self._budget = len(self.oracle()) + 1 + d["budget_slack"]
        steps = "\n".join(f"{i + 1}. {t.text}" for i, t in enumerate(self._subtasks))
        listing = " ".join(sorted(self._files))
        return (f"Files in /work: {listing}\nTasks:\n{steps}\nCall submit when done. "
                f"You have {self._budget} actions.")

    def oracle(self) -> list[ToolCall]:
        if not self._subtasks:
            return []
        return [*(c for t in self._subtasks for c in t.oracle), ToolCall("submit", {})]

    def turn_budget(self) -> int:
        return self._budget

    def ungrounded(self, call: ToolCall, seen: str) -> str:
        """``read_file`` must name a file the task listed or an earlier command showed."""
        if call.name != "read_file":
            return ""
        path = as_text(call.arguments.get("path")).strip()
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name and name not in seen:
            return f"read_file({clip(path)}) names a file no earlier observation showed"
        return ""

    def _sandbox(self) -> Sandbox:
        if self._box is None:
            self._box = Sandbox()
            self._box.put_files(self._files)
        return self._box

    def _release(self) -> None:
        if self._box is not None:
            box, self._box = self._box, None
            box.close()

    def _spend(self) -> str | None:
        if not self._subtasks:
            return "Error: call reset() first."
        if self.done:
            return "The episode is over."
        self.turns += 1
        return None

    def _verify(self) -> None:
        """Reward 1.0 iff every subtask's check passes on the final state; then free the container."""
        box = self._box
        self.failures = []
        if box is not None and box.dead is None:
            try:
                snap = box.snapshot()
                for t in self._subtasks:
                    why = t.check(snap, box)
                    if why:
                        self.failures.append(f"{t.kind}: {why}")
            except SandboxError as e:
                self.failures.append(f"sandbox: {e}")
        else:
            self.failures.append("sandbox: never started or died")
        self.reward = 0.0 if self.failures else 1.0
        self.done = True
        self._release()

    def _after(self, text: str) -> str:
        if not self.done and self.turns >= self._budget:
            self._verify()
            return f"{text}\nOut of actions; the episode is over."
        return text

    def _guard(self, fn: Callable[[Sandbox], str]) -> str:
        """Spend one action, run ``fn`` on the sandbox, turn a dead sandbox into an error that ends the
        episode (the agent cannot recover a removed container)."""
        if (over := self._spend()) is not None:
            return over
        try:
            return self._after(fn(self._sandbox()))
        except SandboxError as e:
            self.done, self.reward = True, 0.0
            self.failures = [f"sandbox: {e}"]
            self._release()
            return f"Error: the sandbox stopped ({clip(str(e), 120)}); the episode is over."

    @staticmethod
    def _observe(r: Any, limit: int, timeout: float) -> str:
        out = r.output.rstrip("\n")
        if r.truncated:
            out += f"\n[output truncated: {r.output_bytes} bytes, showing the first {limit}]"
        if r.timed_out:
            return f"Error: the command ran past {timeout:g} s and was killed.\n{out}".rstrip()
        if r.exit_code == 137:
            return f"Error: the command was killed (memory or process limit).\n{out}".rstrip()
        if r.exit_code != 0:
            return f"Error: exit status {r.exit_code}.\n{out}".rstrip()
        return out or "(no output)"

    # ---- tools (marked @tool: what the agent may call) ----------------------------------------
    @tool
    def run(self, command: str) -> str:
        """
        Run a shell command in /work (busybox sh); processes do not outlive the command.

        Args:
            command: The command line, e.g. "ls -R" or "sort data.txt | uniq -c".

        Returns:
            The command's output (stdout and stderr, truncated), or an error with its exit status.
        """
        cmd = as_text(command)

        def go(box: Sandbox) -> str:
            if not cmd.strip():
                return "Error: empty command; pass a shell command line."
            lim = box.limits
            return self._observe(box.run(cmd), lim.output_bytes, lim.command_timeout_s)

        return self._guard(go)

    @tool
    def read_file(self, path: str) -> str:
        """
        Read a text file.

        Args:
            path: The file's path, relative to /work or absolute.

        Returns:
            The file's contents (truncated when long).
        """
        p = as_text(path).strip()

        def go(box: Sandbox) -> str:
            if not p:
                return "Error: empty path; pass a file path such as logs/app.log."
            r = box.run(f"cat -- {shlex.quote(p)}")
            return self._observe(r, box.limits.output_bytes, box.limits.command_timeout_s)

        return self._guard(go)

    @tool
    def write_file(self, path: str, content: str) -> str:
        """
        Create or overwrite a text file (parent directories are created).

        Args:
            path: The file's path, relative to /work.
            content: The complete new contents of the file.

        Returns:
            A confirmation, or an error.
        """
        p, text = as_text(path).strip(), as_text(content)

        def go(box: Sandbox) -> str:
            if not p:
                return "Error: empty path; pass a file path such as notes.txt."
            if len(text) > 64_000:
                return "Error: content longer than 64000 characters; write smaller files."
            q = shlex.quote(p)
            r = box.run(f"mkdir -p \"$(dirname -- {q})\" && printf %s {shlex.quote(text)} > {q}")
            if r.exit_code != 0:
                return self._observe(r, box.limits.output_bytes, box.limits.command_timeout_s)
            return f"Wrote {len(text.encode())} bytes to {p}."

        return self._guard(go)

    @tool
    def submit(self) -> str:
        """
        Declare the task done; the final state of /work is checked and the episode ends.

        Returns:
            Whether the checks passed.
        """
        if (over := self._spend()) is not None:
            return over
        self._sandbox_or_none()
        self._verify()
        return "Submitted: all checks passed." if self.reward >= 1.0 else \
            "Submitted: the checks failed; the episode is over."

    def _sandbox_or_none(self) -> None:
        try:
            self._sandbox()
        except SandboxError as e:
            self.failures = [f"sandbox: {e}"]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._release()
