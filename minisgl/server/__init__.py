"""The online server: CLI, launcher, OpenAI-compatible HTTP API, worker processes, shell."""
