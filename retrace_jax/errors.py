"""The library's error types. All are ``ValueError``s: bad input that the caller can fix."""


class ConfigError(ValueError):
    """A configuration this library cannot run: a model's ``config.json``, a training config, or options
    that do not fit together."""


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors do not fit the model its config describes."""


class DataError(ValueError):
    """A prompt file or prepared data directory that cannot be used."""
