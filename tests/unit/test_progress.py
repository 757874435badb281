"""Quiet mode and checkpoint progress (apprentice/progress.py), and the flow's wall-time table."""

from __future__ import annotations

import os

from transformers import TrainerControl, TrainerState

from apprentice import progress
from apprentice.training import loggers


def test_quiet_mode_turns_bars_off(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setenv("APPRENTICE_QUIET", "0")
    progress.apply_quiet()
    assert progress.enabled() and "TQDM_DISABLE" not in os.environ
    monkeypatch.setenv("APPRENTICE_QUIET", "1")
    progress.apply_quiet()
    assert not progress.enabled() and os.environ["TQDM_DISABLE"] == "1"


def test_checkpoint_saving_says_how_long_and_the_eta(capsys):
    cb = loggers.CheckpointProgress("sft")
    state, control = TrainerState(max_steps=10, global_step=4), TrainerControl()
    cb.on_train_begin(None, state, control)
    control.should_save = True
    cb.on_step_end(None, state, control)
    cb.on_save(None, state, control)
    err = capsys.readouterr().err
    assert "sft: saving checkpoint-4 ..." in err
    assert "sft: checkpoint-4 saved in" in err and "4/10 steps, ETA" in err
    control.should_save = False
    cb.on_step_end(None, state, control)
    cb.on_save(None, state, control)  # a save this callback did not see start: nothing to say
    assert capsys.readouterr().err == ""


def test_wall_time_table_lists_every_stage_and_the_total():
    from flows.self_improve import wall_time_table

    text = wall_time_table([{"stages": [{"stage": "synth-1", "executed": False, "wall_s": 3.0},
                                        {"stage": "sft-1", "executed": True, "wall_s": 117.0}]}])
    assert "synth-1" in text and "skipped (unchanged)" in text and "2.0 min" in text and "98%" in text
    assert "total" in text
