"""``kill -9`` of a real SFT stage (tiny model, real TRL) during a checkpoint save and during a step:
the rerun resumes from the last complete checkpoint and ends with the same weights and the same
metrics (minus wall-clock fields) as an uninterrupted run.

The comparison is bitwise, so every training runs with deterministic kernels (one thread, MKL's
reproducible code path, torch's deterministic algorithms): a difference can then only come from the
resume (data order, optimizer or scheduler state, RNG, a lost or repeated step), not from a BLAS
kernel that summed in another order in another process. With the default kernels the weights
can differ by rounding alone, which would hide a real resume bug among false alarms; a failure names
the tensors that differ and the first logged step whose loss differs, so the cause is visible.

Slow (five short trainings in subprocesses, minutes): ``.ci/run`` runs it with
``APPRENTICE_RUN_SLOW=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from apprentice.paths import Paths
from apprentice.training.common import METRICS_FILE, read_metrics, work_dir_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # three trainings per test; minutes on a loaded 2-core machine
    pytest.mark.skipif(not os.environ.get("APPRENTICE_RUN_SLOW"), reason="set APPRENTICE_RUN_SLOW=1 (~3 min)"),
]
ROOT = Path(__file__).resolve().parents[2]
WALL_CLOCK = {"time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}

# The child: one SFT stage; `save` cuts optimizer.pt of checkpoint-2 in half and SIGKILLs itself (what a
# kill or a full disk during torch.save leaves), `step` SIGKILLs itself at the start of step 3.
_DRIVER = r"""
import json, os, signal, sys
import torch
from transformers import TrainerCallback
from apprentice.config import Config
from apprentice.paths import Paths
from apprentice.stages import sft

root, tiny, mode = sys.argv[1:4]
torch.use_deterministic_algorithms(True)
cfg = Config.model_validate({"model": {"base": tiny, "dtype": "fp32"},
                             "sft": {"max_steps": 4, "batch_size": 2, "max_length": 128, "save_steps": 1}})
callbacks = []
if mode == "save":
    real_save = torch.save
    def cut_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        if str(f).endswith("optimizer.pt") and "checkpoint-2" in str(f):
            data = open(f, "rb").read()
            open(f, "wb").write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save = cut_save
elif mode == "step":
    class Kill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    callbacks.append(Kill())
print("RESULT " + json.dumps(sft.run(cfg, Paths(__import__("pathlib").Path(root)), callbacks=callbacks)))
"""


# read by OpenMP and MKL when they start, hence set for the child rather than inside it
DETERMINISTIC = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "MKL_CBWR": "COMPATIBLE"}


def _sft(root: Path, tiny: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _DRIVER, str(root), tiny, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, **DETERMINISTIC})


def _differences(weights: dict, ref_weights: dict, rows: list[dict], ref_rows: list[dict]) -> str:
    """What differs from the uninterrupted run: the tensors (max |delta|) and the first differing metrics row."""
    bad = {k: float((weights[k] - v).abs().max()) for k, v in ref_weights.items() if not torch.equal(weights[k], v)}
    first = next(((a, b) for a, b in zip(rows[:-1], ref_rows[:-1], strict=False) if a != b), None)
    return (f"{len(bad)} of {len(ref_weights)} tensors differ (max |delta| {dict(list(bad.items())[:5])}); "
            f"first differing metrics row (rerun, uninterrupted): {first}")


def _data(root: Path) -> None:
    """problems + oracle SFT trajectories of the echo environment (tests/echokit.py, as test_training)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from echokit import EchoEnv, write_data

    from apprentice.envs import FAMILIES

    FAMILIES["echo"] = EchoEnv
    try:
        write_data(Paths(root))
    finally:
        FAMILIES.pop("echo", None)


def _summary(root: Path) -> tuple[dict, list[dict]]:
    model = Paths(root).sft_model
    rows = [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in read_metrics(model / METRICS_FILE)]
    # DVCLive's files (what DVC plots and MLflow charts read) must match byte for byte too
    live = {p.relative_to(model).as_posix(): p.read_text() for p in sorted((model / "dvclive").rglob("*")) if p.is_file()}
    assert "dvclive/plots/metrics/loss.tsv" in live
    return AutoModelForCausalLM.from_pretrained(str(model)).state_dict(), [*rows, live]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("uninterrupted")
    _data(root)
    proc = _sft(root, tiny_model_dir, "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _summary(root), json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("mode", ["save", "step"])
def test_kill_9_then_rerun_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, reference, mode):
    (ref_weights, ref_rows), ref_result = reference
    _data(tmp_path)
    killed = _sft(tmp_path, tiny_model_dir, mode)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    work = work_dir_for(Paths(tmp_path).sft_model)
    if mode == "save":  # the broken checkpoint is there, as after a real kill during the save
        assert (work / "checkpoint-2" / "optimizer.pt").stat().st_size > 0
        assert not (work / "checkpoint-2" / "trainer_state.json").exists()

    rerun = _sft(tmp_path, tiny_model_dir, "none")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = json.loads(rerun.stdout.split("RESULT ", 1)[1])
    if mode == "save":
        assert "checkpoint-2 is incomplete" in rerun.stderr and result["resumed_from_step"] == 1
    else:
        assert result["resumed_from_step"] == 2
    weights, rows = _summary(tmp_path)
    same = all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert same, "weights differ from an uninterrupted run: " + _differences(weights, ref_weights, rows, ref_rows)
    assert rows == ref_rows  # num_tokens, loss, train_loss... continue exactly
    assert result["train_loss"] == ref_result["train_loss"] and result["steps"] == ref_result["steps"]
