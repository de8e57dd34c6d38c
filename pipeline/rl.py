"""Stage `rl`: on-policy reinforcement learning of the SFT model on verifiable tasks; writes the chat model.

nanochat's recipe, made small (docs/rl.md has the choices and the measurements behind them): each step
takes `rl.prompts_per_step` fresh prompts of the tasks in `rl.tasks`, samples `rl.samples` replies to each
through the project's engine (batched, a seed per request, the calculator in the loop), rewards each reply
1 or 0 with the evaluate stage's checker (pipeline/tasks.py), and takes one optimizer step on

    loss = - sum_replies sum_sampled ids (reward - group mean) x log p(id) / (sampled ids in the step)

(pipeline/rollouts.py): on-policy (one step per batch of rollouts, so no importance ratio, no PPO clip), no
KL term, no reference model. Held-out pass@1 (greedy) and pass@k (k sampled replies) of every task trained
on are measured before and after (and every `rl.eval_every` steps).

Runs on the skeleton the training stages share (pipeline/stage.py: start, setup, resume, save, finish):
under the precision backend (the policy-gradient steps), on several ranks under DDP or FSDP (each rank
rolls out its share of the prompts; under FSDP from a whole copy of the weights gathered each step), with
checkpoints that resume bit-exactly: a step's prompts and every request's sampling seed follow from
(rl.seed, step), and the rollouts' batches from the requests.
With `rl.enabled: false` the SFT model is copied unchanged to where the chat model goes.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from model.chat_engine import chat_engine
from model.model_dir import CHECKSUMS, build_model, load_model_dir, portable_state_dict, verify_model_dir
from model.optim import build_optimizer
from model.parallel import all_gather, ddp, fsdp
from sparkchat import paths

from .benchmarks import BenchmarkError
from .checkpoint import fingerprint
from .config import Params, resolve_source
from .metrics import TSVLog, write_reports
from .rollouts import PromptSource, advantages, heldout, loss_batch, loss_rows, pass_at, policy_loss, rollouts
from .runtime import LaunchError, log
from .stage import finish_stage, load_state, save_state, setup_stage, stage_main, start

STAGE = "rl"
INIT = paths.MODEL_DIRS["sft"]
OUT = paths.MODEL_DIRS["rl"]


@dataclass
class RLRun:
    p: Params
    backend: object
    device: torch.device
    rank: int
    world: int
    tok: object
    gen: dict
    model: torch.nn.Module  # the policy: plain, or under FSDP its sharded form
    optimizer: object
    source: PromptSource
    heldout: dict[str, list]
    fp: str = ""
    history: dict = field(default_factory=dict)

    @property
    def r(self):
        return self.p.rl

    @property
    def sharded(self) -> bool:
        return self.p.runtime.parallel == "fsdp"


def build(p: Params, backend, device, rank: int, world: int) -> RLRun:
    r = p.rl
    if r.prompts_per_step % world:
        raise LaunchError(f"rl.prompts_per_step={r.prompts_per_step} must be a multiple of the {world} ranks "
                          f"(each rolls out the same share)")
    setup_stage(STAGE, p, r.seed, rank, world)
    model, tok, gen = load_model_dir(INIT, device=device)
    model = backend.convert(model.train())
    log(backend.describe(device))
    if p.runtime.parallel == "fsdp":
        model = fsdp(model, backend.compute_dtype(device))
    optimizer = build_optimizer(model, r.matrix_lr, r.embedding_lr, r.head_lr, r.weight_decay, use_muon=r.use_muon)
    held = {t: heldout(t, r.eval_items, r) for t in r.tasks}
    return RLRun(p, backend, device, rank, world, tok, gen, model, optimizer, PromptSource(tok, r), held)


def resume(run: RLRun) -> int:
    """Loads the stage's checkpoint when one matches this configuration and these inputs; returns the step to
    start from (its history, the plot rows and the scores before training, goes into `run.history`)."""
    p = run.p
    inputs = [INIT / CHECKSUMS if (INIT / CHECKSUMS).is_file() else INIT / "model.safetensors", paths.EVAL_ITEMS]
    inputs += [Path(resolve_source(s)) for s in (run.r.gsm8k_train, run.r.gsm8k_test) if s and not s.startswith("hub:")]
    run.fp = fingerprint({"stage": STAGE, "rl": asdict(run.r), "precision": asdict(p.precision),
                          "backend": run.backend.name, "parallel": p.runtime.parallel}, inputs)
    state = load_state(STAGE, run.sharded, run.model, run.optimizer, run.fp)
    if state is None:
        return 0
    run.history = state["extra"]
    return state["step"]


def rollout_policy(run: RLRun) -> torch.nn.Module:
    """The model the engine samples from: the policy itself, or under FSDP a whole copy of its weights on every
    rank (the engine's decode steps differ in number between ranks, so they cannot run the sharded model's
    collectives)."""
    if not run.sharded:
        return run.model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))  # on every rank
    return build_model(run.model.config, portable_state_dict(run.model, sd), run.device, torch.float32)


def engine_for(run: RLRun, policy, n_requests: int):
    # no CUDA graphs: they compile the policy's blocks in place, which the training steps then run through
    return chat_engine(policy, run.tok, run.gen, max_batch=min(256, n_requests), max_queue=n_requests + 1,
                       cuda_graphs=False)


def evaluate_heldout(run: RLRun, step: int) -> dict[str, dict[str, float]]:
    """pass@1 (greedy) and pass@k (k = rl.samples) of each task's held-out items; the items split over the ranks."""
    policy = rollout_policy(run)
    r, scores = run.r, {}
    for task, items in run.heldout.items():
        if not items:
            continue
        mine = [(i, text, answer) for i, (text, answer) in enumerate(items)][run.rank::run.world]
        engine = engine_for(run, policy, len(mine) * (r.samples + 1))
        try:
            greedy, passk = pass_at(engine, run.tok, task, mine, r)
        finally:
            engine.shutdown()
        parts = all_gather((sum(greedy), len(greedy), sum(passk), len(passk)))
        scores[task] = {"pass1": round(sum(x[0] for x in parts) / sum(x[1] for x in parts), 4),
                        "passk": round(sum(x[2] for x in parts) / max(1, sum(x[3] for x in parts)), 4)}
    log(f"{STAGE}: held-out at step {step}: " + ", ".join(f"{t} pass@1 {s['pass1']:.3f} pass@{r.samples} "
                                                          f"{s['passk']:.3f}" for t, s in scores.items()))
    return scores


