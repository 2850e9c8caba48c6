"""Large model shapes with random weights built in host memory, no FTW file on disk: a
SyntheticFile has the interface of an opened FTW file (ftw.open), so Engine(SyntheticFile(...))
runs the real engine (scheduler, prefix cache, recurrent-state anchors, the HTTP server) on a
shape whose .ftw would not fit the disk (Qwen3.6-35B-A3B's ~64 GB of bf16 experts fit in RAM once).

The config is what `freetoken convert` writes for the published config.json of the shape
(ftw.hf_config.normalise); tensor names and shapes are the family model's own (canonical_names on
the meta device); dense tensors are drawn on demand, bf16, scaled as tools/make_tiny_model.py
does (a forward stays finite and routing is not degenerate); expert banks are one random 64 MiB
block tiled over each slot from a per-slot offset, written by several threads straight into the
banks' final buffers (built once per SyntheticFile, shared by its reopen() copies). The
tokenizer and chat template are the tiny test models' (make_tiny_model.py: <|im_end|> closes a
turn), padded with plain tokens up to the shape's vocab so that every id decodes to text.

    file = SyntheticFile("qwen3.6-35b-a3b")                       # the full shape
    file = SyntheticFile("gpt-oss-20b", layers=2, experts=4, tiny=True)   # a CPU test size
    file = SyntheticFile("qwen3-30b-a3b", quant="q4_0")          # as convert --quant q4_0 writes it

quant (issue 35): the banks in that type's slot layout, their first slots quantized from these
bf16 experts by ftw/quant.py and the rest noisy copies of them (bench_quant_banks.py).
"""
import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np

import bench_quant_banks as qb
from ftw import constants as C
from ftw.hf_config import normalise
from ftw.layout import BankEntry
from ftw.loading import HostBank, alloc_bank
from ftw.names import FAMILIES
from ftw.reader import BankInfo, ProjInfo, TensorInfo

GB = 1e9
BLOCK_WORDS = 32 << 20  # bf16 values in the random block tiled over the banks (64 MiB)
DRAW_CHUNK = 1 << 22  # random values one thread draws with one generator
PAGE_WORDS = 2048  # bf16 values per 4 KiB page: slot offsets differ modulo it (module docstring)
TOKENIZER_VOCAB = 384  # the tiny models' trained tokenizer (make_tiny_model.DEFAULTS)
BOS_ID, EOS_ID = 0, 2  # <|endoftext|>, <|im_end|> in that tokenizer

# The published config.json of each shape (transformers 5 nested style); layer_types follow from
# the layer count (hybrid: every 4th layer full attention; gpt_oss: sliding, full, ...).
SHAPES = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=False),
    "qwen3.6-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=256,
        num_experts_per_tok=8, linear_conv_kernel_dim=4, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        rms_norm_eps=1e-6, max_position_embeddings=262144, attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25}),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=True,
        tie_word_embeddings=False, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}),
}
# --tiny: every width at test size (a few MB), for smoke runs on a small CPU machine
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 48, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_EXPERT_KEYS = ("num_experts", "num_local_experts")


def shape_config(name: str, layers: Optional[int] = None, experts: Optional[int] = None,
                 tiny: bool = False, **fields) -> dict:
    """The config.json of shape `name`, shrunk: `layers` layers, `experts` experts (top-k capped
    to them), tiny widths (TINY), then `fields` (config.json keys) over it."""
    if name not in SHAPES:
        raise SystemExit(f"error: unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    cfg = json.loads(json.dumps(SHAPES[name]))
    if tiny:
        cfg.update({k: v for k, v in TINY.items() if k in cfg})
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if experts is not None:
        key = next(k for k in _EXPERT_KEYS if k in cfg)
        cfg[key] = experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
    unknown = set(fields) - set(cfg)
    if unknown:
        raise SystemExit(f"error: --set {', '.join(sorted(unknown))}: not a field of the {name} "
                         f"config ({', '.join(sorted(cfg))})")
    cfg.update(fields)
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] == "qwen3_5_moe_text":
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(n)]
    elif cfg["model_type"] == "gpt_oss":
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n)]
    cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="bfloat16")
    return cfg


