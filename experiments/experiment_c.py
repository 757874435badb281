"""On-policy distillation measurements: (a) does OPD improve faster than GRPO early; (b) does vanilla multi-turn OPD's
per-turn KL grow with the turn index, and do Guided-OPD / DASH-OPD / TCOD reduce that growth?

    .venv/bin/python experiments/experiment_c.py --root /tmp/expc --figures docs/figures
    # options: --steps 12 --problems 6 --variants opd,grpo,atod,guided,dash,tcod --teacher-steps 150
    #          --student-steps 25 --eval 24 --jobs 2

Everything is real: a teacher (tiny Llama, SmolLM2 vocabulary) is SFT-trained on oracle episodes of
a small multi-turn environment; the student is an early checkpoint of the same run (format mostly
learnt, task not); each variant then trains a copy of the student with the pipeline's OPD trainer
(``apprentice.training.opd``: TRL ``DistillationTrainer`` + mixed rollouts, env tools executed) and
logs per-step diagnostics; every trained student is finally evaluated greedily on held-out problems.

Environment (``Keypad``): the task names ``length`` keys from {a, b, c} and which to press first; the
one tool ``press(key)`` accepts the next correct key ("ok. Press b.") and rejects a wrong one ("wrong
key. Press b."), so a mistake costs a turn and leads into states the teacher never saw in its SFT data
(the drift OPD papers describe). The hint makes the observation-to-action mapping local, which a
2-layer model learns in ~100 SFT steps (it stayed at chance when it had to count presses itself).
Reward = fraction of the sequence entered (partial credit gives GRPO a signal); success = all of it.
Budget = length + 2 turns.

Why a toy: on the shared 2-core CPU the 49k-word vocabulary head dominates every forward, so an
episode must stay ~150 tokens for a sweep to fit in minutes (docs/experiments.md, the OPD sweep's caveats).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from apprentice.envs.base import DifficultyAxis, Environment, ProblemSpec, ToolCall, tool  # noqa: E402

KEYS = "abc"


class Keypad(Environment):
    family: ClassVar[str] = "keypad"
    axes: ClassVar[tuple[DifficultyAxis, ...]] = (DifficultyAxis("length", 1, 6),)
    system_prompt: ClassVar[str] = "Press the keys in order."

    def build(self, spec: ProblemSpec) -> str:
        rng = spec.rng()
        self._target = [rng.choice(KEYS) for _ in range(int(spec.difficulty["length"]))]
        self._n = 0
        return "Keys: " + " ".join(self._target) + f". Press {self._target[0]}."

    @tool
    def press(self, key: str) -> str:
        """
        Press one key.

        Args:
            key: a, b or c.
        """
        self.turns += 1
        if self.done:
            return "done"
        if str(key) != self._target[self._n]:
            return f"wrong key. Press {self._target[self._n]}."
        self._n += 1
        self.reward = self._n / len(self._target)
        self.done = self._n == len(self._target)
        return "done" if self.done else f"ok. Press {self._target[self._n]}."

    def oracle(self) -> list[ToolCall]:
        return [ToolCall("press", {"key": k}) for k in self._target]

    def turn_budget(self) -> int:
        return len(self._target) + 2


def keypad(spec: ProblemSpec) -> Environment:
    return Keypad()


def specs(n: int, offset: int, length: int) -> list[ProblemSpec]:
    return [Keypad.make_spec(offset + i, {"length": length}) for i in range(n)]


# ---- teacher and student: a plain SFT loop on oracle episodes ----------------------------------------
def oracle_messages(spec: ProblemSpec) -> list[dict]:
    from apprentice.policies.toolcalls import assistant_message

    env = Keypad()
    msgs = [{"role": "system", "content": Keypad.system_prompt}, {"role": "user", "content": env.reset(spec=spec)}]
    for c in env.oracle():
        msgs.append(assistant_message("", [{"name": c.name, "arguments": dict(c.arguments)}]))
        msgs.append({"role": "tool", "name": c.name, "content": env.execute(c)})
    return msgs


def build_models(root: Path, tok_dir: str, teacher_steps: int, student_steps: int, length: int,
                 seed: int = 0, batch: int = 8, lr: float = 5e-3, init: str = "",
                 key_weight: float = 1.0) -> tuple[str, str, dict]:
    """SFT a tiny model on oracle episodes (logits only at assistant tokens: with a 49k vocabulary
    the LM head over every position dominates TRL SFT's step on CPU, so this plain loop is much faster); save the checkpoint at ``student_steps``
    as the student and the one at ``teacher_steps`` as the teacher. Cached in ``root``."""
    from apprentice.lm.modeling import load_model, load_tokenizer, make_tiny_model, save_model

    t_dir, s_dir = root / "teacher", root / "student"
    info_file = root / "models.json"
    if info_file.exists() and (t_dir / "config.json").exists() and (s_dir / "config.json").exists():
        return str(t_dir), str(s_dir), json.loads(info_file.read_text())
    tok = load_tokenizer(tok_dir)
    if not init:
        init = make_tiny_model(tok, root / "init", hidden=64, layers=2, seed=seed)
    model = load_model(init)
    if student_steps == 0:
        save_model(model, tok, s_dir)
    model.train()
    tools = Keypad.tool_schemas()
    data = []
    for s in specs(512, 10_000, length):
        enc = tok.apply_chat_template(oracle_messages(s), tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        data.append((enc["input_ids"], enc["assistant_masks"]))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # The key is 1 of ~29 assistant tokens per turn; the rest is fixed JSON. Up-weighting it makes the
    # decision, not the format, dominate the loss (otherwise 120 steps left it at chance).
    key_ids = torch.tensor([tok.convert_tokens_to_ids(k) for k in KEYS])
    g = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.time()
    for step in range(1, teacher_steps + 1):
        idx = torch.randint(len(data), (batch,), generator=g).tolist()
        width = max(len(data[i][0]) for i in idx)
        ids = torch.tensor([data[i][0] + [tok.pad_token_id] * (width - len(data[i][0])) for i in idx])
        mask = torch.tensor([data[i][1] + [0] * (width - len(data[i][1])) for i in idx])
        att = torch.tensor([[1] * len(data[i][0]) + [0] * (width - len(data[i][0])) for i in idx])
        h = model.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1]
        sel = mask[:, 1:].bool()
        tgt = ids[:, 1:][sel]
        ce = torch.nn.functional.cross_entropy(model.lm_head(h[sel]).float(), tgt, reduction="none")
        w = 1.0 + (key_weight - 1.0) * torch.isin(tgt, key_ids).float()
        loss = (w * ce).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == student_steps:
            save_model(model, tok, s_dir)
        if step % 10 == 0:
            print(f"sft step {step} loss {sum(losses[-10:]) / 10:.4f} ({time.time() - t0:.0f}s)", flush=True)
    save_model(model, tok, t_dir)
    info = {"teacher_steps": teacher_steps, "student_steps": student_steps, "final_loss": losses[-1],
            "student_loss": losses[student_steps - 1] if student_steps else None, "init": init, "key_weight": key_weight,
            "sft_s": round(time.time() - t0, 1)}
    info_file.write_text(json.dumps(info))
    return str(t_dir), str(s_dir), info


def evaluate(model_dir: str, tok_dir: str, eval_specs: list[ProblemSpec]) -> dict:
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.policies.hf import HFPolicy
    from apprentice.rollout.episodes import run_episodes

    pol = HFPolicy(load_model(model_dir), load_tokenizer(tok_dir), temperature=0.0, max_new_tokens=36,
                   dtype="fp32", batch_size=64)
    trajs = run_episodes(eval_specs, pol, progress=False, env_factory=keypad)
    n = len(trajs)
    return {"success": sum(t.success for t in trajs) / n, "reward": sum(t.reward for t in trajs) / n,
            "turns": sum(t.turns for t in trajs) / n, "n": n}


# ---- one variant -------------------------------------------------------------------------------------
def run_variant(name: str, a: dict) -> dict:
    torch.set_num_threads(1)  # tiny models on a shared box: 1 thread is several times faster than 2
    from apprentice.config import Config
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training.common import MetricsCallback, read_metrics
    from apprentice.training.opd import VARIANTS
    from apprentice.training.opd.trainer import make_trainer

    out = Path(a["root"]) / name
    metrics = out / "metrics.jsonl"
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    metrics.unlink(missing_ok=True)
    cfg = Config.model_validate({"distill": {"variant": name, "max_steps": a["steps"], "seed": a["seed"], "opd": {
        "samples_per_problem": a["samples"], "temperature": a["temperature"], "guided_p0": 0.5,
        "tcod_start_turns": 1, "tcod_end_turns": a["length"] + 2, "tcod_schedule": "linear",
        "anneal_kind": "linear", "anneal_opd_end": 0.0, "anneal_rl_end": 1.0}}})
    recipe = VARIANTS[name](cfg)
    tok = load_tokenizer(a["tok_dir"])
    student = load_model(a["student"])
    student.train()
    teacher = load_model(a["teacher"])
    t0 = time.time()
    trainer = make_trainer(recipe, student=student, teacher=teacher, tokenizer=tok,
                           specs=specs(a["problems"] * a["steps"], 0, a["length"]),
                           output_dir=str(out / "work"), max_steps=a["steps"], batch_size=a["problems"],
                           learning_rate=a["lr"], beta=a["beta"], seed=a["seed"], dtype="fp32", save_steps=10_000,
                           turn_tokens=32, env_factory=keypad, callbacks=[MetricsCallback(metrics, name)])
    trainer.train()
    train_s = time.time() - t0
    final = out / "model"
    from apprentice.lm.modeling import save_model

    save_model(trainer.accelerator.unwrap_model(trainer.model), tok, final)
    ev = evaluate(str(final), a["tok_dir"], specs(a["eval"], 50_000, a["length"]))
    rows = [r for r in read_metrics(metrics) if "opd/success" in r]
    res = {"variant": name, "train_s": round(train_s, 1), "eval": ev, "rows": rows}
    (out / "result.json").write_text(json.dumps(res))
    return res


# ---- analysis ----------------------------------------------------------------------------------------
def kl_by_turn(rows: list[dict]) -> dict[int, float]:
    acc: dict[int, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("opd/kl_turn_") and v is not None:
                acc.setdefault(int(k.rsplit("_", 1)[1]), []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def slope(d: dict[int, float]) -> float:
    xs, ys = list(d), list(d.values())
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def summarise(results: dict[str, dict], baseline: dict) -> list[dict]:
    table = []
    for name, r in results.items():
        rows = r["rows"]
        third = max(len(rows) // 3, 1)
        kl = kl_by_turn(rows)
        table.append({
            "variant": name,
            "early_success": sum(x["opd/success"] for x in rows[:third]) / third,
            "early_reward": sum(x["opd/reward"] for x in rows[:third]) / third,
            "late_success": sum(x["opd/success"] for x in rows[-third:]) / third,
            "late_reward": sum(x["opd/reward"] for x in rows[-third:]) / third,
            "loss_opd_first": rows[0].get("opd/loss_opd"), "loss_opd_last": rows[-1].get("opd/loss_opd"),
            "zero_grad_steps": sum(1 for x in rows if x.get("grad_norm", 1.0) == 0.0),
            "eval_success": r["eval"]["success"], "eval_reward": r["eval"]["reward"],
            "eval_turns": r["eval"]["turns"],
            "kl_turn0": kl.get(0, float("nan")), "kl_last": kl[max(kl)] if kl else float("nan"),
            "kl_slope": slope(kl), "kl_by_turn": kl,
            "teacher_share": sum(x["opd/teacher_share"] for x in rows) / len(rows),
            "switches": sum(x["opd/switches"] for x in rows) / len(rows),
            "traj_turns": sum(x["opd/traj_turns"] for x in rows) / len(rows),
            "train_s": r["train_s"],
        })
    return table


def plots(results: dict[str, dict], table: list[dict], figures: Path) -> list[str]:
    """Two figures of two panels each, Vega-Lite rendered offline by vl-convert (the project's one plotting stack)."""
    import vl_convert as vlc

    def png(panels: list[dict], name: str) -> str:
        spec = {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "hconcat": panels}
        p = figures / name
        p.write_bytes(vlc.vegalite_to_png(spec, scale=1.2))
        return str(p)

    def panel(values: list[dict], x: str, y: str, title: str, xtitle: str, ytitle: str) -> dict:
        return {"width": 380, "height": 250, "title": title, "data": {"values": values},
                "mark": {"type": "line", "point": True},
                "encoding": {"x": {"field": x, "type": "quantitative", "title": xtitle},
                             "y": {"field": y, "type": "quantitative", "title": ytitle, "scale": {"zero": False}},
                             "color": {"field": "variant", "type": "nominal"}}}

    figures.mkdir(parents=True, exist_ok=True)
    runs = [{"variant": name, "step": x["step"], "reward": x.get("opd/reward"), "success": x.get("opd/success")}
            for name in ("opd", "grpo", "atod") if name in results for x in results[name]["rows"]]
    out = [png([panel(runs, "step", "reward", "(a) OPD vs GRPO: reward", "step", "rollout reward (student, sampled)"),
                panel(runs, "step", "success", "(a) OPD vs GRPO: success", "step", "rollout success")],
               "c_opd_vs_grpo.png")]
    kl, slope = [], []
    for row in table:
        if row["variant"] in ("opd", "guided", "dash", "tcod"):
            kl += [{"variant": row["variant"], "turn": float(t), "jsd": v} for t, v in row["kl_by_turn"].items()]
            slope += [{"variant": row["variant"], "step": x["step"], "slope": x.get("opd/kl_slope")}
                      for x in results[row["variant"]]["rows"] if x.get("opd/kl_slope") is not None]
    out.append(png([panel(kl, "turn", "jsd", "(b) divergence by turn (mean over steps)", "assistant turn index",
                          "mean per-token JSD (student turns)"),
                    _with_zero_line(panel(slope, "step", "slope", "(b) per-step KL slope", "step",
                                          "slope of KL over turn index"))],
                   "c_kl_by_turn.png"))
    return out


def _with_zero_line(unit: dict) -> dict:
    """``unit`` with a grey rule at y = 0 drawn over it (size and title stay on the layer)."""
    outer = {k: unit.pop(k) for k in ("width", "height", "title")}
    zero = {"data": {"values": [{"zero": 0}]}, "mark": {"type": "rule", "color": "grey"},
            "encoding": {"y": {"field": "zero", "type": "quantitative"}}}
    return {**outer, "layer": [unit, zero]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/apprentice-expc")
    ap.add_argument("--figures", default="")
    ap.add_argument("--variants", default="opd,grpo,atod,guided,dash,tcod")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--problems", type=int, default=6, help="problems per step")
    ap.add_argument("--samples", type=int, default=2, help="episodes per problem (GRPO group)")
    ap.add_argument("--length", type=int, default=3)
    ap.add_argument("--teacher-steps", type=int, default=120)
    ap.add_argument("--student-steps", type=int, default=20)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=5e-3)
    ap.add_argument("--key-weight", type=float, default=10.0)
    ap.add_argument("--teacher", default="", help="use this teacher model dir (skip the SFT build; needs --student)")
    ap.add_argument("--student", default="", help="use this student model dir")
    ap.add_argument("--init", default="", help="start the SFT from this model (with --student-steps 0 it is the student)")
    ap.add_argument("--eval", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--tokenizer", default="", help="SmolLM2 tokenizer dir (default: extract from the GGUF)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    from apprentice.lm.modeling import smol_tokenizer_dir

    tok_dir = args.tokenizer or str(smol_tokenizer_dir(root / "cache"))
    if args.teacher and args.student:
        t_dir, s_dir, info = args.teacher, args.student, {"teacher": args.teacher, "student": args.student}
    else:
        t_dir, s_dir, info = build_models(root, tok_dir, args.teacher_steps, args.student_steps, args.length, args.seed,
                                          args.sft_batch, args.sft_lr, args.init, args.key_weight)
    eval_specs = specs(args.eval, 50_000, args.length)
    base_file = root / "baseline.json"
    if base_file.exists():
        baseline = json.loads(base_file.read_text())
    else:
        baseline = {"teacher": evaluate(t_dir, tok_dir, eval_specs), "student": evaluate(s_dir, tok_dir, eval_specs)}
        base_file.write_text(json.dumps(baseline))
    print("models", json.dumps(info), "baseline", json.dumps(baseline), flush=True)
    a = dict(root=str(root), tok_dir=tok_dir, teacher=t_dir, student=s_dir, steps=args.steps, problems=args.problems,
             samples=args.samples, length=args.length, eval=args.eval, lr=args.lr, beta=args.beta,
             temperature=args.temperature, seed=args.seed)
    names = [v for v in args.variants.split(",") if v]
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {n: pool.submit(run_variant, n, a) for n in names}
        for n, f in futs.items():
            results[n] = f.result()
            print(f"done {n}: eval {results[n]['eval']} in {results[n]['train_s']}s", flush=True)
    table = summarise(results, baseline)
    (root / "summary.json").write_text(json.dumps({"args": vars(args), "models": info, "baseline": baseline,
                                                   "table": table}, indent=1))
    for row in table:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "kl_by_turn"}))
    if args.figures:
        print("figures", plots(results, table, Path(args.figures)))


if __name__ == "__main__":
    main()