def rl_step(run: RLRun, model, step: int, autocast) -> tuple[float, float, dict]:
    """One step: this rank's share of the prompts rolled out and rewarded, the policy-gradient loss over every
    rank's sampled ids, one optimizer update. Returns (mean reward, mean reply length) over all ranks, and per
    task its rewards' sum, its replies and its groups whose rewards differ (the only ones that teach)."""
    r, world = run.r, run.world
    prompts = run.source.step(step, r.prompts_per_step)
    share = len(prompts) // world
    mine = prompts[run.rank * share:(run.rank + 1) * share]
    policy = rollout_policy(run)
    engine = engine_for(run, policy, share * r.samples)
    try:
        rolls = rollouts(engine, run.tok, mine, r, step, run.rank * share)
    finally:
        engine.shutdown()
    del policy
    rewards = torch.tensor([x.reward for x in rolls])
    adv = advantages(rewards, r.samples, r.std_advantage)
    per_task = {}
    for g, p in enumerate(mine):
        group = rewards[g * r.samples:(g + 1) * r.samples]
        t = per_task.setdefault(p.task, [0.0, 0, 0])
        t[0], t[1], t[2] = t[0] + float(group.sum()), t[1] + r.samples, t[2] + int(bool(group.max() > group.min()))
    stats = {}
    for part in all_gather(per_task):
        for task, v in part.items():
            stats[task] = [a + b for a, b in zip(stats.get(task, [0.0, 0, 0]), v)]
    replay = run.source.replay(step, r.prompts_per_step, run.rank * share, share) if r.replay_weight else []
    totals = torch.tensor([float(sum(sum(x.mask) for x in rolls)), float(rewards.sum()),
                           float(sum(x.reply_tokens for x in rolls)), float(sum(sum(x.mask) for x in replay))],
                          dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)
    n_tokens = max(1.0, float(totals[0]))
    if replay:  # a weight on every gold id that makes their sum, / n_tokens below, replay_weight x their mean loss
        rolls, adv = rolls + replay, torch.cat([adv, torch.full((len(replay),), r.replay_weight * n_tokens / float(totals[3]))])
    chunks = loss_rows(rolls, adv, -(-len(rolls) // r.device_batch))  # as many on every rank
    for i, (rows, row_adv) in enumerate(chunks):
        x, y, a = loss_batch(rows, row_adv, run.device)
        last = i == len(chunks) - 1
        sync = model.no_sync() if world > 1 and not run.sharded and not last else contextlib.nullcontext()
        with sync, autocast:
            # DDP and FSDP average the ranks' gradients: x world makes it the sum over every rank's ids / n_tokens
            loss = policy_loss(model, x, y, a, n_tokens) * world
        loss.backward()
    if world > 1:
        run.backend.sync_ranks(run.model)
    if r.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), r.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    n_rolls = r.prompts_per_step * r.samples
    return float(totals[1]) / n_rolls, float(totals[2]) / n_rolls, stats


def heldout_row(step: int, scores: dict) -> dict:
    """The held-out plot's row: pass@1 and pass@k over the tasks (what the headline reports), then each task's."""
    return {"step": step, **{k: mean_over_tasks(scores, k) for k in ("pass1", "passk")},
            **{f"{t}_{k}": v for t, s in scores.items() for k, v in s.items()}}


def loop(run: RLRun, start_step: int) -> float:
    """From `start_step` to the end: the steps, a progress bar (reward, ETA), the plot rows, held-out
    evaluations and checkpoints. Returns the seconds the steps took."""
    r, h = run.r, run.history
    model = ddp(run.model, run.device) if run.world > 1 and not run.sharded else run.model
    autocast = run.backend.autocast(run.device)
    columns = ["step", "pass1", "passk"] + [f"{t}_{k}" for t, items in run.heldout.items() if items
                                            for k in ("pass1", "passk")]
    plot = TSVLog(paths.plot_file(STAGE), ["step", "reward", "reply_tokens", "lr"], h.setdefault("log_rows", [])) \
        if run.rank == 0 else None
    held = TSVLog(paths.RL_HELDOUT, columns, h.setdefault("heldout_rows", [])) if run.rank == 0 else None
    if "before" not in h:
        h["before"] = evaluate_heldout(run, 0)
        if held:
            held.log(**heldout_row(0, h["before"]))
    bar = tqdm(total=r.steps, initial=start_step, desc=STAGE, unit="step", disable=run.rank != 0, file=sys.stderr,
               mininterval=1.0, dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in range(start_step, r.steps):
        mult = 1.0 - step / r.steps  # linear to 0 (nanochat's RL schedule)
        run.optimizer.set_lr_multiplier(mult)
        reward, length, stats = rl_step(run, model, step, autocast)
        done = step + 1
        h.setdefault("rewards", []).append(reward)
        seen = h.setdefault("per_task", {})
        for task, v in stats.items():
            seen[task] = [a + b for a, b in zip(seen.get(task, [0.0, 0, 0]), v)]
        if plot:
            plot.log(step=done, reward=reward, reply_tokens=length, lr=mult)
        bar.set_postfix(reward=f"{reward:.3f}", tokens=f"{length:.1f}")
        if r.eval_every and done % r.eval_every == 0 and done < r.steps:
            scores = evaluate_heldout(run, done)
            if held:
                held.log(**heldout_row(done, scores))
        if done % r.checkpoint_every == 0 and done < r.steps:
            save(run, done)
        bar.update(1)
    bar.close()
    seconds = time.perf_counter() - t0
    h["after"] = evaluate_heldout(run, r.steps)
    if held:
        held.log(**heldout_row(r.steps, h["after"]))
    return seconds


def save(run: RLRun, done: int) -> None:
    save_state(STAGE, run.sharded, run.rank, run.model, run.optimizer, done, {}, run.fp, run.history)


def mean_over_tasks(scores: dict, key: str) -> float:
    return round(sum(s[key] for s in scores.values()) / max(1, len(scores)), 4)


def finish(run: RLRun, seconds: float, steps_run: int) -> dict:
    """The chat model directory (SFT's generation defaults kept), the reports, and the checkpoints removed."""
    r, h = run.r, run.history
    last = h.get("rewards", [])[-5:]
    # two columns in `dvc metrics show` (which every stage's headline widens); pass@k and each task's in details
    headline = {"reward": round(sum(last) / max(1, len(last)), 4), "pass1": mean_over_tasks(h["after"], "pass1")}
    details = {"enabled": True, "passk": mean_over_tasks(h["after"], "passk"), "steps": r.steps, "tasks": list(r.tasks), "k": r.samples,
               "heldout_items": {t: len(v) for t, v in run.heldout.items()},
               "passk_items": {t: min(len(v), r.passk_items) for t, v in run.heldout.items()}, "before": h["before"],
               "after": h["after"],
               "train_reward": {t: round(v[0] / v[1], 4) for t, v in h.get("per_task", {}).items()},
               "groups_that_teach": {t: round(v[2] * r.samples / v[1], 4) for t, v in h.get("per_task", {}).items()},
               "rollouts": r.steps * r.prompts_per_step * r.samples,
               "backend": run.backend.name, "backend_label": run.backend.label, "device": str(run.device),
               "params": run.model.num_params()}
    timings = {"seconds": round(seconds, 1),
               "rollouts_per_s": round(steps_run * r.prompts_per_step * r.samples / seconds, 1) if seconds else None}
    finish_stage(STAGE, run.sharded, run.rank, run.model, OUT, run.tok, {"stage": STAGE, **headline, **details},
                 (headline, details, timings),
                 f"{STAGE}: done: reward {headline['reward']}, held-out pass@1 {headline['pass1']} (before "
                 f"{mean_over_tasks(h['before'], 'pass1')}), pass@{r.samples} {details['passk']}; model in {OUT}",
                 generation=run.gen)
    return {**headline, **details, **timings}


def copy_sft() -> dict:
    """rl.enabled false: SFT's model, verified, becomes the chat model; the reports say the stage was off."""
    verify_model_dir(INIT)
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(INIT, OUT)
    write_reports(STAGE, {}, {"enabled": False}, {})
    TSVLog(paths.plot_file(STAGE), ["step", "reward", "reply_tokens", "lr"])
    TSVLog(paths.RL_HELDOUT, ["step", "pass1", "passk"])  # the plot's columns, no rows
    log(f"{STAGE}: rl.enabled is false: {INIT} copied unchanged to {OUT}")
    return {"enabled": False}


def train_rl(p: Params) -> dict:
    return rl_started(*start(STAGE, p))


def rl_started(stage: str, p: Params, backend, device, rank: int, world: int) -> dict:
    """The stage after `start` (which `sparkchat join` calls itself, then hands an rl stage here)."""
    run = build(p, backend, device, rank, world)
    start_step = resume(run)
    r = run.r
    log(f"{STAGE}: {run.model.num_params():,} params, {r.steps} steps x {r.prompts_per_step} prompts x {r.samples} "
        f"samples ({', '.join(r.tasks)}) on {device}{', FSDP' if run.sharded else ', DDP' if world > 1 else ''}"
        f" x {world} rank(s)")
    seconds = loop(run, start_step)
    return finish(run, seconds, r.steps - start_step)


def skip_when_disabled(p: Params) -> bool:
    """rl.enabled false: the stage is SFT's model copied (`copy_sft`), no training."""
    if p.rl.enabled:
        return False
    copy_sft()
    return True


def main() -> None:
    stage_main(STAGE, train_rl, errors=(BenchmarkError,), skip=skip_when_disabled)


if __name__ == "__main__":
    main()
