"""Quantized synthetic expert banks for the benches (issue 35): the slot layout and bytes
`freetoken convert --quant TYPE` writes for the benches' random bf16 experts, built in memory
(bench_host_banks.HostBanks, bench_shapes.SyntheticFile), and the benches' --quant option. The
banks themselves are the library's (freetoken/quant_banks.py, also what `freetoken profile
--quant TYPE` measures on), re-exported here. Measures nothing itself.
"""
from freetoken.kernel_args import KERNEL_QUANTS
from freetoken.quant_banks import (ELEMENT_MASK, NOISE_BYTES, TEMPLATE_SLOTS,  # noqa: F401
                                   element_regions, fill_quantized, quant_info, quantize_slot,
                                   scale_regions)

QUANTS = ("bf16", *KERNEL_QUANTS)  # bf16: the unquantized baseline row


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise SystemExit(f"error: --quant {quant!r}: choose from {', '.join(QUANTS)}")
    return quant


def parse_quants(text: str) -> list:
    """--quant TYPE[,TYPE...] -> the types in order, each once."""
    out = []
    for q in (t.strip() for t in text.split(",") if t.strip()):
        if check_quant(q) not in out:
            out.append(q)
    return out or ["bf16"]


def add_quant_arg(ap) -> None:
    """--quant TYPE[,TYPE...] (a.quants after parse_quants; the benches set a.quant per run)."""
    ap.add_argument("--quant", default="bf16", metavar="TYPE[,TYPE...]",
                    help=f"expert bank types, a run each, in this order (bf16: the baseline row; "
                         f"of {', '.join(QUANTS)}): bf16 experts quantized as `convert --quant "
                         f"TYPE` writes them (tools/bench_quant_banks.py) [bf16]")
