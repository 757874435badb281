"""One source of defaults: ``params.yaml`` holds exactly the typed config's class defaults, key for key.

Why: the classes in :mod:`apprentice.config` are what a ``Config()`` built in code (a test, a bench script,
a params file that omits a key) runs with, and ``params.yaml`` is what the pipeline runs with. When the two
disagreed, a key left out of a params file silently took another value than the shipped one. So every
key of ``params.yaml`` equals its class default, ``params.yaml`` lists every field the classes have and
none they lack (nested sections too), and every field says what it controls (its ``description``).
Profiles (``apprentice/profiles/``) override on top and are not compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from apprentice.config import Config, Section, load_config, read_yaml

REPO = Path(__file__).resolve().parents[2]
PARAMS = REPO / "params.yaml"


def _key(name: str, field: Any) -> str:
    return field.alias or name  # validate_ is spelled `validate` in params


def _sections(cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """Every section class reachable from ``cls``, with its dotted key (``""`` for ``cls`` itself)."""
    yield prefix, cls
    for name, f in cls.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _sections(ann, f"{prefix}{_key(name, f)}.")


def _compare(cls: type[BaseModel], default: BaseModel, raw: dict[str, Any], prefix: str,
             out: list[str]) -> None:
    keys = {_key(n, f): n for n, f in cls.model_fields.items()}
    for k in sorted(set(raw) - set(keys)):
        out.append(f"{prefix}{k}: in params.yaml, but no class has the field (remove it or add the field)")
    for k, name in keys.items():
        value = getattr(default, name)
        if k not in raw:
            out.append(f"{prefix}{k}: field of {cls.__name__} missing from params.yaml (add it with its default)")
        elif isinstance(value, BaseModel):
            assert isinstance(raw[k], dict), f"{prefix}{k} must be a section in params.yaml"
            _compare(type(value), value, raw[k], f"{prefix}{k}.", out)
        elif raw[k] != value or isinstance(raw[k], bool) != isinstance(value, bool):  # True == 1 otherwise
            out.append(f"{prefix}{k}: params.yaml has {raw[k]!r}, {cls.__name__} defaults to {value!r}")


def test_params_yaml_is_the_class_defaults_key_for_key():
    problems: list[str] = []
    _compare(Config, Config(), read_yaml(PARAMS), "", problems)
    assert not problems, ("params.yaml and the class defaults in apprentice/config.py must agree (change both "
                          "together):\n  " + "\n  ".join(problems))


def test_a_config_built_in_code_is_the_shipped_default_profile():
    """The same thing as the pipeline sees it: the validated params equal a bare ``Config()``."""
    assert load_config(PARAMS) == Config()


SECTIONS = {p.rstrip("."): c for p, c in _sections(Config) if c is not Config}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_is_described(section):
    cls = SECTIONS[section]
    assert issubclass(cls, Section)
    missing = [n for n, f in cls.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"{cls.__name__} ({section}): give these fields a description: {missing}"


def test_the_checks_catch_a_drift():
    """The comparison itself: a changed value, a missing key and an unknown key are each reported."""
    raw = read_yaml(PARAMS)
    raw["sft"]["batch_size"] += 1
    del raw["rl"]["seed"]
    raw["distill"]["opd"]["no_such_knob"] = 1
    problems: list[str] = []
    _compare(Config, Config(), raw, "", problems)
    assert len(problems) == 3
    assert any(p.startswith("sft.batch_size:") for p in problems)
    assert any(p.startswith("rl.seed:") and "missing" in p for p in problems)
    assert any(p.startswith("distill.opd.no_such_knob:") for p in problems)
