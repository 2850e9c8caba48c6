"""What the convert tests share: a checkpoint's tensors as written, a tensor's raw bytes, and one
projection's bytes inside an FTW expert slot (the byte-for-byte comparisons of a round trip)."""
import torch
from safetensors.torch import load_file


def hf_tensors(src) -> dict:
    """{name: tensor} of every *.safetensors shard under src."""
    out = {}
    for path in sorted(src.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def proj_bytes(f, layer, expert, proj) -> bytes:
    """Projection `proj` (gate, up, down) of (layer, expert) in the open FTW file f."""
    p = next(p for p in f.banks[layer].projections if p.name == proj)
    return f.slot_bytes(layer, expert)[p.offset:p.offset + p.nbytes].tobytes()
