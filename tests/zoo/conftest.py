from __future__ import annotations

import pytest
import torch

from kiln.eval.perplexity import dataset_texts, encode_documents
from kiln.models import load_model

# The CI check scores the first 1024 held-out tokens: one full-context window, a few seconds.
CI_MAX_TOKENS = 1024


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These models are too small to gain from intra-op threads, and on a busy 2-core machine
    # a second thread mostly waits for its sibling: one thread is several times faster there.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def kiln_tiny():
    return load_model("kiln-tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def kiln_draft():
    return load_model("kiln-tiny-draft", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def heldout_ids(kiln_tiny) -> torch.Tensor:
    return encode_documents(kiln_tiny.tokenizer, dataset_texts("zoo-heldout", None), CI_MAX_TOKENS)
