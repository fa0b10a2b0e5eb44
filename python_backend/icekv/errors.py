"""The exceptions icekv raises on purpose; each carries a message meant for the user."""


class IcekvError(Exception):
    """Base class: an error the CLI and the server report as a clear message, not a traceback."""


class ConfigError(IcekvError, ValueError):
    """A setting or request parameter is out of range or unknown."""


class AssetError(IcekvError):
    """A model or text could not be fetched, converted or verified."""


class ModelLoadError(IcekvError):
    """A model directory is missing, incomplete or of an unsupported architecture."""


class CacheFullError(IcekvError):
    """The request does not fit in the KV page pool."""
