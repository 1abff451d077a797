"""Per-kernel table from torch.profiler events: time share, FLOPs and bytes from shapes, the
rate achieved, and whether the kernel is compute- or memory-bound against measured ceilings.

Rows are (op, input shapes) groups. On CUDA an op's time is the device time of the kernels it
launched itself; kernels launched outside an aten op (Kiln's Triton kernels, copies) form rows
named by the kernel, with no shape-based estimate. On CPU an
op's time is its self CPU time, and only ops that do the work (GEMMs, fused attention, and
ops with no children but views) get estimates.

Estimates from shapes (per call):
- GEMMs (mm, addmm, bmm, baddbmm, _scaled_mm, _int_mm): ``2 * M * N * K`` FLOPs; bytes of
  both operands, the bias if any, and the output.
- fused attention (SDPA flash / efficient / cuDNN / CPU flash): ``2 * B * H * Lq * Lk * (D + Dv)``
  FLOPs (no causal discount, so an upper bound); bytes of q, k, v and the output.
- copies and casts: no FLOPs; the input read once and written once.
- ``to``, ``type_as``, ``contiguous``: nothing of their own. Already in the asked-for form they
  return their input, a leaf op that moves no data (estimated as an elementwise op, its few
  microseconds read as up to 24x the measured roof); otherwise the copy is a child op
  (``_to_copy`` / ``copy_``, ``clone``) with its own row.
- other leaf ops (elementwise, norms, reductions): one FLOP per element of the largest input;
  bytes of every input plus an output the size of the largest input.
- indexing (index, gather, scatter, index_put_, embedding ...): bytes unknown from shapes
  (a gather reads a few rows of a large table), so no estimate.
Element sizes come from the recorded dtypes when the profiler has them, else the model dtype.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
         "aten::_int_mm"}
ATTENTION = {"aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_flash_attention_forward", "aten::_efficient_attention_forward"}
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::fill_",
          "aten::zero_"}
FORWARDERS = {"aten::to", "aten::type_as", "aten::contiguous"}  # see the module docstring
# metadata-only ops: no data moves (children of real ops that must not make them non-leaf)
VIEWS = {"aten::" + n for n in (
    "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided", "as_strided", "view",
    "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "expand", "slice", "select",
    "unsqueeze", "squeeze", "permute", "detach", "alias", "lift_fresh", "split",
    "split_with_sizes", "narrow", "unbind", "chunk", "unflatten", "flatten", "view_as",
    "expand_as", "detach_", "as_strided_", "result_type")}
INDEXING = ("index", "gather", "scatter", "embedding", "masked", "take", "nonzero", "unique",
            "sort", "topk", "argmax", "multinomial", "empty", "resize", "set_", "record_stream")
DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "c10::half": 2, "half": 2,
               "c10::bfloat16": 2, "bfloat16": 2, "c10::float8_e4m3fn": 1, "float8_e4m3fn": 1,
               "c10::float8_e5m2": 1, "long int": 8, "int64": 8, "int": 4, "int32": 4,
               "signed char": 1, "int8": 1, "unsigned char": 1, "uint8": 1, "bool": 1}


@dataclass
class Estimate:
    flops: float | None  # per call
    bytes: float | None


def _numel(shape: Any) -> int:
    return math.prod(shape) if isinstance(shape, list | tuple) and shape else 0


def _sizes(dtypes: list[str] | None, count: int, default: int) -> list[int]:
    out = []
    for i in range(count):
        name = (dtypes[i] if dtypes and i < len(dtypes) else "").lower()
        out.append(DTYPE_BYTES.get(name, default))
    return out


def estimate(op: str, shapes: list, dtypes: list[str] | None, default_elsize: int) -> Estimate:
    """FLOPs and bytes of one call of ``op`` from its input shapes (see the module docstring)."""
    if op in VIEWS or op in FORWARDERS:
        return Estimate(0.0, 0.0)
    tensors = [(i, s) for i, s in enumerate(shapes) if isinstance(s, list | tuple) and s]
    es = _sizes(dtypes, len(shapes), default_elsize)
    if op in GEMMS:
        a_i, b_i = (1, 2) if op in ("aten::addmm", "aten::baddbmm") else (0, 1)
        if len(shapes) <= b_i or not shapes[a_i] or not shapes[b_i]:
            return Estimate(None, None)
        a, b = shapes[a_i], shapes[b_i]
        batch = a[0] if len(a) == 3 else 1
        m, k, n = a[-2], a[-1], b[-1]
        out_es = 2 if op in ("aten::_scaled_mm",) else (4 if op == "aten::_int_mm" else es[a_i])
        moved = _numel(a) * es[a_i] + _numel(b) * es[b_i] + batch * m * n * out_es
        if a_i == 1 and shapes[0]:
            moved += _numel(shapes[0]) * es[0]
        return Estimate(2.0 * batch * m * n * k, float(moved))
    if op in ATTENTION:
        if len(shapes) < 3 or any(len(s or []) != 4 for s in shapes[:3]):
            return Estimate(None, None)
        (b, h, lq, d), (_, _, lk, _), (_, _, _, dv) = shapes[:3]
        moved = sum(_numel(shapes[i]) * es[i] for i in range(3)) + b * h * lq * dv * es[0]
        return Estimate(2.0 * b * h * lq * lk * (d + dv), float(moved))
    if not tensors:
        return Estimate(0.0, 0.0)
    largest_i, largest = max(tensors, key=lambda t: _numel(t[1]))
    if op in COPIES:
        src = sum(_numel(s) * es[i] for i, s in tensors[-1:]) if op == "aten::copy_" else None
        if op == "aten::cat":
            src = sum(_numel(s) * es[i] for i, s in tensors)
        src = src if src is not None else _numel(largest) * es[largest_i]
        return Estimate(0.0, 2.0 * src if op not in ("aten::fill_", "aten::zero_") else src)
    if any(word in op for word in INDEXING):
        return Estimate(None, None)
    moved = sum(_numel(s) * es[i] for i, s in tensors) + _numel(largest) * es[largest_i]
    return Estimate(float(_numel(largest)), float(moved))


@dataclass
class KernelRow:
    name: str  # the op, or the kernel name when no aten op launched it
    launched_by: str  # the op or range that launched it
    shapes: str
    kernels: set[str]
    calls: int = 0
    time_us: float = 0.0
    flops: float | None = 0.0  # totals over calls; None when unknown
    bytes: float | None = 0.0

    def add(self, time_us: float, est: Estimate) -> None:
        self.calls += 1
        self.time_us += time_us
        self.flops = None if self.flops is None or est.flops is None else self.flops + est.flops
        self.bytes = None if self.bytes is None or est.bytes is None else self.bytes + est.bytes


def _does_work(event: Any) -> bool:
    """GEMMs and fused attention always; other ops when no child op (but views) does it."""
    if event.name in GEMMS or event.name in ATTENTION:
        return True
    return not any(c.name.startswith("aten::") and c.name not in VIEWS
                   for c in event.cpu_children)


def shape_str(shapes: list) -> str:
    """[[4, 64], [64, 192], []] -> "4x64, 64x192" (scalars and lists left out)."""
    return ", ".join("x".join(str(d) for d in s) for s in shapes
                     if isinstance(s, list | tuple) and s and all(isinstance(d, int) for d in s))


def _is_annotation(event: Any) -> bool:
    """A record_function range mirrored on the device timeline: a span, not a kernel."""
    return (bool(getattr(event, "is_user_annotation", False))
            or "annotation" in str(getattr(event, "activity_type", "")).lower()
            or event.name.startswith(("kiln.", "ProfilerStep")))


def _on_device(event: Any) -> bool:
    return "CPU" not in str(getattr(event, "device_type", "CPU"))


def collect_rows(events: Iterable[Any], on_cuda: bool, default_elsize: int) -> list[KernelRow]:
    """Group profiler ``FunctionEvent`` s into per-kernel rows (see the module docstring)."""
    events = list(events)
    rows: dict[tuple[str, str, str], KernelRow] = {}

    def row(name: str, parent: str, shapes: str) -> KernelRow:
        key = (name, parent, shapes)
        if key not in rows:
            rows[key] = KernelRow(name, parent, shapes, set())
        return rows[key]

    attributed_us: Counter[str] = Counter()
    attributed_calls: Counter[str] = Counter()
    for e in events:
        if _on_device(e):
            continue
        shapes = list(e.input_shapes or [])
        dtypes = getattr(e, "input_dtypes", None)
        is_op = e.name.startswith("aten::")
        if on_cuda:
            for k in e.kernels:
                attributed_us[k.name] += k.duration
                attributed_calls[k.name] += 1
                if not is_op:
                    row(k.name, e.name, "").add(k.duration, Estimate(None, None))
            if is_op and e.kernels:  # one call of the op, however many kernels it launched
                r = row(e.name, e.name, shape_str(shapes))
                r.kernels.update(k.name for k in e.kernels)
                r.add(sum(k.duration for k in e.kernels),
                      estimate(e.name, shapes, dtypes, default_elsize))
        elif is_op and e.self_cpu_time_total > 0:
            est = (estimate(e.name, shapes, dtypes, default_elsize) if _does_work(e)
                   else Estimate(None, None))
            row(e.name, e.name, shape_str(shapes)).add(e.self_cpu_time_total, est)
    if on_cuda:
        # device activity no CPU op claimed (launches from Python, memcpy): still time spent
        device_us: Counter[str] = Counter()
        device_calls: Counter[str] = Counter()
        for e in events:
            if _on_device(e) and not _is_annotation(e):
                device_us[e.name] += e.time_range.elapsed_us()
                device_calls[e.name] += 1
        for name, us in device_us.items():
            calls = device_calls[name] - attributed_calls[name]
            if calls > 0:
                r = row(name, "(no aten op)", "")
                r.calls, r.time_us = calls, max(us - attributed_us[name], 0.0)
                r.flops = r.bytes = None
    return sorted(rows.values(), key=lambda r: -r.time_us)


def table(rows: list[KernelRow], peak_tflops: float, peak_gbps: float) -> list[dict[str, Any]]:
    """Rows with time share, achieved rates and the bound, as JSON-ready dicts.

    ``roof_fraction`` is the achieved rate over the roof at the row's intensity; a row past 1
    is flagged ``above_roof``: either its estimate overcounts what it moved, or the measured
    roof is not its roof (on CPU the bandwidth is a DRAM copy and small tensors stay in cache;
    the compute roof is one measured GEMM, which a larger GEMM may beat by a little). The
    fraction is kept: a GEMM a percent past the measured roof says something true."""
    total_us = sum(r.time_us for r in rows) or 1.0
    ridge = peak_tflops * 1e12 / (peak_gbps * 1e9)  # FLOP/byte where the two roofs meet
    out = []
    for r in rows:
        seconds = r.time_us / 1e6
        d: dict[str, Any] = {"name": r.name, "launched_by": r.launched_by, "shapes": r.shapes,
                             "kernels": sorted(r.kernels), "calls": r.calls,
                             "time_us": r.time_us, "share": r.time_us / total_us,
                             "flops": r.flops, "bytes": r.bytes, "tflops": None, "gbps": None,
                             "intensity": None, "bound": None, "roof_fraction": None,
                             "above_roof": False}
        if r.bytes and seconds > 0:
            d["gbps"] = r.bytes / seconds / 1e9
            d["tflops"] = (r.flops or 0.0) / seconds / 1e12
            d["intensity"] = (r.flops or 0.0) / r.bytes
            d["bound"] = "compute" if d["intensity"] >= ridge else "memory"
            attainable = min(peak_tflops * 1e12, d["intensity"] * peak_gbps * 1e9)
            d["roof_fraction"] = (d["tflops"] * 1e12 / attainable if attainable > 0
                                  else d["gbps"] / peak_gbps)
            d["above_roof"] = d["roof_fraction"] > 1.0
        out.append(d)
    return out
