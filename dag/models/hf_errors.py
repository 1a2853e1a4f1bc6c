"""Typed errors for Hugging Face folders: a folder is untrusted input, refused with one of these."""

from fusionllm.common.errors import ConfigError, FusionError


class CheckpointFolderError(FusionError):
    """A Hugging Face folder we cannot read or write; the message names the file and the fix."""


class MissingFileError(CheckpointFolderError, FileNotFoundError):
    """config.json, the weights, or a shard the index names is not there."""


class UnsupportedModelError(CheckpointFolderError, ConfigError):
    """config.json names an architecture or a setting we do not implement, or is malformed."""


class TensorShapeError(CheckpointFolderError):
    """A tensor is missing, unexpected, or has a shape other than the config implies."""


class TensorValueError(CheckpointFolderError):
    """A tensor has a dtype we refuse (not floating point) or holds NaN or infinity."""
