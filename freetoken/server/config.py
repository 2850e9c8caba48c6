"""ServeConfig: how `freetoken serve` listens and admits requests (the engine's own options are
EngineConfig's). `freetoken serve` options map one-to-one to these fields."""
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """host/port: where to listen (localhost by default). api_key: None = no key asked.
    max_queue: requests admitted at once (running + waiting); more get 503 until one ends.
    max_body_mb: a larger request body gets 413. model_name: the id clients see (/v1/models);
    None = the model file's name."""
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    max_queue: int = 64
    max_body_mb: float = 32.0
    model_name: Optional[str] = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, not {self.port}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, not {self.max_queue}")
        if not self.max_body_mb > 0:
            raise ConfigError(f"--max-body-mb must be > 0, not {self.max_body_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty; give a key or leave the option out")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)
