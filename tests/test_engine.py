"""Engine: sampling, determinism, continuous batching, stops, limits, queue, cancellation, tools."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from model.engine import Engine, EngineConfig

from model.requests import Finished, PromptLogprobs, PromptTooLong, QueueFull, SamplingParams, Token
from model.gpt import GPTConfig, KVCache
from model.sampling import sample

pytestmark = pytest.mark.timeout(60)


# ---- a scripted stand-in for GPT: the next id is a function of the last input id ----

class ScriptModel(torch.nn.Module):
    def __init__(self, table: dict[int, int], vocab: int = 32, seq_len: int = 64, gate: threading.Event | None = None):
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab, n_layer=1, n_embd=8, n_head=1, n_kv_head=1, seq_len=seq_len)
        self.rope_len = seq_len * 4
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.table, self.gate, self.inputs = table, gate, []

    def forward(self, idx, kv_cache, kv_len=None):
        if self.gate is not None:
            self.gate.wait(10)
        self.inputs.append(idx.tolist())
        kv_cache.lengths += idx.shape[1]
        logits = torch.full((*idx.shape, self.config.vocab_size), -10.0)
        for b in range(idx.shape[0]):
            logits[b, -1, self.table.get(int(idx[b, -1]), 0)] = 10.0
        return logits


def run(engine, prompt, **kw):
    return engine.generate(prompt, SamplingParams(**kw))


# ---- sampling ----

def test_sample_greedy_topk_topp():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1)
    u = torch.rand(4)
    ones = torch.ones(4)
    assert torch.equal(sample(logits, torch.zeros(4), torch.zeros(4, dtype=torch.long), ones, u), best)
    assert torch.equal(sample(logits, ones, torch.ones(4, dtype=torch.long), ones, u), best)
    assert torch.equal(sample(logits, ones, torch.zeros(4, dtype=torch.long), torch.full((4,), 1e-6), u), best)
    # top-k 3: always one of the three likeliest
    top3 = logits.topk(3).indices
    for _ in range(20):
        got = sample(logits, ones * 2, torch.full((4,), 3, dtype=torch.long), ones, torch.rand(4))
        assert all(int(g) in top3[i].tolist() for i, g in enumerate(got))


def test_greedy_rows_share_the_top_k_sort_with_sampled_rows():
    """A greedy row keeps one token (`top_k_bound`), so a batch of greedy rows and top-k rows sorts only
    the k largest logits, and the greedy rows still take their argmax."""
    from model.sampling import IDLE, TEMPERATURE, TOP_K, top_k_bound
    torch.manual_seed(0)
    logits = torch.randn(4, 500)
    settings = [list(IDLE) for _ in range(4)]
    settings[2][TEMPERATURE], settings[2][TOP_K] = 1.0, 50  # rows 0, 1, 3 greedy with top_k 0
    assert top_k_bound(settings) == 50
    settings[3][TEMPERATURE] = 0.7  # a sampled row that keeps every token: the full sort
    assert top_k_bound(settings) == 0
    temperature = torch.tensor([0.0, 0.0, 1.0, 0.0])
    top_k = torch.tensor([0, 0, 50, 0])
    for k_max in (50, 0):
        got = sample(logits, temperature, top_k, torch.ones(4), torch.rand(4), k_max)
        assert torch.equal(got[[0, 1, 3]], logits.argmax(-1)[[0, 1, 3]])
        assert int(got[2]) in logits[2].topk(50).indices.tolist()


def test_top_k_sampling_orders_equal_logits_by_id(monkeypatch):
    """Equal logits (common in bf16) are ranked by id, lowest first, whatever order topk returns them
    in (CUDA's order of ties varies from run to run): the same picks under shuffled topk outputs, and
    greedy rows take argmax's id."""
    from model.sampling import RANKED_K as k_max
    g = torch.Generator().manual_seed(0)
    rows, V = 64, 3000
    logits = torch.randint(0, 200, (rows, V), generator=g).float() / 8  # each value about 15 times
    temperature, top_p = torch.full((rows,), 1.0), torch.full((rows,), 0.9)
    temperature[:8] = 0.0
    # top_k well inside k_max: which members of a tie group that crosses the k_max-th place topk keeps
    # is its own choice (a rank past every row's top_k)
    top_k = torch.randint(1, k_max - 50, (rows,), generator=g)
    uniform = torch.rand(rows, generator=g)
    want = sample(logits, temperature, top_k, top_p, uniform, k_max)
    assert torch.equal(want[:8], logits[:8].argmax(-1))
    topk = torch.Tensor.topk

    def shuffled(self, k, *args, **kwargs):
        vals, idx = topk(self, k, *args, **kwargs)
        perm = torch.randperm(k, generator=g)
        return vals[:, perm], idx[:, perm]

    monkeypatch.setattr(torch.Tensor, "topk", shuffled)
    for _ in range(3):
        assert torch.equal(sample(logits, temperature, top_k, top_p, uniform, k_max), want)


def test_a_failed_sampler_compile_falls_back_to_eager_for_that_k_max():
    """An Inductor error compiling the sampler for one k_max costs that k_max its compile (warned),
    not the server; other k_max values keep the compiled sampler."""
    import torch._inductor.exc

    from model.decode_graphs import DecodeGraphs
    calls = []

    def compiled(*args):
        calls.append(args[-1])
        if args[-1] == 0:
            raise torch._inductor.exc.InductorError(TypeError("codegen"), None)
        return "compiled"

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sample, graphs.eager_k = compiled, set()
    logits = torch.randn(2, 100)
    args = (logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.tensor([0.3, 0.6]))
    with pytest.warns(UserWarning, match="k_max 0"):
        got = graphs._sample(*args, 0)
    assert torch.equal(got, sample(*args, 0))
    assert graphs._sample(*args, 0).tolist() == got.tolist() and calls == [0]  # not compiled again
    assert graphs._sample(*args, 50) == "compiled" and calls == [0, 50]

    def broken(*args):
        raise ValueError("not a compile error")

    graphs.sample = broken  # any other error is the caller's, not a reason to go eager
    with pytest.raises(ValueError):
        graphs._sample(*args, 50)


def test_sample_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    u = torch.linspace(0, 0.999, 1000)
    ids = sample(logits.expand(1000, 3), torch.ones(1000), torch.zeros(1000, dtype=torch.long),
                 torch.ones(1000), u)
    counts = torch.bincount(ids, minlength=3).float() / 1000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.01)


