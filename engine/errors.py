"""Typed errors a user can meet; each message says what, how much, and what to do."""


class StowageError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelFormatError(StowageError):
    """A model folder or weight file is malformed, incomplete or of a format we refuse."""


class WeightsChangedError(ModelFormatError):
    """A weight file changed on disk (truncated, replaced, rewritten) under a loaded model: the step that met it is
    discarded, and the model must be loaded again."""


class TemplateError(ModelFormatError):
    """The chat template failed to render (or raised on purpose through raise_exception)."""


class TemplateLimitError(TemplateError):
    """The chat template ran past a limit on time, size, loops or nesting (engine/text/template_limits.py)."""


class UnsupportedModelError(StowageError):
    """The architecture in config.json is not one Stowage implements."""


class InvalidArgumentError(StowageError, ValueError):
    """A value the caller gave (a sampling setting, a context size, a prompt) is out of range or malformed."""


class InsufficientMemoryError(StowageError):
    """A plan, an allocation or a load does not fit the memory available."""


class OutOfBlocksError(InsufficientMemoryError):
    """The paged KV cache has no free block left for a sequence."""


class GenerationCancelled(StowageError):
    """Generation or loading was cancelled by the caller."""


class StowageWarning(UserWarning):
    """A problem worth telling the user that does not stop the work."""


class RemoteError(StowageError):
    """A server the client talks to (engine/process/client.py) could not be reached, refused a request, or failed."""


class EngineStartError(StowageError):
    """The engine's child process (engine/process/engine_process.py) refused to start: its own message says why."""


class EngineCrashedError(StowageError):
    """The engine's child process died (a signal, the out-of-memory killer, a crash in native code); the caller,
    its chats and the text streamed so far are intact, and a new engine can be started."""


class HubError(StowageError):
    """The Hugging Face Hub (or the server HF_ENDPOINT names) refused, failed, or sent a file that is not what it
    lists; the message says which repository or file, and what to do."""


class HubAccessError(HubError):
    """A repository is gated or private and the token (HF_TOKEN, the stored login) has no access: log in."""


class DownloadCancelled(StowageError):
    """A download was cancelled by the user; what was fetched is kept, and the next pull of the model resumes it."""
