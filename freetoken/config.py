"""Frozen configs: ModelConfig (the normalised model config from the FTW header) and
EngineConfig (how to run it). Options of `freetoken run` map one-to-one to EngineConfig fields.
Also ENV, the table of every FREETOKEN_* environment variable, read only through env() here.

Model code sees only ModelConfig; HF config variety is normalised once by ftw/convert.py.
"""
import os
from dataclasses import dataclass, field, fields
from typing import Optional, Union

from .errors import ConfigError, ModelError

POLICIES = ("hybrid", "offload", "cpu")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_layers: tuple = ()
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"  # none | per_head | full
    qk_norm_after_rope: bool = False  # hunyuan_v1_moe: the per-head q/k norm after the rotary
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    hidden_act: str = "silu"
    norm_topk_prob: bool = False
    # softmax | sigmoid (glm4_moe: + correction bias, groups) | softmax_of_topk (gpt_oss) |
    # softmax_bias (ernie4_5_moe: experts chosen by probs + correction bias) | sparsemixer (phimoe) |
    # sigmoid_input (llama4_text: the top-1 expert runs on x times its logit's sigmoid)
    router_scoring: str = "softmax"
    # ernie4_5_moe: the top-k weights are divided by max(their sum, moe_norm_min)
    moe_norm_min: float = 0.0
    # sigmoid routing: experts in num_expert_groups equal groups, a token's experts come from its
    # num_topk_groups best groups; the combine weights are multiplied by routed_scaling_factor
    num_expert_groups: int = 1
    num_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # hybrid families (qwen3_next, qwen3_5_moe_text): per-layer token mixer, partial rotary, the
    # output-gated attention and the Gated DeltaNet layers' shapes (0 where there are none)
    # per layer "full_attention" | "linear_attention" | "sliding_attention"; () = all full
    layer_types: tuple = ()
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims of q/k
    attn_output_gate: bool = False  # q projection twice as wide: per head q then its gate
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # gpt_oss: layers whose layer_types entry is "sliding_attention" attend to the last
    # layer_window tokens (self included; sliding_window, every layer's, stays None); a learned
    # logit per head in each softmax's denominator (attn_sinks); the router's bias; expert
    # biases and the expert activation (ExpertAct: silu, or clamped_swiglu with alpha, limit)
    layer_window: Optional[int] = None
    attn_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"  # silu | clamped_swiglu
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # granitemoe: the attention softmax's scale (None: 1/sqrt(head_dim)), the embeddings times
    # embedding_multiplier, each block's attention and MLP output times residual_multiplier
    # before it joins the residual stream, the logits divided by logits_scaling
    attention_multiplier: Optional[float] = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # phimoe: every norm a LayerNorm with a bias (not RMSNorm), the output head with a bias, and
    # the sparsemixer route whose mask drops experts more than 2 x router_jitter_noise (relative)
    # below the one chosen
    layer_norm: bool = False
    output_bias: bool = False
    router_jitter_noise: float = 0.0
    # llama4_text: the layers without rotary (HF no_rope_layers' zeros), whose q is scaled by
    # 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)) when attn_temperature_tuning;
    # the rotary layers' q/k RMS-normed without a weight after the rotary (qk_l2_norm); the
    # layer_types "chunked_attention" layers attend only within their attention_chunk_size chunk
    no_rope_layers: tuple = ()
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    attention_chunk_size: Optional[int] = None
    # multi-head latent attention (deepseek_v2, deepseek_v3), when kv_lora_rank > 0: head_dim is
    # the rotary part of each q/k head (HF qk_rope_head_dim), qk_nope_head_dim the rest, v_head_dim
    # the value heads; q through a q_lora_rank-wide bottleneck (0: one plain projection); rotary
    # on interleaved pairs of dims when rope_interleaved (also ernie4_5_moe's GQA attention)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    source_dtype: str = "bf16"

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from the FTW `model.config` object; unknown keys are ignored, missing required ones raise."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for key in ("moe_layers", "eos_token_ids", "layer_types", "no_rope_layers"):
            if key in kw and kw[key] is not None:
                kw[key] = tuple(kw[key])
        try:
            return cls(**kw)
        except TypeError as e:
            raise ModelError(f"the model's config is incomplete ({e}); re-convert it with this "
                             "version of `freetoken convert`") from None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear_layer(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet (linear attention) layer, not attention."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def attention_window(self, layer: int) -> Optional[int]:
        """Tokens an attention layer sees (self included), None: all before it."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.layer_window
        return self.sliding_window

    @property
    def linear_layers(self) -> tuple:
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (deepseek_v2/v3)."""
        return self.kv_lora_rank > 0

    @property
    def kv_entry(self) -> tuple:
        """(parts, heads, dim): what the KV cache holds per layer and token (kv_cache.KVPages).
        Attention: k and v, (2, num_kv_heads, head_dim). MLA: one part, the compressed kv latent
        then the rotated rope key, (1, 1, kv_lora_rank + head_dim)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The rotated leading dims of each q/k head (head_dim unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)


PREFILL_CHOICES = ("auto", "stream", "slot")
DECODE_BESIDE = ("interleave", "thread")
CPU_EXPERT_BACKENDS = ("auto", "torch", "kernels")


@dataclass(frozen=True)
class Tuning:
    """The engine's tuning and test switches that are not run options: each field says who
    needs it (a test's oracle, a bench's sweep, a diagnostic). Frozen and validated at
    construction; an unknown name is a TypeError of the constructor, so a typo never passes
    silently. None means the engine's own default (named per field)."""
    # admissions (experts/captured/admissions.py): the last N MoE layers' admissions gathered at
    # the next decode step; None: the last half (tests run 0, 1 and 2)
    admit_defer: Optional[int] = None
    # --fill-behind admissions only in layer steps of at most this many misses (None: the
    # runtime's default cap with its default admissions; the benches sweep it)
    fill_behind_max_misses: Optional[int] = None
    # prefill streaming (experts/prefill/): on (None: on, except the plain CPU engine with no
    # cache), from how many tokens (None: ceil(E / K)), device layer buffers, the per-layer
    # choice (None: auto on cuda, stream on cpu), and its bandwidth / CPU rate (None: the
    # stored profile's, else defaults); tests and bench_prefill set them
    prefill_stream: Optional[bool] = None
    prefill_stream_min_tokens: Optional[int] = None
    prefill_buffers: int = 2
    prefill_choice: Optional[str] = None
    prefill_stream_gbps: Optional[float] = None
    prefill_cpu_gflops: Optional[float] = None
    # the CPU experts: auto (the native kernels when built, else torch) | torch (the reference,
    # for tests) | kernels (an error when not built)
    cpu_experts: str = "auto"
    # the cpu device tier's experts: on the kernel pool (False) or as torch ops (True: tests)
    tier_torch: bool = False
    # the dense reference runtime instead of the cache (experts/reference.py: the tests' oracle)
    reference_experts: bool = False
    # diagnostics of GPU-resident control's host server (cython/serve.h): trace the CPU jobs'
    # work items (timing output), or skip the jobs (WRONG results: the step's time only)
    serve_trace: bool = False
    serve_skip_jobs: bool = False
    # the scheduler runs the generating requests' decode steps between the MoE layers of a
    # prefill forward, one every N of them (N >= 1), or one decode step after each prefill
    # chunk (0); tools/bench_batch.py --during-prefill measures the choices
    # (docs/MEASUREMENTS.md#batched-decode)
    decode_beside_every: int = 1
    # how those decode steps run beside a streamed prefill forward: interleave (between its MoE
    # layers, on its thread and stream, every decode_beside_every layers) | thread (back to back
    # on a host thread and CUDA stream of their own, overlapping its layers; a forward that does
    # not stream every layer interleaves); tools/bench_batch.py --during-prefill --beside-mode
    # measures both (docs/MEASUREMENTS.md#decode-beside-a-streamed-prefill)
    decode_beside: str = "interleave"
    # the memory watch (memory_watch.py) checks the device's free memory at most every this many
    # ms, between scheduler steps (0: after every step, as tests run it; the check's cost:
    # docs/MEASUREMENTS.md#memory-watch)
    memory_watch_ms: int = 100

    def __post_init__(self):
        for name in ("admit_defer", "fill_behind_max_misses", "prefill_stream_min_tokens",
                     "decode_beside_every", "memory_watch_ms"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"tuning {name} must be a whole number >= 0, not {value!r}")
        if not isinstance(self.prefill_buffers, int) or self.prefill_buffers < 1:
            raise ConfigError(f"tuning prefill_buffers must be >= 1, not {self.prefill_buffers!r}")
        if self.prefill_choice is not None and self.prefill_choice not in PREFILL_CHOICES:
            raise ConfigError(f"tuning prefill_choice must be one of {', '.join(PREFILL_CHOICES)}, "
                              f"not {self.prefill_choice!r}")
        for name in ("prefill_stream_gbps", "prefill_cpu_gflops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"tuning {name} must be > 0, not {value!r}")
        if self.decode_beside not in DECODE_BESIDE:
            raise ConfigError(f"tuning decode_beside must be one of {', '.join(DECODE_BESIDE)}, "
                              f"not {self.decode_beside!r}")
        if self.cpu_experts not in CPU_EXPERT_BACKENDS:
            raise ConfigError(f"tuning cpu_experts must be one of {', '.join(CPU_EXPERT_BACKENDS)}, "
                              f"not {self.cpu_experts!r}")


# the default state budget's states per parallel sequence: an agent session reuses its latest
# few anchors (the end of the last answer, the last tool output, the last turn) and, after an edit,
# one of its older turns'; states are kept exactly at each closer (two a turn) and at the latest
# request's ends (its prompt's last-but-one token, its answer's end): 10 leaves each sequence those
# and four turns of anchors
STATES_PER_SEQUENCE = 10


# --prefill-chunk's default per device: on cuda a streamed prefill forward costs about the same
# from 512 to 16K tokens (the expert set crosses the link once per forward: docs/MEASUREMENTS.md
# #decode-beside-a-streamed-prefill), so a chunk there is large; the CPU's cost grows with it
PREFILL_CHUNK = {"cuda": 8192, "cpu": 512}


def chunk_default(config: "EngineConfig", device_type: str) -> "EngineConfig":
    """config with prefill_chunk set: its own, or PREFILL_CHUNK's for the device type."""
    if config.prefill_chunk is not None:
        return config
    from dataclasses import replace
    return replace(config, prefill_chunk=PREFILL_CHUNK.get(device_type, 512))


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # compute dtype: auto (bf16 on cuda, fp32 on cpu) | bf16 | fp16 | fp32
    expert_cache_gb: Optional[float] = None
    expert_cache_frac: Optional[float] = None
    gpu_mem_gb: Optional[float] = None  # cap on all the engine takes on the device (memory_plan.py)
    policy: str = "hybrid"
    ctx_size: int = 4096  # tokens of one sequence at most (prompt + generated)
    parallel: int = 4  # sequences at once (the KV budget's default multiple of ctx_size)
    kv_tokens: Optional[int] = None  # the KV page pool's tokens (None: ctx_size x parallel)
    prefix_cache: bool = True  # keep finished sequences' KV pages for later prompts (kv/radix.py)
    prefill_chunk: Optional[int] = None  # prompt tokens per forward (None: chunk_default)
    cpu_threads: Optional[int] = None
    load_threads: Optional[int] = None
    trace_out: Optional[str] = None  # file recording the routed expert ids of every token
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (graphs.py) where possible
    fill_behind: Optional[int] = None  # CPU-run misses also copied into the cache, N per step
                                       # (None: the runtime's default, experts/runtime.py
                                       # admissions: 1 with hybrid on cuda with Triton, else 0)
    # hybrid models (linear-attention layers): keep their recurrent states at anchors in the prefix
    # cache (anchors.py), so that a prompt sharing a prefix prefills from the deepest one
    state_checkpoints: bool = True
    # also a state every this many tokens inside a span without anchors: an edit inside a long
    # span then re-prefills at most this many tokens (+ a page) before it; 2048 = 4 prefill
    # chunks of the default 512; a 32k-token prompt then keeps 16 states (the default budget at
    # --parallel 4 holds 32)
    state_interval: int = 2048
    # bytes of kept states (None: STATES_PER_SEQUENCE x --parallel states of the model): beyond
    # it the least recently used unlocked ones are dropped (kv/radix.py)
    state_budget: Optional[int] = None
    # between steps, shrink the expert cache when the device's free memory falls under the memory
    # plan's margin (another program took it) and grow it back when memory returns (memory_watch.py)
    memory_watch: bool = True
    # a request waiting only for KV pages grows the page pool with bytes taken from the expert
    # cache; given back once no sequence holds the added pages (kv_grow.py)
    kv_grow: bool = True
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self):
        if self.state_interval < 1:
            raise ConfigError(f"--state-interval must be >= 1 token, not {self.state_interval}")
        if self.state_budget is not None and self.state_budget < 0:
            raise ConfigError(f"--state-budget must be >= 0 bytes, not {self.state_budget}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.expert_cache_gb is not None and self.expert_cache_frac is not None:
            raise ConfigError("give --expert-cache-gb or --expert-cache-frac, not both")
        if self.expert_cache_gb is not None and self.expert_cache_gb < 0:
            raise ConfigError("--expert-cache-gb must be >= 0")
        if self.expert_cache_frac is not None and not 0 <= self.expert_cache_frac <= 1:
            raise ConfigError("--expert-cache-frac must be between 0 and 1")
        if self.gpu_mem_gb is not None and not self.gpu_mem_gb > 0:
            raise ConfigError(f"--gpu-mem-gb must be > 0, not {self.gpu_mem_gb}")
        if self.ctx_size < 1:
            raise ConfigError("--ctx-size must be >= 1")
        if self.parallel < 1:
            raise ConfigError(f"--parallel must be >= 1, not {self.parallel}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError(f"--kv-tokens must be >= 1, not {self.kv_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError("--prefill-chunk must be >= 1")
        if self.fill_behind is not None and self.fill_behind < 0:
            raise ConfigError(f"--fill-behind must be >= 0, not {self.fill_behind}")
        if not isinstance(self.tuning, Tuning):
            raise ConfigError(f"EngineConfig.tuning must be a Tuning, not {type(self.tuning).__name__}")
        for name in ("cpu_threads", "load_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, not {value}")

    @property
    def num_default_states(self) -> int:
        """States the default state_budget holds: STATES_PER_SEQUENCE per parallel sequence."""
        return STATES_PER_SEQUENCE * self.parallel

    @property
    def kv_budget(self) -> int:
        """Tokens of the KV page pool: kv_tokens, or ctx_size x parallel."""
        return self.kv_tokens if self.kv_tokens is not None else self.ctx_size * self.parallel


# ---- FREETOKEN_* environment variables -------------------------------------------------------

@dataclass(frozen=True)
class EnvVar:
    """One FREETOKEN_* variable. values: the allowed values (a tuple), int (a whole number >= 0),
    or None (free-form, parsed where it is read). kind: setting (a supported knob of how a run
    goes), comparison (keeps another path, measured or reference, to set beside the default), or
    diagnostic (extra timing output, or timing only with wrong results)."""
    default: str
    values: Union[tuple, type, None]
    kind: str
    doc: str


KINDS = ("setting", "comparison", "diagnostic")

# NOTE: the tuple of FREETOKEN_ISA mirrors kernels.ISAS (imports run downward, so this module
# cannot import it); tests/test_config_env.py holds them equal.
ENV = {
    # CPU expert kernels (kernels.py, kernel_tuning.py, experts/executor.py)
    "FREETOKEN_ISA": EnvVar(
        "", ("generic", "avx2", "avx512", "avx512bf16"), "setting",
        "the CPU kernels' ISA path (default: the best this CPU runs); forced avx512bf16 also rounds x"),
    "FREETOKEN_KERNEL_TUNE": EnvVar(
        "", None, "setting",
        "\"key=value,...\" over the kernel tuning's auto values (KernelTuning.parse checks it)"),
    # `freetoken serve` (server/)
    "FREETOKEN_API_KEY": EnvVar(
        "", None, "setting",
        "the key `freetoken serve` asks clients for when --api-key is not given (empty: none)"),
}


def env(name: str) -> str:
    """The value of the FREETOKEN_* variable `name` as os.environ holds it now (read at every
    call, never cached: tests change the environment between calls); its default when unset or
    empty. A value outside ENV[name].values raises ConfigError; a name not in ENV, KeyError."""
    var = ENV[name]
    value = os.environ.get(name, "")
    if value == "":
        return var.default
    if var.values is int:
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(_bad_value(name, value, var, "use a whole number >= 0"))
    elif var.values is not None and value not in var.values:
        raise ConfigError(_bad_value(name, value, var, f"use one of {', '.join(var.values)}"))
    return value


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in the interpreter (TRITON_INTERPRET=1, Triton's own
    variable: tests on machines without a GPU), which has no PTX and no libdevice."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _bad_value(name: str, value: str, var: EnvVar, choices: str) -> str:
    default = f" ({var.default})" if var.default else ""
    return f"{name}={value!r}: unset it for the default{default} or {choices}"
