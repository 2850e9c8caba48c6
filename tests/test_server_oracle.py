"""Greedy text through the live server equals transformers' greedy continuation on a tiny random
qwen3_moe (HF checkpoint -> ftw.convert -> Engine, fp32, cpu): a system + user chat through the
openai SDK (chat completions, responses) and the anthropic SDK, streamed and whole, alone and as
concurrent requests."""
import threading

import anthropic
import openai
import pytest
import torch
import transformers

import make_tiny_model as mtm
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from serve_support import live_server

MARGIN = 1e-3  # compare only while HF's top-2 logit gap is wider than this (as test_engine_oracle)
SYSTEM, USER = "Answer with code.", "the cache layer reads the expert weights"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base url, reference text, number of tokens to ask for)."""
    from ftw.convert import convert
    root = tmp_path_factory.mktemp("oracle")
    src = mtm.build(root / "hf", "qwen3_moe", dtype="fp32", seed=7)
    path = str(convert(str(src), str(root / "tiny.ftw"), progress=False))
    engine = Engine(path, EngineConfig(device="cpu", dtype="fp32", ctx_size=256))
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            top = hf(torch.tensor([ids])).logits[0, -1].topk(2)
            if float(top.values[0] - top.values[1]) < MARGIN:
                break
            ids.append(int(top.indices[0]))
            if ids[-1] in tok.eos_token_ids:
                break
    ref = ids[len(prompt):]
    assert len(ref) >= 3, f"HF's greedy margins too narrow to compare ({ref})"
    wide = len(ref) - (ref[-1] in tok.eos_token_ids)
    with live_server(engine, name="tiny") as (url, _):
        yield url, tok.decode(ref[:wide]), wide
    engine.close()


def ask_openai(url, wide, stream=False):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                       max_tokens=wide, stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


def ask_anthropic(url, wide, stream=False):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    options = dict(model="tiny", system=SYSTEM, max_tokens=wide, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": USER}])  # (this SDK has no temperature)
    if stream:
        with client.messages.stream(**options) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**options)
    assert message.usage.output_tokens >= 1
    return "".join(b.text for b in message.content if b.type == "text")


def ask_responses(url, wide, stream=False):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    options = dict(model="tiny", instructions=SYSTEM, input=USER, temperature=0,
                   max_output_tokens=wide)
    if stream:  # the raw events: the SDK's accumulator keeps only response.completed's output
        events = list(client.responses.create(stream=True, **options))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == text
        return text
    return client.responses.create(**options).output_text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ask", [ask_openai, ask_anthropic, ask_responses])
def test_greedy_equals_transformers(served, ask, stream):
    url, ref, wide = served
    assert ask(url, wide, stream) == ref


def test_concurrent_requests_equal_transformers(served):
    url, ref, wide = served
    asks = [(ask, stream) for ask in (ask_openai, ask_anthropic, ask_responses)
            for stream in (False, True)]
    results, errors = [], []

    def run(ask, stream):
        try:
            results.append(ask(url, wide, stream))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [ref] * len(asks)
