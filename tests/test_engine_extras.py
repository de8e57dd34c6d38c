"""Engine extras: presence/frequency penalties, logit_bias and logprobs (generated and prompt ids),
checked against the model's own forward; rows without extras unchanged beside rows with them."""
from __future__ import annotations

import threading

import pytest
import torch


from model.requests import Finished, PromptLogprobs, SamplingParams, Token

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8, 9]


def events(engine, prompt, **kw) -> list:
    out, done = [], threading.Event()
    engine.submit(prompt, SamplingParams(**kw), lambda ev: (out.append(ev), isinstance(ev, Finished) and done.set()))
    assert done.wait(30)
    return out


def ids_of(evs) -> list[int]:
    return [ev.id for ev in evs if isinstance(ev, Token)]


@torch.no_grad()
def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """The model's own log-probabilities at every position of `ids` (one forward, no cache)."""
    return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


@torch.no_grad()
def greedy_reference(model, prompt, n, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy decoding with OpenAI's penalty formula, one full forward per token."""
    ids, out = list(prompt), []
    V = model.config.vocab_size
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
        logits = logits - frequency * counts - presence * (counts > 0)
        for i, b in (bias or {}).items():
            logits[i] += b
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_penalties_follow_openai_formula(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=4)
    plain = ids_of(events(e, PROMPT, temperature=0, max_tokens=24))
    assert plain == greedy_reference(serve_model, PROMPT, 24)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"presence_penalty": 1.0, "frequency_penalty": 0.7}):
        got = ids_of(events(e, PROMPT, temperature=0, max_tokens=24, **kw))
        want = greedy_reference(serve_model, PROMPT, 24, kw.get("presence_penalty", 0), kw.get("frequency_penalty", 0))
        assert got == want, kw
        assert got != plain, f"{kw} changed nothing: the test would not see a missing penalty"
    # a negative penalty favours repeats: fewer distinct ids than without
    rep = ids_of(events(e, PROMPT, temperature=0, max_tokens=24, presence_penalty=-2.0))
    assert rep == greedy_reference(serve_model, PROMPT, 24, presence=-2.0) and len(set(rep)) < len(set(plain))


def test_presence_and_frequency_penalties_are_told_apart():
    """An id generated 3 times: a frequency penalty weighs each time, a presence penalty only once, and
    a request's penalties reach the sampler each in its own column (`settings_row`). Greedy, from a
    logit one above the runner-up: frequency 0.5 takes 1.5 off it (the runner-up wins), presence 0.5
    takes 0.5 (it stays first). The greedy tests above cannot tell them apart: their ids repeat rarely."""
    from model.sampling import extras_step, settings_row
    logits = torch.tensor([[10.0, 9.0, 0.0]])
    counts, bias = torch.tensor([[3.0, 0.0, 0.0]]), torch.zeros(1, 3)
    for kw, want in (({"frequency_penalty": 0.5}, 1), ({"presence_penalty": 0.5}, 0)):
        st = torch.tensor([settings_row(SamplingParams(temperature=0.0, **kw), 0.5, -1)])
        sampled, _ = extras_step(logits, st, counts, bias)
        assert int(sampled[0]) == want, kw


def test_penalty_changes_the_sampled_distribution(engine_factory, serve_model):
    """Sampling (not greedy): a strong frequency penalty spreads the ids out."""
    e = engine_factory(serve_model, max_batch=8)
    distinct = {f: sum(len(set(ids_of(events(e, PROMPT, temperature=0.3, max_tokens=40, seed=s, frequency_penalty=f))))
                       for s in range(4)) for f in (0.0, 2.0)}
    assert distinct[2.0] >= distinct[0.0] + 12, distinct  # measured: 159 against 136 of 160 tokens


