"""A two-word environment (``echo``) and the data a training stage needs, for the trainers' tests.

``echo`` keeps prompts short so each TRL step stays cheap; the ``echo_env`` fixture registers it only for
the duration of a test (``monkeypatch``), so the real families are untouched.
"""

from __future__ import annotations

from typing import ClassVar

from apprentice.config import Config
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool
from apprentice.paths import Paths


class EchoEnv(Environment):
    family: ClassVar[str] = "echo"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (DifficultyAxis("length", 1, 2),)
    system_prompt: ClassVar[str] = "Say the word."

    def build(self, spec: ProblemSpec) -> str:
        self.word = spec.rng().choice(["red", "blue", "green", "gold"])
        return f"Word: {self.word}"

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("say", {"word": self.word})]

    def turn_budget(self) -> int:
        return 2

    @tool
    def say(self, word: str) -> str:
        """
        Say a word.

        Args:
            word: The word to say.
        """
        self.turns += 1
        if str(word).strip() == self.word:
            self.done, self.reward = True, 1.0
            return "Correct."
        return "Wrong."


def config(tiny: str, **sections) -> Config:
    raw = {"model": {"base": tiny, "dtype": "fp32"}, "evaluate": {"max_new_tokens": 8, "batch_size": 8}}
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return Config.model_validate(raw)


def write_data(paths: Paths, n: int = 4) -> None:
    """problems.parquet + sft.parquet (oracle trajectories) for the echo environment, and the set SFT
    trains on (train.parquet: what the loop-data stage writes in iteration 1)."""
    from apprentice.data.trajectories import problems_frame, trajectories_frame, write_parquet
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.rollout.episodes import run_episodes

    specs = [EchoEnv.make_spec(i, {"length": 1 + i % 2}) for i in range(n)]
    problems = problems_frame(specs, [i % 2 for i in range(n)], "train")
    write_parquet(problems, paths.problems)
    trajs = run_episodes(problems, OraclePolicy(), progress=False)
    assert all(t.success for t in trajs)
    write_parquet(trajectories_frame(trajs), paths.sft_data)
    from apprentice import (
        gate,  # the gate record sft/distill require (oracle episodes: clean by construction)
    )

    gate.write_reports([], paths.reports / "gate.html", paths.gate_record, "fixture", sft_path=paths.sft_data)
    from apprentice.config import Config
    from apprentice.stages import loop_data

    loop_data.run(Config(), paths)
