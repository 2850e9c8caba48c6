"""Golden greedy tokens of the bundled model (freetoken/data/default.ftw) for a fixed prompt, and
the same tokens from transformers' greedy generate on the HF checkpoint it was built from
(tools/make_default_model.py rebuilds it deterministically)."""
import pytest

from freetoken import LLM, SamplingParams

PROMPT = "def fibonacci(n):"
PROMPT_IDS = [287, 263, 75, 68, 280, 67, 69, 69, 75, 10, 80, 301]
# Greedy, 16 tokens, --device cpu (fp32). Smallest top-2 logit margin on the way: 0.013.
GREEDY_IDS = [178, 236, 72, 221, 86, 72, 221, 103, 169, 189, 27, 11, 292, 302, 361, 95]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu") as model:
        yield model


def test_pinned_greedy_tokens(llm):
    assert llm.encode(PROMPT, chat=False) == PROMPT_IDS
    assert list(llm.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS
    assert llm.stats.num_generated == 16 and llm.stats.stop_reason == "length"


def test_api_text_is_decoded_greedy_tokens(llm):
    text = llm.generate(PROMPT, GREEDY, chat=False)
    assert text == llm.tokenizer.decode(GREEDY_IDS)
    assert "".join(llm.stream(PROMPT, chat=False, temperature=0, max_tokens=16)) == text


def test_prefill_chunking_does_not_change_tokens():
    with LLM(device="cpu", prefill_chunk=5, expert_cache_frac=0.5) as chunked:
        assert list(chunked.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS


def test_equals_transformers_greedy_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import make_default_model

    src = make_default_model.build_checkpoint(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=16, do_sample=False)
    assert out[0, len(PROMPT_IDS):].tolist() == GREEDY_IDS


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
def test_cuda_fp32_pinned_tokens(policy):
    with LLM(device="cuda", dtype="fp32", expert_cache_frac=0.25, policy=policy) as gpu:
        assert list(gpu.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS


@pytest.mark.gpu
def test_cuda_bf16_default_runs():
    with LLM(device="cuda") as gpu:
        text = gpu.generate(PROMPT, chat=False, max_tokens=16, temperature=0)
        assert gpu.stats.num_generated >= 1 and isinstance(text, str)
        assert str(gpu.engine.dtype) == "torch.bfloat16"
