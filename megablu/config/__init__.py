from .load import (
    ConfigError,
    apply_overrides,
    build_config,
    config_hash,
    load_config,
    load_for_command,
    load_raw,
    to_yaml,
)
from .schema import Config, check_invariants, config_warnings, eval_padded_len, grad_accum_steps

__all__ = [
    "Config",
    "ConfigError",
    "apply_overrides",
    "build_config",
    "check_invariants",
    "config_hash",
    "config_warnings",
    "eval_padded_len",
    "grad_accum_steps",
    "load_config",
    "load_for_command",
    "load_raw",
    "to_yaml",
]
