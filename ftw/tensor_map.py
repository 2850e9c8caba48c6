"""Which source tensor of a Hugging Face checkpoint feeds each canonical FTW tensor and each
expert bank (convert.py's plan), and the check that the plan is complete: every tensor the
model needs (INTERFACES §2) present with the shape its config implies, every (expert,
projection) of every MoE layer covered once, per expert or by a fused tensor.
"""
from __future__ import annotations

from collections import defaultdict

from . import names, writer
from .errors import MissingTensorError, UnknownTensorError, UnsupportedConfigError


FP8_SCALE_SUFFIX = ".weight_scale_inv"


class TensorPlan:
    """Which source tensor feeds each canonical tensor and each bank."""

    def __init__(self):
        self.tensors = {}                       # canonical -> hf name
        self.experts = defaultdict(lambda: {"per_expert": {}, "fused": []})  # layer -> sources
        self.ignored = []                       # hf names skipped on purpose
        self.ignored_reasons = {}               # hf name -> why
        self.fp8_scales = {}                    # hf weight -> its weight_scale_inv (FP8 block scales)

    def used_names(self) -> list:
        used = list(self.tensors.values())
        for src in self.experts.values():
            used += list(src["per_expert"].values()) + [hf for hf, _ in src["fused"]]
        return used

    def quantized_names(self) -> list:
        """The used tensors that are halves of published MXFP4 weights (uint8 blocks, scales), or
        published FP8 weights and their scales."""
        mx = [hf for src in self.experts.values() for hf, f in src["fused"] if f.part]
        return mx + list(self.fp8_scales) + list(self.fp8_scales.values())


def map_tensors(family, sources: dict, config: dict) -> TensorPlan:
    """Map every source tensor through the family table and check the result is complete."""
    plan, unknown = TensorPlan(), []
    moe_layers, num_layers = set(config["moe_layers"]), config["num_layers"]
    mtp_layers = range(num_layers, num_layers + config.get("num_mtp_layers", 0))
    scale_of = {hf[:-len(FP8_SCALE_SUFFIX)] + ".weight": hf for hf in sources
                if hf.endswith(FP8_SCALE_SUFFIX)}  # DeepSeek-V3 / Qwen FP8: X.weight_scale_inv
    for hf in sorted(sources):
        if hf.endswith(FP8_SCALE_SUFFIX):
            continue  # goes with its weight, below
        m = names.match(family, hf)
        if _layer_of(hf) in mtp_layers:  # glm4_moe, deepseek: appended after the decoder's layers
            plan.ignored.append(hf)
            plan.ignored_reasons[hf] = names.MTP_LAYER_REASON
        elif m is None:
            unknown.append(hf)
        elif m.kind == "refused":
            raise UnsupportedConfigError(f"{hf}: this {family.name} checkpoint cannot be converted: "
                                         f"{m.reason}")
        elif m.kind == "ignored":
            plan.ignored.append(hf)
            plan.ignored_reasons[hf] = m.reason
        elif m.layer >= num_layers:
            unknown.append(hf)
        elif m.kind == "tensor":
            if m.canonical == "output.weight" and config["tie_word_embeddings"]:
                plan.ignored.append(hf)  # tied: the engine reuses token_embd (INTERFACES §2)
                plan.ignored_reasons[hf] = "tied to token_embd (tie_word_embeddings)"
            elif m.canonical in plan.tensors:
                raise UnknownTensorError(f"{hf} and {plan.tensors[m.canonical]} both map to "
                                         f"{m.canonical}; the checkpoint mixes two layouts")
            else:
                plan.tensors[m.canonical] = hf
        elif m.layer not in moe_layers:
            unknown.append(hf)  # expert weights in a layer the config calls dense
        elif m.kind == "expert":
            plan.experts[m.layer]["per_expert"][(m.expert, m.projection)] = hf
        else:
            plan.experts[m.layer]["fused"].append((hf, _oriented(family, hf, m.fused, sources, config)))
    used = set(plan.used_names())
    for weight, scale in sorted(scale_of.items()):
        if weight in used:
            plan.fp8_scales[weight] = scale
        elif weight in plan.ignored_reasons:
            plan.ignored.append(scale)
            plan.ignored_reasons[scale] = plan.ignored_reasons[weight]
        else:
            unknown.append(scale)
    if unknown:
        raise UnknownTensorError(
            f"{len(unknown)} tensor(s) not known for {family.name}: {', '.join(unknown[:8])}"
            f"{' ...' if len(unknown) > 8 else ''}; this checkpoint does not match the {family.name} "
            "layout freetoken knows (please report it with the model name)")
    _check_complete(plan, sources, config)
    return plan


