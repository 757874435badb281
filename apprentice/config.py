"""Typed configuration: one pydantic class per ``params.yaml`` section.

Why pydantic (and not OmegaConf/Hydra): DVC already owns the YAML file and per-key dependency tracking;
what we need on top is validation that fails at load with a message naming the key and saying how
to fix it, and attribute access with types for the library. ``extra="forbid"`` turns a typo into an
error instead of a silently ignored setting.

Profiles: ``params.yaml`` is the ``default`` profile; ``apprentice/profiles/<name>.yaml`` holds
overrides merged on top (``--profile quick`` or ``pipeline.profile: quick``). Command-line
``--set section.key=value`` overrides win over both.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from apprentice.paths import DEFAULT_BASE

PROFILES_DIR = Path(__file__).parent / "profiles"


class ConfigError(ValueError):
    """A params file or override is wrong; the message says which key and how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class PipelineConfig(Section):
    iterations: int = Field(2, ge=1, description="How many self-improvement iterations dvc.yaml declares.")
    seed: int = Field(0, description="Global seed; every stage derives its own from it.")
    profile: str = Field("default", description="Name of the profile this file was written for.")


class ModelConfig(Section):
    base: str = Field(DEFAULT_BASE, description="HF model id or local path of the base model.")
    chat_template: Literal["compact", "qwen2.5", "model"] = Field(
        "compact", description="'compact' = SmolLM tool template; 'model' = keep the tokenizer's own."
    )
    dtype: Literal["bf16", "fp32", "auto"] = Field(
        "auto", description="'auto' = bf16 autocast where the CPU/GPU supports it, else fp32."
    )
    threads: int = Field(0, ge=0, description="torch threads (0 = torch default).")


def _resolve_families(v: list[str]) -> list[str]:
    """Every family name through the one registry lookup (:func:`apprentice.envs.resolve`), which
    registers adapter (rg_*, toytext_*) and entry-point families on first use."""
    from apprentice.envs import resolve

    for f in v:
        try:
            resolve(f)
        except ImportError as e:
            raise ValueError(f"environment family '{f}' needs a package that is not installed: {e}") from None
        except ValueError as e:
            raise ValueError(f"unknown environment families ['{f}']: {e}") from None
    return v


#: The module that holds the one ``distill.variant`` registry (``VARIANTS``: name -> recipe builder).
VARIANTS_MODULE = "apprentice.training.opd.variants"


def variant_names() -> list[str]:
    """Every selectable ``distill.variant``, read from the registry itself (so the config accepts exactly
    the names the distill stage can dispatch). Imported by a computed name on purpose: the registry
    changes what the distill stage computes only, and that stage imports it itself;
    :mod:`apprentice.codedeps` follows constant imports, so a plain import here would make it a code dep
    of every stage (and rerun them all when a variant is added)."""
    import importlib

    return list(importlib.import_module(VARIANTS_MODULE).VARIANTS)


class SynthConfig(Section):
    families: list[str] = Field(default_factory=lambda: ["grid", "search"], description="Environment families "
                                "trained on (registered names: built-in, rg_*/toytext_* adapters, plugins).")
    n_train: int = Field(200, ge=1, description="Training problems per iteration (all families).")
    levels: list[int] = Field(
        default_factory=lambda: [0, 1, 2], description="Difficulty levels sampled uniformly (iteration 1, and "
        "every iteration under frontier.mode: fixed)."
    )
    seed: int = Field(1, description="Seed of problem synthesis (combined with pipeline.seed and the iteration).")
    sampler: Literal["none", "pass_band", "dtac", "hdc", "aes"] = Field(
        "none", description="Iteration k > 1: generate n_train x oversample candidates, predict the current "
        "model's pass rate on each from its spec (predictor fitted on iteration k-1's held-out episodes) "
        "and keep the n_train this curriculum sampler picks (settings from curriculum.*). none = keep all.")
    oversample: float = Field(2.0, ge=1, description="Candidates generated per kept problem when sampler != none.")

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        _resolve_families(v)
        if not v:
            raise ValueError("list at least one environment family")
        return v


class BenchmarkConfig(Section):
    """The fixed benchmark: one held-out problem set, synthesized once and scored in every iteration."""

    n: int = Field(160, ge=1, description="Benchmark problems (all families, all levels, round-robin).")
    seed: int = Field(1000, description="Its own seed: the benchmark does not move with pipeline.seed or synth.seed.")
    families: list[str] = Field(default_factory=list, description="Families (empty = synth.families).")
    levels: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 7],
                              description="Levels (empty = synth.levels); to the families' top level, so "
                              "that the benchmark spans every level the frontier controller can reach.")

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        return _resolve_families(v)  # the same lookup as synth.families (entry points included)


