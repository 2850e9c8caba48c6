"""Named errors of the FTW format and converter; each message says what is wrong and what to do."""


class FTWError(Exception):
    """Base of every ftw error meant for the user."""


# --- reading a .ftw file (reader.py) -------------------------------------------------------
class FTWFormatError(FTWError):
    """The file is not a valid FTW file; the message names the check that failed."""


class BadMagicError(FTWFormatError):
    """The first bytes are not the FTW magic."""


class UnsupportedVersionError(FTWFormatError):
    """The file's format version is not one this reader supports."""


class TruncatedFileError(FTWFormatError):
    """The file (or one of its parts) is shorter than its header says."""


class HeaderError(FTWFormatError):
    """The header is out of bounds, fails its checksum, or is not the JSON SPEC.md §3 describes."""


class HeaderChecksumError(HeaderError):
    """The header bytes do not match the header crc32 (a flipped or edited byte)."""


class PartNameError(HeaderError):
    """A part file name in the header is not a bare file name (it would be opened outside the
    main file's folder, or cannot name a file at all)."""


class OutOfFileError(FTWFormatError):
    """A tensor or bank byte range ends past the end of its file's data section."""


class OverlapError(FTWFormatError):
    """Two tensors/banks (or two projections in a slot) share bytes."""


class AlignmentError(FTWFormatError):
    """An offset or slot stride is not a multiple of the required alignment."""


class SizeMismatchError(FTWFormatError):
    """A byte size disagrees with dtype x shape."""


class PartFileError(FTWFormatError):
    """A part file of a split FTW model is missing or does not belong to this header."""


class ChecksumError(FTWFormatError):
    """A tensor or expert slot does not match its crc32 (found by verify)."""


class UnknownQuantError(FTWFormatError):
    """A quant type this freetoken does not know (SPEC.md §9.1); the message names it."""


class QuantShapeError(FTWFormatError):
    """A shape that a quant type cannot hold: not 2-D, or cols not a whole number of blocks (§9.3)."""


# --- converting a Hugging Face checkpoint (convert.py) -------------------------------------
class ConvertError(FTWError):
    """The source checkpoint cannot be converted as asked."""


class SourceNotFoundError(ConvertError):
    """The source folder, its config.json or its weights are missing."""


class UnknownArchitectureError(ConvertError):
    """config.json names a model type no family table covers."""


class NotMoEModelError(ConvertError):
    """The model has no Mixture-of-Experts layers (a dense model)."""


class UnsupportedConfigError(ConvertError):
    """A config option the engine does not implement (e.g. per-layer sliding windows)."""


class MissingShardError(ConvertError):
    """model.safetensors.index.json names a shard file that is not there."""


class BadSafetensorsError(ConvertError):
    """A safetensors file is truncated or its header is malformed."""


class UnsupportedDtypeError(ConvertError):
    """Tensors in a dtype the converter cannot handle (int8, fp8, ...)."""


class UnknownTensorError(ConvertError):
    """Source tensors that no name table entry maps and that are not known to be unused."""


class MissingTensorError(ConvertError):
    """A tensor the model needs is missing from the source, or has the wrong shape."""


class OutputExistsError(ConvertError):
    """The output file exists and --force was not given."""


class OutputNotWritableError(ConvertError):
    """The output folder does not exist or cannot be written."""


class DiskFullError(ConvertError):
    """The disk filled up while writing (ENOSPC / EDQUOT)."""


class SplitSizeError(ConvertError):
    """--split-size is malformed or smaller than the largest tensor or bank."""
