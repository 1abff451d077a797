"""Engine configuration: plain dataclasses, validated once in ``__post_init__``.

Option names follow vLLM's where one exists so users can switch engines without relearning
flags: the same names are ``kiln.LLM(...)`` keyword arguments and, dashed, CLI flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16"}
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")
# on-the-fly quantization at load (pre-quantized checkpoints declare their own format)
# (kiln.quant.config.ON_THE_FLY maps each name to its format)
QUANTIZATION_METHODS = ("fp8", "fp8-tensor", "int8", "int4", "w8a8-int8")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}")


def _check_positive(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):  # e.g. "512" from a file
        raise TypeError(f"{name} must be a number > 0, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def normalize_dtype(dtype: str) -> str:
    """Map aliases such as 'bf16' (and torch dtypes: torch.bfloat16) to canonical names; raise
    on unknown ones."""
    name = str(dtype).lower().removeprefix("torch.")
    canonical = DTYPE_ALIASES.get(name, name)
    if canonical not in DTYPE_CHOICES:
        raise ValueError(
            f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)} "
            f"(aliases: {', '.join(DTYPE_ALIASES)})"
        )
    return canonical


@dataclass
class ModelConfig:
    """What to load and how: a local directory, a hub id or a zoo name."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    revision: str | None = None
    seed: int = 0  # dummy weights, and the draws of requests without a seed of their own
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not self.model or not str(self.model).strip():
            raise ValueError("model must be a local directory, a Hugging Face hub id or a zoo name")
        self.dtype = normalize_dtype(self.dtype)
        _check_choice("device", self.device, DEVICE_CHOICES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_positive("max_model_len", self.max_model_len, allow_none=True)


@dataclass
class CacheConfig:
    """Paged KV cache: block geometry and how much memory the pool may take."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GB of CPU memory for swapped-out requests
    cpu_kv_cache_space: float = 2.0  # GB for the KV pool when running on CPU
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # fixes the pool size (tests, small devices)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GB, got {self.swap_space}")
        _check_positive("cpu_kv_cache_space", self.cpu_kv_cache_space)
        _check_positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)


@dataclass
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption_mode: str = "recompute"
    max_waiting_requests: int | None = None  # the server answers 429 beyond this
    # launch decode step N+1 before step N's tokens reach the host (kiln/engine/overlap.py)
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_positive("max_waiting_requests", self.max_waiting_requests, allow_none=True)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    enforce_eager: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``kiln.LLM`` and CLI flags use these names)."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "parallel": ParallelConfig}
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        top_names = {"enforce_eager", "attention_backend"}
        for key, value in kwargs.items():
            if key in top_names:
                top[key] = value
                continue
            for section, klass in sections.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    grouped[section][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}; valid options: "
                                f"{', '.join(sorted(engine_option_names()))}")
        return cls(
            model=ModelConfig(model=model, **grouped["model"]),
            cache=CacheConfig(**grouped["cache"]),
            scheduler=SchedulerConfig(**grouped["scheduler"]),
            parallel=ParallelConfig(**grouped["parallel"]),
            **top,
        )


def engine_option_names() -> set[str]:
    """Every flat option name ``EngineConfig.from_kwargs`` accepts (besides ``model``)."""
    names = {"enforce_eager", "attention_backend"}
    for klass in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        names |= {f.name for f in dataclasses.fields(klass)}
    names.discard("model")
    return names
