"""Policies: a batch of conversations in, a batch of assistant messages out.

``make_policy`` builds one from a typed ``PolicyConfig``; heavy imports (torch, httpx) happen
only for the kind asked for, so the oracle path stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apprentice.policies.base import Message, Policy, Turn

if TYPE_CHECKING:
    from apprentice.config import PolicyConfig

__all__ = ["Message", "Policy", "Turn", "make_policy"]


def make_policy(policy_cfg: PolicyConfig, default_model: str = "", *, root: str = ".",
                dtype: str = "auto", chat_template: str = "model", seed: int = 0,
                **overrides: Any) -> Policy:
    """``kind: oracle | hf | openai`` -> a policy (``hf``: the KV-cache engine, :mod:`apprentice.policies.hf_cached`). ``default_model`` is used when
    ``policy_cfg.model`` is empty (e.g. the stage's model path); relative paths resolve against
    ``root``. ``overrides`` replace constructor arguments (e.g. ``temperature=0.7``)."""
    kind = policy_cfg.kind
    model = policy_cfg.model or default_model
    if kind == "oracle":
        from apprentice.policies.oracle import OraclePolicy

        return OraclePolicy()
    if not model:
        raise ValueError(f"policy kind '{kind}' needs a model: set 'model' in its params section "
                         "(an HF folder/id for hf, the served model name for openai)")
    if kind == "hf":
        from apprentice.lm.modeling import resolve_model_ref
        from apprentice.policies.hf_cached import CachedHFPolicy

        kw: dict[str, Any] = dict(temperature=policy_cfg.temperature, top_p=policy_cfg.top_p,
                                  max_new_tokens=policy_cfg.max_new_tokens, batch_size=policy_cfg.batch_size,
                                  dtype=dtype, chat_template=chat_template, seed=seed)
        kw.update(overrides)
        return CachedHFPolicy(resolve_model_ref(model, root), **kw)
    if kind == "openai":
        from apprentice.policies.openai_compat import OpenAICompatiblePolicy

        kw = dict(api_key_env=policy_cfg.api_key_env, timeout=policy_cfg.timeout_s,
                  max_retries=policy_cfg.max_retries, temperature=policy_cfg.temperature,
                  top_p=policy_cfg.top_p, max_tokens=policy_cfg.max_new_tokens,
                  concurrency=policy_cfg.batch_size, circuit_breaker=policy_cfg.circuit_breaker)
        kw.update(overrides)
        return OpenAICompatiblePolicy(policy_cfg.base_url, model, **kw)
    raise ValueError(f"unknown policy kind {kind!r}; choose oracle, hf or openai")
