"""sparkchat chat server: an OpenAI-compatible API and a Gradio chat page over one batching engine.

Its knobs, with their defaults and checks: serve/settings.py."""