class PolicyConfig(Section):
    """Who acts: the oracle, a local HF model, or an OpenAI-compatible endpoint."""

    kind: Literal["oracle", "hf", "openai"] = Field(
        "oracle", description="Who acts: oracle (the environment's own plan), hf (a local HF model) or openai "
        "(an OpenAI-compatible endpoint).")
    model: str = Field("", description="HF id/path (kind=hf) or served model name (kind=openai).")
    base_url: str = Field("", description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    api_key_env: str = Field("OPENAI_API_KEY", description="Name of the env var holding the API key.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = off).")
    max_new_tokens: int = Field(96, ge=1, description="Token cap of one assistant turn.")
    batch_size: int = Field(32, ge=1, description="Max episodes whose next turn is generated at once.")
    timeout_s: float = Field(60.0, gt=0, description="Seconds one endpoint request may take (kind=openai).")
    max_retries: int = Field(3, ge=0, description="Extra attempts of one request after a transient failure "
                             "(connection, timeout, 429/5xx, a body that is not a chat completion).")
    circuit_breaker: int = Field(8, ge=1, description="Refused connections in a row (nothing listening), or "
                                 "timeouts lasting one request's whole retry span with no answer in between "
                                 "(at least this many), after which the rollout stops with one error instead of "
                                 "spending every problem's retries on an endpoint that is down.")
    max_reply_bytes: int = Field(2_000_000, ge=1024, description="Largest reply body (bytes) read from the "
                                 "endpoint (kind=openai); a longer one fails that turn, naming the limit, and is "
                                 "neither read on nor stored.")

    #: what only decides how an answer is fetched, not what it is: left out of episode fingerprints, so a
    #: rerun with another port, timeout or retry count resumes the finished episodes
    TRANSPORT: ClassVar[frozenset[str]] = frozenset({"base_url", "api_key_env", "timeout_s", "max_retries",
                                                      "circuit_breaker", "max_reply_bytes"})

    def episode_settings(self) -> dict[str, Any]:
        """The settings that determine an episode (kind, model, sampling; for an HF model also the
        batch size, whose padding can change greedy numerics): what a fingerprint includes."""
        drop = set(self.TRANSPORT) | ({"batch_size"} if self.kind == "openai" else set())
        return self.model_dump(exclude=drop)


class RolloutConfig(Section):
    teacher: PolicyConfig = Field(PolicyConfig(), description="The teacher whose episodes SFT learns from.")
    samples_per_problem: int = Field(1, ge=1, description="Teacher episodes per training problem.")
    max_turns: int = Field(0, ge=0, description="Hard cap on turns (0 = each problem's own budget).")
    shard_size: int = Field(64, ge=1, description="Problems per flushed shard: a rerun runs unfinished shards only.")
    error_budget: float = Field(0.0, ge=0, le=1, description="Share of episodes that may fail after retries "
                                "(recorded as failed with their error) before the stage fails.")
    engine: Literal["local", "ray"] = Field(
        "local", description="Where episodes run: 'local' (this process) or 'ray' (sharded over Ray actors, "
        "settings in the 'ray' section); teacher rollout, every evaluation and the RL probe use it.")


class ValidateConfig(Section):
    max_truncation_rate: float = Field(0.2, ge=0, le=1, description="Largest share of truncated teacher "
                                       "episodes (cut off by a turn or token budget) the gate accepts.")
    min_success_rate: float = Field(0.5, ge=0, le=1, description="Smallest share of successful teacher "
                                    "episodes the gate accepts.")
    success_only: bool = Field(True, description="Keep only successful episodes in the SFT set.")
    allow_non_monotone: list[str] = Field(default_factory=list, description="Families used even though "
                                          "check-env finds a level that is easier than a lower one (an explicit "
                                          "override; synth and benchmark refuse such a family otherwise).")
    max_message_chars: int = Field(
        20000, ge=100, description="Longest message (content + tool-call arguments) a teacher episode may "
        "hold: an episode with a longer assistant message (a runaway generation) is excluded from the SFT set; "
        "a longer task or observation fails the gate.")


class SFTConfig(Section):
    max_steps: int = Field(16, ge=1, description="Optimizer steps.")
    batch_size: int = Field(1, ge=1, description="Conversations per forward/backward pass.")
    grad_accum: int = Field(4, ge=1, description="Passes accumulated per optimizer step (a step sees "
                            "batch_size x grad_accum conversations; the loss is normalised by the step's tokens).")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Field(1536, ge=16, description="Tokens per conversation; longer ones are truncated.")
    horizon_tokens: int = Field(0, ge=0, description="Keep the first H tokens of each trajectory (0 = all).")
    lora: bool = Field(False, description="Train LoRA adapters (rank lora_r) instead of all weights.")
    lora_r: int = Field(16, ge=1, description="LoRA rank (lora: true).")
    deepspeed: Literal["none", "zero2", "zero3"] = Field("none", description="DeepSpeed ZeRO stage for SFT "
                                                         "(none, zero2, zero3; needs the gpu extra).")
    save_steps: int = Field(8, ge=1, description="Checkpoint every N steps (a rerun resumes from the last).")
    seed: int = Field(0, description="Training seed (data order, adapter initialisation).")


class RLConfig(Section):
    max_steps: int = Field(3, ge=0, description="GRPO optimizer steps (0 = RL copies the SFT model).")
    prompts_per_step: int = Field(3, ge=1, description="Problems per step, each one GRPO group.")
    num_generations: int = Field(4, ge=2, description="Episodes per problem (the GRPO group size).")
    max_completion_length: int = Field(640, ge=16, description="Token cap of one episode's completion "
                                       "(all assistant turns and tool responses).")
    max_tool_calls: int = Field(8, ge=1, description="Tool calls per episode before it is cut off.")
    learning_rate: float = Field(3e-5, gt=0, description="Peak learning rate (AdamW).")
    beta: float = Field(0.0, ge=0, description="GRPO's KL penalty towards the SFT model (0 = none).")
    curriculum: Literal["difficulty", "random", "sampler"] = Field(
        "difficulty", description="Order of the probed problems: difficulty (easy to hard), random, or "
        "sampler (the order curriculum.sampler picks).")
    probe_samples: int = Field(4, ge=0, description="Pass-rate probe per problem (0 = no filter).")
    probe_problems: int = Field(12, ge=1, description="Training problems the probe measures (spread easy to hard).")
    refill_rounds: int = Field(2, ge=0, description="Dynamic sampling: rounds a step may replace its groups whose "
                               "rewards are all equal with fresh problems (0 = off, TRL's plain step).")
    save_steps: int = Field(2, ge=1, description="Checkpoint every N steps (a rerun resumes from the last).")
    micro_batch_size: int = Field(1, ge=1, description="Episodes per forward/backward pass: the step's "
                                  "prompts_per_step x num_generations episodes are accumulated in micro-batches "
                                  "of this size, which bounds peak memory.")
    seed: int = Field(0, description="Seed of the RL probe, the random curriculum order and GRPO training.")

    @model_validator(mode="after")
    def _micro_divides(self) -> RLConfig:
        total = self.prompts_per_step * self.num_generations
        if total % min(self.micro_batch_size, total):
            raise ValueError(f"rl.micro_batch_size ({self.micro_batch_size}) must divide prompts_per_step x "
                             f"num_generations ({total}); pick a divisor of {total}")
        return self


class StudentConfig(Section):
    source: str = Field("prune", description="'prune' (layer-drop of the teacher) or an HF id/path.")
    keep_every: int = Field(2, ge=1, description="Student size: as many decoder layers as every k-th plus the last.")
    prune: Literal["every", "influence", "block"] = Field(
        "influence", description="Which layers: every k-th + last, or the most influential on the teacher's data "
        "(ShortGPT block influence; first and last always kept), or all but the most redundant contiguous block.")
    warmup_steps: int = Field(60, ge=0, description="Steps of SFT warm start of the student on teacher "
                              "trajectories (sequence-level KD; 0 = none).")
    warmup_lr: float = Field(1e-3, gt=0, description="Learning rate of the warm start.")


class OPDConfig(Section):
    """Knobs of the multi-turn on-policy distillation variants (apprentice/training/opd).

    ``distill.variant`` picks the recipe; these knobs parameterise it. ``*_steps = 0`` means "over
    ``distill.max_steps``"."""

    samples_per_problem: int = Field(1, ge=1, description="Episodes per problem per step (GRPO group; atod/grpo need >= 2).")
    max_turns: int = Field(0, ge=0, description="Cap on turns per training episode (0 = each problem's budget).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of both executors in rollouts.")
    weighting: Literal["token", "turn"] = Field("token", description="Token-level or turn-balanced loss weights.")
    sod_alpha: float = Field(0.0, description="SOD step re-weighting exp(-alpha d_k/mean d): >0 attenuates high-divergence turns, <0 amplifies (T-DUR).")
    train_teacher_turns: bool = Field(False, description="Also distil on teacher-written turns (default: context only).")
    guided_p0: float = Field(0.5, ge=0, le=1, description="Guided-OPD: teacher-intervention probability at step 0.")
    guided_decay: Literal["linear", "cosine", "exponential"] = Field(
        "linear", description="Guided-OPD: shape of the decay of the intervention probability to 0.")
    guided_decay_steps: int = Field(0, ge=0, description="Steps until p reaches 0 (0 = distill.max_steps).")
    dash_drift_threshold: float = Field(0.9, gt=0, description="DASH: drift evidence that hands the turn to the teacher.")
    dash_recovery_threshold: float = Field(0.9, gt=0, description="DASH: recovery evidence that hands it back.")
    dash_allowance: float = Field(0.5, ge=0, lt=1, description="DASH: CUSUM allowance subtracted per turn (spike filter).")
    dash_scale: float = Field(1.0, gt=0, description="DASH: nats of log-ratio that normalise to ~0.63.")
    tcod_start_turns: int = Field(1, ge=1, description="TCOD: exposed depth at step 0.")
    tcod_end_turns: int = Field(8, ge=1, description="TCOD: exposed depth at the end of the schedule.")
    tcod_schedule: Literal["linear", "stages"] = Field(
        "linear", description="TCOD: depth grows linearly, or in equal plateaus (stages).")
    tcod_steps: int = Field(0, ge=0, description="Steps to reach the full depth (0 = distill.max_steps).")
    anneal_kind: Literal["linear", "cosine", "exponential"] = Field("linear", description="ATOD: OPD->RL schedule shape.")
    anneal_steps: int = Field(0, ge=0, description="ATOD: steps of the OPD->RL ramp (0 = distill.max_steps).")
    anneal_opd_end: float = Field(0.1, ge=0, description="ATOD: OPD weight at the end of the ramp (starts at 1).")
    anneal_rl_end: float = Field(1.0, ge=0, description="ATOD: RL weight at the end of the ramp (starts at 0).")
    privileged_context: Literal["oracle_plan", "answer"] = Field(
        "oracle_plan", description="privileged variant: what the self-teacher sees in its system prompt.")
    privileged_sync_steps: int = Field(0, ge=0, description="privileged: re-copy the student into the teacher every N steps (0 = never).")


class DistillConfig(Section):
    student: StudentConfig = Field(StudentConfig(), description="How the student is built and warm-started.")
    max_steps: int = Field(2, ge=0, description="On-policy distillation optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Prompts (or, for multi-turn variants, problems) per step.")
    max_completion_length: int = Field(48, ge=8, description="Tokens the student generates per prompt (multi-turn "
                                       "variants: per turn).")
    learning_rate: float = Field(5e-5, gt=0, description="Peak learning rate (AdamW).")
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "jsd", description="Token-level divergence between student and teacher: forward_kl, reverse_kl, or "
        "jsd (generalised JSD with beta).")
    beta: float = Field(0.5, ge=0, le=1, description="JSD interpolation (0 = forward KL, 1 = reverse KL).")
    variant: str = Field("vanilla", description="Which distillation trainer and recipe: a name registered in "
                         "apprentice/training/opd/variants.py (VARIANTS); an unknown name fails at load and "
                         "lists the registered ones.")
    opd: OPDConfig = Field(OPDConfig(), description="Knobs of the multi-turn variants.")
    prompt_source: Literal["problems", "trajectories", "both"] = Field(
        "both", description="Distillation prompts: problem starts, teacher-trajectory prefixes, or both."
    )
    save_steps: int = Field(2, ge=1, description="Checkpoint every N steps (a rerun resumes from the last).")
    micro_batch_size: int = Field(2, ge=1, description="Prompts per forward/backward pass of the single-turn "
                                  "trainer (vanilla): the step's batch_size prompts are generated together, then "
                                  "accumulated in micro-batches of this size, which bounds peak memory. The "
                                  "multi-turn variants batch by batch_size.")
    seed: int = Field(0, description="Seed of the student's warm start and distillation.")

    @field_validator("variant")
    @classmethod
    def _registered_variant(cls, v: str) -> str:
        names = variant_names()
        if v not in names:
            raise ValueError(f"unknown distill.variant '{v}'; choose from {names}")
        return v

    @model_validator(mode="after")
    def _micro_divides(self) -> DistillConfig:
        if self.batch_size % min(self.micro_batch_size, self.batch_size):
            raise ValueError(f"distill.micro_batch_size ({self.micro_batch_size}) must divide distill.batch_size "
                             f"({self.batch_size}); pick a divisor of {self.batch_size}")
        return self


