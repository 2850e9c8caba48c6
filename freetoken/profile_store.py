"""Where `freetoken profile`'s results live: the machine's identity (CPU model, GPU name), the
file key, JSON load/save, and which stored profile a lookup takes (find_profile's ranking).

Profiles live in $XDG_CACHE_HOME/freetoken/profiles/ (default ~/.cache), keyed by GPU name, CPU
model, pool threads and expert shape/dtype: KEY.json from `freetoken profile`, and
KEY.calibration.json from the short calibration of profile.bandwidths_for (marked "calibrated";
a full profile of the same key wins). Measures nothing; profile.py re-exports these names.
"""
import json
import os
import re
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"


def gpu_name(device=None):
    """The CUDA device's name, or None without CUDA."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device)
    except (ImportError, RuntimeError):
        pass
    return None


def profile_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "freetoken" / "profiles"


def profile_key(gpu, cpu, threads, shape_key) -> str:
    """File-name-safe key: GPU, CPU model, pool threads, expert shape/dtype."""
    raw = f"{gpu or 'nogpu'}__{cpu}__t{threads}__{shape_key}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def load_profile(gpu, cpu, threads, shape_key):
    """The stored profile dict for this key (the full profile, else the calibration), or None."""
    key = profile_key(gpu, cpu, threads, shape_key)
    for suffix in (".json", ".calibration.json"):
        try:
            return json.loads((profile_dir() / (key + suffix)).read_text())
        except (OSError, ValueError):
            continue
    return None


def save_profile(r: dict) -> str:
    """Writes the profile dict `r` (a calibration to its own file) and returns the path."""
    key = profile_key(r["gpu"], r["cpu"], r["threads"], r["shape_key"])
    path = profile_dir() / (key + (".calibration.json" if r.get("calibrated") else ".json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1))
    return str(path)


def find_profile(gpu, match, threads=None):
    """The stored profile of this GPU and CPU that `match`es, None when there is none. Chosen by,
    in order: `threads` threads; a full profile before a calibration; the most threads; the last
    file name."""
    found = []
    directory = profile_dir()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            p = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if p.get("gpu") == gpu and p.get("cpu") == cpu_model() and match(p):
            found.append(p)
    def rank(item):
        i, p = item
        return p.get("threads") == threads, not p.get("calibrated"), p.get("threads", 0), i
    return max(enumerate(found), key=rank)[1] if found else None