def model_config(hf: dict) -> dict:
    """What `freetoken convert` writes as model.config for config.json `hf` in bf16."""
    family = next(f for f in FAMILIES.values() if hf["model_type"] in f.model_types)
    return {**normalise(hf, family), "source_dtype": "bf16"}


def tokenizer_json(vocab_size: int) -> str:
    """The tiny models' tokenizer (make_tiny_model.py) with plain tokens added to its BPE
    vocab up to vocab_size ids (unreachable by its merges; each decodes to ` tN`)."""
    import make_tiny_model
    if vocab_size < TOKENIZER_VOCAB:
        raise SystemExit(f"error: vocab_size {vocab_size} is below the tokenizer's "
                         f"{TOKENIZER_VOCAB} ids; use --set vocab_size={TOKENIZER_VOCAB} or more")
    tok = json.loads(make_tiny_model.tokenizer_json(TOKENIZER_VOCAB))
    vocab = tok["model"]["vocab"]
    i = 0
    for token_id in range(TOKENIZER_VOCAB, vocab_size):
        while f"\u0120t{i}" in vocab:  # (\u0120: the byte-level space)
            i += 1
        vocab[f"\u0120t{i}"] = token_id
        i += 1
    return json.dumps(tok, ensure_ascii=False)


class SyntheticFile:
    """An opened-FTW-file stand-in (path, config, tokenizer_json, chat_template, tensors,
    tensor_bytes, banks, load_banks, close) for shape `name` shrunk as shape_config says.
    load_banks builds the banks at its first call (fill_threads threads, all CPUs by default);
    reopen() gives another file over the same banks (several engines of one run); close() is
    a no-op on them: they live while a file or an engine holds them."""

    def __init__(self, name: str, seed: int = 0, layers: Optional[int] = None,
                 experts: Optional[int] = None, tiny: bool = False,
                 fill_threads: Optional[int] = None, quant: str = "bf16", **fields):
        from freetoken.config import ModelConfig
        self.name, self.seed, self.fill_threads = name, seed, fill_threads
        self.quant = qb.check_quant(quant)
        self.hf_config = shape_config(name, layers, experts, tiny, **fields)
        self.config = model_config(self.hf_config)
        self.path = f"synthetic:{name}"
        self.tokenizer_json = tokenizer_json(self.config["vocab_size"])
        import make_tiny_model
        self.chat_template = make_tiny_model.CHAT_TEMPLATE
        mc = ModelConfig.from_dict(self.config)
        self._dense = _dense_tensors(mc)  # {name: (shape, std, mean)}
        self.tensors = {n: TensorInfo(n, "bf16", shape, 0, 2 * int(np.prod(shape)), 0)
                        for n, (shape, _, _) in self._dense.items()}
        self.banks = _bank_infos(mc)  # bf16; a quant type's below (the bf16 ones give its values)
        self._bf16_banks = self.banks
        self.banks = {layer: qb.quant_info(b, quant) for layer, b in self.banks.items()}
        self._shared = {"host": None, "pinned_by": None, "build_s": 0.0, "exact": (0, 0.0)}
        self._token = object()  # who registered the banks (_shared["pinned_by"])

    def reopen(self) -> "SyntheticFile":
        """Another file of the same model whose load_banks returns these banks (built once)."""
        other = object.__new__(SyntheticFile)
        other.__dict__.update(self.__dict__, _token=object())
        return other

    @property
    def bank_bytes(self) -> int:
        return sum(b.nbytes for b in self.banks.values())

    @property
    def exact(self) -> tuple:
        """(slots quantized by ftw/quant.py, their seconds) of quantized banks once built."""
        return self._shared["exact"]

    @property
    def build_s(self) -> float:
        """Seconds the banks took to build (0 before load_banks)."""
        return self._shared["build_s"]

    def describe(self) -> str:
        """One line: the shape and, once built, how fast its banks were."""
        mc = self.config
        built = (f", built in {self.build_s:.1f} s ({self.bank_bytes / GB / self.build_s:.1f} GB/s)"
                 if self.build_s else "")
        kind = "bf16" if self.quant == "bf16" else f"bf16 experts as {self.quant}"
        return (f"{self.name} ({mc['family']}) random {kind}, no FTW file: {mc['num_layers']} layers, "
                f"{mc['num_experts']} experts top-{mc['num_experts_per_tok']}, hidden "
                f"{mc['hidden_size']}, expert width {mc['moe_intermediate_size']}, vocab "
                f"{mc['vocab_size']}; host banks {self.bank_bytes / GB:.2f} GB{built}")

    def tensor_bytes(self, name: str) -> np.ndarray:
        """uint8 bytes of a freshly drawn bf16 tensor (the same for a given seed and name),
        drawn in chunks by several threads (a 1 GB embedding: a single generator takes seconds)."""
        shape, std, mean = self._dense[name]
        flat = _normal_bf16(int(np.prod(shape)), self.seed * 1000003 + zlib.crc32(name.encode()),
                            std, mean)
        return flat.view(np.uint8)

    def load_banks(self, threads: Optional[int] = None, direct: bool = True,
                   register: Optional[Callable] = None) -> dict:
        """{layer: HostBank} in layer order, as FTWFile.load_banks (threads and direct are for
        its reads: unused here). register(data) runs once per bank in layer order, unless
        another open file of these banks registered them and is not closed yet."""
        shared = self._shared
        register = register if shared["pinned_by"] is None else None
        if register is not None:
            shared["pinned_by"] = self._token
        if shared["host"] is None:  # each bank registered once filled, while later ones fill
            t0 = time.perf_counter()
            if self.quant == "bf16":
                shared["host"] = fill_banks(self.banks, self.seed, self.fill_threads,
                                            _expert_std(self.config), register)
            else:
                shared["host"], shared["exact"] = fill_quantized_banks(
                    self._bf16_banks, self.banks, self.seed, self.fill_threads,
                    _expert_std(self.config), register)
            shared["build_s"] = time.perf_counter() - t0
        elif register is not None:
            for bank in shared["host"].values():
                register(bank.data)
        return dict(shared["host"])

    def close(self) -> None:
        """The banks stay (other files or engines may hold them); the engine that closes this
        file has unregistered them (Engine.close), so the next file may register them again."""
        if self._shared["pinned_by"] is self._token:
            self._shared["pinned_by"] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _dense_tensors(mc) -> dict:
    """{canonical name: (shape, std, mean)} of the family model's non-expert tensors. As
    make_tiny_model.py: embeddings std 1, routers 2/sqrt(D), other matrices 0.64/sqrt(fan-in);
    norms 1 (0 where the model adds 1), Gated DeltaNet decays A in [e^-5, 1], small biases."""
    import torch
    from freetoken.models import model_class
    from freetoken.models.gated_attention import OffsetRMSNorm
    with torch.device("meta"):
        model = model_class(mc.family)(mc, None)
    params = dict(model.named_parameters())
    out = {}
    for name, path in model.canonical_names().items():
        shape = tuple(params[path].shape)
        owner = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        if name == "token_embd.weight":
            std, mean = 1.0, 0.0
        elif name.endswith("ffn_gate_inp.weight"):
            std, mean = 2.0 / shape[-1] ** 0.5, 0.0
        elif name.endswith("ssm_a_log"):  # log A, A log-uniform-ish in [e^-5, 1]
            std, mean = 1.2, -2.5
        elif name.endswith("ssm_conv1d.weight"):
            std, mean = 0.5, 0.0
        elif len(shape) >= 2:
            std, mean = 0.64 / shape[-1] ** 0.5, 0.0
        elif "norm" in name:
            std, mean = 0.05, 0.0 if isinstance(owner, OffsetRMSNorm) else 1.0
        elif name.endswith("ssm_dt.bias"):
            std, mean = 0.1, 1.0
        else:  # biases, attention sinks
            std, mean = 0.05, 0.0
        out[name] = (shape, std, mean)
    return out