def test_sampling_params_checked_up_front():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"top_k": 2**40}, {"max_tokens": -1},
                {"seed": 2**70}, {"temperature": float("nan")}, {"presence_penalty": 2.5},
                {"frequency_penalty": float("nan")}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {"5": 1.0}},
                {"logit_bias": {5: 101.0}}, {"logprobs": 21}, {"prompt_logprobs": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- the real model ----

def test_seeded_requests_repeat(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=4)
    a, _ = run(e, [1, 2, 3], temperature=1.5, max_tokens=30, seed=7)
    b, _ = run(e, [1, 2, 3], temperature=1.5, max_tokens=30, seed=7)
    c, _ = run(e, [1, 2, 3], temperature=1.5, max_tokens=30, seed=8)
    assert a == b and a != c


def test_batched_equals_alone(engine_factory, serve_model):
    """Requests sharing the batch (joining, leaving, rows moved) produce exactly what they do alone."""
    e = engine_factory(serve_model, max_batch=3)
    prompts = [[5, 6, 7], [9], [20, 21, 22, 23, 24], [30, 31], [40, 41, 42, 43]]
    lengths = [12, 30, 7, 25, 18]
    alone = [run(e, p, temperature=0, max_tokens=n)[0] for p, n in zip(prompts, lengths)]
    results = [[] for _ in prompts]
    finished = threading.Semaphore(0)

    def sink_for(out):
        return lambda ev: out.append(ev.id) if isinstance(ev, Token) else finished.release()

    for p, n, out in zip(prompts, lengths, results):
        e.submit(p, SamplingParams(temperature=0, max_tokens=n), sink_for(out))
    for _ in prompts:
        assert finished.acquire(timeout=30)
    assert results == alone
    assert [len(a) for a in alone] == lengths


def test_context_limit(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=2)
    ctx = e.max_len
    ids, fin = run(e, list(range(1, ctx - 4)), temperature=0, max_tokens=100)
    assert (len(ids), fin.reason) == (5, "length")
    with pytest.raises(PromptTooLong):
        run(e, list(range(ctx)), max_tokens=1)


# ---- scheduling, with the scripted model ----

def test_stop_id_ends_reply_unemitted(engine_factory):
    m = ScriptModel({1: 5, 5: 6, 6: 2})  # 2 is the stop id
    e = engine_factory(m, stop_ids=(2,))
    ids, fin = run(e, [1], temperature=0, max_tokens=10)
    assert ids == [5, 6] and fin.reason == "stop" and fin.completion_tokens == 2 and fin.prompt_tokens == 1


def test_tool_call_is_force_fed(engine_factory):
    PS, PE, OS, OE, END = 20, 21, 22, 23, 2
    seen = []

    def tool(expr):
        seen.append(list(expr))
        return [OS, 9, OE]

    m = ScriptModel({1: PS, PS: 10, 10: 11, 11: PE, PE: 3, OE: END})
    e = engine_factory(m, tool=tool, stop_ids=(END,), tool_start=PS, tool_end=PE)
    out, done = [], threading.Event()
    e.submit([1], SamplingParams(temperature=0, max_tokens=20),
             lambda ev: (out.append(ev), isinstance(ev, Finished) and done.set()))
    assert done.wait(10)
    assert seen == [[10, 11]]
    assert [(t.id, t.forced) for t in out[:-1]] == [(PS, False), (10, False), (11, False), (PE, False),
                                                    (OS, True), (9, True), (OE, True)]
    assert out[-1].reason == "stop"
    fed = [row[0][-1] for row in m.inputs[1:]]  # the decode inputs after the prefill
    assert fed[-3:] == [OS, 9, OE]


def test_forced_ids_carry_their_own_logprob(engine_factory):
    """A tool's forced id reports the model's logprob of that id, not of the id it would have sampled."""
    PS, PE, OS, OE, END = 20, 21, 22, 23, 2
    m = ScriptModel({1: PS, PS: 10, 10: PE, PE: 3, OS: 4, OE: END})  # after PE the model wants 3
    e = engine_factory(m, tool=lambda expr: [OS, OE], stop_ids=(END,), tool_start=PS, tool_end=PE)
    out, done = [], threading.Event()
    e.submit([1], SamplingParams(temperature=0, max_tokens=20, logprobs=1),
             lambda ev: (out.append(ev), isinstance(ev, Finished) and done.set()))
    assert done.wait(10)
    toks = [ev for ev in out if isinstance(ev, Token)]
    lse = torch.logsumexp(torch.tensor([10.0] + [-10.0] * 31), 0).item()
    assert [(t.id, t.forced) for t in toks] == [(PS, False), (10, False), (PE, False), (OS, True), (OE, True)]
    assert [t.logprob for t in toks] == pytest.approx([10 - lse] * 3 + [-10 - lse] * 2, abs=1e-4)
    assert toks[3].top[0][0] == 3 and toks[4].top[0][0] == 4  # what the model wanted instead


def taken(e, timeout: float = 30) -> None:
    """Until the scheduler has taken every waiting request into a row (a fixed sleep is too short on a
    loaded machine)."""
    deadline = time.time() + timeout
    while e.queue_depth and time.time() < deadline:
        time.sleep(0.005)
    assert e.queue_depth == 0


def test_queue_full_and_cancel_frees_the_row(engine_factory):
    gate = threading.Event()
    m = ScriptModel({i: i + 1 for i in range(30)}, gate=gate)
    e = engine_factory(m, max_batch=1, max_queue=1)
    events = {0: [], 1: []}
    first = e.submit([1], SamplingParams(temperature=0, max_tokens=1000), events[0].append)
    taken(e)  # the first request is being prefilled (blocked in the gate)
    e.submit([1], SamplingParams(temperature=0, max_tokens=3), events[1].append)
    with pytest.raises(QueueFull):
        e.submit([1], SamplingParams(max_tokens=3), lambda ev: None)
    assert e.queue_depth == 1
    e.cancel(first)
    gate.set()
    deadline = time.time() + 10
    while not (events[1] and isinstance(events[1][-1], Finished) and e.num_active == 0) and time.time() < deadline:
        time.sleep(0.01)  # (a finished request's sink hears it before its row is freed)
    assert isinstance(events[0][-1], Finished) and events[0][-1].reason == "cancelled"
    assert [ev.id for ev in events[1][:-1]] == [2, 3, 4] and events[1][-1].reason == "length"
    assert e.num_active == 0 and e.queue_depth == 0


def test_cancelling_a_waiting_request_frees_the_queue(engine_factory):
    gate = threading.Event()
    m = ScriptModel({i: i + 1 for i in range(30)}, gate=gate)
    e = engine_factory(m, max_batch=1, max_queue=1)
    e.submit([1], SamplingParams(temperature=0, max_tokens=2), lambda ev: None)
    taken(e)
    waiting = e.submit([1], SamplingParams(max_tokens=2), lambda ev: None)
    e.cancel(waiting)
    assert e.queue_depth == 0
    e.submit([1], SamplingParams(max_tokens=2), lambda ev: None)  # room again
    gate.set()


def test_submit_all_is_all_or_none(engine_factory):
    """A batch of requests the queue cannot hold whole, or with one bad request in it, leaves none of
    them queued (a request's n choices run together or not at all)."""
    gate = threading.Event()
    m = ScriptModel({i: i + 1 for i in range(30)}, gate=gate)
    e = engine_factory(m, max_batch=1, max_queue=2)
    e.submit([1], SamplingParams(temperature=0, max_tokens=2), lambda ev: None)  # takes the row
    taken(e)
    e.submit([1], SamplingParams(max_tokens=2), lambda ev: None)
    with pytest.raises(QueueFull):  # two more do not fit the one place left
        e.submit_all([([1], SamplingParams(max_tokens=2), lambda ev: None)] * 2)
    assert e.queue_depth == 1
    with pytest.raises(ValueError):  # the second is bad
        e.submit_all([([1], SamplingParams(max_tokens=2), lambda ev: None), ([], SamplingParams(), lambda ev: None)])
    assert e.queue_depth == 1
    assert len(e.submit_all([([1], SamplingParams(max_tokens=2), lambda ev: None)])) == 1 and e.queue_depth == 2
    gate.set()


def test_a_failing_forward_ends_its_requests_with_an_error(engine_factory):
    """A forward that raises (here every prompt's first chunk, or a decode step) ends the requests in it
    with Finished('error') naming the exception, never leaves one waiting for ever, and the engine
    serves the next request."""

    class FailingModel(ScriptModel):
        fail_prefill, fail_decode = True, False

        def forward(self, idx, kv_cache, kv_len=None):
            if idx.shape[1] > 1 and self.fail_prefill or idx.shape[1] == 1 and self.fail_decode:
                raise RuntimeError("broken on purpose")
            return super().forward(idx, kv_cache, kv_len)

    model = FailingModel({1: 2, 2: 3, 3: 1})
    e = engine_factory(model, max_batch=4)

    def finished(prompt: list[int]) -> Finished:
        box, done = [], threading.Event()
        e.submit(prompt, SamplingParams(temperature=0, max_tokens=4),
                 lambda ev: isinstance(ev, Finished) and (box.append(ev), done.set()))
        assert done.wait(10), "the request never finished"
        return box[0]

    for prompt in ([1, 2, 3], [2, 3]):
        f = finished(prompt)
        assert f.reason == "error" and "broken on purpose" in f.error, f
    assert finished([1]).reason == "length"  # its one-id prompt passes, as a decode step does
    model.fail_prefill, model.fail_decode = False, True
    assert finished([1, 2]).reason == "error"
    model.fail_decode = False
    assert finished([1, 2]) == Finished("length", 2, 4)


def test_a_failing_sink_does_not_stop_the_engine(engine_factory, serve_model):
    e = engine_factory(serve_model, max_batch=2)

    def bad(ev):
        raise RuntimeError("client gone")

    e.submit([1, 2], SamplingParams(max_tokens=50), bad)
    ids, fin = run(e, [3, 4], temperature=0, max_tokens=5)
    assert len(ids) == 5 and fin.reason == "length"


# ---- chat wiring (model/chat_engine.py) and the stream decoder (model/tokenizer.py) ----

@pytest.mark.parametrize("tool_use", [True, False])
def test_chat_engine_calls_the_calculator_only_if_tool_use(serve_tokenizer, tool_use):
    from model.chat import ToolUse, read_reply
    from model.chat_engine import chat_engine
    from model.requests import sampling_params
    from model.model_info import DEFAULT_GENERATION
    from model.tokenizer import StreamDecoder

    tok = serve_tokenizer
    s = tok.special
    expr = tok.encode("6*7")
    assert len(set(expr)) == len(expr) and 1 not in expr
    chain = [1, s["<|python_start|>"], *expr, s["<|python_end|>"], s["<|assistant_end|>"]]
    table = dict(zip(chain, chain[1:]))
    table[s["<|output_end|>"]] = s["<|assistant_end|>"]  # after the tool's answer, the reply ends
    gen = {**DEFAULT_GENERATION, "tool_use": tool_use}
    engine = chat_engine(ScriptModel(table, vocab=tok.vocab_size), tok, gen, max_batch=2)
    try:
        ids, fin = engine.generate([1], sampling_params(gen, temperature=0))
    finally:
        engine.shutdown()
    assert fin.reason == "stop"  # <|assistant_end|> is a stop id, not emitted
    reply = read_reply(tok, ids)
    assert reply.tool_uses == [ToolUse("6*7", "42" if tool_use else None)] and reply.words == ""
    dropped = StreamDecoder(tok)  # without a display, special ids are skipped
    assert "".join(dropped.push(i) for i in ids) + dropped.flush() == ("6*742" if tool_use else "6*7")


def test_sampling_params_fill_in_generation_defaults():
    from model.requests import sampling_params
    gen = {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "max_tokens": 256}
    p = sampling_params(gen, temperature=0.0, max_tokens=5, seed=3)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed) == (0.0, 50, 0.9, 5, 3)
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_params(gen, max_tokens=-1)
    assert sampling_params(gen, presence_penalty=0.5, logprobs=2).presence_penalty == 0.5


