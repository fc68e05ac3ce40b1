"""OpenAI-compatible server: `specserve serve` / `create_app(engine)`."""
