"""Resume finds the last *complete* checkpoint; metrics continue the run's counters across a resume.

The checkpoints here are built from the same files HF's Trainer writes (``torch.save`` archives,
safetensors, ``trainer_state.json``), then damaged the way a ``kill -9`` or a full disk leaves them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from apprentice.training import common


def _checkpoint(work: Path, step: int) -> Path:
    d = work / f"checkpoint-{step}"
    d.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, str(d / "model.safetensors"))
    torch.save({"state": {0: torch.zeros(4)}}, d / "optimizer.pt")
    torch.save({"python": 1}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def test_complete_checkpoint_is_resumed_from(tmp_path):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)
    assert common.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert common.checkpoint_problem(tmp_path / "checkpoint-2") is None


@pytest.mark.parametrize("damage", ["no_state", "empty_optimizer", "truncated_optimizer", "truncated_weights",
                                    "half_state"])
def test_half_written_checkpoint_is_moved_aside_and_the_previous_one_wins(tmp_path, damage):
    _checkpoint(tmp_path, 1)
    bad = _checkpoint(tmp_path, 2)
    if damage == "no_state":  # killed before trainer_state.json (written last)
        (bad / "trainer_state.json").unlink()
    elif damage == "empty_optimizer":  # the observed case: 0-byte optimizer.pt, no state
        (bad / "optimizer.pt").write_bytes(b"")
        (bad / "trainer_state.json").unlink()
    elif damage == "truncated_optimizer":  # full disk: a state file from an older layout, a cut archive
        data = (bad / "optimizer.pt").read_bytes()
        (bad / "optimizer.pt").write_bytes(data[: len(data) // 2])
    elif damage == "truncated_weights":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[:20])
    elif damage == "half_state":
        (bad / "trainer_state.json").write_text('{"global_st')

    with pytest.warns(UserWarning, match="checkpoint-2 is incomplete"):
        assert common.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert not bad.exists()
    (aside,) = (tmp_path / "broken").iterdir()
    assert aside.name.startswith("checkpoint-2-")
    assert common.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")  # stable on the next rerun


def test_no_complete_checkpoint_means_start_from_scratch(tmp_path):
    bad = _checkpoint(tmp_path, 1)
    (bad / "trainer_state.json").unlink()
    with pytest.warns(UserWarning):
        assert common.last_checkpoint(tmp_path) is None
    assert common.last_checkpoint(tmp_path / "missing") is None


def _state(step: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, is_world_process_zero=True)


def test_metrics_continue_counters_and_train_loss_after_resume(tmp_path):
    """Steps 1-3 logged in one go == steps 1-2, a kill (a half line), trim to step 2, step 3 resumed."""
    losses, tokens = [0.5, 0.25, 0.125], [100.0, 210.0, 330.0]

    whole = tmp_path / "whole.jsonl"
    cb = common.MetricsCallback(whole, "sft")
    for s in (1, 2, 3):
        cb.on_log(None, _state(s), None, logs={"loss": losses[s - 1], "num_tokens": tokens[s - 1]})
    cb.on_log(None, _state(3), None, logs={"train_loss": sum(losses) / 3, "train_runtime": 1.0})

    resumed = tmp_path / "resumed.jsonl"
    cb = common.MetricsCallback(resumed, "sft")
    for s in (1, 2, 3):
        cb.on_log(None, _state(s), None, logs={"loss": losses[s - 1], "num_tokens": tokens[s - 1]})
    with resumed.open("a") as f:
        f.write('{"stage": "sft", "st')  # a kill in the middle of a line
    common.trim_metrics(resumed, "sft", 2)
    cb = common.MetricsCallback(resumed, "sft")
    # the restarted trainer counts tokens and loss from zero: only step 3's own
    cb.on_log(None, _state(3), None, logs={"loss": losses[2], "num_tokens": tokens[2] - tokens[1]})
    cb.on_log(None, _state(3), None, logs={"train_loss": losses[2], "train_runtime": 1.0})

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "time"} for r in rows]

    assert strip(common.read_metrics(resumed)) == strip(common.read_metrics(whole))
    times = [r["time"] for r in common.read_metrics(resumed)]
    assert times == sorted(times)  # the clock continues, it does not restart at 0
    assert common.summary_train_loss(resumed, "sft", losses[2]) == sum(losses) / 3