def _expert_std(config: dict) -> float:
    return 0.64 / max(config["hidden_size"], config["moe_intermediate_size"]) ** 0.5


def _bank_infos(mc) -> dict:
    """{layer: BankInfo} in the converter's slot layout (ftw.layout.BankEntry), bf16; offsets
    are 0 (no file behind them)."""
    out = {}
    for layer in mc.moe_layers:
        entry = BankEntry(layer, "bf16", mc.num_experts, mc.moe_intermediate_size,
                          mc.hidden_size, read_expert=None, has_bias=mc.expert_bias)
        projs = tuple(ProjInfo(p["name"], tuple(p["shape"]), p["offset"], p["nbytes"])
                      for p in entry.projections)
        out[layer] = BankInfo(layer, C.bank_name(layer), 0, mc.num_experts, entry.slot_stride,
                              "bf16", projs, (0,) * mc.num_experts)
    return out


def _normal_bf16(n: int, seed: int, std: float, mean: float = 0.0) -> np.ndarray:
    """n normal bf16 values as uint16 bits, drawn in chunks of DRAW_CHUNK by several threads
    (chunk i from its own generator, seeded seed + i: the same values for the same seed)."""
    import torch
    flat = torch.empty(n, dtype=torch.bfloat16)

    def draw(start):
        gen = torch.Generator().manual_seed(seed + start)
        flat[start:start + DRAW_CHUNK].normal_(mean, std, generator=gen)

    starts = range(0, n, DRAW_CHUNK)
    with ThreadPoolExecutor(max(1, min(len(starts), os.cpu_count() or 1))) as pool:
        list(pool.map(draw, starts))
    return flat.view(torch.int16).numpy().view(np.uint16)