def _oriented(family, hf: str, fused, sources: dict, config: dict):
    """The one of the family's FusedExperts for `hf` (the same name, [E, out, in] or [E, in, out]:
    qwen3_vl_moe) whose shape the tensor has; the first when only one is listed, or none fits
    (_check_complete then names the shape). A square block, where both fit, is refused."""
    choices = [f for f in family.fused if f.hf == fused.hf]
    if len(choices) == 1:
        return fused
    fits = [f for f in choices if tuple(sources[hf].shape) == _fused_shape(f, config)]
    if len(fits) > 1:
        raise UnsupportedConfigError(
            f"{hf} has shape {list(sources[hf].shape)}, which reads both as [experts, in, out] and "
            "as [experts, out, in]; convert cannot tell which layout this checkpoint uses")
    return fits[0] if fits else fused


def _fused_shape(f, config: dict) -> tuple:
    """The shape config.json implies for one fused expert tensor."""
    E, D, I = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    is_down = f.projections[0].startswith("down")
    out = D if is_down else I * len(f.projections)
    inn = I if is_down else D
    if f.is_bias:
        return (E, out)
    if f.part == "blocks":
        return (E, out, inn // 32, 16)
    if f.part == "scales":
        return (E, out, inn // 32)
    return (E, inn, out) if f.transposed else (E, out, inn)


def _check_mxfp4_pairs(layer: int, fused: list, sources: dict, D: int, I: int) -> None:
    """Every MXFP4 blocks tensor has its scales and the other way round, both uint8, and its
    `in` dimension holds whole 32-blocks."""
    parts = {(f.projections, f.part): hf for hf, f in fused if f.part}
    for (projs, part), hf in parts.items():
        other = "scales" if part == "blocks" else "blocks"
        if (projs, other) not in parts:
            raise MissingTensorError(f"{hf} has no matching {other} tensor ({hf.rsplit('_', 1)[0]}_"
                                     f"{other}); the MXFP4 checkpoint is incomplete")
        if sources[hf].st_dtype != "U8":
            raise UnsupportedConfigError(f"{hf} is {sources[hf].st_dtype}, but MXFP4 {part} are "
                                         "uint8 (U8); this checkpoint's layout is not the one "
                                         "gpt-oss publishes")
        inn = I if projs[0].startswith("down") else D
        if inn % 32:
            raise UnsupportedConfigError(f"{hf}: MXFP4 needs the input dimension ({inn}) in "
                                         "whole 32-blocks")


def _layer_of(hf: str) -> int:
    """L of a `model.layers.L.` tensor name, else -1."""
    head, _, rest = hf.partition("model.layers.")
    number = rest.partition(".")[0]
    return int(number) if not head and number.isdigit() else -1


def expected_shapes(config: dict) -> dict:
    """Canonical name -> shape of every non-expert tensor the model needs (INTERFACES §2)."""
    c = config
    V, D, hd = c["vocab_size"], c["hidden_size"], c["head_dim"]
    q, kv = c["num_heads"] * hd, c["num_kv_heads"] * hd
    want = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not c["tie_word_embeddings"]:
        want["output.weight"] = (V, D)
    if c.get("output_bias"):
        want["output.bias"] = (V,)
    norms = ("weight", "bias") if c.get("layer_norm") else ("weight",)  # LayerNorm: + a bias
    if c.get("layer_norm"):
        want["output_norm.bias"] = (D,)
    q_rows = 2 * q if c.get("attn_output_gate") else q  # per head: q, then its output gate
    layer_types = c.get("layer_types") or ()
    for i in range(c["num_layers"]):
        b = f"blk.{i}."
        want.update({f"{b}{norm}.{p}": (D,) for norm in ("attn_norm", "ffn_norm") for p in norms})
        if layer_types and layer_types[i] == "linear_attention":
            want.update(_linear_attention_shapes(c, b))
        elif c.get("kv_lora_rank"):
            want.update(_mla_shapes(c, b))
        else:
            want.update({b + "attn_q.weight": (q_rows, D), b + "attn_k.weight": (kv, D),
                         b + "attn_v.weight": (kv, D), b + "attn_output.weight": (D, q)})
            if c["attention_bias"]:
                want.update({b + "attn_q.bias": (q_rows,), b + "attn_k.bias": (kv,),
                             b + "attn_v.bias": (kv,)})
            if c.get("attn_sinks"):
                want[b + "attn_sinks"] = (c["num_heads"],)
            if c["qk_norm"] == "per_head":
                want.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
            elif c["qk_norm"] == "full":
                want.update({b + "attn_q_norm.weight": (q,), b + "attn_k_norm.weight": (kv,)})
        if i in c["moe_layers"]:
            want[b + "ffn_gate_inp.weight"] = (c["num_experts"], D)
            Is = c["shared_expert_intermediate_size"]
            if Is:
                want.update({b + "ffn_gate_shexp.weight": (Is, D), b + "ffn_up_shexp.weight": (Is, D),
                             b + "ffn_down_shexp.weight": (D, Is)})
            if c["shared_expert_gate"]:
                want[b + "ffn_gate_inp_shexp.weight"] = (1, D)
            if c.get("router_scoring") == "sigmoid":  # the correction bias of the expert choice
                want[b + "exp_probs_b"] = (c["num_experts"],)
            elif c.get("router_scoring") == "softmax_bias":  # ernie4_5_moe's, as published
                want[b + "exp_probs_b"] = (1, c["num_experts"])
            if c.get("router_bias"):
                want[b + "ffn_gate_inp.bias"] = (c["num_experts"],)
        else:
            Iff = c["intermediate_size"]
            want.update({b + "ffn_gate.weight": (Iff, D), b + "ffn_up.weight": (Iff, D),
                         b + "ffn_down.weight": (D, Iff)})
    return want


def _mla_shapes(c: dict, b: str) -> dict:
    """A multi-head latent attention layer's tensors (head_dim = the rope dims): q through the
    q_lora_rank bottleneck or one projection, the kv latent + rope key, their up-projection."""
    D, H, r, rq = c["hidden_size"], c["num_heads"], c["kv_lora_rank"], c["q_lora_rank"]
    dr, dn, dv = c["head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    want = {b + "attn_kv_a_mqa.weight": (r + dr, D), b + "attn_kv_a_norm.weight": (r,),
            b + "attn_kv_b.weight": (H * (dn + dv), r), b + "attn_output.weight": (D, H * dv)}
    if rq:
        want.update({b + "attn_q_a.weight": (rq, D), b + "attn_q_a_norm.weight": (rq,),
                     b + "attn_q_b.weight": (H * (dn + dr), rq)})
    else:
        want[b + "attn_q.weight"] = (H * (dn + dr), D)
    if c["attention_bias"]:
        want.update({b + "attn_kv_a_mqa.bias": (r + dr,), b + "attn_output.bias": (D,)})
        if rq:
            want[b + "attn_q_a.bias"] = (rq,)
    return want


def _linear_attention_shapes(c: dict, b: str) -> dict:
    """A Gated DeltaNet layer's tensors: in projections (qwen3_next: q, k, v, z grouped per key
    head in one, b and a in another; qwen3_5_moe_text: four), conv, dt bias, A_log, norm, out."""
    D, K = c["hidden_size"], c["linear_conv_kernel_dim"]
    nv = c["linear_num_value_heads"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = nv * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    want = {b + "ssm_conv1d.weight": (conv_dim, 1, K), b + "ssm_dt.bias": (nv,), b + "ssm_a_log": (nv,),
            b + "ssm_norm.weight": (c["linear_value_head_dim"],), b + "ssm_out.weight": (D, value_dim)}
    if c["family"] == "qwen3_next":
        want.update({b + "ssm_in_qkvz.weight": (conv_dim + value_dim, D),
                     b + "ssm_in_ba.weight": (2 * nv, D)})
    else:
        want.update({b + "ssm_in_qkv.weight": (conv_dim, D), b + "ssm_in_z.weight": (value_dim, D),
                     b + "ssm_in_b.weight": (nv, D), b + "ssm_in_a.weight": (nv, D)})
    return want


def _check_complete(plan: TensorPlan, sources: dict, config: dict) -> None:
    want = expected_shapes(config)
    missing = sorted(set(want) - set(plan.tensors), key=writer.tensor_sort_key)
    if missing:
        raise MissingTensorError(f"{len(missing)} tensor(s) the model needs are missing: "
                                 f"{', '.join(missing[:6])}; the checkpoint is incomplete or its "
                                 "config.json does not match its weights")
    for canon, hf in plan.tensors.items():
        if canon in want and sources[hf].shape != want[canon]:
            raise MissingTensorError(f"{hf} has shape {list(sources[hf].shape)} but config.json implies "
                                     f"{list(want[canon])}; the config does not match the weights")
    E, D, I = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    for layer in config["moe_layers"]:
        src = plan.experts.get(layer)
        if src is None:
            raise MissingTensorError(f"layer {layer} is a MoE layer but has no expert weights")
        per, fused = src["per_expert"], src["fused"]
        covered = {p for _, f in fused for p in f.projections}
        if len(covered) != sum(len(f.projections) for _, f in fused if f.part != "scales"):
            raise MissingTensorError(f"layer {layer}: the same projection appears in two fused tensors")
        _check_mxfp4_pairs(layer, fused, sources, D, I)
        if config.get("expert_bias") and not set(names.BIAS_PROJECTIONS) <= covered:
            raise MissingTensorError(f"layer {layer}: the experts' biases (gate_up_proj_bias, "
                                     "down_proj_bias) are missing; the checkpoint is incomplete")
        if not config.get("expert_bias") and covered & set(names.BIAS_PROJECTIONS):
            raise UnknownTensorError(f"layer {layer} has expert biases its config does not expect")
        for hf, f in fused:
            shape = _fused_shape(f, config)
            if sources[hf].shape != shape:
                raise MissingTensorError(f"{hf} has shape {list(sources[hf].shape)}, expected {list(shape)}")
        for e in range(E):
            for p in names.PROJECTIONS:
                if p in covered:
                    continue
                hf = per.get((e, p))
                if hf is None:
                    raise MissingTensorError(f"layer {layer} expert {e} has no {p} projection; the "
                                             "checkpoint is incomplete")
                shape = (D, I) if p == "down" else (I, D)
                if sources[hf].shape != shape:
                    raise MissingTensorError(f"{hf} has shape {list(sources[hf].shape)}, expected {list(shape)}")
        extra = [hf for (e, p), hf in per.items() if e >= E or p in covered]
        if extra:
            raise UnknownTensorError(f"unexpected expert tensor(s) {', '.join(sorted(extra)[:4])} "
                                     f"(num_experts={E}, or duplicated by a fused tensor)")
