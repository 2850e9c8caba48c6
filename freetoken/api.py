"""The Python API, which the CLI calls: LLM(path, **engine options).generate(prompt) -> str,
.stream(prompt) -> text pieces, .chat(messages) -> the assistant's reply. Holds one Engine; owns
prompt -> ids (chat template) and ids -> text (streaming detokenization, stop strings).

    from freetoken import LLM
    llm = LLM("qwen3.ftw", device="cpu", expert_cache_frac=0.1)
    print(llm.generate("Explain PCIe", max_tokens=64, temperature=0))
    llm.generate(["Explain PCIe", "Explain NVLink"], max_tokens=64)   # batched, texts in order
    messages = [{"role": "user", "content": "Explain PCIe"}]
    messages.append({"role": "assistant", "content": llm.chat(messages, max_tokens=64)})
    messages.append({"role": "user", "content": "And NVLink?"})
    llm.chat(messages)   # prefills only the new turn: llm.stats.cached_tokens
"""
from dataclasses import fields, replace
from importlib import resources
from typing import Iterator, Optional, Union

from .config import EngineConfig
from .engine import Engine
from .errors import ConfigError, ModelError
from .sampling import SamplingParams
from .tokenizer import TextStream

DEFAULT_MODEL = "default.ftw"  # in freetoken/data/, built by tools/make_default_model.py


def default_model_path() -> str:
    """Path of the small model bundled in the package (used when no MODEL is given)."""
    ref = resources.files("freetoken") / "data" / DEFAULT_MODEL
    if not ref.is_file():
        raise ModelError("the bundled model (freetoken/data/default.ftw) is missing from this "
                         "install; reinstall freetoken or give a MODEL.ftw")
    return str(ref)


def engine_config(**options) -> EngineConfig:
    """EngineConfig from keyword options; an unknown name is a ConfigError listing the valid ones."""
    valid = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(valid))}")
    return EngineConfig(**options)


def plan_model(path: Optional[str], config: EngineConfig):
    """The MemoryPlan the engine would make loading `path` (None: the bundled model) with
    `config`, now, without loading it (its refusals raise here)."""
    import ftw
    from .config import ModelConfig
    from .engine import resolve_device, resolve_dtype
    from .memory_plan import make_memory_plan
    device = resolve_device(config.device)
    with ftw.open(path or default_model_path()) as f:
        return make_memory_plan(ModelConfig.from_dict(f.config), config, f, device,
                                resolve_dtype(config.dtype, device))


def sampling_params(base: Optional[SamplingParams] = None, **overrides) -> SamplingParams:
    """`base` (or the defaults) with `overrides` applied; unknown names are a ConfigError."""
    valid = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown sampling option(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(valid))}")
    return replace(base, **overrides) if base else SamplingParams(**overrides)