class EvaluateConfig(Section):
    samples_per_problem: int = Field(1, ge=1, description="n for pass@k (k <= n).")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="The k of each pass@k reported (each "
                              "<= samples_per_problem).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0 = greedy).")
    max_new_tokens: int = Field(48, ge=1, description="Token cap of one assistant turn (also of the RL probe's and "
                                "the champion's rollouts).")
    batch_size: int = Field(64, ge=1, description="Episodes decoded together (at most; a finished episode's "
                            "place goes to the next one of its shard).")
    max_format_errors: int = Field(
        2, ge=0, description="End an episode after this many consecutive unparseable turns (0 = never); "
        "also used by the RL probe.")
    max_repeats: int = Field(
        3, ge=0, description="End an episode once the same calls got the same observations this many turns in a "
        "row (0 = never): a greedy agent that sees nothing change repeats itself to the end of its budget. "
        "Greedy evaluation and the frontier probe only: at evaluate.temperature > 0 a sampled agent can leave "
        "such a loop, so it plays on.")
    shard_size: int = Field(160, ge=1, description="Problems per flushed shard: a rerun runs unfinished shards "
                            "only. Larger than batch_size so finished episodes' places refill (the default "
                            "benchmark is one shard).")
    error_budget: float = Field(0.0, ge=0, le=1, description="Share of episodes that may fail after retries "
                                "(recorded as failed with their error) before the stage fails.")
    drafts: Literal["auto", True, False] = Field(
        "auto", description="Greedy evaluation drafts each turn from the parent model's episodes (RL from SFT, the "
        "student from RL, SFT from the previous candidate), verified in one prefill: auto = where that is exact "
        "(fp32 compute), true = in bf16 too (faster; a few episodes may round otherwise, and the parent's "
        "evaluation is no DVC dependency), false = never.")

    @model_validator(mode="after")
    def _pass_k_fits_samples(self) -> EvaluateConfig:
        too_big = [k for k in self.pass_k if k > self.samples_per_problem]
        if too_big:
            raise ValueError(
                f"pass@{too_big[0]} needs at least {too_big[0]} samples per problem but evaluate.samples_per_problem="
                f"{self.samples_per_problem}; raise evaluate.samples_per_problem or drop {too_big} from evaluate.pass_k")
        return self

    @property
    def repeat_stop(self) -> int:
        """``max_repeats`` where the episodes are greedy (a repeated step then repeats forever), else 0."""
        return self.max_repeats if self.temperature == 0 else 0


