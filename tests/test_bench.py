"""The benchmarks' own machinery (their speed is measured in bench/, never here)."""
from __future__ import annotations

import pytest

from bench.serve import rounds_in_processes, shares
from bench.serve_gpu import scrape
from serve.api import Settings, create_app


def test_shares_give_every_stream_to_one_client_process():
    assert shares(5, 3) == [range(0, 1), range(1, 3), range(3, 5)]
    assert shares(2, 8) == [range(0, 1), range(1, 2)]  # never a process with nothing to do
    for streams, procs in ((1, 1), (16, 2), (128, 8), (7, 3)):
        got = shares(streams, procs)
        assert sorted(i for r in got for i in r) == list(range(streams)) and all(got)
    with pytest.raises(ValueError, match="at least one stream and one client process"):
        shares(4, 0)


def test_client_processes_count_the_tokens_the_server_generated(serve_start, serve_model_dir):
    """The HTTP levels' client processes, against a live server: `at_start` runs once, after the warm-up
    and before the timed rounds, and the tokens they count are those the server's metrics count."""
    s = serve_start(create_app(Settings(model_dir=serve_model_dir, ui=False)))
    url = s.url + "/v1/chat/completions"
    snapshots = []
    r = rounds_in_processes(url, 3, 6, 0.0, 5, lambda: snapshots.append(scrape(s.url)) or len(snapshots),
                            lambda: scrape(s.url), str(serve_model_dir / "tokenizer.json"))
    after = r.at_end
    generated = after["sparkchat_completion_tokens_total"] - snapshots[0]["sparkchat_completion_tokens_total"]
    assert r.processes == 3 and r.at_start == 1
    assert 0 < r.tokens == generated <= 3 * 6
    assert 0 <= r.text_tokens <= r.tokens  # those that arrived as text (counted after the timed rounds)
    assert (r.text_events > 0) == (r.text_tokens > 0) and r.text_events <= r.text_tokens  # an event carries >= 1
    assert r.seconds > 0 and r.client_cpu_s > 0 and 0 < r.busiest_cpu_share
