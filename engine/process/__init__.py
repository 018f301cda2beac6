"""The engine in a child process and the client of any OpenAI-compatible server that talks to it."""