class PromoteConfig(Section):
    alpha: float = Field(0.05, gt=0, lt=1, description="Significance level of the paired test.")
    registered_model: str = Field("apprentice-agent", description="MLflow registered-model name the "
                                  "candidate is registered under.")
    candidate: Literal["sft", "rl", "student"] = Field(
        "rl", description="Which model of the iteration is registered and becomes `challenger`."
    )
    alternates: list[Literal["sft", "rl", "student"]] = Field(
        ["sft"], description="Other models of the iteration tested against the champion beside `candidate`; the "
        "one with the smallest p is promoted when p < alpha / (number tested) (Bonferroni: the chance of promoting "
        "a model no better than the champion stays <= alpha). [] tests `candidate` alone.")

    @field_validator("alternates")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"promote.alternates lists a model twice ({v}); list each at most once")
        return v

    @property
    def kinds(self) -> list[str]:
        """The models tested, ``candidate`` first (it wins ties, and is registered when none is promoted)."""
        return list(dict.fromkeys([self.candidate, *self.alternates]))


class LineageConfig(Section):
    tracking_uri: str = Field("sqlite:///mlruns.db", description="MLflow store; sqlite path or http URL.")
    experiment: str = Field("apprentice", description="MLflow experiment the runs are logged to.")


class EvolveConfig(Section):
    """Environment evolution: generation g -> g+1 by difficulty-raising operators. The evolve stage runs
    only while something reads its generations (``feed`` > 0: :mod:`apprentice.pipeline`)."""

    generations: int = Field(3, ge=1, description="Generations to evolve beyond generation 0.")
    problems: int = Field(60, ge=1, description="Problems in generation 0 (each later one evolves them all).")
    families: list[str] = Field(default_factory=list, description="Families evolved (empty = synth.families: "
                                "evolved problems of a family no iteration trains would feed nothing).")
    operators: list[Literal["horizon", "state", "harness"]] = Field(
        default_factory=lambda: ["horizon", "state", "harness"],  # type: ignore[arg-type]
        description="Directions applied in turn (one per problem per generation, round-robin).")
    reference_epsilon: float = Field(0.3, ge=0, le=1, description="Random-action share of the noisy oracle "
                                     "used as the fixed reference policy that measures each generation.")
    reference_samples: int = Field(2, ge=1, description="Reference episodes per evolved problem.")
    feed: int = Field(0, ge=0, description="RL: evolved problems the generation scheduler probes per generation "
                      "and adds to the RL pool (0 = off). It starts at generation 0 and moves on while the "
                      "policy's pass rate reaches curriculum.advance_threshold. Also what puts the evolve "
                      "stage in the pipeline: with 0 nothing reads its output, so it does not run.")
    seed: int = Field(0, description="Seed of generation 0 and of the reference episodes.")

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        return _resolve_families(v)


