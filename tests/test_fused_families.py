"""The families whose layers differ from the fused kernels' assumptions: each family's fused
path (cuda, or Triton's interpreter on cpu) equals its torch path, eager and as the StaticKV
decode step (captured in a CUDA graph on cuda), while the kernels that would compute something
else for it never run (fused_support.fused_path_equals_torch). gpt_oss and the MLA families
have their own versions (tests/test_gpt_oss.py, tests/test_deepseek.py)."""
import pytest
import torch

from freetoken.models import fused, fused_router
from fused_support import fused_path_equals_torch, interpreter

QK, ROUTER = (fused, "qk_rope"), (fused_router, "softmax_topk")
# family -> (kernels it must never reach, why)
REFUSED = {
    "ernie4_5_moe": ([QK, ROUTER], "interleaved rotary reached the q/k kernel, or the route the "
                                   "softmax one"),
    "glm4_moe": ([QK, ROUTER], "partial rotary reached the full-rotary q/k kernel or the softmax "
                               "router"),
    "granitemoe": ([ROUTER], "the top-k softmax route reached the softmax-over-all router kernel"),
    "hunyuan_v1_moe": ([QK], "the q/k norm after the rotary reached the norm-then-rotary kernel"),
    "llama4_text": ([QK, ROUTER], "interleaved rotary reached the q/k kernel, or the route the "
                                  "softmax one"),
    "minimax_m2": ([QK, ROUTER], "partial rotary reached the q/k kernel, or the route the softmax "
                                 "one"),
    "phimoe": ([(fused, "rms_norm"), (fused, "add_rms_norm"), ROUTER],
               "a LayerNorm reached the RMSNorm kernels, or the route the softmax one"),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def check(family, device, dtype, monkeypatch, force_on_cpu):
    refused, why = REFUSED[family]
    model = fused_path_equals_torch(family, device, dtype, monkeypatch, force_on_cpu, refused, why)
    if family == "glm4_moe":  # the tiny model's rotary is partial, so the refusal means something
        assert model.config.rotary_dim == 6 and model.config.head_dim == 10


@interpreter
@pytest.mark.slow  # (a whole model's forwards in the interpreter: seconds each)
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])  # (bf16: the cuda test)
@pytest.mark.parametrize("family", REFUSED)
def test_fused_path_equals_torch_interpreted(family, dtype, monkeypatch):
    check(family, "cpu", dtype, monkeypatch, force_on_cpu=True)


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize("family", REFUSED)
def test_fused_path_and_captured_step_equal_torch_cuda(family, dtype, monkeypatch):
    check(family, "cuda", dtype, monkeypatch, force_on_cpu=False)
