"""Tools are marked with ``@tool``, the protocol (``build``, ``oracle``, ``turn_budget``,
``execute``) is public, and TRL still sees only the tools: its real ``GRPOTrainer`` is given every
family's :func:`trl_environment` facade and the tools it collects (names, JSON schemas, reward
columns) are exactly the marked ones. check-env names what is wrong with a family's surface."""

from __future__ import annotations

import inspect

import pytest
from transformers.utils import get_json_schema

from apprentice.envs import FAMILIES, resolve, tool, trl_environment
from apprentice.envs.base import (
    _OPENAI_FUNCTION_KEYS,
    PROTOCOL_METHODS,
    DifficultyAxis,
    Environment,
    ToolCall,
)
from apprentice.envs.check import check_family, surface_problems

FAMILY_NAMES = ["grid", "search", "store", "shell", "toytext_frozenlake", "toytext_taxi", "rg_basic_arithmetic"]


def _strict(schema: dict) -> dict:
    """What :meth:`Environment.tool_schemas` keeps of transformers' schema (the OpenAI function keys)."""
    return {"type": "function", "function": {k: v for k, v in schema["function"].items() if k in _OPENAI_FUNCTION_KEYS}}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_marks_its_tools_and_keeps_the_protocol_public(family):
    cls = resolve(family)
    public = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert cls.tool_names() and public == set(cls.tool_names()) | (PROTOCOL_METHODS & public)
    assert {"build", "oracle", "turn_budget", "execute", "reset", "get_reward"} <= public
    assert surface_problems(cls) == []


@pytest.fixture(scope="module")
def grpo_trainer(tiny_model_dir, tmp_path_factory):
    """TRL's own GRPOTrainer, built (not trained) with a dict ``environment_factory`` of every family's facade."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training import common

    classes = {f: resolve(f) for f in FAMILY_NAMES}
    rows = [{"prompt": [{"role": "system", "content": c.system_prompt}, {"role": "user", "content": ""}],
             "environment": f} for f, c in classes.items()]
    args = common.trl_args(GRPOConfig, tmp_path_factory.mktemp("grpo"), dtype="fp32", max_steps=1, batch_size=2,
                           learning_rate=1e-5, save_steps=10, seed=0, num_generations=2, max_completion_length=8,
                           beta=0.0, shuffle_dataset=False, remove_unused_columns=False)
    trainer = GRPOTrainer(model=load_model(tiny_model_dir, dtype="fp32"), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(tiny_model_dir),
                          environment_factory={f: trl_environment(c) for f, c in classes.items()})
    return trainer, classes


def test_trls_own_discovery_finds_exactly_the_marked_tools(grpo_trainer):
    trainer, classes = grpo_trainer
    for family, cls in classes.items():
        tools = trainer._env_tools[family]
        assert [t.__name__ for t in tools] == cls.tool_names(), family
        assert [_strict(get_json_schema(t)) for t in tools] == cls.tool_schemas(), family
        # transformers' full schema (what the chat template renders) is the one of the environment's method
        assert [get_json_schema(t) for t in tools] == [get_json_schema(getattr(cls, n)) for n in cls.tool_names()]
        instance = trainer._environment_pool[family][0]
        assert type(instance) is trl_environment(cls) and isinstance(instance.env, cls)
    # one reward column per environment class, named as before the facade (rewards/<EnvClass>/mean)
    assert set(trainer.reward_func_names) == {c.__name__ for c in classes.values()}


def test_the_facade_plays_the_same_episode_as_the_environment():
    cls = FAMILIES["grid"]
    spec = cls.generate(3, 1)
    env, facade = cls(), trl_environment(cls)()
    assert trl_environment(cls) is type(facade)  # cached: one facade class per environment class
    assert facade.reset(spec=spec.to_json(), prompt=[]) == env.reset(spec=spec)
    for call in env.oracle():
        assert getattr(facade, call.name)(**call.arguments) == env.execute(call)
    assert facade.get_reward() == env.get_reward() == 1.0 and facade.env.done
    with pytest.raises(TypeError):  # TRL reports a raising tool itself; the facade adds nothing
        facade.move(bogus=1)


# ---- check-env: the class surface -----------------------------------------------------------------
class _Base(Environment):
    family = "surface_test"
    axes = (DifficultyAxis("n", 1, 3, "how many pokes"),)

    def build(self, spec):
        self._left = int(spec.difficulty["n"])
        return f"Poke {self._left} times."

    def oracle(self):
        return [ToolCall("poke", {"times": 1})] * self._left

    def turn_budget(self):
        return self._left

    @tool
    def poke(self, times: int) -> str:
        """Poke the thing.

        Args:
            times: How many times (1).
        """
        if times != 1:
            return "Error: poke once."
        self._left -= 1
        if self._left == 0:
            self.reward, self.done = 1.0, True
        return f"{self._left} left."


def _problems(**methods):
    return surface_problems(type("Env", (_Base,), methods))


def test_surface_of_a_good_family_is_clean():
    assert _Base.tool_names() == ["poke"] and surface_problems(_Base) == []


def test_a_forgotten_tool_mark_is_named_with_the_fix():
    def nudge(self, times: int) -> str:
        """Nudge.

        Args:
            times: How many.
        """
        return "ok"

    (msg,) = _problems(nudge=nudge)
    assert "public method 'nudge'" in msg and "mark it with @tool or make it _private" in msg
    assert _problems(_nudge=nudge) == []  # private helpers are fine


def test_a_family_without_tools_is_told_to_mark_them():
    msgs = _problems(poke=lambda self, times: "x")
    assert any(m.startswith("no tools: mark the methods the agent may call with @tool") for m in msgs), msgs


def test_tool_arguments_and_docstrings_are_checked():
    @tool
    def untyped(self, where) -> str:
        """Go.

        Args:
            where: Where.
        """
        return ""

    @tool
    def undocumented(self, x: int) -> str:
        return ""

    @tool
    def no_args_section(self, x: int) -> str:
        """Do x."""
        return ""

    @tool
    def missing_one(self, x: int, y: str = "") -> str:
        """Do x and y.

        Args:
            x (int): The x.
        """
        return ""

    assert _problems(untyped=untyped) == ["tool 'untyped': argument 'where' has no type annotation (e.g. 'where: str')"]
    assert _problems(undocumented=undocumented) == [
        "tool 'undocumented': no docstring (Google style: a summary line, then 'Args:' with one line per argument)"]
    assert _problems(no_args_section=no_args_section) == [
        "tool 'no_args_section': the docstring has no 'Args:' section (Google style) documenting x"]
    assert _problems(missing_one=missing_one) == [
        "tool 'missing_one': argument 'y' is not documented under Args: (a line 'y: what it is')"]


def test_tool_refuses_private_and_protocol_names():
    def _helper(self) -> str:
        return ""

    def oracle(self) -> str:
        return ""

    with pytest.raises(TypeError, match="must be public"):
        tool(_helper)

    with pytest.raises(TypeError, match="protocol methods"):
        tool(oracle)
    with pytest.raises(TypeError, match="plain method"):
        tool(classmethod(oracle))


def test_check_env_reports_the_forgotten_mark(monkeypatch):
    def nudge(self) -> str:
        """Nudge."""
        return "ok"

    cls = type("Forgetful", (_Base,), {"family": "forgetful_test", "nudge": nudge})
    monkeypatch.setitem(FAMILIES, "forgetful_test", cls)
    found = check_family("forgetful_test", levels=[0], seeds=1, echo=lambda *_: None)
    assert found == [surface_problems(cls)[0]] and "mark it with @tool" in found[0]
