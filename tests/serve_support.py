"""Helpers of the server tests: a live server on 127.0.0.1 (a free port) around any engine, a
Qwen-style chat template with tool calls and thinking, and RecordedEngine, which replays a
recorded model output (Qwen's real formats) through a real tokenizer so the HTTP layer, parsers
and SDKs are exercised on tool calls that a tiny random model would never write."""
import contextlib
import threading

from freetoken.config import EngineConfig
from freetoken.stats import GenerationStats

# Our own template in the format Qwen's templates render: tools listed in <tools>, calls as
# <tool_call> JSON, results as <tool_response> in a user turn, reasoning in <think>.
QWEN_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif -%}"
    "{{ 'Tools you may call, one <tool_call></tool_call> block of JSON each:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "(c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def qwen_tokenizer():
    """The tiny models' tokenizer with QWEN_TEMPLATE (EOS <|im_end|>)."""
    import make_tiny_model
    from freetoken.tokenizer import Tokenizer
    return Tokenizer(make_tiny_model.tokenizer_json(384), QWEN_TEMPLATE, 0, (2,))


class RecordedRequest:
    """A RecordedEngine generation as the worker sees a scheduler request."""

    def __init__(self, tokens, stats):
        self.tokens, self.stats = tokens, stats
        self.events, self.finished = [], False

    def take(self):
        out, self.events = self.events, []
        return out


class RecordedEngine:
    """Engine stand-in with the scheduler's interface (submit, step, cancel): each step gives
    every submitted generation its next token of `output` (a recorded model answer), then it
    stops as at EOS, or at max_tokens. endless: repeat it until max_tokens; gate: a
    threading.Event each token waits for; fail: raise on the first token. `prompts` collects the
    prompt ids; `closed` is set when a generation is cancelled before its end."""

    def __init__(self, tokenizer, ctx_size: int = 4096):
        self.tokenizer = tokenizer
        self.config = EngineConfig(device="cpu", ctx_size=ctx_size)
        self.output, self.endless, self.gate, self.fail = "", False, None, False
        self.prompts, self.closed = [], threading.Event()
        self.last_stats = GenerationStats()
        self.requests = []

    def submit(self, prompt_ids, params, constraint=None):
        st = self.last_stats = GenerationStats(num_prompt_tokens=len(prompt_ids),
                                               stop_reason="interrupted")
        self.prompts.append(list(prompt_ids))
        req = RecordedRequest(self._tokens(params, st), st)
        self.requests.append(req)
        return req

    def step(self):
        for req in list(self.requests):
            try:
                req.events.append(next(req.tokens))
            except StopIteration:
                req.finished = True
                self.requests.remove(req)

    def cancel(self, req):
        if req in self.requests:
            self.requests.remove(req)
            req.tokens.close()
            req.finished = True

    def _tokens(self, params, st):
        ids = self.tokenizer.encode(self.output, add_special_tokens=False)
        try:
            for i in range(params.max_tokens):
                if self.fail:
                    raise RuntimeError("recorded engine failure")
                if self.gate is not None:
                    self.gate.wait()
                if i == len(ids) and not self.endless:
                    st.stop_reason = "eos"
                    st.num_generated += 1
                    return
                st.num_generated += 1
                yield ids[i % len(ids)]
            st.stop_reason = "length"
        finally:
            if st.stop_reason == "interrupted":
                self.closed.set()


@contextlib.contextmanager
def live_server(engine, name: str = "test-model", **config):
    """(base url, worker) of a server over `engine` on 127.0.0.1 at a free port."""
    # (imported here: the template and RecordedEngine need no server, nor its packages)
    from freetoken.server.config import ServeConfig
    from freetoken.server.serve import BackgroundServer, build_app
    app, worker = build_app(engine, ServeConfig(port=0, **config), name)
    server = BackgroundServer(app).start()
    try:
        yield server.url, worker
    finally:
        server.stop()
        worker.close()


def http(method: str, url: str, body=None, raw=None, headers: dict = None):
    """(status, parsed JSON or text) of one plain HTTP request (stdlib only: the raw cases the
    SDKs would not send). raw: bytes, or an iterator of bytes (sent chunked)."""
    import json
    import urllib.error
    import urllib.request
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
