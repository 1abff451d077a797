"""Load a Llama-family model from a Hugging Face directory, a hub id or a zoo name.

Weights come only from safetensors files (nothing is ever unpickled). Every problem with the
checkpoint is reported with the file and tensor it concerns.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.config import normalize_dtype
from kiln.models.arch import ArchConfig, arch_from_hf_config
from kiln.models.llama import LlamaForCausalLM
from kiln.parallel import SINGLE, TPContext
from kiln.quant.checkpoint import setup_quantization
from kiln.quant.config import CONFIG_FILE
from kiln.quant.methods import QUANTIZED_TENSORS
from kiln.safetensors_reader import check_floating, iter_safetensors

log = logging.getLogger("kiln.loader")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    path: Path | None
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint has none
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    load_seconds: float = 0.0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is visible; "
                         "use device='cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' keeps a half-precision checkpoint's dtype on the GPU; the CPU computes in fp32."""
    dtype = normalize_dtype(dtype)
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(str(checkpoint_dtype), torch.bfloat16) \
        if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory, a Kiln zoo name, or a hub id fetched with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from kiln.zoo import ZOO_MODELS, model_path

    if model in ZOO_MODELS:
        return Path(model_path(model))
    if path.exists():
        raise ValueError(f"model {model!r} is a file; pass the checkpoint directory")
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is neither a local directory, a zoo name "
                         f"({', '.join(ZOO_MODELS)}) nor a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # the hub raises many types; all mean "could not fetch"
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise RuntimeError(
            f"could not download {model!r} from the Hugging Face hub "
            f"({'HF_HUB_OFFLINE=1 is set' if offline else 'no network or no access'}): "
            f"{type(exc).__name__}: {exc}. Download it where the network allows and pass the "
            f"local directory instead."
        ) from exc


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing; a Hugging Face checkpoint needs it") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def read_arch(path: Path) -> ArchConfig:
    """The architecture of the checkpoint at ``path``, from its config.json alone (no weights:
    what start-up checks need before a model loads)."""
    return arch_from_hf_config(read_json(path / "config.json"), source=str(path / "config.json"))


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, from the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in _index_shards(index)})
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"safetensors shard {f.name} listed in {index.name} is "
                                        f"missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    hint = (f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to "
            "safetensors)") if pickled else ""
    raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")


def _index_shards(index: Path) -> set[str]:
    """The shard names ``index`` lists, each a file inside its directory: a name that leaves it
    ('../x', an absolute path) would read weights from elsewhere on the machine."""
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                   for f in weight_map.values()):
        raise ValueError(f"{index} has no weight_map object of tensor name -> shard file name; "
                         "the file is damaged: download it again")
    shards = set(weight_map.values())
    for name in shards:
        # lexically, not resolved: a hub snapshot's shards are links into its blob store
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{index} lists shard {name!r}, which is not a file inside "
                             f"{index.parent}; Kiln reads only the checkpoint's own files: fix "
                             "the index or download the checkpoint again")
    return shards


def load_checkpoint_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    expected = model.expected_checkpoint_names()
    seen: set[str] = set()
    for file_name, name, tensor in iter_safetensors(files):
        try:
            target = model.checkpoint_targets(name)
        except KeyError:
            # Kiln's quantized layout (no "model." prefix) without its config
            quantized = (not name.startswith("model.")
                         and name.rpartition(".")[2] in QUANTIZED_TENSORS)
            hint = (f"; the checkpoint looks quantized by `kiln quantize`, but {CONFIG_FILE} "
                    "is missing beside it: restore that file or quantize the dense model again"
                    if quantized else "")
            raise ValueError(f"{file_name}: tensor {name!r} does not belong to a "
                             f"{model.cfg.architecture} of this config{hint}") from None
        if target is None:
            continue
        module, param, shard_id = target
        check_floating(file_name, name, tensor)
        try:
            module.load(param, tensor, shard_id) if hasattr(module, "load") \
                else _copy_exact(getattr(module, param), tensor)
        except ValueError as exc:
            raise ValueError(f"{file_name}: tensor {name!r}: {exc}") from None
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _copy_exact(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} does not match the expected "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights drawn directly on the model's device (benchmarks without checkpoints)."""
    gen_device = next(model.parameters()).device
    generator = torch.Generator(device=gen_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.uniform_(0.9, 1.1, generator=generator)  # keep activations bounded
        else:
            param.data.uniform_(-0.02, 0.02, generator=generator)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any: a tokenizer


def load_tokenizer(path: Path) -> Any:
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:  # transformers' own message is about its internals
        reason = " ".join(str(exc).split()) or type(exc).__name__
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        raise ValueError(f"{path}: its tokenizer does not load ({reason}); Kiln needs the fast "
                         "tokenizer's tokenizer.json beside tokenizer_config.json: copy both from "
                         "the model this directory came from") from None


def load_model(model: str, dtype: str = "auto", device: str = "auto", load_format: str = "auto",
               revision: str | None = None, max_model_len: int | None = None,
               tp: TPContext = SINGLE, seed: int = 0,
               quantization: str | None = None) -> LoadedModel:
    """Build a Kiln model from ``model`` (directory, hub id or zoo name) ready for inference.

    ``quantization`` quantizes the dense weights on the fly (kiln.quant.config.ON_THE_FLY); a
    checkpoint written by ``kiln quantize`` is recognized by its JSON config and loads as is.
    """
    start = time.perf_counter()
    path = resolve_model_path(model, revision)
    arch = read_arch(path)
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, arch.torch_dtype, target)
    files = [] if load_format == "dummy" else safetensors_files(path)
    max_positions = max(max_model_len or 0, arch.max_position_embeddings)
    with torch.device(target):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype)
        try:
            net = LlamaForCausalLM(arch, tp=tp, max_positions=max_positions)
        finally:
            torch.set_default_dtype(prev)
    # the rotary table stays float32: positions up to 128k need the precision
    for module in net.modules():
        if hasattr(module, "cos_sin_cache"):
            module.cos_sin_cache = module.cos_sin_cache.float()
    if setup_quantization(net, path, quantization, files, tp):
        pass  # a pre-quantized checkpoint: its weights are loaded
    elif load_format == "dummy":
        init_dummy_weights(net, seed)
    else:
        load_checkpoint_weights(net, files)
    for module in net.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    net.eval()
    gen_cfg_path = path / "generation_config.json"
    gen_cfg = read_json(gen_cfg_path) if gen_cfg_path.exists() else {}
    eos = gen_cfg.get("eos_token_id", None)
    eos_ids = arch.eos_token_ids if eos is None else tuple([eos] if isinstance(eos, int) else eos)
    tokenizer = load_tokenizer(path)
    if not eos_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids = (tokenizer.eos_token_id,)
    seconds = time.perf_counter() - start
    log.info("loaded %s (%s, %s, %s) in %.1f s", path, arch.architecture, torch_dtype, target,
             seconds)
    return LoadedModel(model=net, arch=arch, path=path, tokenizer=tokenizer, dtype=torch_dtype,
                       device=target, eos_token_ids=eos_ids, generation_defaults=gen_cfg,
                       load_seconds=seconds)
