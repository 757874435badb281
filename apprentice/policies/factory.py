"""A stage's policy from its config: ``--policy`` choice -> ``PolicyConfig`` -> a built policy.

Why here and not in a stage: the teacher rollout, the evaluation and anything else that plays
episodes build their policy the same way (the pipeline's model folders, the model settings, the
KV-cache engine for local models); a stage importing another stage for that made the stage graph
lie about what depends on what.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apprentice.config import Config, PolicyConfig
    from apprentice.paths import Paths

#: ``--policy`` values that name this iteration's own models.
MODEL_CHOICES = ("base", "sft", "rl", "student")


def model_dir(choice: str, cfg: Config, paths: Paths) -> str:
    """``base|sft|rl|student`` -> the model folder of this iteration; anything else is a path/HF id."""
    if choice == "base":
        from apprentice.lm.modeling import resolve_model_ref

        return resolve_model_ref(cfg.model.base, paths.root)
    if choice in MODEL_CHOICES:
        p = paths.model_dir(choice)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} holds no model; run `python -m apprentice {choice if choice != 'student' else 'distill'}` first")
        return str(p)
    return choice


def resolve_policy(choice: str | None, default: PolicyConfig, cfg: Config, paths: Paths) -> tuple[str, PolicyConfig]:
    """``--policy`` value -> (short name for outputs, PolicyConfig). ``None`` keeps ``default``."""
    if choice is None:
        name = "oracle" if default.kind == "oracle" else _short(default.model or "base")
        if default.kind == "hf" and not default.model:
            default = default.model_copy(update={"model": model_dir("base", cfg, paths)})
        return name, default
    if choice == "oracle":
        return "oracle", default.model_copy(update={"kind": "oracle"})
    kind = "openai" if default.kind == "openai" and choice not in MODEL_CHOICES and not Path(choice).exists() else "hf"
    model = model_dir(choice, cfg, paths) if kind == "hf" else choice
    if kind == "hf" and choice == "base":  # a missing local base would surface as a hub connection error
        from apprentice.training.common import require_model

        require_model(model)
    name = choice if choice in MODEL_CHOICES else _short(choice)
    return name, default.model_copy(update={"kind": kind, "model": model})


def _short(ref: str) -> str:
    tail = Path(ref.rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tail)


def build_policy(pol_cfg: PolicyConfig, cfg: Config, paths: Paths) -> Any:
    """The policy object: ``make_policy`` with the ``model`` section's settings; a local HF model
    gets the KV-cache engine (:class:`~apprentice.policies.hf_cached.CachedHFPolicy`), the one
    engine every multi-turn generation runs on."""
    from apprentice.policies import make_policy

    if cfg.model.threads > 0:
        import torch

        torch.set_num_threads(cfg.model.threads)
    return make_policy(pol_cfg, model_dir("base", cfg, paths), root=str(paths.root), dtype=cfg.model.dtype,
                       chat_template=cfg.model.chat_template, seed=cfg.pipeline.seed)
