"""Supported model architectures, their config, and (in ``loader``) checkpoint locating."""

from __future__ import annotations

from minisgl.models.config import ModelConfig, RopeConfig
from minisgl.models.registry import get_model_class, supported_architectures

__all__ = ["ModelConfig", "RopeConfig", "get_model_class", "supported_architectures"]
