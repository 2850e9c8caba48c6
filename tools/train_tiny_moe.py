"""Train the small qwen3_moe causal LM that freetoken bundles as its default model.

Tooling only (imports transformers, never a runtime dependency). Offline: the corpus is the
Python standard library's own .py sources found through `sysconfig`, split into train and
validation by file. Steps: corpus -> byte-level BPE (`tokenizers`) -> packed token stream ->
Qwen3MoeForCausalLM trained with AdamW + cosine + router load-balancing loss (bf16 autocast on
CUDA) -> best-validation weights saved as an HF checkpoint (bf16) -> greedy samples from the
reloaded checkpoint -> optional FTW conversion. Copying the .ftw into the package is a separate step.

    # GPU host, ~6 minutes of training:
    PYTHONUNBUFFERED=1 python tools/train_tiny_moe.py --out tiny-moe --ftw tiny-moe.ftw --minutes 6
    # seconds-long CPU smoke run:
    python tools/train_tiny_moe.py --out OUT_DIR --device cpu --steps 5 --preset smoke

`--minutes` plans a step count from the measured step time (printed; pass it back as `--steps`
to repeat the same schedule). With the same Python version, seed and flags, the corpus,
tokenizer and data order are identical; GPU kernels may still differ in the last bits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
EOT_ID, IM_END_ID = 0, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):",
           "    for i in range(")

# Model shape presets. "default": ~9.4M parameters, ~19 MB in bf16; experts are ~75% of it.
# A slot (one expert: gate, up, down at D=256, I=48, bf16) is 73,728 bytes = 18 pages.
PRESETS = {
    "default": dict(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, num_experts=32, num_experts_per_tok=4,
                    moe_intermediate_size=48, seq_len=512, batch_size=64),
    "smoke": dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, seq_len=64, batch_size=4),
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------- corpus
def list_sources(root: pathlib.Path, include_tests: bool, max_file_kb: int) -> list[pathlib.Path]:
    """All .py files under root in sorted (deterministic) order, minus tests and huge files."""
    skip = SKIP_DIRS - ({"test", "tests", "idle_test"} if include_tests else set())
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            path = pathlib.Path(dirpath) / name
            if name.endswith(".py") and path.stat().st_size <= max_file_kb * 1024:
                found.append(path)
    return found


def read_corpus(paths, seed: int, val_frac: float, max_mb: float):
    """Shuffle files with `seed`, put the first ~val_frac of the bytes in validation, and fill
    train up to max_mb. Returns (train_texts, val_texts)."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    texts = []
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    budget = int(max_mb * 1e6)
    total = min(budget, sum(len(t) for t in texts))
    train, val, val_chars, train_chars = [], [], 0, 0
    for text in texts:
        if val_chars < val_frac * total:
            val.append(text)
            val_chars += len(text)
        elif train_chars + len(text) <= budget - val_chars:
            train.append(text)
            train_chars += len(text)
    return train, val


# ---------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s} got id {tok.token_to_id(s)}"
    return tok