def test_utf8_pieces_are_whole(serve_tokenizer):
    from model.tokenizer import StreamDecoder
    text = "Café naïve 你好世界 🙂🚀 résumé"
    dec = StreamDecoder(serve_tokenizer)
    pieces = [dec.push(i) for i in serve_tokenizer.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it did stream

def test_stream_decoder_reads_what_decode_writes(serve_tokenizer):
    """Any ids, read a few at a time, make the text the tokenizer's decode makes of them (special ids
    left out), bytes that never make a character included."""
    import random
    from model.tokenizer import StreamDecoder
    tok = serve_tokenizer
    rng = random.Random(0)
    plain = [i for i in range(tok.vocab_size) if i not in tok.special_ids]
    cut = [i for i in plain if tok.token_bytes(i)[-1:] >= b"\xc0"]  # ids ending where a character starts
    assert cut
    for _ in range(200):
        ids = [rng.choice(cut if rng.random() < 0.3 else plain) for _ in range(rng.randint(1, 12))]
        dec, pieces, k = StreamDecoder(tok), [], 0
        while k < len(ids):
            n = rng.randint(1, 4)
            pieces.append(dec.read(ids[k:k + n]))
            k += n
        assert "".join(pieces) + dec.flush() == tok.decode(ids)
    with_special = [*tok.encode("a"), tok.special["<|assistant_end|>"], *tok.encode("b")]
    assert StreamDecoder(tok).read(with_special) == "ab"


def small_gpt():
    """A real GPT, fp32, small enough for a CPU, with output projections that are not zero and a
    sharp head (large logit gaps: greedy ids do not hang on float rounding between paths)."""
    from model.gpt import GPT
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, seq_len=128))
    model.init_weights(seed=0)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.1)
            block.mlp.c_proj.weight.normal_(0, 0.1)
        model.lm_head.weight.mul_(1000)
    return model.eval()


