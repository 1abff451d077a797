"""Quantized checkpoints: safetensors in Kiln's module layout plus ``kiln_quant_config.json``.

A quantized directory holds ``config.json`` (the dense model's, unchanged), tokenizer and
generation files, ``model.safetensors`` with the model's ``state_dict`` (each quantized Linear
contributes its format's buffers, e.g. ``layers.3.mlp.gate_up_proj.qweight``) and the JSON
quantization config. ``setup_quantization`` is the loader's one call into this package: it
installs the methods for ``--quantization`` (on the fly) or recognizes and loads such a
directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from types import TracebackType

import torch
from safetensors.torch import save_file
from torch import nn

from kiln.parallel import SINGLE, TPContext
from kiln.quant.config import CONFIG_FILE, QuantConfig, on_the_fly_config
from kiln.quant.kv_cache import set_kv_scales
from kiln.quant.methods import (
    check_tensors,
    install_methods,
    linear_configs,
    make_method,
    quantized_linears,
)
from kiln.quant.w8a8 import check_fp8_supported
from kiln.safetensors_reader import check_floating, iter_safetensors

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                "chat_template.jinja", "added_tokens.json")


def process_umask() -> int:
    """The process umask, e.g. 0o022.

    POSIX has no call that only reads it: ``os.umask`` sets a new mask and returns the old one,
    so set one and put the old one straight back.
    """
    mask = os.umask(0o077)  # not 0: a file another thread creates meanwhile stays private
    os.umask(mask)
    return mask


def check_quantized_as(model: nn.Module, cfg: QuantConfig) -> None:
    """Refuse a model whose Linears do not hold ``cfg``'s tensors (``quantize_model`` with this
    config did not run on it): the checkpoint written would not load."""
    quantized = set()
    for name, layer, layer_cfg in linear_configs(model, cfg):
        quantized.add(name)
        tensors = {n: t for n, t in [*layer.named_parameters(recurse=False),
                                     *layer.named_buffers(recurse=False)] if n != "bias"}
        try:
            check_tensors(name, tensors, make_method(layer_cfg).tensor_spec(layer))
        except ValueError as exc:
            raise ValueError(f"the model is not quantized as cfg says ({cfg.name}): {exc}; "
                             "run quantize_model(model, cfg) with this cfg first") from None
    for name, layer in quantized_linears(model):
        if name not in quantized and "weight" not in layer._parameters:
            raise ValueError(f"cfg ({cfg.name}) keeps {name} dense, but the model's is "
                             "quantized; save with the cfg quantize_model returned")


def check_not_dense_checkpoint(out: Path) -> None:
    """Refuse a directory holding a dense checkpoint (e.g. the model's own): its weights
    would be overwritten, or left beside the new ones for the loader to read."""
    if (out / "config.json").is_file() and not (out / CONFIG_FILE).is_file():
        raise ValueError(f"{out} holds a dense checkpoint; saving there would overwrite or mix "
                         "with its weights: choose a new or empty directory")


def save_quantized(model: nn.Module, cfg: QuantConfig, out_dir: str | Path,
                   source_dir: str | Path | None = None) -> Path:
    """Write ``model`` (quantized in place by ``quantize_model(model, cfg)``) to ``out_dir``.

    ``source_dir`` is the dense checkpoint's directory: its config.json, tokenizer and
    generation files are copied. Without it the caller must add config.json, which loading
    needs. A model not quantized as ``cfg`` says, or an ``out_dir`` holding a dense
    checkpoint, is refused before anything is written.
    """
    out = Path(out_dir)
    check_quantized_as(model, cfg)
    check_not_dense_checkpoint(out)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    # a tied dense head is the embedding's tensor: saved once (a quantized one has no .weight)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    weights = out / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    # save_file creates the file 0600; the checkpoint must load for other users and service
    # accounts like its other files, which follow the umask
    os.chmod(weights, 0o666 & ~process_umask())
    if source_dir is not None:
        for name in COPIED_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, out / name)
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    return out


class StagedDir:
    """Build a directory under a hidden name beside ``out_dir``; it becomes ``out_dir`` whole.

    Creating it (with any missing parents of ``out_dir``) is the constructor's first act, so an
    unwritable location fails with an ``OSError`` before any work. Used as a context manager it
    yields the staging path: on success that replaces ``out_dir`` (an existing one, empty or not,
    is removed, so none of its files mix with the new ones); on an exception or an interrupt
    it is removed, with the parents it created, and ``out_dir`` is left as it was.
    """

    def __init__(self, out_dir: str | Path) -> None:
        # resolved: '--out .' has a name and a parent to stage beside; a symlink's target is
        # what gets replaced, the link stays
        self.out = Path(out_dir).resolve()
        missing = [p for p in self.out.parents if not p.exists()]
        self.created = missing[-1] if missing else None  # the topmost parent this makes
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial",
                                              dir=self.out.parent))
            # mkdtemp makes it 0700: the checkpoint must be readable as the umask allows
            os.chmod(self.path, 0o777 & ~process_umask())
        except BaseException:
            self._remove_created()
            raise

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                self._commit()
        finally:
            if self.path.exists():  # the work or the commit failed: leave nothing behind
                shutil.rmtree(self.path, ignore_errors=True)
                self._remove_created()

    def _commit(self) -> None:
        if not self.out.exists():
            self.path.rename(self.out)
            return
        old = self.path.with_suffix(".old")  # a name of this run's own
        self.out.rename(old)
        try:
            self.path.rename(self.out)
        except BaseException:
            old.rename(self.out)  # the previous contents stay where they were
            raise
        shutil.rmtree(old)

    def _remove_created(self) -> None:
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)


def read_quant_config(path: str | Path) -> QuantConfig | None:
    """The Kiln quantization config of checkpoint dir ``path``, or None for a dense checkpoint.

    Quantized checkpoints of other tools (a ``quantization_config`` in config.json) are refused
    with a clear error instead of loading packed integers as if they were weights.
    """
    path = Path(path)
    file = path / CONFIG_FILE
    if file.is_file():
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from None
        return QuantConfig.from_json(data, source=str(file))
    hf = path / "config.json"
    if hf.is_file():
        try:
            config = json.loads(hf.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{hf} is not valid JSON: {exc}") from None
        qc = config.get("quantization_config") if isinstance(config, dict) else None
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ValueError(f"{path} is quantized by another tool (quant_method={method!r}); "
                             "Kiln loads its own quantized checkpoints only: quantize the dense "
                             "model with `kiln quantize`")
    return None


def load_quantized_weights(model: nn.Module, cfg: QuantConfig, files: list[Path]) -> None:
    """Fill a model whose Linears carry ``cfg``'s methods from Kiln-layout safetensors files.

    A tied LM head that ``cfg`` quantizes reads its own codes (in its own format,
    ``cfg.lm_head_config()``); the embedding table it shared comes from ``embed_tokens.weight``
    like any dense tensor.
    """
    linears = dict(quantized_linears(model, lm_head=cfg.lm_head_bits is not None))
    params = dict(model.named_parameters())
    required = {n for n in params if not (n.rpartition(".")[0] in linears
                                          and n.endswith(".weight"))}
    per_layer: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    seen: set[str] = set()
    # iter_safetensors: a truncated or corrupt file is a one-line error naming it
    for file_name, name, tensor in iter_safetensors(files):
        owner, _, attr = name.rpartition(".")
        if owner in linears and attr != "bias":
            per_layer[owner][attr] = tensor
            continue
        if name not in required:
            raise ValueError(f"{file_name}: tensor {name!r} does not belong to this model")
        param = params[name]
        check_floating(file_name, name, tensor)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{file_name}: tensor {name!r} has shape "
                             f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        seen.add(name)
    missing = sorted(required - seen)
    if missing:
        raise ValueError(f"quantized checkpoint is missing {len(missing)} tensor(s): "
                         f"{', '.join(missing[:5])}")
    for name, layer in linears.items():
        try:
            layer.method.set_tensors(layer, per_layer.get(name, {}), name)
        except ValueError as exc:
            raise ValueError(f"the weights do not match {CONFIG_FILE} ({cfg.name}): {exc}; the "
                             "two files come from different runs or were edited: quantize the "
                             "dense model again") from None


def setup_quantization(model: nn.Module, path: Path | None, quantization: str | None,
                       files: list[Path], tp: TPContext = SINGLE) -> bool:
    """The loader's hook, called after the model is built and before weights are loaded.

    - pre-quantized Kiln checkpoint: installs its methods, loads every weight, returns True
      (the loader then skips its own weight loading);
    - ``quantization`` given (on the fly): installs the methods, whose
      ``process_weights_after_loading`` quantizes the dense weights; returns False;
    - neither: nothing to do, returns False.
    """
    pre = read_quant_config(path) if path is not None else None
    if pre is None:
        if quantization is None:
            return False
        cfg = on_the_fly_config(quantization)
        try:
            layers = install_methods(model, cfg)
        except ValueError as exc:
            # on the fly the format is fixed: the fix is another option or `kiln quantize`
            raise ValueError(f"quantization={quantization!r} ({cfg.name}) cannot store this "
                             f"model: {exc}. The on-the-fly formats are fixed: load with "
                             "quantization='int8' or 'fp8', or write a checkpoint in a format "
                             "that fits with `kiln quantize`") from None
        if cfg.scheme == "w8a8" and cfg.w8a8_dtype == "fp8" and layers:
            check_fp8_supported(layers[0][1].params_device)
        return False
    if quantization is not None:
        raise ValueError(f"{path} is already quantized ({pre.name}); drop "
                         f"quantization={quantization!r}")
    if tp.size > 1:
        raise ValueError("pre-quantized checkpoints load with tensor_parallel_size=1 only; "
                         "quantize on the fly (--quantization) to shard across GPUs")
    if not files:
        raise ValueError(f"{path} is a quantized checkpoint: load_format='dummy' does not "
                         "apply; use --quantization with a dense model for dummy weights")
    try:
        install_methods(model, pre)
    except ValueError as exc:  # its format cannot store these layers: not this model's config
        raise ValueError(f"{path / CONFIG_FILE} ({pre.name}) does not fit this model: {exc}; "
                         "the checkpoint's files do not belong together: quantize the dense "
                         "model again") from None
    load_quantized_weights(model, pre, files)
    try:
        set_kv_scales(model, pre.kv_cache_scales)
    except ValueError as exc:  # scales of a model with another number of layers
        raise ValueError(f"{path / CONFIG_FILE}: {exc}; the checkpoint's files do not belong "
                         "together: quantize the dense model again") from None
    return True
