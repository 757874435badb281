"""The policy protocol shared by the oracle, local HF models and OpenAI-compatible endpoints.

A policy never sees an environment (import direction: policies do not import envs). It gets the
conversation so far and the tool schemas, and returns one assistant message per conversation. A
model that produces a malformed tool call yields a :class:`Turn` with ``parse_error`` set; the
rollout engine turns that into an error observation and a counted metric, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass
class Turn:
    """One assistant turn: the message to append plus accounting."""

    message: Message  # {"role": "assistant", "content": str, "tool_calls": [...] (optional)}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    parse_error: str | None = None  # set when the model's output was not a valid tool call
    raw: str = ""  # raw decoded text, for debugging and for error observations
    extra: dict[str, Any] = field(default_factory=dict)
    #: set when the policy could not produce this turn at all (an endpoint request that failed after
    #: its retries): the engine ends that episode as *failed* with this error and plays the others on;
    #: the shard runner does not keep it, so a rerun plays it again. Never contains a credential.
    error: str | None = None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])


class PolicyUnavailable(RuntimeError):
    """The policy cannot serve any request (a rejected API key, nothing listening, an endpoint that
    stopped answering): the rollout stops at once, and a retry of the stage cannot help, so the
    orchestrator must not retry it (``retryable = False``, read by the CLI and the Prefect tasks)."""

    retryable = False


@runtime_checkable
class Policy(Protocol):
    """``act`` must be safe to call with any batch size >= 1; ``policy_id`` names it in trajectories."""

    policy_id: str

    def act(
        self,
        conversations: list[list[Message]],
        tools: list[list[dict[str, Any]]],
        *,
        contexts: list[dict[str, Any]] | None = None,
    ) -> list[Turn]:
        """``contexts[i]`` carries privileged per-episode data (used only by the oracle)."""
        ...
