"""Golden greedy tokens of the bundled model (freetoken/data/default.ftw, the trained qwen3_moe of
tools/train_tiny_moe.py) for a fixed prompt; and, since its HF checkpoint is too big to ship,
transformers' greedy generate against our engine on a tiny random model built here."""
import pytest

from freetoken import LLM, SamplingParams

PROMPT = "def fibonacci(n):"
PROMPT_IDS = [322, 291, 1458, 270, 1176, 514, 10, 80, 304]
# Greedy, 24 tokens, --device cpu (fp32 compute on the bf16 weights). transformers' greedy
# generate on the HF checkpoint the file was converted from gives the same 24 ids (checked when
# the model was bundled). Smallest top-2 logit margin on the way: 0.0046 (token 8), next 0.065.
GREEDY_IDS = [265, 383, 265, 1245, 273, 763, 399, 302, 308, 504, 69, 3322, 494, 442, 399, 302,
              308, 504, 69, 3322, 494, 442, 399, 265]
GREEDY_TEXT = ('\n    """\n    Return a list of the sitecustomizes of the sitecustomizes of\n'
               '   ')
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu") as model:
        yield model


def test_bundled_model_is_the_trained_one(llm):
    mc = llm.engine.model_config
    assert (mc.family, mc.num_layers, mc.num_experts, mc.num_experts_per_tok, mc.vocab_size) == \
        ("qwen3_moe", 6, 32, 4, 4096)
    assert llm.tokenizer.chat_template is None  # trained on raw source: prompts go in as they are


def test_pinned_greedy_tokens(llm):
    assert llm.encode(PROMPT, chat=False) == PROMPT_IDS
    assert llm.encode(PROMPT) == PROMPT_IDS  # no chat template: chat=True is raw too
    assert list(llm.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS
    assert llm.stats.num_generated == 24 and llm.stats.stop_reason == "length"


def test_api_text_is_decoded_greedy_tokens(llm):
    text = llm.generate(PROMPT, GREEDY)
    assert text == llm.tokenizer.decode(GREEDY_IDS) == GREEDY_TEXT
    assert "".join(llm.stream(PROMPT, temperature=0, max_tokens=24)) == text


def test_prefill_chunking_and_cpu_cache_do_not_change_tokens():
    with LLM(device="cpu", prefill_chunk=4, expert_cache_frac=0.25) as chunked:
        assert list(chunked.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS
        assert chunked.stats.experts["hits"] > 0


def test_equals_transformers_greedy_generate(tmp_path):
    import torch
    import transformers
    import make_tiny_model
    from ftw.convert import convert

    # The random model the package bundled before the trained one (fp32: exact on the CPU).
    src = make_tiny_model.build(tmp_path / "hf", family="qwen3_moe", layout="per_expert",
                                dtype="fp32", seed=1234)
    path = convert(str(src), str(tmp_path / "tiny.ftw"), progress=False)
    with LLM(str(path), device="cpu") as ours:
        ids = ours.encode(PROMPT, chat=False)
        got = list(ours.engine.generate(ids, SamplingParams(temperature=0, max_tokens=16)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert len(got) == 16 and out[0, len(ids):].tolist() == got


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybrid", "offload", "cpu"])
def test_cuda_fp32_pinned_tokens(policy):
    with LLM(device="cuda", dtype="fp32", expert_cache_frac=0.25, policy=policy) as gpu:
        assert list(gpu.engine.generate(PROMPT_IDS, GREEDY)) == GREEDY_IDS


@pytest.mark.gpu
def test_cuda_bf16_default_runs():
    with LLM(device="cuda") as gpu:
        text = gpu.generate(PROMPT, max_tokens=16, temperature=0)
        assert gpu.stats.num_generated >= 1 and isinstance(text, str)
        assert str(gpu.engine.dtype) == "torch.bfloat16"
