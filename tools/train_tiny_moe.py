"""Train the small qwen3_moe causal LM that freetoken bundles as its default model.

Tooling only (imports transformers, never a runtime dependency). Offline: the corpus is the
Python standard library's own .py sources found through `sysconfig`, split into train and
validation by file. Steps: corpus -> byte-level BPE (`tokenizers`) -> packed token stream ->
Qwen3MoeForCausalLM trained with AdamW + cosine + router load-balancing loss (bf16 autocast on
CUDA) -> best-validation weights saved as an HF checkpoint (bf16) -> greedy samples from the
reloaded checkpoint -> optional FTW conversion. Copying the .ftw into the package is a separate step.
The --out folder also keeps the held-out split: val_ids.npy (the validation token stream the
evaluations score) and val_files.txt (its files, relative to the stdlib), which
`tools/perplexity.py MODEL.ftw --split OUT_DIR` scores on any machine and Python version.

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
import pathlib
import platform
import signal
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

# tools/ siblings (the script's own folder is on sys.path; tests put tools/ there too)
from tiny_corpus import (EOT_ID, VAL_FILES, VAL_IDS, encode_stream, list_sources, save_split,
                         save_tokenizer, split_corpus, train_tokenizer)
from tiny_moe_model import (Batches, autocast, balance_loss, build_model, evaluate, greedy, log,
                            lr_at, make_optimizer, pick_experts_impl, val_windows)

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
    try:
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
    except KeyboardInterrupt:  # SIGINT (Ctrl-C, `timeout -s INT`): keep what is trained so far
        log(f"interrupted at step {step}: keeping the best weights so far")
    train_s = time.perf_counter() - t_start
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    peak = (f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            if device == "cuda" else "")
    log(f"trained {step} steps, {step * tokens_per_step:,} tokens in {train_s:.0f}s "
        f"({step * tokens_per_step / train_s:,.0f} tok/s incl. evals{peak}); "
        f"keeping step {best['step']} (val {best['val']:.4f})")
    return {"steps": step, "best_step": best["step"], "best_val": best["val"], "train_s": train_s}


class _SigintDeferred:
    """Within: SIGINT only notes itself (`.hit`), so the checkpoint and .ftw writes finish whole
    (a `timeout -s INT` landing just after training); no-op off the main thread."""

    def __enter__(self):
        self.hit, self.old = False, None
        try:
            self.old = signal.signal(signal.SIGINT, self._note)
        except ValueError:  # not the main thread
            pass
        return self

    def _note(self, signum, frame):
        self.hit = True
        log("SIGINT: finishing the checkpoint first")

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        return False


# ------------------------------------------------------------------------------- export
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
    train_files, val_files = split_corpus(paths, args.seed, args.val_frac, args.max_corpus_mb)
    train_texts, val_texts = [t for _, t in train_files], [t for _, t in val_files]
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
    save_split(args.out, root, [p for p, _ in val_files], val_ids)
    log(f"held-out split: {args.out / VAL_IDS} ({len(val_ids):,} tokens), {args.out / VAL_FILES} "
        f"({len(val_files)} files); score it with tools/perplexity.py MODEL.ftw --split {args.out}")

    model = build_model(args.shape, args.max_positions, args.aux_coef, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log(f"model: qwen3_moe {args.shape}: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in "
        f"experts, ~{n_params * 2 / 1e6:.1f} MB bf16); batch {args.batch_size}x{args.seq_len}")

    val_win = val_windows(val_ids, args.seq_len)
    run = train(args, model, train_ids, val_win, device)
    amp = device == "cuda"
    try:
        val_loss, counts = evaluate(model, val_win, args.batch_size, device, amp, expert_counts=True)
        share = counts.float() / counts.sum(dim=1, keepdim=True) * args.shape["num_experts"]
        log(f"final val loss {val_loss:.4f}  ppl {math.exp(val_loss):.2f}  "
            f"~{val_loss / math.log(2) / chars_per_tok:.3f} bits/char  "
            f"({val_win.shape[0]} windows x {args.seq_len})")
        log("expert load per layer (share x num_experts; 1.0 = uniform): min "
            + " ".join(f"{v:.2f}" for v in share.min(dim=1).values.tolist()) + " | max "
            + " ".join(f"{v:.2f}" for v in share.max(dim=1).values.tolist()))
    except KeyboardInterrupt:  # a late SIGINT: save what training kept
        val_loss = run["best_val"]
        log(f"final evaluation interrupted: saving the step-{run['best_step']} weights "
            f"(val {val_loss:.4f} on {min(len(val_win), args.eval_seqs)} windows)")

    with _SigintDeferred() as late:
        model.to(torch.bfloat16).save_pretrained(str(args.out))
        meta = {"seed": args.seed, "python": platform.python_version(), "steps": run["steps"],
                "best_step": run["best_step"], "val_loss": val_loss, "argv": sys.argv[1:],
                "split": {"stdlib": str(root), "include_tests": args.include_tests,
                          "val_frac": args.val_frac, "max_corpus_mb": args.max_corpus_mb,
                          "max_file_kb": args.max_file_kb, "val_files": len(val_files),
                          "val_tokens": len(val_ids), "seq_len": args.seq_len,
                          "val_windows": int(val_win.shape[0])}}
        (args.out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if args.ftw:  # before the checks below, which a late SIGINT skips
            convert_ftw(args.out, args.ftw)
    del model
    if late.hit:
        log(f"interrupted: {args.out} is saved; skipping the reload check and samples")
        return {"val_loss": val_loss, "bf16_val_loss": None, **run}
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
    log(f"done in {time.perf_counter() - t0:.0f}s total")
    return {"val_loss": val_loss, "bf16_val_loss": bf16_loss, **run}


if __name__ == "__main__":
    main()
