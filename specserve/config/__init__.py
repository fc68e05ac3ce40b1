"""Validated configuration dataclasses (plain data: they import nothing above them). CLI flags
map 1:1 onto their fields."""

from specserve.config.engine import EngineConfig, resolve_dtype
from specserve.config.speculative import METHODS, SpeculativeConfig

__all__ = ["METHODS", "EngineConfig", "SpeculativeConfig", "resolve_dtype"]
