"""On CUDA: the sampler never synchronizes with the host, and matches the CPU semantics."""

import pytest
import torch

from kiln.sampling import Sampler, SamplingMetadata, SamplingParams, generator_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 4099  # odd size: no kernel gets a power-of-two shape for free


def mixed_batch(device):
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=5,
                       allowed_token_ids=[7, 100, VOCAB - 1], bad_words_token_ids=[[3, 100]]),
        SamplingParams(seed=7, temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(min_p=0.05, presence_penalty=0.5, frequency_penalty=0.2, min_tokens=3),
        SamplingParams(temperature=1.3, top_k=5, logprobs=2, logit_bias={3: 2.0, 4: -100}),
    ]
    gens = [None, generator_for(7, 0, device), None, None]
    outputs = [[1, 2, 3], [4], [5, 5], []]
    prompts = [[9, 8, 7], [6], [5, 4], [3, 2, 1]]
    return SamplingMetadata.build(params, gens, outputs, prompts, device, eos_token_ids=[0])


def test_sample_does_not_synchronize():
    device = torch.device("cuda")
    logits = torch.randn(4, VOCAB, device=device)
    meta = mixed_batch(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler().sample(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda" and out.logprobs is not None
    assert int(out.token_ids.min()) >= 0 and int(out.token_ids.max()) < VOCAB
    # row 0 may take 7 or VOCAB - 1 only: its output ends with 3, so the word bans 100
    assert int(out.token_ids[0]) in (7, VOCAB - 1)


def test_seeded_row_independent_of_batch_on_cuda():
    device = torch.device("cuda")
    params = SamplingParams(seed=11, temperature=0.7, top_p=0.9)
    gen_alone, gen_batch = generator_for(11, 0, device), generator_for(11, 0, device)
    sampler = Sampler()
    for step in range(20):
        row = torch.randn(VOCAB, device=device, generator=torch.Generator(device).manual_seed(step))
        alone = SamplingMetadata.build([params], [gen_alone], [[]], [[1]], device)
        t_alone = sampler.sample(row[None], alone).token_ids[0]
        others = torch.randn(3, VOCAB, device=device)
        batch_params = [SamplingParams(top_k=3), params, SamplingParams(temperature=0)] + [
            SamplingParams(min_p=0.2)
        ]
        batch = SamplingMetadata.build(
            batch_params, [None, gen_batch, None, None], [[]] * 4, [[1]] * 4, device
        )
        logits = torch.cat([others[:1], row[None], others[1:]])
        assert sampler.sample(logits, batch).token_ids[1].item() == t_alone.item()


def test_greedy_matches_cpu():
    logits = torch.randn(16, VOCAB)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)] * 16
    outputs = [[i, i + 1, 2 * i] for i in range(16)]
    prompts = [[3 * i, 7] for i in range(16)]

    def run(device):
        meta = SamplingMetadata.build(params, [None] * 16, outputs, prompts, device)
        return Sampler().sample(logits.to(device), meta).token_ids.cpu()

    assert torch.equal(run("cpu"), run("cuda"))


def test_allowed_token_ids_and_bad_words_match_cpu():
    logits = torch.randn(8, VOCAB)
    allowed = [0, 5, 99, 2048, VOCAB - 1]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0, bad_words_token_ids=[[int(logits[1].argmax())]]),
              SamplingParams(temperature=0, allowed_token_ids=allowed, logit_bias={5: 3.0},
                             bad_words_token_ids=[[1, 99]]),
              SamplingParams(temperature=0)] * 2
    outputs = [[], [], [4, 1], []] * 2

    def run(device):
        meta = SamplingMetadata.build(params, [None] * 8, outputs, [[1]] * 8, device)
        return Sampler().sample(logits.to(device), meta).token_ids.cpu()

    cpu = run("cpu")
    assert set(cpu[0::4].tolist()) <= set(allowed) and set(cpu[2::4].tolist()) <= set(allowed)
    assert 99 not in cpu[2::4].tolist()
    assert torch.equal(cpu, run("cuda"))