class CurriculumConfig(Section):
    """Which problems RL (and synthesis) spend rollouts on: one sampler, chosen by ``sampler``."""

    sampler: Literal["pass_band", "dtac", "hdc", "aes"] = Field(
        "pass_band", description="pass_band: pass rate near p_star; dtac: learnable + hard-won replay + "
        "some infeasible; hdc: harness weakening, then state scale; aes: cover abilities, not count.")
    p_star: float = Field(0.5, gt=0, lt=1, description="Target pass rate (pass_band, aes tie-break).")
    band: float = Field(0.35, gt=0, le=1, description="pass_band keeps |pass_rate - p_star| <= band.")
    hard_threshold: float = Field(0.25, gt=0, lt=1, description="dtac: 0 < pass rate <= this is hard-won.")
    easy_threshold: float = Field(0.9, gt=0, le=1, description="Pass rate >= this counts as mastered.")
    replay_share: float = Field(0.2, ge=0, le=1, description="dtac: share of hard-won successes replayed.")
    infeasible_share: float = Field(0.1, ge=0, le=1, description="dtac: share of never-solved problems.")
    min_attempts: int = Field(2, ge=1, description="Attempts before a 0 pass rate counts as infeasible.")
    advance_threshold: float = Field(0.6, gt=0, le=1, description="Scheduler: move to the next generation "
                                     "when the student's pass rate on the current one reaches this.")
    seed: int = Field(0, description="Seed of the samplers' tie-breaks between equally ranked problems.")
    evolve: EvolveConfig = Field(EvolveConfig(), description="Environment evolution and its feed into RL.")

    @field_validator("infeasible_share")
    @classmethod
    def _shares(cls, v: float, info: Any) -> float:
        if v + info.data.get("replay_share", 0.0) > 1:
            raise ValueError("replay_share + infeasible_share must be <= 1 (the rest is learnable problems)")
        return v


