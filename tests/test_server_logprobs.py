"""logprobs / top_logprobs through the openai SDK's types on a tiny random qwen3_moe (fp32, cpu):
chat completions and completions, whole and streamed, report each generated token's
log-probability and the top alternatives' as log_softmax of the engine's own logits (teacher-
forced through Engine.score)."""
import openai
import pytest
import torch

import make_tiny_model as mtm
from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.sampling import SamplingParams
from serve_support import live_server

USER = "the cache layer reads the expert weights"
MESSAGES = [{"role": "user", "content": USER}]
N, K = 6, 3
TOL = 1e-4  # decode steps against one teacher-forced prefill, fp32
GAP = 1e-3  # alternatives closer than this may come in either order


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, {prompt kind: (token texts, logprobs [N], top [N][K] of (text, logprob))})."""
    from ftw.convert import convert
    root = tmp_path_factory.mktemp("logprobs")
    src = mtm.build(root / "hf", "qwen3_moe", dtype="fp32", seed=7)
    path = str(convert(str(src), str(root / "tiny.ftw"), progress=False))
    engine = Engine(path, EngineConfig(device="cpu", dtype="fp32", ctx_size=256,
                                       prefix_cache=False))
    tok = engine.tokenizer
    prompts = {"chat": tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False),
               "completion": tok.encode(USER)}
    refs = {}
    for kind, prompt in prompts.items():
        ids = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=N)))
        assert len(ids) == N, "the tiny model ended early: pick another seed"
        logp = torch.log_softmax(engine.score(prompt + ids)[len(prompt) - 1:-1], dim=-1)
        top = logp.topk(K)
        text = [tok.decode([i], skip_special_tokens=False) for i in ids]
        refs[kind] = (text, [float(logp[j, i]) for j, i in enumerate(ids)],
                      [[(tok.decode([i], skip_special_tokens=False), float(v))
                        for i, v in zip(top.indices[j].tolist(), top.values[j].tolist())]
                       for j in range(N)])
    with live_server(engine, name="tiny") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), refs
    engine.close()


def check(ref, tokens, logprobs, tops):
    """tokens, logprobs and tops [(text, logprob)] of a response against the reference; tops
    may be dicts {text: logprob} (completions' shape: alternatives of the same text collapse)."""
    text, ref_logprobs, ref_tops = ref
    assert tokens == text
    assert logprobs == pytest.approx(ref_logprobs, abs=TOL)
    for top, ref_top in zip(tops, ref_tops, strict=True):
        if isinstance(top, dict):
            texts = [t for t, _ in ref_top]
            assert set(top) == set(texts)
            assert all(top[t] == pytest.approx(v, abs=TOL) for t, v in ref_top
                       if texts.count(t) == 1)
            continue
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=TOL)
        values = [v for _, v in ref_top] + [float("-inf")]
        for k, ((t, _), (ref_t, v)) in enumerate(zip(top, ref_top)):
            if values[k - 1] - v > GAP if k else True:
                if v - values[k + 1] > GAP:
                    assert t == ref_t


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(served, stream):
    client, refs = served
    options = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=N, logprobs=True,
                   top_logprobs=K)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **options))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**options).choices[0].logprobs.content
    assert all(bytes(e.bytes) == e.token.encode() for e in entries)
    check(refs["chat"], [e.token for e in entries], [e.logprob for e in entries],
          [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(served, stream):
    client, refs = served
    options = dict(model="tiny", prompt=USER, temperature=0, max_tokens=N, logprobs=K)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **options)]
        parts = [c.logprobs for c in chunks if c.logprobs]
        tokens = [t for p in parts for t in p.tokens]
        logprobs = [v for p in parts for v in p.token_logprobs]
        tops = [t for p in parts for t in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        text = "".join(c.text for c in chunks)
    else:
        choice = client.completions.create(**options).choices[0]
        tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops, offsets, text = choice.logprobs.top_logprobs, choice.logprobs.text_offset, choice.text
    check(refs["completion"], tokens, logprobs, tops)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert text == "".join(tokens)


def test_without_logprobs_none_are_sent(served):
    client, _ = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                       max_tokens=2)
    assert r.choices[0].logprobs is None
    chunks = list(client.completions.create(model="tiny", prompt=USER, temperature=0,
                                            max_tokens=2, stream=True))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
