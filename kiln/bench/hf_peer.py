"""The peer: the same workload through Hugging Face transformers ``generate`` (eager, greedy).

Every generated token is forced (``min_new_tokens = max_new_tokens``) so both engines do the
same work. Per-step times come from a streamer, which ``generate`` calls once per step with
the new tokens already copied to the host, so a timestamp there is after the step finished.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from kiln.bench.workload import BenchRequest


class TimingStreamer(BaseStreamer):
    """Records when each generation step's tokens reached the host (the prompt put is skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


class HFPeer:
    """A transformers model built from the same checkpoint directory (random if ``dummy``)."""

    def __init__(self, model_path: Path, dtype: torch.dtype, device: torch.device,
                 load_format: str) -> None:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        self.name = f"hf-transformers {transformers.__version__} generate (eager)"
        self.device = device
        start = time.perf_counter()
        has_weights = any(model_path.glob("*.safetensors"))
        if load_format == "dummy" or not has_weights:
            config = AutoConfig.from_pretrained(str(model_path))
            # built on the device directly: initializing 8B parameters on the CPU takes minutes
            with torch.device(device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if next(self.model.parameters()).device != device:  # a version ignoring the context
                self.model.to(device)
            if next(self.model.parameters()).dtype != dtype:  # or the dtype argument
                self.model.to(dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(
                device)
        self.model.eval()
        self.load_seconds = time.perf_counter() - start
        gen = self.model.generation_config
        self.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else 0
        self.tokenizer: Any = None
        if any((model_path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path))

    def token_ids(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer in the model directory")
        return list(self.tokenizer.encode(prompt))

    @torch.inference_mode()
    def generate(self, prompts: list[list[int] | str], output_len: int
                 ) -> tuple[float, list[float], float, int]:
        """One batch, left-padded: (start, per-step times, end, prompt tokens)."""
        ids = [self.token_ids(p) for p in prompts]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, width - len(x):] = torch.tensor(x)
            mask[row, width - len(x):] = 1
        streamer = TimingStreamer()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.monotonic()
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
            pad_token_id=self.pad_token_id, streamer=streamer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.monotonic()
        produced = out.shape[1] - width
        if produced != output_len:
            raise RuntimeError(f"transformers generated {produced} tokens, asked {output_len}")
        return start, streamer.times, end, sum(len(x) for x in ids)

    def run_batches(self, requests: list[BenchRequest], batch_size: int) -> dict[str, Any]:
        """Throughput over ``requests`` in batches; each batch runs to its longest output.

        Only the tokens each request asked for are counted, so a mixed-length batch's extra
        steps count against the peer (none with fixed lengths).
        """
        start = time.monotonic()
        prompt_tokens = output_tokens = 0
        for i in range(0, len(requests), batch_size):
            chunk = requests[i:i + batch_size]
            _, _, _, num_prompt = self.generate([r.prompt for r in chunk],
                                                max(r.output_len for r in chunk))
            prompt_tokens += num_prompt
            output_tokens += sum(r.output_len for r in chunk)
        elapsed = time.monotonic() - start
        return {"elapsed_s": elapsed, "num_requests": len(requests),
                "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
                "requests_per_s": len(requests) / elapsed,
                "output_tokens_per_s": output_tokens / elapsed,
                "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed}
