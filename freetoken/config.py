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
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    hidden_act: str = "silu"
    norm_topk_prob: bool = False
    router_scoring: str = "softmax"
    intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    source_dtype: str = "bf16"

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from the FTW `model.config` object; unknown keys are ignored, missing required ones raise."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for key in ("moe_layers", "eos_token_ids"):
            if key in kw and kw[key] is not None:
                kw[key] = tuple(kw[key])
        try:
            return cls(**kw)
        except TypeError as e:
            raise ModelError(f"the model's config is incomplete ({e}); re-convert it with this "
                             "version of `freetoken convert`") from None

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # compute dtype: auto (bf16 on cuda, fp32 on cpu) | bf16 | fp16 | fp32
    expert_cache_gb: Optional[float] = None
    expert_cache_frac: Optional[float] = None
    policy: str = "hybrid"
    ctx_size: int = 4096  # tokens of one sequence at most (prompt + generated)
    parallel: int = 4  # sequences at once (the KV budget's default multiple of ctx_size)
    kv_tokens: Optional[int] = None  # the KV page pool's tokens (None: ctx_size x parallel)
    prefix_cache: bool = True  # keep finished sequences' KV pages for later prompts (kv/radix.py)
    prefill_chunk: int = 512
    cpu_threads: Optional[int] = None
    load_threads: Optional[int] = None
    trace_out: Optional[str] = None  # file recording the routed expert ids of every token
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (graphs.py) where possible
    fill_behind: Optional[int] = None  # CPU-run misses also copied into the cache, N per step
                                       # (None: the runtime's default, experts/runtime.py
                                       # admissions: 1 with hybrid on cuda with Triton, else 0)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
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
        if self.ctx_size < 1:
            raise ConfigError("--ctx-size must be >= 1")
        if self.parallel < 1:
            raise ConfigError(f"--parallel must be >= 1, not {self.parallel}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError(f"--kv-tokens must be >= 1, not {self.kv_tokens}")
        if self.prefill_chunk < 1:
            raise ConfigError("--prefill-chunk must be >= 1")
        if self.fill_behind is not None and self.fill_behind < 0:
            raise ConfigError(f"--fill-behind must be >= 0, not {self.fill_behind}")
        for name in ("cpu_threads", "load_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, not {value}")

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

# NOTE: the tuples of FREETOKEN_ISA, FREETOKEN_CPU_EXPERTS and FREETOKEN_SIGNALS and the default of
# FREETOKEN_ADMIT_PROGRAMS mirror kernels.ISAS, experts/executor.BACKENDS,
# experts/handshake.Signals.HOWS and experts/admissions.ADMIT_PROGRAMS (imports run downward, so
# this module cannot import them); tests/test_config_env.py holds them equal.
ENV = {
    # CPU expert kernels (kernels.py, kernel_tuning.py, experts/executor.py)
    "FREETOKEN_ISA": EnvVar(
        "", ("generic", "avx2", "avx512", "avx512bf16"), "setting",
        "the CPU kernels' ISA path (default: the best this CPU runs); forced avx512bf16 also rounds x"),
    "FREETOKEN_KERNEL_TUNE": EnvVar(
        "", None, "setting",
        "\"key=value,...\" over the kernel tuning's auto values (KernelTuning.parse checks it)"),
    "FREETOKEN_CPU_EXPERTS": EnvVar(
        "auto", ("auto", "torch", "kernels"), "setting",
        "the CPU expert backend where the run asks for auto (auto: the kernels when built)"),
    # the decode step on cuda (experts/)
    "FREETOKEN_DEVICE_CONTROL": EnvVar(
        "1", ("1", "0"), "comparison",
        "0: captured decode steps plan each MoE layer on the host between cuts, not on the GPU"),
    "FREETOKEN_SIGNALS": EnvVar(
        "plan", ("plan", "memops"), "comparison",
        "how GPU-resident control raises a layer's ready: plan (default) the plan kernel itself "
        "after a system-scope fence, memops a stream memory op"),
    "FREETOKEN_ADMIT_AT": EnvVar(
        "plan", ("plan", "after_cpu"), "comparison",
        "after_cpu: a layer's admission gather starts after its CPU job, not with its plan"),
    "FREETOKEN_ADMIT_DEFER": EnvVar(
        "auto", None, "setting",
        "the last N MoE layers' admissions gathered at the next decode step (auto: half; 0: none)"),
    "FREETOKEN_ADMIT_PROGRAMS": EnvVar(
        "8", int, "setting",
        "looping programs of the admission gather (0: one program per 16 KiB block)"),
    "FREETOKEN_SPLIT_ADAPT": EnvVar(
        "0", ("0", "1"), "comparison",
        "1: captured decode steps feed their path times to the hybrid split (observe)"),
    "FREETOKEN_FILLS": EnvVar(
        "auto", ("auto", "copy"), "comparison",
        "copy: decode cache fills are copies on the copy stream, not the zero-copy gather kernel"),
    "FREETOKEN_FILL_COPIES": EnvVar(
        "driver", ("driver", "torch"), "comparison",
        "torch: fill copies go through torch's copies, not the CUDA driver's (cuda_copy.py)"),
    "FREETOKEN_DEVICE_EXPERTS": EnvVar(
        "auto", ("auto", "torch"), "comparison",
        "torch: device experts gather their slots and run torch matmuls, not Triton in place"),
    "FREETOKEN_SERVE_TRACE": EnvVar(
        "0", ("0", "1"), "diagnostic",
        "1: the served CPU jobs' work items are traced and summed (timing output; right results)"),
    "FREETOKEN_SERVE_SKIP_JOBS": EnvVar(
        "0", ("0", "1"), "diagnostic",
        "1: served CPU jobs are skipped, zero partials: WRONG results, the step's time only"),
    # the model's kernels on cuda (models/)
    "FREETOKEN_FUSED": EnvVar(
        "1", ("1", "0"), "comparison",
        "0: norms, q/k/v, q/k norm + rotary and the router run torch's code, not fused Triton"),
    "FREETOKEN_FUSED_KV": EnvVar(
        "1", ("1", "0"), "comparison",
        "0: the captured decode step stores k and v separately, not in its rotary kernel"),
    "FREETOKEN_GEMV": EnvVar(
        "triton", ("triton", "torch"), "comparison",
        "torch: one token's linear layers on cuda run F.linear (cuBLAS), not the Triton GEMV"),
    "FREETOKEN_PREFILL_EXPERTS": EnvVar(
        "triton", ("triton", "torch"), "comparison",
        "torch: many tokens' device experts run as torch matmuls per expert, not grouped kernels"),
    "FREETOKEN_DECODE_ATTENTION": EnvVar(
        "triton", ("triton", "sdpa"), "comparison",
        "sdpa: the captured decode step's attention is SDPA over the masked span, not split-K"),
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


def env_int(name: str) -> int:
    """env(name) of a variable whose values are int, as an int."""
    assert ENV[name].values is int, name
    return int(env(name))


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in the interpreter (TRITON_INTERPRET=1, Triton's own
    variable: tests on machines without a GPU), which has no PTX and no libdevice."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _bad_value(name: str, value: str, var: EnvVar, choices: str) -> str:
    default = f" ({var.default})" if var.default else ""
    return f"{name}={value!r}: unset it for the default{default} or {choices}"
