"""FTW constants; mirrors SPEC.md §2-§5 and §9 (tests/test_ftw_format.py and tests/test_ftw_quant.py
keep the two in step)."""
from typing import NamedTuple

MAGIC = b"FTW\x00"
PART_MAGIC = b"FTWP"
VERSION = 2  # the newest; a writer writes the lowest version that holds its file (SPEC.md §9.5)
SUPPORTED_VERSIONS = (1, 2)
ALIGNMENT = 4096
PROJ_ALIGNMENT = 64
PREFIX_SIZE = 24
PART_PREFIX_SIZE = 4096
MAX_HEADER_LEN = 1 << 30

# dtype code -> bytes per element (SPEC.md §2)
DTYPE_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4}
# numpy dtype used to hand out / compute each code; bf16 travels as its raw uint16 bits
NUMPY_DTYPES = {"bf16": "<u2", "fp16": "<f2", "fp32": "<f4"}

BANK_PROJECTIONS = ("gate", "up", "down")  # slot order (SPEC.md §5.2)
# the expert biases of a biased bank (gpt_oss), after down in this order: [I], [I], [D]
BIAS_PROJECTIONS = ("gate_bias", "up_bias", "down_bias")

# quant types (SPEC.md §9.1, §9.2): "none" means plain `dtype` elements
QUANT_NONE = "none"
QUANT_REGION_ALIGNMENT = 64  # the scales (and nvfp4's tensor scale) start at this boundary


class QuantType(NamedTuple):
    """One row of SPEC.md §9.1/§9.2."""
    name: str
    block_rows: int
    block_cols: int
    bits: int                # per element
    scale_bytes: int         # per block scale
    tensor_scale_bytes: int  # 0, or 4 (nvfp4's fp32 g)
    partial: bool            # edge blocks may be partial (fp8_e4m3); else cols % block_cols == 0


QUANT_TYPES = {q.name: q for q in (
    QuantType("q8_0", 1, 32, 8, 2, 0, False),
    QuantType("q4_0", 1, 32, 4, 2, 0, False),
    QuantType("mxfp4", 1, 32, 4, 1, 0, False),
    QuantType("nvfp4", 1, 16, 4, 1, 4, False),
    QuantType("fp8_e4m3", 128, 128, 8, 4, 0, True),
)}

# metadata keys (SPEC.md §4)
KEY_CONFIG = "model.config"
KEY_TOKENIZER_JSON = "tokenizer.json"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
KEY_TOKENIZER_CONFIG = "tokenizer.config"
KEY_SOURCE_FORMAT = "source.format"
KEY_SOURCE_ARCH = "source.architecture"
KEY_SOURCE_FINGERPRINT = "source.fingerprint"
KEY_IGNORED = "source.ignored_tensors"
KEY_IGNORED_REASONS = "source.ignored_reasons"
KEY_DEQUANTIZED = "source.dequantized_tensors"
KEY_CONVERTER_NAME = "converter.name"
KEY_CONVERTER_VERSION = "converter.version"


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def bank_name(layer: int) -> str:
    return f"blk.{layer}.ffn_exps"
