"""Typed configuration: each field declares its default, help and Megatron flag once."""

from mega.core.config.options import flag_of, option
from mega.core.config.parser import ConfigError, add_section, flag_reference, load_toml, parse

__all__ = ["ConfigError", "add_section", "flag_of", "flag_reference", "load_toml", "option", "parse"]
