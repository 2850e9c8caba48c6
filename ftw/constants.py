"""FTW constants; mirrors SPEC.md §2-§5 (tests/test_ftw_format.py keeps the two in step)."""

MAGIC = b"FTW\x00"
PART_MAGIC = b"FTWP"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
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
KEY_CONVERTER_NAME = "converter.name"
KEY_CONVERTER_VERSION = "converter.version"


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def bank_name(layer: int) -> str:
    return f"blk.{layer}.ffn_exps"
