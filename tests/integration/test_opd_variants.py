"""Every OPD variant runs real TRL training steps on a tiny random model and changes its weights.

A two-tool "keypad" environment keeps prompts short (~90 tokens instead of grid's ~200), because on
CPU the 49k-word vocabulary head dominates the tiny model's cost. Rollouts really execute the tools.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

import pytest
import torch

from apprentice.config import Config
from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool
from apprentice.training.common import MetricsCallback, read_metrics
from apprentice.training.opd import VARIANTS

pytestmark = pytest.mark.integration


class KeypadEnv(Environment):
    family: ClassVar[str] = "keypad"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (DifficultyAxis("length", 1, 3),)
    system_prompt: ClassVar[str] = "Press the keys."

    def build(self, spec: ProblemSpec) -> str:
        rng = spec.rng()
        self._target = [rng.choice("ab") for _ in range(int(spec.difficulty["length"]))]
        self._pressed: list[str] = []
        return "Press " + " then ".join(self._target) + "."

    @tool
    def press(self, key: str) -> str:
        """
        Press one key.

        Args:
            key: "a" or "b".
        """
        self.turns += 1
        self._pressed.append(str(key))
        if self._pressed == self._target:
            self.done, self.reward = True, 1.0
        return "ok"

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("press", {"key": k}) for k in self._target]

    def turn_budget(self) -> int:
        return len(self._target) + 1


def _keypad(spec: ProblemSpec) -> Environment:
    return KeypadEnv()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a small shared CPU: one torch thread is much faster than two (OpenMP threads
    spin-waiting on each other for 64-wide matmuls), so these tests pin it and restore it after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tiny_model_dir, smol_tokenizer_dir, tmp_path_factory):
    from apprentice.lm.modeling import load_tokenizer, make_tiny_model

    tok = load_tokenizer(smol_tokenizer_dir)
    teacher_dir = make_tiny_model(tok, tmp_path_factory.mktemp("teacher") / "m", hidden=64, layers=2, seed=1)
    return tok, tiny_model_dir, str(teacher_dir)


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"vanilla"}))  # vanilla: single-turn, not this trainer
def test_variant_trains_and_logs_diagnostics(variant, models, tmp_path):
    from apprentice.lm.modeling import load_model
    from apprentice.training.opd.trainer import make_trainer

    tok, student_dir, teacher_dir = models
    cfg = Config.model_validate({"distill": {"variant": variant, "max_steps": 2, "opd": {
        "samples_per_problem": 2, "guided_p0": 1.0, "tcod_start_turns": 1, "tcod_end_turns": 2,
        "dash_drift_threshold": 0.4, "dash_allowance": 0.1}}})
    recipe = VARIANTS[variant](cfg)
    student = load_model(student_dir)
    student.train()
    teacher = None if recipe.privileged != "none" else load_model(teacher_dir)
    before = {k: p.detach().clone() for k, p in student.named_parameters()}
    specs = [KeypadEnv.make_spec(s, {"length": 2}) for s in range(2)]
    metrics = tmp_path / "metrics.jsonl"
    trainer = make_trainer(recipe, student=student, teacher=teacher, tokenizer=tok, specs=specs,
                           output_dir=str(tmp_path / "work"), max_steps=2, batch_size=2, learning_rate=1e-2,
                           beta=0.5, dtype="fp32", save_steps=100, turn_tokens=8, max_turns=2,
                           env_factory=_keypad, callbacks=[MetricsCallback(metrics, "distill")])
    trainer.train()

    changed = [k for k, p in student.named_parameters() if not torch.equal(before[k], p)]
    rows = [r for r in read_metrics(metrics) if "opd/teacher_share" in r]
    if variant == "grpo":
        # A random model never solves the keypad: every group has equal rewards, so GRPO's advantages
        # are 0 and so is its gradient. The RL-only baseline must then leave the weights alone.
        assert all(r["opd/reward"] == 0.0 and r["opd/loss_rl"] == 0.0 for r in rows)
        assert not changed
    else:
        assert changed, f"{variant}: no parameter changed"
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"])
        assert {"opd/success", "opd/switches", "opd/traj_turns", "opd/w_opd"} <= set(r)
    # KL per turn index is logged whenever the student wrote a turn (guided's step 1 is all teacher)
    assert any(k.startswith("opd/kl_turn_") for r in rows for k in r)
    if variant == "guided":  # p0 = 1 at step 0: the teacher wrote every turn of the first rollout
        assert rows[0]["opd/teacher_share"] == 1.0
    elif variant in ("opd", "tcod", "privileged", "atod", "grpo"):
        assert all(r["opd/teacher_share"] == 0.0 for r in rows)
    if variant == "tcod":
        assert rows[0]["opd/horizon"] == 1 and rows[0]["opd/traj_turns"] == 1
    if variant == "atod":
        assert rows[0]["opd/w_opd"] == 1.0 and rows[0]["opd/w_rl"] == 0.0
        assert rows[1]["opd/w_rl"] > 0
    if variant == "grpo":
        assert all(r["opd/w_opd"] == 0.0 for r in rows)
    json.dumps(recipe.describe())
