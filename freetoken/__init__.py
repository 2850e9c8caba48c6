"""freetoken: edge-native Mixture-of-Experts inference (GPU expert cache + CPU experts).

Public surface: LLM and SamplingParams, imported lazily so that `import freetoken` stays fast.
"""
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from .api import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
