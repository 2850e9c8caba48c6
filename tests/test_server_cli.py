"""`freetoken serve` options: each maps to its ServeConfig / EngineConfig field (defaults agree),
the key comes from --api-key or FREETOKEN_API_KEY, bad values are one-line errors (exit 2)."""
from dataclasses import fields

from click.testing import CliRunner

from freetoken import api
from freetoken.cli import main, serve
from freetoken.config import EngineConfig
from freetoken.server import serve as serve_module
from freetoken.server.config import ServeConfig



def test_defaults_agree_with_the_dataclasses():
    defaults = {p.name: p.default for p in serve.params}
    for cls in (ServeConfig, EngineConfig):
        for f in fields(cls):
            if f.name in defaults:
                assert defaults[f.name] == f.default, f.name
    assert {"host", "port", "api_key", "max_queue", "max_body_mb", "model_name", "ctx_size",
            "device", "policy", "expert_cache_frac"} <= set(defaults)


def calls(monkeypatch):
    """serve() recorded, not run; the memory plan serve prints first is not made either."""
    seen = []
    monkeypatch.setattr(serve_module, "serve", lambda *args, **kw: seen.append(args))
    monkeypatch.setattr(api, "plan_model", lambda path, config: NoPlan())
    return seen


class NoPlan:
    def lines(self):
        return []


def test_options_reach_the_configs(monkeypatch):
    seen = calls(monkeypatch)
    monkeypatch.delenv("FREETOKEN_API_KEY", raising=False)
    r = CliRunner().invoke(main, ["serve", "m.ftw", "--port", "9000", "--ctx-size", "1024",
                                  "--device", "cpu", "--max-queue", "3", "--model-name", "qwen"])
    assert r.exit_code == 0, r.output
    model, engine, config = seen[0]
    assert model == "m.ftw" and engine.ctx_size == 1024 and engine.device == "cpu"
    assert config == ServeConfig(port=9000, max_queue=3, model_name="qwen")


def test_key_from_option_or_environment(monkeypatch):
    seen = calls(monkeypatch)
    monkeypatch.setenv("FREETOKEN_API_KEY", "from-env")
    assert CliRunner().invoke(main, ["serve"]).exit_code == 0
    assert CliRunner().invoke(main, ["serve", "--api-key", "from-option"]).exit_code == 0
    assert [args[2].api_key for args in seen] == ["from-env", "from-option"]


def test_bad_values_are_one_line_errors(monkeypatch):
    calls(monkeypatch)
    for argv, message in ((["--max-queue", "0"], "--max-queue must be >= 1"),
                          (["--port", "70000"], "--port must be in 0..65535"),
                          (["--ctx-size", "0"], "--ctx-size must be >= 1")):
        r = CliRunner().invoke(main, ["serve", *argv])
        assert r.exit_code == 2 and message in r.output, (argv, r.output)


def test_serve_process_answers_and_stops(tmp_path):
    """The real command in a subprocess: it prints its URL once ready (port 0: a free port),
    answers with the key from the environment, and exits on SIGINT (130, as Ctrl-C).
    It runs the installed package (no PYTHONPATH, cwd outside the checkout): CI installs the
    project without building its kernels in the checkout, so the checkout itself can't import."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from serve_support import http

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["FREETOKEN_API_KEY"] = "k"
    proc = subprocess.Popen([sys.executable, "-m", "freetoken", "serve", "--port", "0",
                             "--device", "cpu", "--ctx-size", "64"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        lines = [proc.stderr.readline() for _ in range(5)]  # the memory plan, then the URL
        if not lines[-1]:  # it exited: show why
            lines.append(proc.stderr.read())
        assert lines[0].startswith("memory plan (cpu"), lines
        found = re.search(r"OpenAI base URL (http://127\.0\.0\.1:\d+)/v1", lines[4])
        assert found, lines
        url = found.group(1)
        assert http("GET", url + "/v1/models")[0] == 401
        status, body = http("GET", url + "/v1/models", headers={"x-api-key": "k"})
        assert status == 200 and body["data"][0]["id"] == "default"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 130  # Ctrl-C: the CLI's interrupted exit
