"""The GPU path: what the ``gpu`` profile needs from the machine, and how its stages are launched.

Why a module of its own: the CPU default must stay as simple as it is, so every GPU-only dependency
(vLLM, a CUDA torch, DeepSpeed's kernels) is checked here, once, with one error that names the
extra to install, instead of failing deep inside TRL with an ImportError. Launching is delegated to
the existing engines: ``accelerate launch`` with the configs in ``apprentice/infra/accelerate/`` (DeepSpeed
ZeRO-3 or FSDP2), TRL's own ``use_vllm`` for generation inside GRPO and distillation, and ``vllm
serve`` (OpenAI-compatible) when a large model is the teacher.

    python -m apprentice.infra.gpu check --profile gpu         # what is missing, or "ready"
    python -m apprentice.infra.gpu launch sft --profile gpu    # prints the accelerate command for a stage
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

from apprentice.config import Config, GPUConfig, load_config

GPU_EXTRA = "pip install -e '.[gpu]'"
ACCELERATE_DIR = Path(__file__).resolve().parent / "accelerate"
DEEPSPEED_DIR = Path(__file__).resolve().parent / "deepspeed"
#: stages that train (launched under accelerate); the others run as plain processes.
TRAINING_STAGES = ("sft", "rl", "distill")


class GPUUnavailable(RuntimeError):
    """The gpu profile was asked for on a machine that lacks a GPU or the gpu extra."""


def missing(cfg: GPUConfig, *, need_cuda: bool = True) -> list[str]:
    """What the GPU path lacks on this machine (empty = ready)."""
    out = []
    if need_cuda:
        import torch

        if not torch.cuda.is_available():
            out.append("no CUDA GPU visible to torch (torch.cuda.is_available() is False; a CPU-only torch wheel?)")
    if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
        out.append("package 'vllm' (gpu.use_vllm: true)")
    if cfg.launcher == "accelerate" and cfg.accelerate_config == "zero3" and importlib.util.find_spec("deepspeed") is None:
        out.append("package 'deepspeed' (gpu.accelerate_config: zero3)")
    return out


def require(cfg: GPUConfig, *, need_cuda: bool = True) -> None:
    """Raise one :class:`GPUUnavailable` naming everything missing and the extra that installs it."""
    gaps = missing(cfg, need_cuda=need_cuda)
    if gaps:
        raise GPUUnavailable("the gpu profile needs: " + "; ".join(gaps) + f". Install the GPU extra with `{GPU_EXTRA}` "
                             "on a machine with an NVIDIA GPU, or run the default/quick profile on CPU")


def trl_extras(cfg: GPUConfig, config_cls: type) -> dict[str, Any]:
    """TRL config fields for generation with vLLM, filtered to those ``config_cls`` has (GRPOConfig,
    DistillationConfig): pass them as ``**extra`` to :func:`apprentice.training.common.trl_args`."""
    if not cfg.use_vllm:
        return {}
    want = {"use_vllm": True, "vllm_mode": cfg.vllm_mode,
            "vllm_gpu_memory_utilization": cfg.vllm_gpu_memory_utilization}
    fields = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set(want)
    return {k: v for k, v in want.items() if k in fields}


def accelerate_config_file(cfg: GPUConfig) -> Path:
    return ACCELERATE_DIR / f"{cfg.accelerate_config}.yaml"


def launch_command(stage: str, cfg: Config, *, profile: str = "gpu", iteration: int | None = None,
                   python: str = sys.executable) -> list[str]:
    """The argv that runs ``stage`` on this profile: ``accelerate launch`` for training stages when
    ``gpu.launcher: accelerate``, else ``python -m apprentice <stage>``."""
    tail = ["-m", "apprentice", stage, "--profile", profile]
    if iteration is not None:
        tail += ["--iter", str(iteration)]
    g = cfg.gpu
    if stage not in TRAINING_STAGES or g.launcher == "none":
        return [python, *tail]
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config_file(g)),
           "--num_processes", str(g.num_processes)]
    if g.accelerate_config == "zero3":  # absolute, so the launch works from any directory
        cmd += ["--deepspeed_config_file", str(DEEPSPEED_DIR / "zero3.json")]
    return [*cmd, *tail]


def vllm_serve_command(model: str, port: int = 8000, gpu_memory_utilization: float = 0.85) -> list[str]:
    """A vLLM OpenAI-compatible server for a teacher: then ``rollout.teacher: {kind: openai,
    base_url: http://127.0.0.1:<port>/v1, model: <model>}``. Tool calls need vLLM's auto tool choice."""
    return ["vllm", "serve", model, "--port", str(port), "--dtype", "bfloat16",
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apprentice.infra.gpu", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["check", "launch"])
    p.add_argument("stage", nargs="?", default="sft")
    p.add_argument("--profile", default="gpu")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--iter", type=int, default=None)
    a = p.parse_args(argv)
    cfg = load_config(a.params, profile=a.profile)
    if a.what == "check":
        gaps = missing(cfg.gpu)
        print("ready" if not gaps else "missing: " + "; ".join(gaps) + f"\ninstall: {GPU_EXTRA}")
        return 0 if not gaps else 1
    print(shlex.join(launch_command(a.stage, cfg, profile=a.profile, iteration=a.iter)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