def random_block(seed: int, std: float, num_words: int = BLOCK_WORDS) -> np.ndarray:
    """num_words random normal bf16 values of std `std`, as uint16 bits."""
    return _normal_bf16(num_words, seed, std)


def fill_banks(infos: dict, seed: int, threads: Optional[int], std: float,
               register: Optional[Callable] = None) -> dict:
    """{layer: HostBank}: each bank its own exact-size page-aligned buffer (ftw.loading's
    alloc_bank), every slot a copy of the random block from its own offset (wrapping around);
    slot i of the model starts at word (i * (PAGE_WORDS + 1)) mod the block's size, so 2048
    slots in a row start at distinct offsets within a page and no page repeats among them (VMs
    merge identical pages). Several threads copy (numpy releases the GIL); one copy of the
    banks. register(data) runs per bank in layer order once it is filled, on the calling
    thread. Rates: docs/MEASUREMENTS.md#synthetic-banks."""
    total = sum(b.nbytes for b in infos.values()) // 2
    block = random_block(seed, std, min(BLOCK_WORDS, total))  # (a small test model: less)
    threads = threads or os.cpu_count() or 1
    infos = sorted(infos.values(), key=lambda b: b.layer)
    out, first_slot = {}, 0
    with ThreadPoolExecutor(threads, thread_name_prefix="synthetic-fill") as pool:
        pending = []
        for info in infos:
            data = np.frombuffer(alloc_bank(info.nbytes), dtype=np.uint8)
            words = data.view(np.uint16).reshape(info.num_experts, -1)
            per_task = max(1, (32 << 20) // info.slot_stride)  # ~32 MB per task
            futures = [pool.submit(_fill_slots, block, words[e:e + per_task], first_slot + e)
                       for e in range(0, info.num_experts, per_task)]
            pending.append((info, data, futures))
            first_slot += info.num_experts
        for info, data, futures in pending:
            for f in futures:
                f.result()
            if register is not None:
                register(data)
            out[info.layer] = HostBank(info, data)
    return out


def fill_quantized_banks(bf16: dict, infos: dict, seed: int, threads: Optional[int], std: float,
                         register: Optional[Callable] = None) -> tuple:
    """({layer: HostBank}, (exact slots, their seconds)): fill_banks' model in the quant type of
    `infos` (bench_quant_banks.quant_info of the bf16 infos `bf16`): its first slots quantized
    from the bf16 slots fill_banks would write, the others noisy copies of them."""
    first = min(bf16.values(), key=lambda b: b.layer)
    total = sum(b.nbytes for b in bf16.values()) // 2
    layers = sorted(infos)
    datas = [np.frombuffer(alloc_bank(infos[layer].nbytes), dtype=np.uint8) for layer in layers]

    def bf16_slots(n):
        rows = np.empty((n, first.slot_stride // 2), np.uint16)
        _fill_slots(random_block(seed, std, min(BLOCK_WORDS, total)), rows, 0)
        return rows

    def done(i):
        if register is not None:
            register(datas[i])

    slots = [d.reshape(infos[layer].num_experts, -1) for d, layer in zip(datas, layers)]
    exact = qb.fill_quantized(slots, first, infos[layers[0]], bf16_slots, seed, threads, done)
    return {layer: HostBank(infos[layer], d) for layer, d in zip(layers, datas)}, exact


def _fill_slots(block: np.ndarray, rows: np.ndarray, first_slot: int) -> None:
    S, B = rows.shape[1], block.size
    for i, row in enumerate(rows):
        start, done = ((first_slot + i) * (PAGE_WORDS + 1)) % B, 0
        while done < S:
            n = min(S - done, B - start)
            np.copyto(row[done:done + n], block[start:start + n])
            done, start = done + n, 0


# ---- command-line options of the benches ---------------------------------------------------------

def add_shape_args(ap, shrink: bool = True) -> None:
    """--shape NAME (instead of a model path), --tiny, --set KEY=VALUE; with shrink also
    --layers, --experts and --fill-threads (a bench with its own, bench_moe_setup's, leaves
    them out)."""
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None,
                    help="a synthetic model of this shape (random weights in host memory, "
                         "tools/bench_shapes.py) instead of an FTW file")
    ap.add_argument("--tiny", action="store_true", help="--shape: every width at test size")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="--shape: a config.json field (JSON value), e.g. vocab_size=4096")
    if shrink:
        ap.add_argument("--layers", type=int, default=None, help="--shape: this many layers")
        ap.add_argument("--experts", type=int, default=None, help="--shape: this many experts")
        ap.add_argument("--fill-threads", type=int, default=None,
                        help="--shape: threads filling the banks [all CPUs]")


def parse_sets(items) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def file_from_args(a) -> SyntheticFile:
    """The SyntheticFile of parsed add_shape_args options (a.shape set)."""
    return SyntheticFile(a.shape, seed=getattr(a, "seed", 0), layers=getattr(a, "layers", None),
                         experts=getattr(a, "experts", None), tiny=a.tiny,
                         fill_threads=a.fill_threads, quant=getattr(a, "quant", "bf16"),
                         **parse_sets(a.set))


class ModelSource:
    """What Engine() takes, once per engine a bench opens: the FTW path (a.model, or the bundled
    model), or with --shape a SyntheticFile (every engine of the run shares its banks). `label`
    names it in the benches' header lines."""

    def __init__(self, a):
        if a.shape and a.model:
            raise SystemExit("error: give a model path or --shape, not both")
        self.file = file_from_args(a) if a.shape else None
        if self.file is None:
            from freetoken.api import default_model_path
            self.path = a.model or default_model_path()
            self.label = self.path
        else:
            self.label = self.file.describe()

    def __call__(self):
        if self.file is None:
            return self.path
        return self.file.reopen()

    def built(self) -> str:
        """The label again, with the banks' build time once an engine built them."""
        return self.file.describe() if self.file is not None else self.label


if __name__ == "__main__":  # build a shape's banks and say how fast (no engine)
    import argparse
    p = argparse.ArgumentParser(description="build a synthetic model's host banks, print the rate")
    add_shape_args(p)
    args = p.parse_args()
    if args.shape is None:
        sys.exit("error: give --shape NAME")
    f = file_from_args(args)
    f.load_banks()
    print(f.describe())
