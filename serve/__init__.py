"""sparkchat chat server: an OpenAI-compatible API and a Gradio chat page over one batching engine."""
