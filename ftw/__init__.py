"""FTW: the freetoken weight format (see SPEC.md). numpy only; no torch import.

    f = ftw.open("model.ftw")          # validated header; f.config, f.tensors, f.banks
    banks = f.load_banks()             # {layer: HostBank}, O_DIRECT into page-aligned buffers
"""
from .constants import VERSION
from .errors import FTWError
from .reader import BankInfo, FTWFile, HostBank, ProjInfo, TensorInfo, open

__all__ = ["open", "FTWFile", "TensorInfo", "BankInfo", "ProjInfo", "HostBank", "FTWError", "VERSION"]
