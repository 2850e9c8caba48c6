"""Shared pytest set-up: makes tools/ importable, skips `gpu` tests without CUDA; without CUDA
it turns on Triton's interpreter (_interpret_without_cuda) so the Triton kernels' tests run on
cpu tensors, and mends the interpreter's scalar-to-index conversion
(_mend_triton_interpreter); torch's thread count is restored after each test; the oracle
table's option, fixture and hooks (oracle_table.py: --oracle-table=FILE); grid cells past the
default run marked slow (SUITE_CELLS, _mark_cells_past_the_suite); transformers' hybrid models
on their torch ops where fla is installed (_transformers_hybrids_on_torch_ops); helpers the tests import from here (refuse_o_direct_io)."""
import errno
import os
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from oracle_table import (oracle, pytest_addoption, pytest_configure,  # noqa: E402, F401
                          pytest_runtest_makereport, pytest_sessionfinish)


def _mend_triton_interpreter() -> None:
    """Triton 3.5's interpreter holds a kernel's runtime scalars as one-element arrays and
    converts them to an index with int(array), which numpy >= 2.4 refuses for arrays that are
    not 0-d: every loop to a runtime bound (`range(0, C, BC)`) then fails. The conversion is
    patched in at each launch; this wraps that patch so the index comes from the one element.
    A test-side shim only: compiled kernels are untouched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "mended", False):
        return

    def mended(tensor, *rest):  # (Triton 3.9 passes a patch scope too)
        patch(tensor, *rest)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    mended.mended = True
    interpreter._patch_lang_tensor = mended
    _mend_interpreted_comparisons(interpreter)


def _mend_interpreted_comparisons(interpreter) -> None:
    """Triton 3.9's interpreter tags a comparison's result with its operands' type (int32 for
    `j < H`) though the data are booleans; a scalar comparison broadcast into a block then
    becomes int32 data, and tl.store refuses it as a mask ("mask has unsupported dtype": the
    `ok & (j < H)` mask of models/fused.py _qk_rope). Each comparison's result is tagged int1,
    as compiled Triton types it. Test-side only: compiled kernels are untouched."""
    import triton.language as tl
    builder = interpreter.InterpreterBuilder
    for name in dir(builder):
        if not name.startswith(("create_icmp", "create_fcmp")):
            continue
        compare = getattr(builder, name)
        if getattr(compare, "mended", False):
            continue

        def typed(self, lhs, rhs, compare=compare):
            out = compare(self, lhs, rhs)
            return interpreter.TensorHandle(out.data.astype(bool, copy=False), tl.int1)

        typed.mended = True
        setattr(builder, name, typed)


def _interpret_without_cuda() -> None:
    """Without CUDA, TRITON_INTERPRET=1 unless the environment chose already. Triton reads it
    when a kernel is decorated (triton.jit returns an interpreted function then), so it is set
    here, before any test module imports freetoken's kernels; with CUDA the kernels compile."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_without_cuda()
if os.environ.get("TRITON_INTERPRET") == "1":
    _mend_triton_interpreter()


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist (README's `-n auto`) each worker takes its share of the cores for
    torch's threads, not all of them: the workers would otherwise oversubscribe the CPU."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_among_workers()


def _transformers_hybrids_on_torch_ops() -> None:
    """Where fla-core is installed (the GPU host: the engine's Gated DeltaNet kernels on cuda),
    transformers binds fla's Triton kernels into its Gated DeltaNet modules when it imports them,
    and the oracle models, which run on the CPU, then fail ("cannot be accessed from Triton (cpu
    tensor?)"). Those modules are imported here with fla hidden, so they bind their torch ops;
    the engine's own `import fla` is untouched."""
    import importlib
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        return
    loaded = {name: module for name, module in sys.modules.items()
              if name == "fla" or name.startswith("fla.")}
    for name in loaded:
        del sys.modules[name]
    sys.modules["fla"] = None  # `import fla` raises ImportError
    try:
        for family in ("qwen3_next", "qwen3_5_moe"):
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    finally:
        del sys.modules["fla"]
        sys.modules.update(loaded)


_transformers_hybrids_on_torch_ops()


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The kernel executor and the CPU benches set torch's thread count; restore it after."""
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the cells it marks slow leave the run
def pytest_collection_modifyitems(config, items):
    _mark_cells_past_the_suite(items)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mark_cells_past_the_suite(items) -> None:
    """A module's SUITE_CELLS = {test name: [cells]} keeps those parameter cells of a grid in the
    default run (a cell: a dict of parameter values, fixture params included, that the item's
    must contain) and marks the test's other cells `slow`, which the default run deselects
    (pyproject's addopts: -m "not slow"; `pytest -m "slow or not slow"` runs the whole grid).
    The suite keeps one cell of each path the grid covers, within CI's 10 minutes."""
    slow = pytest.mark.slow
    for item in items:
        cells = getattr(getattr(item, "module", None), "SUITE_CELLS", {}).get(
            getattr(item, "originalname", None))
        if cells is None or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        if not any(all(k in params and params[k] == v for k, v in cell.items()) for cell in cells):
            item.add_marker(slow)


def refuse_o_direct_io(monkeypatch, call: str) -> set:
    """Make os look like a filesystem that opens files with O_DIRECT but refuses the I/O on
    them: files open without the flag, and os.<call> (pwrite, preadv, ...) on a descriptor that
    asked for O_DIRECT raises EINVAL. Returns the set of those descriptors, filled as files
    open."""
    direct = getattr(os, "O_DIRECT", 0)
    real_open, real_io, direct_fds = os.open, getattr(os, call), set()

    def fake_open(path, flags, *args):
        fd = real_open(path, flags & ~direct, *args)
        if flags & direct:
            direct_fds.add(fd)
        return fd

    def fake_io(fd, *args):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_io(fd, *args)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, call, fake_io)
    return direct_fds