def generate_together(engine, jobs, timeout: float = 30) -> list:
    """`engine.generate` for every (prompt, params) job at once, each from a thread of its own (so they
    share batches); the results in the jobs' order."""
    box = {}
    threads = [threading.Thread(target=lambda k, p, s: box.__setitem__(k, engine.generate(p, s)), args=(k, p, s))
               for k, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [box[k] for k in range(len(jobs))]


def test_long_prompts_prefill_in_chunks_with_the_same_ids():
    """A prompt longer than `prefill_chunk` goes in over several scheduler steps while another request
    decodes; the ids equal those of a whole-prompt prefill (a real GPT, fp32 on CPU)."""
    model = small_gpt()
    g = torch.Generator().manual_seed(1)
    long, short = torch.randint(0, 64, (90,), generator=g).tolist(), [1, 2, 3]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    whole = Engine(model, EngineConfig(max_batch=4, prefill_chunk=1000)).start()
    want = [whole.generate(p, greedy)[0] for p in (long, short)]
    whole.shutdown()
    chunked = Engine(model, EngineConfig(max_batch=4, prefill_chunk=16)).start()
    try:
        got = [ids for ids, _ in generate_together(chunked, [(long, greedy), (short, greedy)])]
    finally:
        chunked.shutdown()
    assert got == want


def test_flex_cache_gives_the_sdpa_logits(monkeypatch):
    """A FlexAttention cache (the GPU graphs' path) against the boolean-mask SDPA one: rows of other
    lengths, a chunk of 150 new tokens (FlexAttention's general kernel) into three slot blocks, then
    decode steps over a bucket wider than any row; the same logits. The blocks compiled, as the engine
    runs them (why: `KVCache`), dynamo reset first so earlier tests' compiles cannot push these past its
    recompile limit, and with inductor's on-disk caches off: with torch 2.13 on a CPU, these blocks
    loaded from a warm cache gave NaN logits or aborted the process (a fresh cache: the same logits)."""
    from model.gpt import KVCache
    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    model = small_gpt()
    for block in model.blocks:
        block.compile(dynamic=True)
    g = torch.Generator().manual_seed(2)
    chunk = torch.randint(0, 64, (3, 150), generator=g)
    steps = torch.randint(0, 64, (3, 3, 1), generator=g)
    outs = []
    with torch.no_grad():
        for flex in (False, True):
            cache = KVCache(model.config, 3, 512, "cpu", torch.float32, flex=flex)
            cache.lengths.copy_(torch.tensor([0, 40, 130]))  # earlier slots hold zeros: attended all the same
            outs.append([model(chunk, kv_cache=cache, kv_len=130 + 150)])
            outs[-1] += [model(ids, kv_cache=cache, kv_len=512) for ids in steps]
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def replayed_graphs(monkeypatch):
    """DecodeGraphs on a CPU: each "graph" replayed by running its step again, writing its results into
    the first run's tensors (a CUDA graph's fixed outputs)."""
    from model.decode_graphs import DecodeGraphs

    class Replay:
        def __init__(self, step, out):
            self.step, self.out = step, out

        def replay(self):
            new = self.step()
            for a, b in zip(*((self.out, new) if isinstance(new, tuple) else ((self.out,), (new,)))):
                if a is not None:
                    a.copy_(b)

    def graph(self, step, put_back):
        out = step()
        put_back()
        return Replay(step, out), out

    monkeypatch.setattr(DecodeGraphs, "_graph", graph)
    return DecodeGraphs


def test_graph_paths_give_the_eager_ids_on_cpu(replayed_graphs, capsys):
    """DecodeGraphs' own logic (buckets of rows and slots, rows past the active ones, the first chunk
    prefilled padded into the scratch row and copied to its row) with each "graph" replayed by running
    its step again, so that it runs on a CPU: the same ids as the plain path, one request at a time and
    batched, greedy and seeded (a real GPT, fp32). The warm-up's progress bar counts every capture.
    The captured graphs themselves: tests/test_engine_gpu.py."""
    DecodeGraphs = replayed_graphs
    model = small_gpt()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 20, 40, 5)]  # 40 > the chunk
    params = lambda i: SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=8, max_tokens=12, seed=i)  # noqa: E731

    def run(engine, together):
        jobs = [(p, params(i)) for i, p in enumerate(prompts)]
        if together:
            return [ids for ids, _ in generate_together(engine, jobs)]
        return [engine.generate(p, s)[0] for p, s in jobs]

    plain = Engine(model, EngineConfig(max_batch=4, prefill_chunk=32, run_ahead=False)).start()
    try:
        want = run(plain, together=False)
    finally:
        plain.shutdown()
    engine = Engine(model, EngineConfig(max_batch=4, prefill_chunk=32, run_ahead=False))
    engine.graphs = DecodeGraphs(model, engine.cache, engine.extras_buffers, engine.config.prefill_chunk,
                                 compile_blocks=False)
    engine.start()
    g = engine.graphs
    total = 2 + len(g.prefills) + len(g.graphs)  # two compile calls (one row, two), then one per capture
    bar = capsys.readouterr().err.split("\r")[-1]
    if not os.environ.get("TQDM_DISABLE"):  # a user's switch for every tqdm bar
        assert bar.startswith("engine warm-up: compile, capture graphs: 100%") and f" {total}/{total} [" in bar, bar
    try:
        alone, together = run(engine, together=False), run(engine, together=True)
        assert engine.graphs.prefill_replays >= len(prompts) and engine.graphs.graphs
    finally:
        engine.shutdown()
    assert alone == want
    assert together == want