def save_tokenizer(tok, out: pathlib.Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
           "eos_token": SPECIAL_TOKENS[EOT_ID], "pad_token": SPECIAL_TOKENS[EOT_ID],
           "unk_token": None, "model_max_length": max_len, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Token ids of all texts, each followed by <|endoftext|>, as one int32 array."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=np.int32)


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


# ----------------------------------------------------------------------------- training
def train(args, model, train_ids, val_win, device) -> dict:
    amp = device == "cuda"
    batches = Batches(train_ids, args.seq_len, args.batch_size, args.seed, device)
    if device == "cuda":
        log(f"using experts implementation: {pick_experts_impl(model, batches, amp)}")
        batches = Batches(train_ids, args.seq_len, args.batch_size, args.seed, device)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    eval_win = val_win[:args.eval_seqs]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    t_start = time.perf_counter()
    v0, _ = evaluate(model, eval_win, args.batch_size, device, amp)
    eval_s = time.perf_counter() - t_start
    log(f"step 0: val loss {v0:.4f} (ln V = {math.log(model.config.vocab_size):.4f}), "
        f"eval {eval_s:.1f}s")
    best = {"val": float("inf"), "step": 0, "state": None}
    budget_s = args.minutes * 60
    total = args.steps or 10**9  # planned after the calibration steps when time-budgeted
    warmup = min(args.warmup, max(1, total // 10))
    calib, t_calib = 10, None
    tokens_per_step = args.batch_size * args.seq_len
    t_log, step = time.perf_counter(), 0
    model.train()
    while step < total:
        lr = lr_at(step, total, warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches.next()
        with autocast(device, amp):
            out = model(input_ids=x, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
        aux = balance_loss(out.router_logits, model.config.num_experts_per_tok)
        loss = ce + model.config.router_aux_loss_coef * aux
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if not args.steps and step == 2:
            sync()
            t_calib = time.perf_counter()
        if not args.steps and step == calib:
            sync()
            step_s = (time.perf_counter() - t_calib) / (calib - 2)
            left = budget_s - (time.perf_counter() - t_start)
            planned = int((left - eval_s) / (step_s + eval_s / args.eval_every))
            total = max(calib + 1, step + planned)
            warmup = min(args.warmup, max(1, total // 10))
            log(f"planned {total} steps ({step_s * 1e3:.0f} ms/step, eval {eval_s:.1f}s) for "
                f"{args.minutes} min; repeat this schedule with --steps {total}")
        if step % args.log_every == 0 or step == total:
            sync()
            now = time.perf_counter()
            n = args.log_every if step % args.log_every == 0 else step % args.log_every
            log(f"step {step}/{total if total < 10**9 else '?'}  loss {ce.item():.4f}  "
                f"balance {aux.item():.3f}  lr {lr:.2e}  "
                f"{n * tokens_per_step / (now - t_log):,.0f} tok/s  "
                f"{now - t_start:.0f}s")
            t_log = now
        if step % args.eval_every == 0 or step == total:
            v, _ = evaluate(model, eval_win, args.batch_size, device, amp)
            flag = ""
            if v < best["val"]:
                best.update(val=v, step=step,
                            state={k: t.detach().to("cpu", copy=True)
                                   for k, t in model.state_dict().items()})
                flag = " *best"
            log(f"step {step}: val loss {v:.4f}  ppl {math.exp(v):.2f}{flag}")
            t_log = time.perf_counter()
        if not args.steps and time.perf_counter() - t_start > budget_s + 30:
            log(f"stopping at step {step}: past the time budget")
            break
    train_s = time.perf_counter() - t_start
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    peak = (f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            if device == "cuda" else "")
    log(f"trained {step} steps, {step * tokens_per_step:,} tokens in {train_s:.0f}s "
        f"({step * tokens_per_step / train_s:,.0f} tok/s incl. evals{peak}); "
        f"keeping step {best['step']} (val {best['val']:.4f})")
    return {"steps": step, "best_step": best["step"], "train_s": train_s}


# ------------------------------------------------------------------------ save + check
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


def convert_ftw(out: pathlib.Path, ftw_path: pathlib.Path) -> None:
    try:
        from ftw.convert import convert
    except ImportError:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
        try:
            from ftw.convert import convert
        except ImportError as e:
            log(f"--ftw skipped: freetoken's converter is not importable ({e}); the HF checkpoint "
                f"is in {out}; convert it later with `freetoken convert {out} -o {ftw_path}`")
            return
    t0 = time.perf_counter()
    convert(str(out), str(ftw_path), dtype="auto", force=True, progress=False)
    log(f"wrote {ftw_path} ({ftw_path.stat().st_size / 1e6:.2f} MB) in "
        f"{time.perf_counter() - t0:.1f}s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=pathlib.Path, help="HF checkpoint directory")
    p.add_argument("--ftw", type=pathlib.Path, help="also convert to this .ftw file")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=6.0, help="training time budget")
    p.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for key in PRESETS["default"]:
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=int,
                       help=f"override the preset's {key}")
    p.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-corpus-mb", type=float, default=40.0)
    p.add_argument("--max-file-kb", type=int, default=256, help="skip larger source files")
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--include-tests", action="store_true", help="also use the stdlib's test dirs")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-seqs", type=int, default=64, help="validation windows per eval")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--sample-tokens", type=int, default=64)
    args = p.parse_args(argv)
    shape = dict(PRESETS[args.preset])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
        setattr(args, key, shape[key])
    args.shape = {k: v for k, v in shape.items() if k not in ("seq_len", "batch_size")}
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import tokenizers
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available; use --device cpu")
    dev_name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    log(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, tokenizers {tokenizers.__version__}, device {device} "
        f"({dev_name})")
    torch.set_float32_matmul_precision("high")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = list_sources(root, args.include_tests, args.max_file_kb)
    train_texts, val_texts = read_corpus(paths, args.seed, args.val_frac, args.max_corpus_mb)
    train_mb = sum(len(t) for t in train_texts) / 1e6
    val_mb = sum(len(t) for t in val_texts) / 1e6
    log(f"corpus: stdlib {root} ({len(paths)} files): train {len(train_texts)} files "
        f"{train_mb:.2f} MB, val {len(val_texts)} files {val_mb:.2f} MB")
    tok = train_tokenizer(train_texts, args.vocab_size)
    t_tok = time.perf_counter()
    train_ids, val_ids = encode_stream(tok, train_texts), encode_stream(tok, val_texts)
    chars_per_tok = val_mb * 1e6 / len(val_ids)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {t_tok - t0:.1f}s; tokens: train "
        f"{len(train_ids):,}, val {len(val_ids):,} ({chars_per_tok:.2f} chars/token), "
        f"encoded in {time.perf_counter() - t_tok:.1f}s")
    save_tokenizer(tok, args.out, args.max_positions)

    model = build_model(args.shape, args.max_positions, args.aux_coef, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log(f"model: qwen3_moe {args.shape}: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in "
        f"experts, ~{n_params * 2 / 1e6:.1f} MB bf16); batch {args.batch_size}x{args.seq_len}")

    val_win = val_windows(val_ids, args.seq_len)
    run = train(args, model, train_ids, val_win, device)
    amp = device == "cuda"
    val_loss, counts = evaluate(model, val_win, args.batch_size, device, amp, expert_counts=True)
    share = counts.float() / counts.sum(dim=1, keepdim=True) * args.shape["num_experts"]
    log(f"final val loss {val_loss:.4f}  ppl {math.exp(val_loss):.2f}  "
        f"~{val_loss / math.log(2) / chars_per_tok:.3f} bits/char  "
        f"({val_win.shape[0]} windows x {args.seq_len})")
    log("expert load per layer (share x num_experts; 1.0 = uniform): min "
        + " ".join(f"{v:.2f}" for v in share.min(dim=1).values.tolist()) + " | max "
        + " ".join(f"{v:.2f}" for v in share.max(dim=1).values.tolist()))

    model.to(torch.bfloat16).save_pretrained(str(args.out))
    meta = {"seed": args.seed, "python": platform.python_version(), "steps": run["steps"],
            "best_step": run["best_step"], "val_loss": val_loss, "argv": sys.argv[1:]}
    (args.out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    del model
    # bf16 matmuls are slow on many CPUs: there the saved bf16 weights are computed in fp32.
    run_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reloaded = AutoModelForCausalLM.from_pretrained(str(args.out), dtype=run_dtype).to(device)
    reloaded.eval()
    hf_tok = AutoTokenizer.from_pretrained(str(args.out))
    assert hf_tok.eos_token_id == EOT_ID, hf_tok.eos_token_id
    bf16_loss, _ = evaluate(reloaded, val_win[:args.eval_seqs], args.batch_size, device, False)
    log(f"saved {args.out} (bf16); reloaded with AutoModelForCausalLM: val loss {bf16_loss:.4f} "
        f"on {min(len(val_win), args.eval_seqs)} windows (step-{run['best_step']} weights)")
    for prompt in PROMPTS:
        log(f"--- sample (greedy) for {prompt!r}:\n{greedy(reloaded, tok, prompt, args.sample_tokens, device)}")
    log("---")
    if args.ftw:
        convert_ftw(args.out, args.ftw)
    log(f"done in {time.perf_counter() - t0:.0f}s total")
    return {"val_loss": val_loss, "bf16_val_loss": bf16_loss, **run}


if __name__ == "__main__":
    main()
