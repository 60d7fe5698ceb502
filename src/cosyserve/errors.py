"""The one error hierarchy of cosyserve.

Every error a user can cause derives from :class:`CosyserveError`. Its ``code`` is a
stable machine-readable identifier; the transports (HTTP, gRPC, CLI) map error classes
to their status codes in one place and show ``str(error)`` (never internal exception
text) to clients.
"""


class CosyserveError(Exception):
    """Base class of all errors cosyserve raises on purpose."""

    code = "internal_error"


class ModelDirError(CosyserveError):
    """The model directory is missing, incomplete, unsupported or unreadable."""

    code = "model_dir_invalid"


class CheckpointError(ModelDirError):
    """A checkpoint file is corrupt or does not match the expected tensor table."""

    code = "checkpoint_invalid"


class InvalidRequestError(CosyserveError):
    """A request (text, prompt, options) is not acceptable."""

    code = "invalid_request"


class PromptAudioError(InvalidRequestError):
    """The prompt audio cannot be decoded or is unusable (too short, too long, silent, ...)."""

    code = "invalid_prompt_audio"


class UnsupportedAudioFormatError(InvalidRequestError):
    """The requested response format or output sample rate cannot be produced."""

    code = "unsupported_audio_format"