def test_running_ahead_changes_no_token():
    """With `run_ahead` the next decode step starts from the last step's sampled ids before the host
    has read them (as on CUDA); every request still gets the ids of the plain path: stops, lengths,
    tool calls with forced ids, and seeded sampling, all in one batch."""
    PS, PE, OS, OE, END = 20, 21, 22, 23, 2
    table = {1: PS, PS: 10, 10: 11, 11: PE, PE: 3, OE: END, 3: 4, 4: 5, 5: 6, 6: 7, 7: END, 8: 9, 9: 8}

    def run(run_ahead: bool):
        m = ScriptModel(table)
        e = Engine(m, EngineConfig(max_batch=4, stop_ids=(END,), tool_start=PS, tool_end=PE, run_ahead=run_ahead),
                   tool=lambda expr: [OS, 9, OE]).start()
        try:
            # one-id prompts: ScriptModel reads the last column
            jobs = [([1], SamplingParams(temperature=0, max_tokens=20)), ([3], SamplingParams(temperature=0, max_tokens=20)),
                    ([8], SamplingParams(temperature=0, max_tokens=7)), ([5], SamplingParams(temperature=1.0, seed=4, max_tokens=9))]
            results = generate_together(e, jobs, timeout=10)
        finally:
            e.shutdown()
        return {k: (ids, fin.reason) for k, (ids, fin) in enumerate(results)}, e.steps_ahead

    plain, none_ahead = run(False)
    ahead, launched_ahead = run(True)
    assert ahead == plain and len(plain) == 4
    assert none_ahead == 0 and launched_ahead > 0


