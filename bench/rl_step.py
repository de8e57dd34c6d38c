"""The rl stage's policy-gradient update, against the update over every rollout, on the same rollouts.

One step's rollouts (the default params' prompts, samples and tasks: `rl:` in params.yaml) are drawn once
from the SFT model through the engine; then each round times, back to back on the same weights:
  - reference: every rollout a row, the head and loss at every position (`reduction="none"`), in batches
    of `rl.device_batch`, forward and backward;
  - the stage's: `pipeline.rollouts.loss_rows` (equal rollouts merged, rows of advantage 0 left out) and
    the head at the sampled ids only (`reduction="kept"`), forward and backward.
The two gradients are compared (they must agree) and each round's ratio of the two times is reported,
median (min-max):

    python -m bench.rl_step --out bench/results/training-and-data/rl_step.json

Figures: bench/results/training-and-data.md, "The rl step's update".
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.stats import fmt, ratios, save_json, spread
from model.chat_engine import chat_engine
from model.model_dir import load_model_dir
from pipeline.config import load_params
from pipeline.rollouts import PromptSource, advantages, loss_batch, loss_rows, policy_loss, rollouts


def reference_loss(model, rolls, adv, n_tokens: int, batch: int) -> None:
    for lo in range(0, len(rolls), batch):
        x, y, a = loss_batch(rolls[lo:lo + batch], adv[lo:lo + batch], "cpu")
        nll = model(x, y, reduction="none").view_as(a)
        ((a * nll).sum() / n_tokens).backward()


def stage_loss(model, rolls, adv, n_tokens: int, batch: int) -> None:
    for rows, w in loss_rows(rolls, adv, -(-len(rolls) // batch)):
        policy_loss(model, *loss_batch(rows, w, "cpu"), n_tokens).backward()


def timed(fn, model, *args) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    fn(model, *args)
    seconds = time.perf_counter() - t
    return seconds, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="artifacts/sft/model", help="the policy to start from (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="RL steps whose rollouts are timed (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of both updates a step (default: %(default)s)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    r = load_params(stage="rl").rl
    model, tok, gen = load_model_dir(args.model, device="cpu")
    model.train()
    source = PromptSource(tok, r)
    res: dict = {"model": args.model, "tasks": r.tasks, "prompts_per_step": r.prompts_per_step, "samples": r.samples,
                 "device_batch": r.device_batch, "steps": []}
    ref_s, new_s = [], []
    for step in range(args.steps):
        engine = chat_engine(model, tok, gen, max_batch=min(256, r.prompts_per_step * r.samples),
                             max_queue=r.prompts_per_step * r.samples + 1, cuda_graphs=False)
        try:
            rolls = rollouts(engine, tok, source.step(step, r.prompts_per_step), r, step, 0)
        finally:
            engine.shutdown()
        adv = advantages(torch.tensor([x.reward for x in rolls]), r.samples, r.std_advantage)
        n_tokens = max(1, sum(sum(x.mask) for x in rolls))
        rows = sum(len(rs) for rs, _ in loss_rows(rolls, adv, -(-len(rolls) // r.device_batch)))
        for _ in range(args.rounds):
            a, g_ref = timed(reference_loss, model, rolls, adv, n_tokens, r.device_batch)
            b, g_new = timed(stage_loss, model, rolls, adv, n_tokens, r.device_batch)
            diff = float((g_new - g_ref).abs().max() / g_ref.abs().max().clamp(min=1e-12))
            if diff > 1e-4:
                raise SystemExit(f"the two gradients differ (max relative difference {diff:.2e})")
            ref_s.append(a)
            new_s.append(b)
        res["steps"].append({"step": step, "rollouts": len(rolls), "rows": rows,
                             "rollout_ids": sum(len(x.ids) for x in rolls), "sampled_ids": n_tokens,
                             "reference_s": ref_s[-args.rounds:], "stage_s": new_s[-args.rounds:]})
        print(f"step {step}: {len(rolls)} rollouts -> {rows} rows; reference {fmt(spread(ref_s[-args.rounds:]), '.3f')} s, "
              f"the stage's {fmt(spread(new_s[-args.rounds:]), '.3f')} s", flush=True)
    res["reference_s"], res["stage_s"] = spread(ref_s), spread(new_s)
    res["speedup"] = spread(ratios(ref_s, new_s), 2)
    print(f"the update, reference / the stage's: {fmt(res['speedup'], '.2f', 'x')} over {len(ref_s)} rounds")
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
