"""What the GPT-2 and Llama reference models share: the config base and `random_batch`.

`ModelConfig`: named presets, `with_`, and field validation. `GPTConfig` and `LlamaConfig` are
frozen dataclasses that also inherit it. It adds no dataclass fields; a subclass sets two class
attributes (without annotations, so they are not fields either):
- `PRESETS`: its module's {name: field overrides} table, which `preset(name, **overrides)` reads;
- `MODEL_NAME`: how "unknown ... preset" errors name the model ("GPT-2", "Llama").
Validation errors name the config class and the field, e.g. "GPTConfig.n_head must be positive".
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import torch

Config = TypeVar("Config", bound="ModelConfig")


class ModelConfig:
    """Mixin for a frozen dataclass of model sizes (see the module docstring)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    MODEL_NAME: ClassVar[str] = "model"

    @classmethod
    def preset(cls: type[Config], name: str, **overrides) -> Config:
        """A named size from the model module's PRESETS, with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.MODEL_NAME} preset {name!r}; choose from {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def with_(self: Config, **overrides) -> Config:
        """A copy with some fields changed (validated again)."""
        return replace(self, **overrides)

    # ---- validation helpers for __post_init__ -------------------------------------------------------
    def _require_positive(self, *fields: str) -> None:
        """ValueError "<Class>.<field> must be positive, got <value>" for the first field that is <= 0."""
        for f in fields:
            if getattr(self, f) <= 0:
                raise ValueError(f"{type(self).__name__}.{f} must be positive, got {getattr(self, f)}")

    def _require_multiple(self, field: str, of: str) -> None:
        """ValueError "<Class>: <field>=<v> is not a multiple of <of>=<w>" unless `of` divides `field`."""
        value, divisor = getattr(self, field), getattr(self, of)
        if value % divisor:
            raise ValueError(f"{type(self).__name__}: {field}={value} is not a multiple of {of}={divisor}")

    def _require_choice(self, field: str, choices: tuple[str, ...]) -> None:
        """ValueError "<Class>.<field> must be 'a' or 'b', got <value>" unless the field is one of `choices`."""
        value = getattr(self, field)
        if value not in choices:
            allowed = " or ".join(repr(c) for c in choices)
            raise ValueError(f"{type(self).__name__}.{field} must be {allowed}, got {value!r}")


def random_batch(
    config: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    ignore_fraction: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A reproducible (idx, targets) pair of (B, T) int64 tensors for a GPT-2 or Llama config: random
    tokens below config.vocab_size, targets being the next token (as in language-model training).
    `ignore_fraction` of the targets are set to -1, the ignore_index the models' forward passes to
    cross_entropy. T defaults to config.block_size."""
    T = config.block_size if seq_len is None else seq_len
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, T + 1), generator=g)
    idx, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ignore_fraction > 0:
        targets[torch.rand(targets.shape, generator=g) < ignore_fraction] = -1
    return idx.to(device), targets.to(device)