def test_special_token_text_in_a_message_is_plain_text(serve_tokenizer):
    """Prompt injection: the text of every control token, typed into any message, encodes as plain
    text; the only control ids in a rendered prompt are the ones the renderer put there."""
    from model.chat import render
    from model.tokenizer import SPECIAL_TOKENS
    tok = serve_tokenizer
    control = set(tok.special.values())
    typed = " ".join(SPECIAL_TOKENS)
    for t in SPECIAL_TOKENS:
        ids = tok.encode(t)
        assert not control & set(ids) and tok.decode(ids) == t
    plain = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"},
             {"role": "user", "content": "w"}]
    forged = [{"role": m["role"], "content": m["content"] + typed} for m in plain]
    want = [i for i in render(tok, plain, for_completion=True)[0] if i in control]
    got = [i for i in render(tok, forged, for_completion=True)[0] if i in control]
    assert got == want  # the same control ids, in the same places
    assert not control & set(tok.encode_batch([typed])[0])  # the tokenize stage's path too


def test_requests_of_one_prompt_share_its_prefill(engine_factory, serve_model, monkeypatch):
    """Requests of the same prompt admitted together run one prefill row between them (the others copy its
    cache row, all copies in one go) and sample exactly what each does alone: every seed's ids, greedy's, and the prompt's logprobs."""
    e = engine_factory(serve_model, max_batch=8)
    prompt, other = [5, 6, 7, 8, 9], [30, 31]
    wanted = [(prompt, dict(temperature=1.0, max_tokens=12, seed=s)) for s in (1, 2, 3)]
    wanted += [(other, dict(temperature=0, max_tokens=12)), (prompt, dict(temperature=0, max_tokens=12, prompt_logprobs=2))]
    wanted += [(other, dict(temperature=1.0, max_tokens=12, seed=4))]  # copies of two prompts of unequal lengths
    alone = [run(e, p, **kw) for p, kw in wanted]
    lone_lp = []
    got = threading.Event()
    e.submit(prompt, SamplingParams(**wanted[4][1]),
             lambda ev: lone_lp.append(ev.logprobs) if isinstance(ev, PromptLogprobs) else got.set() if isinstance(ev, Finished) else None)
    assert got.wait(30)
    rows = []
    forward = e.model.forward

    def counting(idx, *a, **kw):
        if kw.get("kv_cache") is not None and idx.shape[1] > 1:  # a prefill
            rows.append(idx.shape[0])
        return forward(idx, *a, **kw)

    monkeypatch.setattr(e.model, "forward", counting)
    results = [[] for _ in wanted]
    ends, done = [None] * len(wanted), threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            if isinstance(ev, Token):
                results[i].append(ev.id)
            elif isinstance(ev, PromptLogprobs):
                ends[i] = ev.logprobs
            else:
                done.release()
        return sink

    e.submit_all([(p, SamplingParams(**kw), sink_for(i)) for i, (p, kw) in enumerate(wanted)])
    for _ in wanted:
        assert done.acquire(timeout=30)
    assert rows == [2]  # one forward, one row for each distinct prompt
    assert results == [ids for ids, _ in alone] and len(set(map(tuple, results[:3]))) == 3
    assert ends[4] == lone_lp[0] and len(ends[4]) == len(prompt) - 1