class FrontierConfig(Section):
    """The frontier controller (:mod:`apprentice.curriculum.frontier`): after each promotion the champion is
    probed on fresh dev problems per family x level, and the next iteration's synthesis mix follows its
    pass rates; fixed = every iteration synthesizes synth.levels (the controller off)."""

    mode: Literal["frontier", "fixed"] = Field(
        "frontier", description="frontier: iteration k > 1 trains where the champion's probed pass rate is near "
        "target (iteration 1 uses synth.levels); fixed: synth.levels in every iteration.")
    target: float = Field(0.5, gt=0, lt=1, description="The pass rate the window is centred on.")
    band: float = Field(0.3, gt=0, lt=1, description="A level is in the band when |pass rate - target| <= band, "
                        "mastered above it.")
    replay_share: float = Field(0.4, ge=0, lt=1, description="Share of the problems on mastered levels below the "
                                "window (so the climb does not forget them); no such level gets more problems "
                                "than a window level, the rest goes to the window.")
    explore_share: float = Field(0.2, ge=0, lt=1, description="Share on the level above the window (demonstrated "
                                 "before the champion reaches it).")
    probe_per_cell: int = Field(8, ge=1, description="Dev problems probed per family x level (greedy, one "
                                "episode each).")
    probe_above: int = Field(2, ge=0, description="Levels probed above the previous iteration's ceiling.")
    seed: int = Field(7, description="Seed of the dev problems (never the benchmark's or training's).")

    @model_validator(mode="after")
    def _shares(self) -> FrontierConfig:
        if self.replay_share + self.explore_share >= 1:
            raise ValueError(f"frontier.replay_share + frontier.explore_share must be < 1 (got "
                             f"{self.replay_share} + {self.explore_share}): the rest trains the window")
        return self


