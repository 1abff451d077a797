"""Model definitions and the checkpoint loader."""

from kiln.models.arch import SUPPORTED_ARCHITECTURES, ArchConfig
from kiln.models.loader import LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchConfig", "LoadedModel", "load_model"]