def test_an_engine_of_one_row_warms_its_graphs_up(replayed_graphs):
    """max_batch 1 (bench/hf_peer.py's engine): the warm-up compiles for one row only; a call of two rows
    on its one-row cache indexed past it (on a GPU, a device-side assert in a later call)."""
    model = small_gpt()
    engine = Engine(model, EngineConfig(max_batch=1, prefill_chunk=32, run_ahead=False))
    engine.graphs = replayed_graphs(model, engine.cache, engine.extras_buffers, 32, compile_blocks=False)
    engine.start()
    try:
        ids = engine.generate([3, 5, 7], SamplingParams(temperature=0.0, max_tokens=8))[0]
    finally:
        engine.shutdown()
    plain = Engine(model, EngineConfig(max_batch=1, run_ahead=False)).start()
    try:
        assert ids == plain.generate([3, 5, 7], SamplingParams(temperature=0.0, max_tokens=8))[0]
    finally:
        plain.shutdown()


def test_row_products_give_the_linear_s_logits(monkeypatch):
    """model.gpt.ROW_PRODUCTS (one row's Linears as a product and a sum, for Inductor to fuse): a decode
    step's logits as the Linears give them (fp32, summation order aside), and more rows take the Linears."""
    from model import gpt
    model = small_gpt()
    prompt = torch.tensor([[5, 9, 2, 7]])

    def last_logits():
        cache = KVCache(model.config, 1, 16, "cpu", torch.float32)
        model(prompt, kv_cache=cache)
        return model(torch.tensor([[3]]), kv_cache=cache)[:, -1]

    calls = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[:-1].numel()))
    want = last_logits()
    monkeypatch.setattr(gpt, "ROW_PRODUCTS", True)
    calls.clear()
    got = last_logits()
    # the decode step calls no Linear; the 4-token prefill called them all
    assert calls.count(1) == 0 and calls.count(4) == 2 * 4 + 1, calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_constrained_row_replays_the_graphs_with_its_mask(replayed_graphs, serve_model, serve_tokenizer):
    """Under graphs a grammar's mask goes in through the extras' mask rows (model.grammar.write_masks) and
    the step replays the extras' graph: the ids of the engine without graphs, the constrained reply valid
    JSON, and every step run from a graph."""
    import json

    from model.chat import STOP_TOKENS
    from model.chat_engine import run_all
    from model.grammar import Grammars, json_grammar
    s = serve_tokenizer.special
    grammars = Grammars(serve_tokenizer.to_str(), serve_model.config.vocab_size, s["<|assistant_end|>"])
    prompt = [serve_tokenizer.bos_id] + serve_tokenizer.encode("Hello!")
    array = json_grammar({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3,
                          "maxItems": 5})
    jobs = [(prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=i)) for i in range(3)] + [
        (prompt, SamplingParams(temperature=1.0, max_tokens=60, seed=9, grammar=array))]

    def run(graphs: bool):
        engine = Engine(serve_model, EngineConfig(max_batch=4, run_ahead=False,
                                                  stop_ids=tuple(s[name] for name in STOP_TOKENS)), grammars=grammars)
        if graphs:
            engine.graphs = replayed_graphs(serve_model, engine.cache, engine.extras_buffers,
                                            engine.config.prefill_chunk, compile_blocks=False)
        engine.start()
        try:
            replayed = []
            if graphs:  # every decode step through DecodeGraphs.step, none through the plain forward
                step = engine.graphs.step
                engine.graphs.step = lambda *a, **k: replayed.append(a[3] if len(a) > 3 else k.get("extras")) or step(*a, **k)
            ids = [[t.id for t in toks] for toks, _ in run_all(engine, jobs)]
            return ids, replayed, engine.steps
        finally:
            engine.shutdown()

    plain, _, _ = run(False)
    graphed, replayed, steps = run(True)
    assert graphed == plain
    assert len(json.loads(serve_tokenizer.decode(graphed[3]))) >= 3
    assert len(replayed) == steps and True in replayed  # the constrained steps replayed the extras' graph
