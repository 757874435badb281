"""The gpu profile on a CPU machine: it loads, its launch commands are well formed, the extra is
declared, and a missing GPU stack fails with one message naming the extra."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from apprentice.config import GPUConfig, load_config
from apprentice.infra import gpu

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_profile_loads_bf16_vllm_and_accelerate():
    cfg = load_config(ROOT / "params.yaml", profile="gpu")
    assert cfg.model.dtype == "bf16" and cfg.gpu.use_vllm and cfg.gpu.launcher == "accelerate"
    assert cfg.pipeline.profile == "gpu"


def test_gpu_launch_commands_are_well_formed():
    cfg = load_config(ROOT / "params.yaml", profile="gpu")
    cmd = gpu.launch_command("rl", cfg, iteration=2, python="python")
    assert cmd[:3] == ["python", "-m", "accelerate.commands.launch"]
    cfgfile = Path(cmd[cmd.index("--config_file") + 1])
    ds = Path(cmd[cmd.index("--deepspeed_config_file") + 1])
    assert cfgfile.exists() and ds.exists() and cmd[cmd.index("--num_processes") + 1] == "1"
    assert cmd[-7:] == ["-m", "apprentice", "rl", "--profile", "gpu", "--iter", "2"]
    acc = yaml.safe_load(cfgfile.read_text())
    assert acc["distributed_type"] == "DEEPSPEED" and acc["mixed_precision"] == "bf16"
    assert (ROOT / acc["deepspeed_config"]["deepspeed_config_file"]).exists()
    fsdp = cfg.model_copy(update={"gpu": cfg.gpu.model_copy(update={"accelerate_config": "fsdp", "num_processes": 4})})
    c2 = gpu.launch_command("sft", fsdp, python="python")
    assert "--deepspeed_config_file" not in c2 and c2[c2.index("--num_processes") + 1] == "4"
    assert yaml.safe_load(Path(c2[c2.index("--config_file") + 1]).read_text())["distributed_type"] == "FSDP"
    assert gpu.launch_command("evaluate", cfg, python="python")[:4] == ["python", "-m", "apprentice", "evaluate"]
    # accelerate's own parser accepts the launch flags we emit
    from accelerate.commands.launch import launch_command_parser

    ns = launch_command_parser().parse_args(cmd[3:])
    assert ns.config_file == str(cfgfile) and ns.module and ns.training_script == "apprentice"
    # and the CLI prints the same command
    out = subprocess.run([sys.executable, "-m", "apprentice.infra.gpu", "launch", "sft", "--params", str(ROOT / "params.yaml")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "accelerate.commands.launch" in shlex.split(out)[2]


def test_gpu_extra_is_declared_and_missing_packages_name_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("vllm") for d in extras["gpu"]) and any(d.startswith("deepspeed") for d in extras["gpu"])
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(gpu.GPUUnavailable, match=r"pip install -e '\.\[gpu\]'") as e:
            gpu.require(GPUConfig(use_vllm=True), need_cuda=False)
        assert "vllm" in str(e.value)
    from trl import GRPOConfig

    extra = gpu.trl_extras(GPUConfig(use_vllm=True, vllm_mode="colocate"), GRPOConfig)
    assert extra == {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
    assert gpu.trl_extras(GPUConfig(), GRPOConfig) == {}


def test_gpu_smoke_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_smoke.sh")], check=True)
