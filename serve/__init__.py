"""sparkchat chat server: an OpenAI-compatible API and a Gradio chat page over one batching engine."""

# the server's defaults (`sparkchat serve` flags and api.Settings); here so the flag parser needs no torch
MAX_BATCH = 16  # sequences decoded together (KV-cache rows)
MAX_QUEUE = 64  # requests that may wait for a row; beyond that, 429
MODEL_ID = "sparkchat"  # the model's name in the API
API_SERVERS = 1  # front-end processes (HTTP, rendering, detokenizing, SSE), beside the engine's
STREAM_INTERVAL = 0.0  # least seconds between two SSE events of one stream (0: each token at once)
# the most SSE events a second one front end sends over all its streams (0: no limit). Each event costs
# the front end a task wake-up, an ASGI send and a socket write whatever it carries (bench/results/serving.md,
# "What an event costs"): with many streams, each stream's events are spaced active streams / this many
# seconds apart and carry the tokens in between; one stream, or a few, still get every token at once.
# 1000 rather than 2000: less of the server's CPU a token at 128 CPU streams (serving.md, "The server's
# CPU a token at 128 CPU streams"), and still eight events a second to each of 128 streams.
STREAM_EVENTS_PER_S = 1000.0

# limits of one front end's connections (serve.limits; docs/serving.md, "Limits of a connection")
MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers together
MAX_HEADER_BYTES = 8190  # one header line (Apache httpd's LimitRequestFieldSize)
MAX_HEADERS = 100  # headers of one request (Apache httpd's LimitRequestFields)
REQUEST_TIMEOUT_S = 30.0  # from a request's first byte until its head and body have arrived
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle connection, between requests or before its first (uvicorn's default)
MAX_CONNECTIONS = 1000  # open connections of one front end (fewer where the open-file limit is lower)
# seconds the engine may leave a front end's ping unanswered before /health says 503 and requests fail
# (serve.watchdog); the supervisor stops the server when it has not answered for STOP_AFTER times this
ENGINE_TIMEOUT_S = 5.0