class LoopConfig(Section):
    """How iteration k > 1 trains SFT (:mod:`apprentice.training.loop_rules`)."""

    rule: Literal["continue", "restart", "self", "repair"] = Field(
        "continue", description="continue: from the champion at a lower learning rate with replay; restart: from "
        "the base model on the union of all validated data; self: continue + the champion's verifier-passed "
        "rollouts; repair: continue + the champion's failures cut at the first error, continued by the teacher.")
    lr_factor: float = Field(0.1, gt=0, le=1, description="From the champion: SFT runs at sft.learning_rate x this, "
                             "GRPO at rl.learning_rate x this.")
    warmup_steps: int = Field(2, ge=0, description="From the champion: linear warm-up steps of the learning rate.")
    max_steps: int = Field(48, ge=0, description="Iteration k > 1: SFT steps (0 = sft.max_steps). Its set is the new "
                           "data plus the replay, twice iteration 1's at replay_share 0.5: at sft.max_steps it saw a sixth "
                           "of it and left the champion where it was (docs/experiments.md).")
    replay_share: float = Field(0.5, ge=0, lt=1, description="From the champion: share of the SFT set drawn from "
                                "earlier iterations' validated data (< 1: the new data always stays).")
    self_share: float = Field(0.5, ge=0, le=1, description="self: share of the new data that is the champion's own "
                              "verifier-passed episodes (at most as many as passed; teacher rows fill the rest).")
    repair_share: float = Field(0.5, ge=0, le=1, description="repair: share of the new data that is repaired episodes.")
    problems: int = Field(64, ge=1, description="self/repair: new problems the champion plays (its rollouts cost "
                          "about as much as evaluating problems x samples episodes).")
    samples: int = Field(2, ge=1, description="self/repair: champion episodes per problem.")
    temperature: float = Field(1.0, ge=0, description="self/repair: the champion's sampling temperature.")
    seed: int = Field(0, description="Seed of replay sampling and of the champion's rollouts.")


class RayConfig(Section):
    """Ray cluster for ``rollout.engine: ray`` (apprentice/infra/distributed.py). Where episodes run, never
    what they compute: greedy results are identical to ``local``."""

    address: str = Field("local", description="'local' starts a private Ray instance for the call; 'auto' joins "
                         "the cluster of `ray start` on this node; host:6379 or ray://host:10001 joins a remote one.")
    workers: int = Field(2, ge=1, description="Rollout actors, each holding one policy replica.")
    threads_per_worker: int = Field(1, ge=1, description="CPUs (torch threads) each actor reserves.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each actor reserves (fractions share a GPU).")
    shards_per_worker: int = Field(1, ge=1, description="Problem shards per actor (more = finer progress and "
                                   "retries, smaller generation batches).")
    max_restarts: int = Field(3, ge=0, description="Times a dead actor is replaced and its shard rerun.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Fail fast when ray.address cannot be reached.")
    parallel_evaluations: bool = Field(True, description="With rollout.engine=ray, the flow runs the per-model "
                                       "evaluations concurrently as Prefect tasks on Ray (prefect-ray).")


class GPUConfig(Section):
    """The GPU path (apprentice/infra/gpu.py, profile ``gpu``): vLLM generation and multi-GPU launch."""

    use_vllm: bool = Field(False, description="TRL use_vllm for GRPO and distillation generation (needs the gpu extra).")
    vllm_mode: Literal["colocate", "server"] = Field("colocate", description="colocate: vLLM shares the "
                                                     "training GPUs; server: a `trl vllm-serve` process.")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="GPU share vLLM may take (colocate).")
    launcher: Literal["none", "accelerate"] = Field("none", description="How training stages start: in-process "
                                                     "or `accelerate launch` with accelerate_config.")
    accelerate_config: Literal["zero3", "fsdp"] = Field("zero3", description="apprentice/infra/accelerate/<name>.yaml")
    num_processes: int = Field(1, ge=1, description="GPUs (processes) accelerate launches.")

