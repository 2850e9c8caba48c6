"""The Python API on the bundled model: option errors, lazy import, early stop of a stream,
a full context, stop strings, the chat template (on a tiny model: the bundled one has none),
and trace_out."""
import subprocess
import sys

import pytest

from freetoken import LLM, SamplingParams
from freetoken.errors import ConfigError

GREEDY = dict(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", ctx_size=64) as model:
        yield model


def test_import_is_lazy():
    code = "import sys, freetoken; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_options_are_config_errors(llm):
    with pytest.raises(ConfigError, match="expert_cache_gb"):
        LLM(device="cpu", expert_cache=1)
    with pytest.raises(ConfigError, match="temperature"):
        llm.generate("hi", temprature=0)


def test_prompt_too_long_raises_before_any_text(llm):
    with pytest.raises(ConfigError, match="--ctx-size"):
        llm.stream("word " * 100, max_tokens=4)


def test_early_break_ends_generation(llm):
    for i, _ in enumerate(llm.stream("hello", temperature=1.0, top_k=0, min_p=0, seed=3,
                                     max_tokens=50)):
        if i == 1:
            break
    assert llm.stats.stop_reason == "interrupted"
    assert llm.stats.num_generated <= 10


def test_full_context_stops_generation(llm):
    ids = llm.encode("hello", chat=False)
    with LLM(device="cpu", ctx_size=len(ids) + 3) as small:
        out = list(small.engine.generate(ids, SamplingParams(temperature=0, max_tokens=20)))
        if small.stats.stop_reason != "eos":
            assert small.stats.stop_reason == "context"
            assert len(out) == 4  # the last one is sampled but never fed back


def test_stop_strings_through_api(llm):
    full = llm.generate("hello", chat=False, **GREEDY)
    assert len(full) >= 4, "greedy text too short"
    stop = full[2:4]
    assert llm.generate("hello", chat=False, stop=[stop], **GREEDY) == full[:full.index(stop)]
    assert llm.stats.stop_reason == "stop"


def test_chat_uses_template(tmp_path):
    import make_tiny_model
    from ftw.convert import convert
    src = make_tiny_model.build(tmp_path / "hf", family="qwen3_moe", seed=7)
    with LLM(str(convert(str(src), str(tmp_path / "chat.ftw"), progress=False)),
             device="cpu") as chat_llm:
        raw, chat = chat_llm.encode("hello", chat=False), chat_llm.encode("hello", chat=True)
        assert len(chat) > len(raw)
        text = chat_llm.tokenizer.decode(chat, skip_special_tokens=False)
        assert text.startswith("<|im_start|>user\nhello") and text.endswith("assistant\n")


def test_bundled_model_has_no_chat_template(llm):
    assert llm.tokenizer.chat_template is None
    assert llm.encode("def f(x):", chat=True) == llm.encode("def f(x):", chat=False)


def test_trace_out_through_api(tmp_path):
    from freetoken.trace import read_trace
    path = tmp_path / "api.npz"
    with LLM(device="cpu", trace_out=str(path)) as traced:
        text = traced.generate("def f(x):", temperature=0, max_tokens=8)
        ids = traced.encode("def f(x):")
    meta, routes = read_trace(path)
    mc = traced.engine.model_config
    assert routes.shape == (len(ids) + 7, len(mc.moe_layers), mc.num_experts_per_tok)
    assert meta["prompt_token_ids"] == ids and meta["prompt"] == "def f(x):"
    assert traced.tokenizer.decode(meta["generated_token_ids"]) == text
    assert (meta["phases"] == 0).sum() == len(ids) and (meta["phases"] == 1).sum() == 7
    assert meta["temperature"] == 0 and meta["num_experts"] == mc.num_experts


def test_seeded_sampling_reproducible(llm):
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=12, chat=False)
    assert llm.generate("hello", seed=5, **kw) == llm.generate("hello", seed=5, **kw)


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory):
    import make_tiny_model
    from ftw.convert import convert
    tmp = tmp_path_factory.mktemp("chat")
    src = make_tiny_model.build(tmp / "hf", family="qwen3_moe", seed=7)
    return str(convert(str(src), str(tmp / "chat.ftw"), progress=False))


def test_chat_reuses_the_conversation_from_the_prefix_cache(chat_path, monkeypatch):
    """A second turn prefills only past the first turn's cached whole pages (of 4 tokens here)
    and replies as an engine without the prefix cache does."""
    from freetoken import kv_cache
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)
    turns = [{"role": "user", "content": "hello there"}]
    with LLM(chat_path, device="cpu") as llm:
        first = llm.chat(turns, temperature=0, max_tokens=5)
        num_first = len(llm.encode_messages(turns))
        assert llm.stats.cached_tokens == 0
        turns += [{"role": "assistant", "content": first}, {"role": "user", "content": "more"}]
        second = llm.chat(turns, temperature=0, max_tokens=5)
        assert llm.stats.cached_tokens >= num_first // 4 * 4 > 0
        assert any("prompt cache" in line for line in llm.stats.lines())
    with LLM(chat_path, device="cpu", prefix_cache=False) as cold:
        assert cold.chat(turns, temperature=0, max_tokens=5) == second
        assert cold.stats.cached_tokens == 0


def test_chat_rejects_malformed_messages(llm):
    with pytest.raises(ConfigError, match="'role' and a 'content'"):
        llm.chat([{"role": "user"}])
    with pytest.raises(ConfigError, match="at least one message"):
        llm.chat([])
    # the bundled model has no chat template: the messages as plain lines
    assert llm.encode_messages([{"role": "user", "content": "def f(x):"}]) == \
        llm.encode("def f(x):\n", chat=False)


def test_a_list_of_prompts_runs_batched_in_order(llm):
    prompts = ["The cat", "Once upon a time", "1 2 3", "hello", "abc"]  # 5 > parallel 4
    alone = [llm.generate(p, **GREEDY) for p in prompts]
    assert llm.generate(prompts, **GREEDY) == alone
    llm.engine.kv_manager.check_idle()
    with pytest.raises(ConfigError, match="list of prompt strings"):
        llm.generate(["ok", 3])
    with pytest.raises(ConfigError, match="--ctx-size"):  # checked before any runs
        llm.generate(["hi", "word " * 100], max_tokens=4)
    assert llm.engine.scheduler.idle
