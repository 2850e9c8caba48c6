"""What the convert tests share: a checkpoint's tensors as written, a tensor's raw bytes, one
projection's bytes inside an FTW expert slot, the byte-for-byte check of a round trip, a
checkpoint's config edited, a bad config's refusal, and a converted model on the reference
experts."""
import json
import re

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


# a per-expert tensor's projection: transformers' names, and mixtral's (w1 gate, w3 up, w2 down;
# also minimax_m2's and phimoe's)
_PROJECTION = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
               "w1": "gate", "w3": "up", "w2": "down"}


def assert_tensors_landed(f, hf: dict, skipped: set, layer_names: dict, global_names: dict,
                          prefix: str = "model.") -> set:
    """Every tensor of hf (a checkpoint's, as written) but those in skipped stands bitwise in the
    open FTW file f: per-expert and fused expert tensors inside their slots, the others under
    their canonical names (layer_names: the suffix after {prefix}layers.N.; global_names: whole
    names, or names after the prefix). Returns the (layer, expert, proj) of the experts seen."""
    layers = re.escape(prefix) + r"layers\.(\d+)\."
    experts = set()
    for name, t in hf.items():
        if name in skipped:
            continue
        m = re.fullmatch(layers + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight", name)
        # fused [E, out, in]: transformers 5's names (granitemoe's under block_sparse_moe.), and
        # granitemoe's hub names (input_linear: gate rows, then up; output_linear: down)
        fused_t = re.fullmatch(layers + r"(?:(?:mlp|block_sparse_moe)\.experts\.(gate_up|down)_proj"
                               r"|block_sparse_moe\.(input|output)_linear\.weight)", name)
        if m:
            proj = _PROJECTION[m[3]]
            assert proj_bytes(f, int(m[1]), int(m[2]), proj) == raw(t), name
            experts.add((int(m[1]), int(m[2]), proj))
        elif fused_t:
            layer, inter = int(fused_t[1]), f.config["moe_intermediate_size"]
            for e in range(t.shape[0]):
                if fused_t[2] == "gate_up" or fused_t[3] == "input":
                    assert proj_bytes(f, layer, e, "gate") == raw(t[e, :inter]), name
                    assert proj_bytes(f, layer, e, "up") == raw(t[e, inter:]), name
                    experts |= {(layer, e, "gate"), (layer, e, "up")}
                else:
                    assert proj_bytes(f, layer, e, "down") == raw(t[e]), name
                    experts.add((layer, e, "down"))
        else:
            lm = re.fullmatch(layers + r"(.+)", name)
            canon = (f"blk.{lm[1]}.{layer_names[lm[2]]}" if lm else
                     global_names.get(name) or global_names[name.removeprefix(prefix)])
            assert f.tensors[canon].shape == tuple(t.shape), name
            assert f.tensor_bytes(canon).tobytes() == raw(t), name
    return experts


def edit_config(src, drop=(), **changes) -> None:
    """src/config.json with the keys in `drop` removed (where present), then `changes` set."""
    cfg = json.loads((src / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def assert_config_refused(tmp_path, family, changes: dict, message: str, **build) -> None:
    """Converting the tiny `family` checkpoint (make_tiny_model.build(..., **build)) with
    `changes` in its config raises ConvertError saying `message`."""
    import pytest
    import make_tiny_model as mtm
    from ftw.convert import convert
    from ftw.errors import ConvertError
    src = mtm.build(tmp_path / "hf", family, **build)
    edit_config(src, **changes)
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(src, tmp_path / "m.ftw")


def load_reference(path, dtype):
    """(the model of an FTW file on cpu over the dense reference experts, its ModelConfig)."""
    import ftw
    from freetoken.config import ModelConfig
    from freetoken.experts.reference import DenseReferenceExperts
    from freetoken.loader import load_model
    with ftw.open(path) as f:
        config = ModelConfig.from_dict(f.config)
        experts = DenseReferenceExperts(f.load_banks(), config, "cpu", dtype)
        return load_model(f, config, "cpu", dtype, experts), config

