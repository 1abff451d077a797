"""The offline Python API: ``kiln.LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from kiln.config import EngineConfig
from kiln.engine.inputs import PromptLike, normalize_prompts, render_chat
from kiln.engine.llm_engine import LLMEngine
from kiln.models.loader import resolve_device
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams
from kiln.zoo import DEFAULT_MODEL

# Offline runs trade a step's latency for throughput, as vLLM's offline default does on GPUs of
# 70 GiB or more: 16384 tokens a step gave 512 x 512/256 10,413 against 10,282 output tok/s and
# 64 x 512/256 +0.5% on an H100 (benchmarks/results/h100/offline_token_budget.txt). `kiln serve`
# keeps SchedulerConfig's 8192, whose steps hold running streams back half as long while prompts
# arrive; a smaller GPU keeps it too, its memory going to KV blocks rather than activations.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384
OFFLINE_BUDGET_MIN_GPU_BYTES = 70 * 2**30


def offline_options(options: dict[str, Any]) -> dict[str, Any]:
    """Engine options of an offline run (``kiln.LLM``, ``kiln bench``, ``kiln profile``): the
    caller's, with OFFLINE_MAX_NUM_BATCHED_TOKENS a step on a large GPU where it set none."""
    if "max_num_batched_tokens" in options:
        return options
    device = resolve_device(options.get("device", "auto"))
    if device.type != "cuda":
        return options
    if torch.cuda.get_device_properties(device).total_memory < OFFLINE_BUDGET_MIN_GPU_BYTES:
        return options
    return {**options, "max_num_batched_tokens": OFFLINE_MAX_NUM_BATCHED_TOKENS}


class LLM:
    """Load a model once and generate from many prompts with the paged engine.

    ``engine_options`` are the engine's flat option names (``block_size``, ``max_num_seqs``,
    ``num_kv_blocks`` ...), the same as the CLI's dashed flags; the step's token budget defaults
    to the offline one (``offline_options``).
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
                 **engine_options: Any) -> None:
        options = offline_options({"dtype": dtype, "device": device, **engine_options})
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(self, prompts: PromptLike | list[PromptLike],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in the order given."""
        items = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                  else [sampling_params] * len(items))
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts; pass "
                             f"one, or one per prompt")
        request_ids: list[str] = []
        try:
            for prompt, p in zip(items, params, strict=True):
                request_ids.append(str(next(self._ids)))
                self.engine.add_request(request_ids[-1], prompt, p, stream=False)
        except (ValueError, TypeError):
            for rid in request_ids:  # all or nothing: a bad prompt queues none of them
                self.engine.abort_request(rid)
            raise
        try:
            finished = {o.request_id: o for o in self.engine.run_to_completion()}
        except BaseException:  # a failed step or Ctrl-C: leave no request behind for later calls
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return [finished[rid] for rid in request_ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation ([{"role": ..., "content": ...}, ...]) or a
        list of them, rendered with the model's chat template (or ``chat_template``, a Jinja
        string) and generated as ``generate`` does; one ``RequestOutput`` per conversation.
        ``chat_template_kwargs`` are the template's own variables (Qwen3's enable_thinking);
        ``tools`` (OpenAI's function entries) are the template's, for it to describe them, as in
        vLLM (to force a call, constrain the output with structured outputs)."""
        if not messages:
            raise ValueError("messages is empty; give a conversation or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            raise ValueError("this model has no chat template: pass chat_template= (a Jinja "
                             "string), or generate() from a prompt")
        prompts = [render_chat(self.tokenizer, c, template, add_generation_prompt,
                               chat_template_kwargs, tools) for c in conversations]
        return self.generate(prompts, sampling_params)
