"""End to end on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): llmtrace's generation loop against
transformers loading the same file (float32, eager attention).

The generation under test is `llmtrace.run.generate.generate` with a greedy Sampler: the real prefill + KV-cache decode
loop, the same code the CLI runs. transformers' `generate(do_sample=False)` is the reference.
"""

import pytest
import torch

from llmtrace.run.generate import generate
from llmtrace.run.sampler import Sampler, SamplerConfig

pytestmark = pytest.mark.slow  # compares with transformers or compiles: minutes on a small CPU

N_NEW = 24
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village at the edge of a forest,",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(lm, ids, n=N_NEW, ignore_eos=True):
    return generate(lm, ids, Sampler(SamplerConfig(temperature=0), lm.config.vocab_size), n, ignore_eos=ignore_eos)


def chat_ids(lm) -> list[int]:
    text = lm.tokenizer.render_chat(CHAT, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    return lm.tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def forward_no_cache(model, ids, last_only=False):
    """A plain forward from position 0, no cache."""
    return model(torch.tensor([ids]), last_only=last_only)


@torch.no_grad()
def hf_greedy(hf, ids, n=N_NEW, stop_at_eos=False) -> list[int]:
    extra = {} if stop_at_eos else {"eos_token_id": None}  # None: run the full n tokens, like ignore_eos
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, **extra)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PLAIN)
def test_prompt_ids_match_transformers_tokenizer(smollm, hf_smollm_tokenizer, prompt):
    assert smollm.tokenizer.encode(prompt) == hf_smollm_tokenizer(prompt)["input_ids"]


@pytest.mark.parametrize("prompt", PLAIN + ["<chat>"])
def test_greedy_tokens_match_transformers(smollm, hf_smollm, prompt):
    ids = chat_ids(smollm) if prompt == "<chat>" else smollm.tokenizer.encode(prompt)
    result = greedy(smollm, ids)
    assert result.stop_reason == "max_tokens" and len(result.tokens) == N_NEW
    assert result.tokens == hf_greedy(hf_smollm, ids)
    assert result.text == smollm.tokenizer.decode(result.tokens)
    if prompt == PLAIN[0]:
        assert result.text.startswith(" Paris")  # the model works, not merely agrees with itself


def test_chat_stops_at_eos_like_transformers(smollm, hf_smollm):
    """Without ignore_eos both stop on <|im_end|>, after the same tokens, and the marker is not in the text."""
    ids = chat_ids(smollm)
    result = greedy(smollm, ids, ignore_eos=False)
    ref = hf_greedy(hf_smollm, ids, stop_at_eos=True)
    assert result.stop_reason == "eos"
    assert result.tokens == ref and ref[-1] in smollm.tokenizer.eos_ids
    assert len(ref) < N_NEW
    assert "Paris" in result.text and "<|im_end|>" not in result.text


@torch.no_grad()
def test_first_step_top5(smollm, hf_smollm):
    ids = smollm.tokenizer.encode(PLAIN[0])
    ours = forward_no_cache(smollm.model, ids, last_only=True)[0]  # (V,): what the prefill hands the sampler
    ref = hf_smollm(torch.tensor([ids])).logits[0, -1]
    top_ours, top_ref = torch.topk(ours, 5), torch.topk(ref, 5)
    assert top_ours.indices.tolist() == top_ref.indices.tolist()
    torch.testing.assert_close(top_ours.values, top_ref.values, atol=1e-3, rtol=0)


@torch.no_grad()
def test_full_sequence_logits(smollm, hf_smollm):
    text = ("Transformers read the whole prompt at once: every position attends to the ones before it, "
            "and the last one predicts the next token.")
    ids = smollm.tokenizer.encode(text)
    assert len(ids) > 20
    ours = forward_no_cache(smollm.model, ids)
    ref = hf_smollm(torch.tensor([ids])).logits
    assert ours.shape == ref.shape == (1, len(ids), smollm.config.vocab_size)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
