"""The offline Python API: ``kiln.LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.inputs import PromptLike, normalize_prompts
from kiln.engine.llm_engine import LLMEngine
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams
from kiln.zoo import DEFAULT_MODEL


class LLM:
    """Load a model once and generate from many prompts with the paged engine.

    ``engine_options`` are the engine's flat option names (``block_size``, ``max_num_seqs``,
    ``num_kv_blocks`` ...), the same as the CLI's dashed flags.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
                 **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, dtype=dtype, device=device,
                                                         **engine_options))
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
