"""The expert tier: host banks, the device expert cache, the miss-split policy, CPU executor, the MoE layer's plan/run/combine."""
from .runtime import ExpertRuntime, create_expert_runtime

__all__ = ["ExpertRuntime", "create_expert_runtime"]
