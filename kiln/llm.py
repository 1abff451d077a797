"""The offline Python API: ``kiln.LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from typing import Any

from kiln.config import EngineConfig
from kiln.engine.inputs import PromptLike, check_prompt_length, normalize_prompts, tokenize_prompt
from kiln.engine.reference import reference_generate
from kiln.models.loader import load_model
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams


def default_max_model_len(config_len: int | None, max_positions: int,
                          sliding_window: int | None) -> int:
    """The context length Kiln serves: the user's choice, bounded by what the model supports."""
    limit = min(max_positions, sliding_window) if sliding_window else max_positions
    if config_len is None:
        return limit
    if config_len > limit:
        raise ValueError(f"max_model_len={config_len} exceeds what the model supports ({limit}); "
                         f"lower --max-model-len")
    return config_len


class LLM:
    """Load a model once and generate from many prompts.

    ``engine_options`` are the engine's flat option names (``block_size``, ``max_num_seqs``,
    ``num_kv_blocks`` ...), the same as the CLI's dashed flags.
    """

    def __init__(self, model: str = "kiln-tiny", dtype: str = "auto", device: str = "auto",
                 **engine_options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, dtype=dtype, device=device,
                                               **engine_options)
        mc = self.config.model
        self.loaded = load_model(mc.model, dtype=mc.dtype, device=mc.device,
                                 load_format=mc.load_format, revision=mc.revision,
                                 max_model_len=mc.max_model_len, seed=mc.seed)
        arch = self.loaded.arch
        self.max_model_len = default_max_model_len(mc.max_model_len, arch.max_position_embeddings,
                                                   arch.sliding_window)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def generate(self, prompts: PromptLike | list[PromptLike],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order."""
        items = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                  else [sampling_params] * len(items))
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts; pass "
                             f"one, or one per prompt")
        parsed = [tokenize_prompt(p, self.tokenizer, self.loaded.arch.vocab_size) for p in items]
        for p in parsed:
            check_prompt_length(len(p.token_ids), self.max_model_len)
        outputs = reference_generate(self.loaded, [p.token_ids for p in parsed], params,
                                     self.max_model_len)
        for out, p in zip(outputs, parsed, strict=True):
            out.prompt = p.text
        return outputs