def test_logit_bias_bans_and_forces(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=4)
    sampled = [i for s in range(4) for i in ids_of(events(e, PROMPT, temperature=0.5, max_tokens=40, seed=s))]
    common = max(set(sampled), key=sampled.count)
    assert sampled.count(common) >= 4
    banned = [i for s in range(4) for i in ids_of(events(e, PROMPT, temperature=0.5, max_tokens=40, seed=s,
                                                          logit_bias={common: -100.0}))]
    assert common not in banned and len(banned) == 160
    forced = ids_of(events(e, PROMPT, temperature=1.0, max_tokens=10, seed=0, logit_bias={17: 100.0}))
    assert forced == [17] * 10
    greedy = ids_of(events(e, PROMPT, temperature=0, max_tokens=6, logit_bias={3: 30.0, 4: -5.0}))
    assert greedy == greedy_reference(serve_model, PROMPT, 6, bias={3: 30.0, 4: -5.0})


def test_logprobs_of_generated_ids_are_the_model_s(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=4)
    evs = events(e, PROMPT, temperature=1.0, max_tokens=12, seed=3, logprobs=5, frequency_penalty=1.0)
    toks = [ev for ev in evs if isinstance(ev, Token)]
    ref = log_softmax(serve_model, PROMPT + [t.id for t in toks])
    for i, t in enumerate(toks):
        row = ref[len(PROMPT) - 1 + i]
        assert t.logprob == pytest.approx(float(row[t.id]), abs=1e-4)  # raw model logprobs, before penalties
        assert [j for j, _ in t.top] == row.topk(5).indices.tolist()
        assert [lp for _, lp in t.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
    none = events(e, PROMPT, temperature=1.0, max_tokens=3, seed=3)
    assert all(ev.logprob is None and ev.top is None for ev in none if isinstance(ev, Token))
    zero = [ev for ev in events(e, PROMPT, temperature=0, max_tokens=3, logprobs=0) if isinstance(ev, Token)]
    assert all(ev.top == [] and ev.logprob is not None for ev in zero)


@pytest.mark.parametrize("chunk", [512, 3])
def test_prompt_logprobs_equal_a_direct_forward(engine_factory, serve_model, chunk):
    """max_tokens 0 scores the prompt alone; the prefill in chunks of 3 gives the same numbers."""
    e = engine_factory(serve_model, max_batch=4, prefill_chunk=chunk)
    prompt = list(range(20, 31))
    evs = events(e, prompt, max_tokens=0, prompt_logprobs=3)
    assert isinstance(evs[0], PromptLogprobs) and isinstance(evs[1], Finished) and len(evs) == 2
    assert (evs[1].reason, evs[1].completion_tokens) == ("length", 0)
    ref = log_softmax(serve_model, prompt)
    want = ref[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert evs[0].logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert [[i for i, _ in top] for top in evs[0].top] == ref[:-1].topk(3).indices.tolist()
    # with a reply: the prompt's logprobs come first, then the tokens
    evs = events(e, prompt, temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=1)
    assert isinstance(evs[0], PromptLogprobs) and evs[0].logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert [type(ev) for ev in evs[1:]] == [Token, Token, Finished]
    # the whole context may be scored: no room is needed for a reply
    full = [i % 300 for i in range(e.max_len)]
    evs = events(e, full, max_tokens=0, prompt_logprobs=0)
    assert len(evs[0].logprobs) == e.max_len - 1 and evs[1].reason == "length"


def test_rows_without_extras_are_unchanged_beside_rows_with_them(engine_factory, serve_model):
    """Requests with and without extras share the batch (joining, leaving, rows moved): each gives what
    it gives alone, so the per-row counts and biases move with their rows."""
    e = engine_factory(serve_model, max_batch=2)
    ban = {i: -100.0 for i in range(40, 200)}
    # the first ends early: the second (penalty and bias) moves to row 0 with its history
    kws = [{}, {"frequency_penalty": 2.0, "logit_bias": ban}, {"presence_penalty": 2.0, "logprobs": 2}, {},
           {"frequency_penalty": 1.5}]
    prompts = [[5, 6, 7], [9], [20, 21, 22, 23, 24], [30, 31], [40, 41, 42, 43]]
    lengths = [4, 30, 7, 25, 18]
    alone = [ids_of(events(e, p, temperature=0, max_tokens=n, **kw)) for p, n, kw in zip(prompts, lengths, kws)]
    results = [[] for _ in prompts]
    finished = threading.Semaphore(0)
    for p, n, kw, out in zip(prompts, lengths, kws, results):
        e.submit(p, SamplingParams(temperature=0, max_tokens=n, **kw),
                 lambda ev, out=out: out.append(ev.id) if isinstance(ev, Token) else
                 (isinstance(ev, Finished) and finished.release()))
    for _ in prompts:
        assert finished.acquire(timeout=30)
    assert results == alone
    assert not any(40 <= i < 200 for i in alone[1])


@pytest.mark.parametrize("run_ahead,prefill_chunk", [(False, 512), (True, 512), (True, 4)],
                         ids=["plain", "running-ahead", "running-ahead-chunked-prompts"])
def test_rows_ending_together_leave_the_others_their_state(engine_factory, serve_model, run_ahead, prefill_chunk):
    """Several rows end in one step, below and above the rows that stay, while requests wait for rows:
    the staying rows past the end move down into the freed ones (all at once), each with its cache,
    length, counts and bias, so every request gives what it gives alone; also with the next step
    launched before the last one is read (as on CUDA), and with prompts prefilled a chunk a step (rows
    still prefilling move too)."""
    e = engine_factory(serve_model, max_batch=6, run_ahead=run_ahead, prefill_chunk=prefill_chunk)
    ban = {i: -100.0 for i in range(40, 200)}
    # rows 0, 2 and 5 end after 5 tokens; rows 3 and 4 (penalties, a bias) move into rows 2 and 0
    lengths = [5, 24, 5, 20, 22, 5, 9, 16]
    kws = [{}, {}, {"presence_penalty": 1.0}, {"frequency_penalty": 2.0}, {"logit_bias": ban}, {}, {}, {}]
    prompts = [[5 + i, 6, 7 + i] + [8 + i] * (3 * i) for i in range(len(lengths))]  # rows of unequal lengths
    alone = [ids_of(events(e, p, temperature=0, max_tokens=n, **kw)) for p, n, kw in zip(prompts, lengths, kws)]
    results = [[] for _ in prompts]
    finished = threading.Semaphore(0)
    e.submit_all([(p, SamplingParams(temperature=0, max_tokens=n, **kw),
                   lambda ev, out=out: out.append(ev.id) if isinstance(ev, Token) else
                   (isinstance(ev, Finished) and finished.release()))
                  for p, n, kw, out in zip(prompts, lengths, kws, results)])
    for _ in prompts:
        assert finished.acquire(timeout=30)
    assert results == alone
    assert [len(a) for a in alone] == lengths and not any(40 <= i < 200 for i in alone[4])


def test_seeded_sampling_with_extras_repeats(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=4)
    kw = dict(temperature=1.2, max_tokens=30, presence_penalty=0.5, logit_bias={7: 2.0}, logprobs=2)
    a, b = events(e, PROMPT, seed=5, **kw), events(e, PROMPT, seed=5, **kw)
    assert ids_of(a) == ids_of(b) and ids_of(a) != ids_of(events(e, PROMPT, seed=6, **kw))
    assert [ev.logprob for ev in a if isinstance(ev, Token)] == [ev.logprob for ev in b if isinstance(ev, Token)]


def test_bad_ids_are_refused_before_they_reach_a_kernel(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=2)
    V = serve_model.config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.submit([1, V], SamplingParams(), lambda ev: None)
    with pytest.raises(ValueError, match="logit_bias"):
        e.submit([1], SamplingParams(logit_bias={V: 1.0}), lambda ev: None)
