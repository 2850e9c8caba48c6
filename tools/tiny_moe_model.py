"""The tiny MoE model and the pieces its training loop uses: the Qwen3MoeForCausalLM builder,
the LR schedule, the per-layer router balance loss, AdamW groups, random training windows,
validation windows and evaluation, the CUDA experts-implementation pick, and greedy sampling
for the final check. Imports transformers lazily (tooling only). Used by tools/train_tiny_moe.py."""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from tiny_corpus import EOT_ID, IM_END_ID


def log(msg: str) -> None:
    print(msg, flush=True)



# -------------------------------------------------------------------------------- model
def build_model(shape: dict, max_positions: int, aux_coef: float, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=4 * shape["hidden_size"],  # unused: every layer is MoE
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
        router_aux_loss_coef=aux_coef, bos_token_id=None, eos_token_id=[EOT_ID, IM_END_ID],
        pad_token_id=EOT_ID)
    torch.manual_seed(seed)  # init on CPU: the same weights whatever the training device
    return Qwen3MoeForCausalLM(config)


def lr_at(step: int, total: int, warmup: int, max_lr: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def balance_loss(router_logits, k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss per MoE layer, averaged over layers (1.0 when
    uniform). HF's `aux_loss` pools all layers' tokens before balancing, which lets one layer
    collapse onto a few experts as long as other layers favour different ones."""
    losses = []
    for logits in router_logits:  # [T, E] per layer
        probs = logits.float().softmax(dim=-1)
        top = probs.topk(k, dim=-1).indices.flatten()  # [T*k]
        frac = torch.zeros_like(probs[0]).scatter_add_(0, top, torch.ones_like(top, dtype=probs.dtype))
        losses.append(probs.shape[-1] * (frac / top.numel() * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def make_optimizer(model, lr: float, weight_decay: float, device: str):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device == "cuda")


class Batches:
    """Random windows of seq_len+1 tokens from the packed train stream (numpy RNG: the same
    sequence of windows on any device)."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch_size: int, seed: int, device: str):
        self.data = torch.from_numpy(ids.astype(np.int64)).to(device)
        self.span = torch.arange(seq_len + 1, device=device)
        self.rng = np.random.default_rng(seed)
        self.seq_len, self.batch_size, self.device = seq_len, batch_size, device

    def next(self):
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size)
        idx = torch.from_numpy(starts).to(self.device)[:, None] + self.span  # [B, L+1]
        chunk = self.data[idx]
        return chunk[:, :-1], chunk[:, 1:]


def val_windows(ids: np.ndarray, seq_len: int) -> torch.Tensor:
    n = (len(ids) - 1) // seq_len
    return torch.stack([torch.from_numpy(ids[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64))
                        for i in range(n)])  # [N, L+1]


def autocast(device: str, enabled: bool):
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device: str, amp: bool,
             expert_counts: bool = False):
    """Mean next-token cross-entropy over windows; optionally per-layer expert route counts."""
    was_training = model.training
    model.eval()
    total, n_tok, counts = 0.0, 0, None
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size].to(device)
        with autocast(device, amp):
            out = model(input_ids=chunk[:, :-1], output_router_logits=expert_counts)
        total += F.cross_entropy(out.logits.float().flatten(0, 1), chunk[:, 1:].flatten(),
                                 reduction="sum").item()
        n_tok += chunk[:, 1:].numel()
        if expert_counts:
            k = model.config.num_experts_per_tok
            layer_counts = torch.stack([
                torch.bincount(r.topk(k, dim=-1).indices.flatten(),
                               minlength=model.config.num_experts).cpu()
                for r in out.router_logits])  # [layers, E]
            counts = layer_counts if counts is None else counts + layer_counts
    model.train(was_training)
    return total / n_tok, counts


def pick_experts_impl(model, batches: Batches, amp: bool) -> str:
    """On CUDA, time a forward+backward with each usable experts implementation (grouped_mm can
    refuse fp32 weights under autocast on some torch builds) and keep the fastest."""
    best, best_t = None, float("inf")
    x, y = batches.next()
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with autocast("cuda", amp):
                    out = model(input_ids=x, output_router_logits=True)
                loss = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
                loss = loss + balance_loss(out.router_logits, model.config.num_experts_per_tok)
                loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            log(f"experts impl {impl}: {min(times) * 1e3:.1f} ms fwd+bwd")
            if min(times) < best_t:
                best, best_t = impl, min(times)
        except Exception as e:  # noqa: BLE001 - any failure just disqualifies the implementation
            model.zero_grad(set_to_none=True)
            log(f"experts impl {impl}: unusable ({type(e).__name__}: {str(e)[:120]})")
    if best is None:
        raise SystemExit("error: no experts implementation works on this device")
    model.set_experts_implementation(best)
    return best


# -------------------------------------------------------------------------- final check
@torch.no_grad()
def greedy(model, tok, prompt: str, max_new: int, device: str) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
        nxt = int(logits.argmax())
        if nxt in (EOT_ID, IM_END_ID):
            break
        ids.append(nxt)
    return tok.decode(ids)
