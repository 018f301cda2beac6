"""`stowage serve`: an OpenAI-compatible HTTP API over the engine, with continuous batching (docs/server.md).

listener (sockets, uvicorn) -> schemas (requests in) -> app (HTTP) -> serving (the model served; swapping it) ->
responses (objects out). The engine's work runs in engine/serving/ (the scheduler); engine/cli/serve.py is the
command."""