class EnvsConfig(Section):
    modules: list[str] = Field(
        default_factory=list, description="Python modules that register environment families (imported when "
        "the config loads, so every stage and subprocess sees them), e.g. [my_pkg.my_env]. Installed packages "
        "can instead declare an 'apprentice.envs' entry point.")


class Config(Section):
    pipeline: PipelineConfig = PipelineConfig()
    model: ModelConfig = ModelConfig()
    synth: SynthConfig = SynthConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    rollout: RolloutConfig = RolloutConfig()
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    distill: DistillConfig = DistillConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    promote: PromoteConfig = PromoteConfig()
    lineage: LineageConfig = LineageConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    frontier: FrontierConfig = FrontierConfig()
    loop: LoopConfig = LoopConfig()
    ray: RayConfig = RayConfig()
    gpu: GPUConfig = GPUConfig()

    envs: EnvsConfig = EnvsConfig()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=())

    @model_validator(mode="after")
    def _benchmark_covers_training(self) -> Config:
        missing = sorted(set(self.synth.families) - set(self.benchmark_families))
        if missing:
            raise ValueError(f"benchmark.families must cover every family trained on (synth.families); missing "
                             f"{missing}: add them, or leave benchmark.families empty to use synth.families")
        return self

    @property
    def benchmark_families(self) -> list[str]:
        return list(self.benchmark.families or self.synth.families)

    @property
    def benchmark_levels(self) -> list[int]:
        return list(self.benchmark.levels or self.synth.levels)

    @model_validator(mode="before")
    @classmethod
    def _load_env_modules(cls, data: Any) -> Any:
        """Import ``envs.modules`` first: the families they register are then known to ``synth.families``."""
        mods = ((data or {}).get("envs") or {}).get("modules") if isinstance(data, dict) else None
        if mods:
            from apprentice.envs import load_modules

            load_modules([str(m) for m in mods] if isinstance(mods, list) else [str(mods)])
        return data


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value (e.g. sft.max_steps=10)")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
    node[parts[-1]] = yaml.safe_load(value)


#: Keys that moved to another section: the error names the new key.
MOVED = {"synth.n_eval": "benchmark.n"}


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]).replace("validate_", "validate")
        if e["type"] == "extra_forbidden" and key in MOVED:
            lines.append(f"  - '{key}' has moved: use '{MOVED[key]}' instead")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  - '{key}' is not a known key; remove it or check its spelling")
        else:
            got = e.get("input")
            lines.append(f"  - '{key}': {e['msg']} (got {got!r}); fix it in the params file or with --set {key}=...")
    return "\n".join(lines)


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently,
    so a second ``sft:`` section used to replace the first without a word)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"{getattr(loader, 'source', '<params>')}:{key_node.start_mark.line + 1}: key '{key}' "
                              f"appears twice in the same mapping (first on line {seen[key]}); merge the two into one")
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def read_yaml(path: Path) -> Any:
    """Parse a params/profile file strictly: a syntax error or a duplicate key is one :class:`ConfigError`
    naming the file and line (not a PyYAML traceback)."""
    path = Path(path)
    loader = _StrictLoader(path.read_text())
    loader.source = str(path)  # type: ignore[attr-defined]
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML ({what}); fix the file (indentation, a missing ':' or quote)") from None
    finally:
        loader.dispose()


def load_raw(path: str | Path = "params.yaml", profile: str | None = None,
             overrides: list[str] | None = None) -> dict[str, Any]:
    path = Path(path)
    raw: dict[str, Any] = {}
    if path.exists():
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, not {type(raw).__name__}")
    elif str(path) != "params.yaml":
        raise ConfigError(f"params file {path} does not exist")
    if profile and profile != "default":
        pfile = PROFILES_DIR / f"{profile}.yaml"
        if not pfile.exists():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
            raise ConfigError(f"unknown profile '{profile}'; choose from {['default', *known]}")
        raw = _deep_merge(raw, read_yaml(pfile) or {})
        raw.setdefault("pipeline", {})["profile"] = profile
    for item in overrides or []:
        _apply_override(raw, item)
    return raw


def load_config(path: str | Path = "params.yaml", profile: str | None = None,
                overrides: list[str] | None = None) -> Config:
    """Load, merge profile and overrides, validate. Raises :class:`ConfigError` naming the bad key."""
    raw = load_raw(path, profile, overrides)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, str(path))) from None