class LLM:
    """A loaded model. path None = the bundled model; path may also be an opened model file
    (Engine). Engine options (or `config`) are EngineConfig fields (device, expert_cache_gb,
    expert_cache_frac, gpu_mem_gb, policy, ctx_size, parallel, kv_tokens, prefix_cache,
    prefill_chunk, ...);
    trace_out="run.npz" records the routed experts of the latest generation (trace.py format).
    Sampling options of generate/stream are SamplingParams fields (max_tokens, temperature,
    top_k, top_p, min_p, repetition_penalty, seed, stop). One caller thread; generate() of a
    list runs its prompts together."""

    def __init__(self, path: Optional[str] = None, config: Optional[EngineConfig] = None,
                 **engine_options):
        if config is not None and engine_options:
            raise ConfigError("give LLM an EngineConfig or engine options, not both")
        config = config or engine_config(**engine_options)
        self.engine = Engine(path or default_model_path(), config)
        self.tokenizer = self.engine.tokenizer

    @property
    def stats(self):
        """GenerationStats of the latest generation (load time, prefill, TTFT, decode, experts;
        cached_tokens: the prompt tokens taken from the prefix cache)."""
        return self.engine.last_stats

    def encode(self, prompt: str, chat: bool = True) -> list:
        """Prompt token ids: through the model's chat template when chat and the model has one."""
        if chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat(prompt)
        return self.tokenizer.encode(prompt)

    def stream(self, prompt: str, sampling: Optional[SamplingParams] = None, *,
               chat: bool = True, **options) -> Iterator[str]:
        """Text pieces as they are generated (never half a UTF-8 character; stop strings
        excluded). Bad options or a prompt that does not fit raise here, before any text."""
        params = sampling_params(sampling, **options)
        ids = self.encode(prompt, chat)
        token_ids = self.engine.generate(ids, params)
        return self._pieces(token_ids, TextStream(self.tokenizer, params.stop))

    def generate(self, prompt: Union[str, list], sampling: Optional[SamplingParams] = None, *,
                 chat: bool = True, **options) -> Union[str, list]:
        """The whole generated text (without the prompt). A list of prompts runs batched (up to
        the engine's `parallel` decode together) and gives their texts in the same order."""
        if isinstance(prompt, str):
            return "".join(self.stream(prompt, sampling, chat=chat, **options))
        if not all(isinstance(p, str) for p in prompt):
            raise ConfigError("generate takes a prompt string or a list of prompt strings")
        params = sampling_params(sampling, **options)
        ids = [self.encode(p, chat) for p in prompt]
        for i in ids:  # every prompt is checked before any runs
            self.engine.check_prompt(len(i), params.max_tokens)
        reqs = [self.engine.submit(i, params) for i in ids]
        try:
            while not all(r.finished for r in reqs):
                self.engine.step()
        finally:
            for r in reqs:
                self.engine.cancel(r)  # a no-op for those that ended
        texts = []
        for r in reqs:
            text = TextStream(self.tokenizer, params.stop)
            texts.append("".join(text.push(t) for t in r.take()) + text.finish())
        return texts

    def chat(self, messages: list, sampling: Optional[SamplingParams] = None, **options) -> str:
        """The assistant's reply to OpenAI-style messages ([{"role": "system" | "user" |
        "assistant", "content": str}, ...]) rendered by the model's chat template. The prefix
        cache keeps each call's KV, so a later call whose messages extend these prefills only
        the new part (llm.stats.cached_tokens)."""
        return "".join(self.stream_chat(messages, sampling, **options))

    def stream_chat(self, messages: list, sampling: Optional[SamplingParams] = None,
                    **options) -> Iterator[str]:
        """chat(), as text pieces while they are generated (as stream())."""
        params = sampling_params(sampling, **options)
        ids = self.encode_messages(messages)
        token_ids = self.engine.generate(ids, params)
        return self._pieces(token_ids, TextStream(self.tokenizer, params.stop))

    def encode_messages(self, messages: list) -> list:
        """Prompt token ids of OpenAI-style messages through the model's chat template (with the
        assistant's turn opened); a model without one (the bundled model) gets each message's
        content as plain text, one line each. ConfigError for a malformed message."""
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ConfigError(f"message {i} must be a dict with a 'role' and a 'content' "
                                  f"string, like {{'role': 'user', 'content': 'hi'}}; got {m!r}")
        if not messages:
            raise ConfigError("chat needs at least one message")
        if not self.tokenizer.chat_template:
            return self.tokenizer.encode("".join(m["content"] + "\n" for m in messages))
        text = self.tokenizer.apply_chat_template(list(messages))
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _pieces(token_ids: Iterator[int], text: TextStream) -> Iterator[str]:
        try:
            for token_id in token_ids:  # the engine ends by itself at a stop string
                piece = text.push(token_id)
                if piece:
                    yield piece
            tail = text.finish()
            if tail:
                yield tail
        finally:
            token_ids.close()  # ends the engine's generation (and its stats) when we stop early

    def resize_expert_cache(self, gb: float) -> None:
        """The expert cache becomes gb GB (shrink: the least recently used experts leave and
        their memory is released; grow: empty slots, filled as experts are missed), without
        reloading; also between the pieces of a stream; on cuda the decode graphs are captured
        again on the next step. llm.engine.memory_plan follows. Tokens are unchanged by it."""
        self.engine.resize_expert_cache(gb)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
