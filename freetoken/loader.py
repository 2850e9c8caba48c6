"""FTW tensors -> model parameters: the model is built on the meta device, then every parameter
is assigned from the tensor of the same canonical name, cast to the compute dtype on the compute
device (fp32 for those a module lists in `fp32_parameters`: a router kept in fp32). Strict: a
missing or extra tensor, a shape mismatch or a non-float dtype raises ModelError. Routed experts
are not parameters (they stay in the host banks, experts/).
"""
import warnings
from typing import Mapping

import torch

from .errors import ModelError
from .experts.bank import TORCH_DTYPES
from .models import model_class


def _list(names, limit=5) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_model(model_config, tensors: Mapping[str, torch.Tensor], device, dtype,
                expert_runtime):
    """The family's model with its parameters taken from `tensors` {canonical name: tensor}
    (any float dtype, any device; copied, never aliased); dtype: torch dtype or bf16/fp16/fp32.
    Returns the model in eval mode."""
    cls = model_class(model_config.family)
    dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = cls(model_config, expert_runtime)
    names = model.canonical_names()  # {canonical: parameter path}
    missing, extra = set(names) - set(tensors), set(tensors) - set(names)
    if missing or extra:
        what = []
        if missing:
            what.append(f"missing {_list(missing)}")
        if extra:
            what.append(f"unexpected {_list(extra)}")
        raise ModelError(f"the model's tensors do not match a {model_config.family} model with "
                         f"this config ({'; '.join(what)}); re-convert it with `freetoken convert`")
    params = dict(model.named_parameters())
    # parameters a module lists in fp32_parameters (names relative to it) stay fp32
    fp32 = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name in getattr(module, "fp32_parameters", ())}
    state = {}
    for name, path in names.items():
        t, want = tensors[name], params[path]
        if tuple(t.shape) != tuple(want.shape):
            raise ModelError(f"tensor {name} has shape {tuple(t.shape)}, the config needs "
                             f"{tuple(want.shape)}; re-convert the model")
        if t.dtype not in TORCH_DTYPES.values():
            raise ModelError(f"tensor {name} has dtype {t.dtype}; only bf16, fp16 and fp32 "
                             "non-expert tensors are supported")
        state[path] = t.to(device=device, dtype=torch.float32 if path in fp32 else dtype, copy=True)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _ftw_tensor(ftw_file, name: str) -> torch.Tensor:
    """One FTW tensor as a torch tensor view of its bytes (numpy has no bf16: viewed here)."""
    info = ftw_file.tensors[name]
    if info.dtype not in TORCH_DTYPES:
        raise ModelError(f"tensor {name} has dtype {info.dtype}; only bf16, fp16 and fp32 "
                         "non-expert tensors are supported")
    raw = ftw_file.tensor_bytes(name)  # np.uint8 [nbytes], maybe read-only
    with warnings.catch_warnings():  # read-only buffer: never written, build_model copies
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(raw)
    return t.view(TORCH_DTYPES[info.dtype]).view(*info.shape)


def load_model(ftw_file, model_config, device, dtype, expert_runtime):
    """The model of an open FTW file (ftw.open), its non-expert tensors on `device` in `dtype`."""
    tensors = {name: _ftw_tensor(ftw_file, name) for name in ftw_file.tensors}
    return build_model(model_config, tensors, device, dtype, expert_runtime)
