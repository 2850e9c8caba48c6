"""Frozen configs: ModelConfig (the normalised model config from the FTW header) and
EngineConfig (how to run it). Options of `freetoken run` map one-to-one to EngineConfig fields.

Model code sees only ModelConfig; HF config variety is normalised once by ftw/convert.py.
"""
from dataclasses import dataclass, field, fields
from typing import Optional

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
    ctx_size: int = 4096
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
        if self.prefill_chunk < 1:
            raise ConfigError("--prefill-chunk must be >= 1")
        if self.fill_behind is not None and self.fill_behind < 0:
            raise ConfigError(f"--fill-behind must be >= 0, not {self.fill_behind}")
        for name in ("cpu_threads", "load_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, not {value}")
