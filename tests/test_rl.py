"""The rl stage's parts (pipeline/rollouts.py, pipeline/tasks.py, RLParams): advantages, the loss and what it
masks (the prompt and the calculator's outputs), rewards from the evaluate stage's own checker, the training
prompts (never a held-out item; the same on every run), and params refused before any work."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import ConfigError, RLParams, params_from_dict
from project_files import committed_params, run_on_params

ROOT = Path(__file__).resolve().parent.parent


def test_advantage_is_reward_minus_group_mean():
    from pipeline.rollouts import advantages
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = advantages(rewards, 4, divide_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    scaled = advantages(rewards, 4, divide_by_std=True)
    assert scaled[:4].tolist() == pytest.approx((adv[:4] / rewards[:4].std()).tolist(), rel=1e-3)
    assert scaled[4:].tolist() == [0.0] * 4  # a group that agrees says nothing, with or without the std


def test_rewards_are_the_evaluate_stage_checker():
    import pipeline.evaluate as evaluate
    import pipeline.rollouts as rollouts
    from pipeline.tasks import is_correct
    assert evaluate.is_correct is is_correct and rollouts.is_correct is is_correct
    assert is_correct("letter_count", "The letter 'r' appears 3 times in 'strawberry'.", "3")
    assert not is_correct("letter_count", "The letter 'r' appears 2 times in 'strawberry'.", "3")
    assert is_correct("spelling", "h-o-u-s-e.", "h-o-u-s-e") and not is_correct("spelling", "h-o-u-s", "h-o-u-s-e")
    assert is_correct("largest", "C", "C") and not is_correct("largest", "A chair", "A")
    assert is_correct("gsm8k", "So 7.50 dollars.\n#### 7.5", "7.5")
    with pytest.raises(ValueError, match="no checker for task 'chess'"):
        is_correct("chess", "e4", "e4")


def test_rollouts_mask_the_prompt_and_the_calculator_output(conv_tool_model_dir, serve_model):
    """A tiny model that learned to call the calculator: its rollout trains the ids it sampled (the call,
    the answer, the stop id) and none of the ids the calculator fed or the prompt; the loss is exactly
    -advantage x log p summed over those ids / their count."""
    from model.chat_engine import chat_engine
    from model.model_dir import load_model_dir
    from pipeline.rollouts import Prompt, advantages, chat_prompt, loss_batch, policy_loss, rollouts

    model, tok, gen = load_model_dir(conv_tool_model_dir)
    s = tok.special
    r = RLParams(tasks=["arithmetic"], samples=2, temperature=0.05, max_new_tokens=40)
    prompt = Prompt("arithmetic", chat_prompt(tok, "What is 37 + 58?"), "95")
    engine = chat_engine(model, tok, gen, max_batch=4)
    try:
        rolls = rollouts(engine, tok, [prompt], r, step=0, first=0)
    finally:
        engine.shutdown()
    assert [x.reward for x in rolls] == [1.0, 1.0]
    roll = rolls[0]
    n = len(prompt.ids)
    reply, mask = roll.ids[n:], roll.mask[n:]
    assert roll.mask[:n] == [0] * n
    out_start, out_end = reply.index(s["<|output_start|>"]), reply.index(s["<|output_end|>"])
    assert reply[out_start + 1:out_end] == tok.encode("95")  # the calculator's result, fed by the engine
    assert mask[out_start:out_end + 1] == [0] * (out_end + 1 - out_start)
    assert mask[:out_start] == [1] * out_start and reply[0] == s["<|python_start|>"]  # the call: sampled
    assert reply[-1] == s["<|assistant_end|>"] and mask[-1] == 1  # the stop id the policy chose: trained
    assert all(m == 1 for m in mask[out_end + 1:])

    adv = torch.tensor([0.75, -0.25])
    x, y, a = loss_batch(rolls, adv, "cpu")
    kept = [torch.tensor(x.mask[1:]).bool() for x in rolls]
    for b, k in enumerate(kept):
        assert (y[b, :len(k)] != -1).tolist() == k.tolist() and (y[b, len(k):] == -1).all()
    policy = serve_model  # a random model of the same vocabulary: its log-probabilities are far from 0
    n_tokens = sum(int(k.sum()) for k in kept)
    with torch.no_grad():
        loss = policy_loss(policy, x, y, a, n_tokens)
        logp = torch.log_softmax(policy(x), dim=-1)
    want = sum(-adv[b] * logp[b, t, y[b, t]] for b in range(2) for t in range(y.shape[1]) if y[b, t] != -1) / n_tokens
    assert float(loss) == pytest.approx(float(want), rel=1e-4)
    assert advantages(torch.tensor([1.0, 1.0]), 2, False).tolist() == [0.0, 0.0]  # both right: no push either way


def test_merged_rows_give_the_same_gradient_as_every_rollout(serve_model):
    """loss_rows: equal rollouts merged (advantages summed), rows of advantage 0 left out, in as many batches
    as asked (padded with a row of advantage 0): the gradient is that of the loss over every rollout."""
    from pipeline.rollouts import Rollout, loss_batch, loss_rows, policy_loss
    prompt = [5, 6, 7, 8]
    a, b, c = prompt + [20, 1], prompt + [21, 1], prompt + [22, 23, 1]
    rolls = [Rollout(0, ids, [0] * 4 + [1] * (len(ids) - 4), 0.0, len(ids) - 4)
             for ids in (a, a, b, a, c, c, b, a)] + [Rollout(1, [9, 9, 20, 1], [0, 0, 1, 1], 1.0, 2)] * 4
    adv = torch.tensor([0.5, 0.5, -0.25, 0.5, -0.5, -0.5, -0.25, 0.0, 0, 0, 0, 0])
    n_tokens = sum(sum(r.mask) for r in rolls)
    chunks = loss_rows(rolls, adv, 3)
    assert len(chunks) == 3 and sorted(len(rows) for rows, _ in chunks) == [1, 1, 1]  # a, b, c: one row each
    assert sorted(x for _, w in chunks for x in w.tolist()) == pytest.approx([-1.0, -0.5, 1.5])
    model = serve_model

    def grad(batches):
        model.zero_grad()
        for rows, w in batches:
            policy_loss(model, *loss_batch(rows, w, "cpu"), n_tokens).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    want = grad([(rolls, adv)])
    assert torch.allclose(grad(chunks), want, atol=1e-6) and want.abs().max() > 1e-4
    assert [len(rows) for rows, _ in loss_rows(rolls[8:], adv[8:], 2)] == [1, 1]  # nothing to learn: 2 zero rows
    model.zero_grad()


def test_training_prompts_are_never_held_out_and_the_same_every_run(tmp_path, monkeypatch, serve_tokenizer):
    from pipeline import tool_tasks
    from pipeline.rollouts import TOOL_USE, PromptSource
    from pipeline.synthetic import generate_eval, normalize_prompt
    from sparkchat import paths
    monkeypatch.chdir(tmp_path)
    (tmp_path / paths.EVAL_ITEMS).mkdir(parents=True)
    held = {**generate_eval(200, seed=1337), TOOL_USE: tool_tasks.generate_eval(50, seed=1340)}  # replay reads both
    for task, items in held.items():
        (tmp_path / paths.EVAL_ITEMS / f"{task}.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    r = RLParams(tasks=["spelling", "largest"])
    a, b = PromptSource(serve_tokenizer, r), PromptSource(serve_tokenizer, r)
    held_out = {normalize_prompt(it["prompt"]) for t, items in held.items() if t != TOOL_USE for it in items}
    tasks = []
    for step in range(20):
        prompts = a.step(step, 16)
        assert prompts == b.step(step, 16)
        tasks += [p.task for p in prompts]
        texts = [serve_tokenizer.decode(p.ids) for p in prompts]
        assert not any(normalize_prompt(h) in normalize_prompt(t) for t in texts for h in held_out
                       if h.startswith("spell")), "a held-out spelling prompt was drawn"
    assert tasks.count("spelling") == tasks.count("largest")
    assert a.step(3, 16) != a.step(4, 16)


def test_replay_is_sft_gold_of_the_tasks_not_trained_never_held_out(tmp_path, monkeypatch, serve_tokenizer):
    """The replay term's rows: gold conversations of every SFT synthetic task not in rl.tasks and of the tool-use
    task, taking turns, none a held-out item, the same every run, a rank's share the same rows as in one run; the
    mask is the training renderer's (the gold reply's ids, without the calculator's output or a tool's result)."""
    from model.chat import render
    from pipeline import tool_tasks
    from pipeline.rollouts import TOOL_USE, PromptSource
    from pipeline.synthetic import TRAIN_MIX, generate_eval, normalize_prompt
    from sparkchat import paths
    monkeypatch.chdir(tmp_path)
    (tmp_path / paths.EVAL_ITEMS).mkdir(parents=True)
    held = {**generate_eval(200, seed=1337), TOOL_USE: tool_tasks.generate_eval(400, seed=1340)}
    for task, items in held.items():
        (tmp_path / paths.EVAL_ITEMS / f"{task}.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    src = PromptSource(serve_tokenizer, RLParams(tasks=["largest"], replay_weight=1.0))
    assert src.replayed == [t for t in TRAIN_MIX if t != "largest"] + [TOOL_USE]
    assert PromptSource(serve_tokenizer, RLParams(tasks=["largest"], replay_weight=0.0)).replayed == []
    held_out = {normalize_prompt(it["prompt"]) for t, items in held.items() if t != TOOL_USE for it in items}
    held_tools = {tool_tasks.key(it) for it in held[TOOL_USE]}
    s = serve_tokenizer.special
    tool_rows = 0
    for step in range(10):
        rows = src.replay(step, 12, 0, 12)
        assert [(r.ids, r.mask) for r in rows] == [(r.ids, r.mask) for r in src.replay(step, 12, 0, 6) + src.replay(step, 12, 6, 6)]
        for r in rows:
            user = serve_tokenizer.decode(r.ids[r.ids.index(s["<|user_start|>"]) + 1:r.ids.index(s["<|user_end|>"])])
            reply = r.ids[r.ids.index(s["<|assistant_start|>"]):]
            if s["<|tools_start|>"] in r.ids:  # a tool-use conversation: its item is not a held-out one
                tool_rows += 1
                shown = serve_tokenizer.decode(r.ids[r.ids.index(s["<|tools_start|>"]) + 1:r.ids.index(s["<|tools_end|>"])])
                assert (user, tuple(sig.split("(")[0] for sig in shown.split(";"))) not in held_tools
                if s["<|result_start|>"] in r.ids:  # the result is given, not learned
                    assert r.mask[r.ids.index(s["<|result_start|>"]) + 1] == 0
                continue
            assert normalize_prompt(user) not in held_out
            assert sum(r.mask) > 0 and render(serve_tokenizer, [{"role": "user", "content": user}],
                                              for_completion=True)[0] + reply[1:] == r.ids
            if s["<|output_start|>"] in r.ids:  # a calculator result is given, not learned
                assert r.mask[r.ids.index(s["<|output_start|>"]) + 1] == 0
    n = len(src.replayed)  # the tool-use task's turn: the last of the n
    assert tool_rows == sum((step * 12 + i) % n == n - 1 for step in range(10) for i in range(12)) > 0
    assert src.replay(1, 12, 0, 12)[0].ids != src.replay(2, 12, 0, 12)[0].ids


def base() -> dict:
    return committed_params(ROOT)  # not an experiment's values


@pytest.mark.parametrize("edit, key", [
    ({"samples": 1}, "rl.samples must be >= 2"),
    ({"temperature": 0.0}, "rl.temperature must be in (0, 10]"),
    ({"tasks": []}, "rl.tasks must name at least one task"),
    ({"tasks": ["spelling", "spelling"]}, "rl.tasks must name at least one task, each once"),
    ({"tasks": ["chess"]}, "rl.tasks[0] must be one of letter_count"),
    ({"tasks": ["gsm8k"]}, "rl.gsm8k_train is empty"),
    ({"gsm8k_train": "nowhere.jsonl"}, "rl.gsm8k_train='nowhere.jsonl': no such file"),
    ({"matrix_lr": 0.0}, "rl.matrix_lr must be in (0, 10)"),
    ({"enabled": "yes"}, "rl.enabled must be true or false"),
    ({"backend": "fp16"}, 'rl.backend must be one of "", bf16'),
    ({"kl": 0.1}, "unknown key 'rl.kl'"),
])
def test_bad_rl_params_name_the_key(edit, key):
    d = base()
    d["rl"].update(edit)
    with pytest.raises(ConfigError) as e:
        params_from_dict(d, ROOT / "profiles")
    assert key in str(e.value)


def test_gsm8k_fixture_loads_in_the_hub_schema(serve_tokenizer):
    """The GPU profiles train on GSM8K; the default run does not, so the fixture keeps that path tested: its
    train rows are the prompts, its test rows the held-out items, the answers GSM8K's final numbers."""
    from pipeline.rollouts import PromptSource, heldout
    r = RLParams(tasks=["gsm8k"], gsm8k_train="tests/fixtures/evals/gsm8k_train.jsonl",
                 gsm8k_test="tests/fixtures/evals/gsm8k.jsonl", eval_items=4,
                 replay_weight=0.0)  # no replay: nothing here reads the prepare stage's items
    items = heldout("gsm8k", 4, r)
    assert len(items) == 4 and all(a.lstrip("-").replace(".", "").isdigit() for _, a in items)
    train = [json.loads(line) for line in (ROOT / r.gsm8k_train).read_text().splitlines()]
    prompts = PromptSource(serve_tokenizer, r).step(0, 6)
    assert {p.task for p in prompts} == {"gsm8k"}
    by_question = {row["question"]: row["answer"].rsplit("#### ", 1)[1] for row in train}
    for p in prompts:
        question = next(q for q in by_question if serve_tokenizer.encode(q)[:5] == p.ids[2:7])
        assert p.answer == by_question[question]
    # the GPU profiles that read the hub's GSM8K in evaluate train on its train split
    profiles = [yaml.safe_load(p.read_text()) for p in (ROOT / "profiles").glob("*.yaml")]
    hub = [p for p in profiles if p.get("evaluate", {}).get("benchmarks", {}).get("gsm8k", {}).get("source", "")
           .startswith("hub:")]
    assert hub and all("gsm8k" in p["rl"]["tasks"] and p["rl"]["gsm8k_train"].startswith("hub:openai/gsm8k")
                       for p in hub)


def test_bad_rl_params_fail_before_any_work(tmp_path):
    d = base()
    d["rl"]["samples"] = 1
    r = run_on_params(ROOT, tmp_path, d, "pipeline.rl")
    assert r.returncode != 0 and "rl.samples must be >= 2" in r.stderr
    assert not (tmp_path / "artifacts").exists()


def test_defaults_equal_params_yaml():
    assert replace(RLParams()) == RLParams.from_dict(base()["rl"])


def test_rl_tasks_allowed_are_the_tasks_a_checker_exists_for():
    """params.yaml's rl.tasks choices (RLTask) and pipeline/tasks.py's checkers name the same tasks."""
    from typing import get_args

    from pipeline import tasks
    from pipeline.config import RLTask
    assert sorted(get_args(RLTask)) == sorted(tasks.CHECKED)
