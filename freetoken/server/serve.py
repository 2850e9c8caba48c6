"""Putting a server together: build_app(engine) wires worker, metrics, chat format and routes;
serve() loads the model and runs uvicorn until Ctrl-C (what `freetoken serve` calls);
BackgroundServer runs an app on a thread (tests, embedding)."""
import os
import socket
import threading
import time
from typing import Callable, Optional

from ..errors import ConfigError
from .app import ServerState, create_app
from .chat import ChatFormat
from .config import ServeConfig
from .grammar import Grammars
from .metrics import Metrics
from .worker import EngineWorker

SHUTDOWN_GRACE_S = 5  # on Ctrl-C, requests in flight get this long before they are cut


def build_app(engine, config: ServeConfig, model_name: str):
    """(app, worker) over a loaded engine; close the worker (joins its thread) when done."""
    metrics = Metrics()
    worker = EngineWorker(engine, config.max_queue, metrics)
    metrics.bind(worker)
    vocab_size = getattr(getattr(engine, "model_config", None), "vocab_size",
                         engine.tokenizer.vocab_size)  # (the logits' width)
    state = ServerState(worker, ChatFormat(engine.tokenizer), model_name, metrics,
                        Grammars(engine.tokenizer, vocab_size))
    return create_app(state, config.api_key, config.max_body_bytes), worker


def model_name(path: str) -> str:
    """The id clients see by default: the model file's name without .ftw."""
    name = os.path.basename(path)
    return name[:-4] if name.endswith(".ftw") else name


def serve(model: Optional[str], engine_config, config: ServeConfig,
          echo: Callable[[str], None] = print) -> None:
    """Load `model` (None: the bundled one), print where it listens, serve until interrupted."""
    import uvicorn

    from ..api import default_model_path
    from ..engine import Engine

    path = model or default_model_path()
    sock = listen(config.host, config.port)  # before the load: a port in use fails at once
    with sock, Engine(path, engine_config) as engine:
        engine.warm_up()  # the kernels' compiles before the first request (cuda)
        name = config.model_name or model_name(path)
        app, worker = build_app(engine, config, name)
        try:
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                   timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
            for line in ready_lines(engine, config, name, sock.getsockname()[1]):
                echo(line)
            server.run(sockets=[sock])
            if server.should_exit:  # uvicorn took a SIGINT/SIGTERM and shut down: exit as
                raise KeyboardInterrupt  # interrupted (130) even where it re-raised nothing
        finally:
            worker.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one); a port in use is a ConfigError."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                    else socket.AF_INET)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); choose another "
                          "--port or --host") from None


def ready_lines(engine, config: ServeConfig, name: str, port: int) -> list:
    """What `freetoken serve` prints once the model is loaded."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    lines = [f"freetoken: serving {name}: OpenAI base URL http://{host}:{port}/v1, Anthropic "
             f"http://{host}:{port} ({'API key required' if config.api_key else 'no API key'})",
             f"freetoken: device {engine.device.type}, {engine.config.ctx_size}-token context, "
             f"up to {config.max_queue} requests admitted, loaded in {engine.load_s:.1f} s"
             + (f", kernels warmed in {engine.warm_s:.1f} s" if engine.warm_s else "")]
    split = getattr(engine.experts, "split_info", None)
    if split:
        lines.append(f"freetoken: expert split {split}")
    return lines + [f"freetoken: {note}" for note in engine.notes]


class BackgroundServer:
    """Runs `app` under uvicorn on a daemon thread. port 0 picks a free port; `url` is the base
    (http://host:port). start() returns once it accepts connections; stop() shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="freetoken-http",
                                        daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:  # uvicorn sets it once its sockets listen
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
