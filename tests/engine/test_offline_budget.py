"""The offline step budget: 16384 tokens on a GPU of 70 GiB or more unless the caller sets one;
8192 (SchedulerConfig's, which `kiln serve` keeps) elsewhere."""

from types import SimpleNamespace

import pytest
import torch

from kiln import llm
from kiln.config import EngineConfig, SchedulerConfig


def fake_gpu(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(llm, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * 2**30)))


@pytest.mark.parametrize("gib, budget", [(80, 16384), (139.8, 16384), (69.9, 8192), (24, 8192)])
def test_large_gpus_take_the_offline_budget(monkeypatch, gib, budget):
    fake_gpu(monkeypatch, gib)
    options = llm.offline_options({"device": "auto", "max_num_seqs": 8})
    assert options.get("max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens) == budget
    assert options["max_num_seqs"] == 8


def test_the_callers_budget_wins(monkeypatch):
    fake_gpu(monkeypatch, 80)
    assert llm.offline_options({"max_num_batched_tokens": 2048}) == {"max_num_batched_tokens": 2048}


def test_cpu_keeps_the_serving_default(tiny_llama):
    engine = llm.LLM(str(tiny_llama), device="cpu", max_model_len=64, num_kv_blocks=16).engine
    assert engine.config.scheduler.max_num_batched_tokens == 8192
    assert EngineConfig.from_kwargs("m").scheduler.max_num_batched_tokens == 8192
