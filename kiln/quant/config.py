"""What a quantized model is: one validated ``QuantConfig`` for every Linear (and the LM head).

Two weight formats cover every method (the method only decides how the numbers are chosen):

- ``wint``: weight-only integers, 8-bit per output channel or 4-bit group-wise, symmetric or
  asymmetric, optional per-input-channel ``smooth`` (AWQ) and act-order permutation (GPTQ).
  Activations stay in the model dtype (W8A16 / W4A16).
- ``w8a8``: 8-bit weights *and* activations, ``fp8`` (e4m3) or ``int8``, weight scales per tensor
  or per output channel, activation scales dynamic per token or static per tensor (calibrated),
  optional SmoothQuant ``smooth`` vector.

``lm_head_bits`` says what the LM head is: ``None`` dense, 8 W8A16 (per output channel,
symmetric, RTN, whatever the layers' bits, group and method), or the layers' own 4-bit format
when ``bits`` is 4. ``wint`` defaults to 8: at batch 1 the bf16 head is the largest single read
of a weight-only decode step, and at 8 bits it costs no measurable accuracy where a 4-bit head
took W4A16 AWQ and GPTQ variants past their perplexity target (docs/quantization.md). ``w8a8``
keeps it in the model dtype, as vLLM's FP8 does, so that the comparison stays fair.

The JSON form (``to_json`` / ``from_json``) is the quantization config written next to a
quantized checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

FORMAT_NAME = "kiln"
FORMAT_VERSION = 1
CONFIG_FILE = "kiln_quant_config.json"

METHODS = ("rtn", "awq", "gptq", "fp8", "smoothquant")
SCHEMES = ("wint", "w8a8")
W8A8_DTYPES = ("fp8", "int8")
WEIGHT_GRANULARITIES = ("tensor", "channel")
ACTIVATION_SCHEMES = ("dynamic", "static")
GROUP_SIZES = (-1, 32, 64, 128)  # -1: one group per output channel
OBSERVERS = ("minmax", "percentile", "entropy", "mse")
# the fields that say how the tensors are laid out: every config Kiln wrote has them, so a
# missing one is a damaged file, named as such rather than guessed from the default (a wrong
# guess failed later on tensor shapes, far from the cause)
LAYOUT_FIELDS = ("method", "scheme", "bits", "group_size", "symmetric", "act_order",
                 "w8a8_dtype", "weight_granularity", "activation_scheme")


def _check(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         f"{', '.join(map(str, choices))}")


@dataclass
class QuantConfig:
    method: str = "rtn"
    scheme: str = "wint"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False  # GPTQ: quantize columns by decreasing Hessian diagonal
    w8a8_dtype: str = "fp8"
    weight_granularity: str = "channel"
    activation_scheme: str = "dynamic"
    observer: str = "minmax"  # static activation scales: how the calibrated range is chosen
    alpha: float = 0.5  # SmoothQuant migration strength
    # the LM head: None dense, 8 W8A16 per channel RTN, 4 the (4-bit) layers' own format; a
    # weight-only setting like bits and group_size, so w8a8 sets it to None (dense head)
    lm_head_bits: int | None = 8
    kv_cache_scales: list[list[float]] | None = None  # per layer [k_scale, v_scale] (FP8 KV)
    calibration: dict[str, Any] = field(default_factory=dict)  # provenance, written to JSON

    def __post_init__(self) -> None:
        _check("method", self.method, METHODS)
        _check("scheme", self.scheme, SCHEMES)
        if self.scheme == "wint":
            _check("bits", self.bits, (4, 8))
            _check("group_size", self.group_size, GROUP_SIZES)
            if self.bits == 8 and self.group_size != -1:
                raise ValueError("8-bit weight-only quantization is per output channel; "
                                 f"use group_size=-1 (got {self.group_size})")
            if self.method in ("fp8", "smoothquant"):
                raise ValueError(f"method={self.method!r} produces W8A8 weights; "
                                 "use scheme='w8a8'")
            if self.lm_head_bits not in (None, 8, self.bits):
                raise ValueError(f"lm_head_bits={self.lm_head_bits!r}: the LM head is dense "
                                 f"(None), W8A16 per channel (8) or in the layers' format "
                                 f"(bits={self.bits})")
        else:
            _check("w8a8_dtype", self.w8a8_dtype, W8A8_DTYPES)
            _check("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES)
            _check("activation_scheme", self.activation_scheme, ACTIVATION_SCHEMES)
            if self.method in ("awq", "gptq"):
                raise ValueError(f"method={self.method!r} produces weight-only integers; "
                                 "use scheme='wint'")
            # W8A8 is 8 bits per channel with a dense LM head: a weight-only value other than
            # the default or that is a mistake, not something to round silently
            for name, allowed in (("bits", (4, 8)), ("group_size", (128, -1)),
                                  ("lm_head_bits", (8, None))):
                if getattr(self, name) not in allowed:
                    raise ValueError(f"{name}={getattr(self, name)!r} is a weight-only setting; "
                                     "scheme='w8a8' is 8-bit per channel: drop it")
            self.bits, self.group_size, self.lm_head_bits = 8, -1, None
        _check("observer", self.observer, OBSERVERS)
        if self.observer != "minmax" and (self.scheme == "wint"
                                          or self.activation_scheme == "dynamic"):
            raise ValueError(f"observer={self.observer!r} picks static activation scales; this "
                             "config has none: use scheme='w8a8' with activation_scheme='static'"
                             " or drop it")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} (SmoothQuant migration strength) must be in "
                             "[0, 1]")
        if self.alpha != 0.5 and self.method != "smoothquant":
            raise ValueError(f"alpha is SmoothQuant's migration strength; method="
                             f"{self.method!r} does not use it: use method='smoothquant' or "
                             "drop it")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order is a GPTQ option; use method='gptq'")

    @property
    def name(self) -> str:
        """Short human label, e.g. 'W4A16 g128 sym (awq)' or 'FP8 W8A8 channel/dynamic'."""
        if self.scheme == "wint":
            group = "channel" if self.group_size == -1 else f"g{self.group_size}"
            kind = "sym" if self.symmetric else "asym"
            order = ", act-order" if self.act_order else ""
            head = {8: "", None: ", dense LM head"}.get(self.lm_head_bits,
                                                        f", {self.lm_head_bits}-bit LM head")
            return f"W{self.bits}A16 {group} {kind} ({self.method}{order}{head})"
        return (f"{self.w8a8_dtype.upper()} W8A8 {self.weight_granularity}/"
                f"{self.activation_scheme} ({self.method})")

    def lm_head_config(self) -> QuantConfig | None:
        """The LM head's format: None (dense), W8A16 per channel RTN, or the layers' own."""
        if self.lm_head_bits is None:
            return None
        if self.lm_head_bits == 8:
            return QuantConfig(method="rtn", bits=8, group_size=-1)
        return self

    def check_layer(self, in_features: int, what: str = "layer") -> None:
        """Raise if this format cannot store a layer with ``in_features`` inputs."""
        if self.scheme != "wint":
            return
        if self.group_size != -1 and in_features % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide in_features="
                             f"{in_features} of {what}; choose a group size that divides it "
                             "or -1 (per channel)")
        if self.bits == 4 and in_features % 8:
            raise ValueError(f"4-bit packing needs in_features divisible by 8; {what} has "
                             f"{in_features}: use 8 bits (per channel, not packed)")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "quantization config") -> QuantConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}; "
                             "rewrite it with `kiln quantize`")
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"{source}: format={data.get('format')!r} is not a Kiln quantization "
                             f"config (expected {FORMAT_NAME!r})")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source}: version {data.get('version')!r} is not supported "
                             f"(this Kiln reads version {FORMAT_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"format", "version"})
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}")
        missing = [name for name in LAYOUT_FIELDS if name not in data]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}; the file is "
                             "incomplete: rewrite it with `kiln quantize`")
        fields = {k: v for k, v in data.items() if k in names}
        # configs written before lm_head_bits existed kept the LM head dense
        fields.setdefault("lm_head_bits", None)
        try:
            _check_json_types(fields)
            return cls(**fields)
        except ValueError as exc:  # the checks name the field; this names the file
            raise ValueError(f"{source}: {exc}; the file was edited or is damaged: rewrite it "
                             "with `kiln quantize`") from None


def _check_json_types(fields: dict[str, Any]) -> None:
    """What ``__post_init__`` does not check: its choices catch a string where a number
    belongs, not a string flag ("false" is true) or KV-cache scales that are no pairs."""
    for f in dataclasses.fields(QuantConfig):
        if isinstance(f.default, bool) and not isinstance(fields.get(f.name, False), bool):
            raise ValueError(f"{f.name}={fields[f.name]!r} is not true or false")
    scales = fields.get("kv_cache_scales")
    if scales is not None and not (isinstance(scales, list) and all(
            isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in pair)
            for pair in scales)):
        raise ValueError(f"kv_cache_scales={scales!r} is not a list of [k_scale, v_scale] "
                         "pairs of positive numbers")


# `--quantization NAME` at load: quantize the dense checkpoint on the fly, no calibration
ON_THE_FLY: dict[str, dict[str, Any]] = {
    "fp8": dict(method="fp8", scheme="w8a8", w8a8_dtype="fp8"),
    "fp8-tensor": dict(method="fp8", scheme="w8a8", w8a8_dtype="fp8",
                       weight_granularity="tensor"),
    "int8": dict(method="rtn", scheme="wint", bits=8, group_size=-1),
    "int4": dict(method="rtn", scheme="wint", bits=4, group_size=128),
    "w8a8-int8": dict(method="rtn", scheme="w8a8", w8a8_dtype="int8"),
}


def on_the_fly_config(name: str) -> QuantConfig:
    _check("quantization", name, tuple(ON_THE_FLY))
    return QuantConfig(**ON_THE_FLY[name])
