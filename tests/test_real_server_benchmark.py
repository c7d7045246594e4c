"""benchmarks/real_server.py on CPU: the server command it builds for the installed SGLang, and
its summary of the recorded H200 run. The servers themselves need a GPU (benchmarks/README.md,
"Real servers")."""

import json
import pathlib
import socket
import threading
from types import SimpleNamespace

import pytest

from benchmarks import real_server

RECORDED = pathlib.Path(real_server.__file__).parent / "real_server_h200_gemma2b.json"


def test_the_server_command_uses_flags_this_release_parses():
    """0.5.22 split --cuda-graph-max-bs into decode and prefill flags, and 0.5.23 refuses the old
    name as ambiguous; SGLang's own parser must take the flag as given. Every supported release
    has `sglang serve`."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flag = real_server.decode_graph_flag()
    parsed, unknown = parser.parse_known_args(["--model-path", "m", flag, "8"])
    assert unknown == [] and 8 in (getattr(parsed, "cuda_graph_max_bs", None), getattr(parsed, "cuda_graph_max_bs_decode", None))
    assert real_server.launcher()[-1] == "serve"


def test_the_summary_of_the_recorded_run_reads_every_server():
    """The recorded run: every plugin server identical, radix hits where the radix cache was on,
    the three startup refusals said what they must."""
    servers = json.loads(RECORDED.read_text())["servers"]
    rows = {row["name"]: row for row in map(real_server._row, servers)}
    plugin = [name for name in rows if name.startswith("plugin-chunk")]
    assert len(plugin) == 7 and all(rows[name]["ok"] for name in plugin)
    for name in plugin:
        radix = name.endswith("radixon")
        assert all(("cached 0" not in cell) == radix for key, cell in rows[name].items() if "/" in key), name
    refusals = [e for e in servers if "refusal" in e]
    assert [e["ok"] for e in refusals] == [True] * 3
    assert all(any(e["expected"] in line for line in e["said"]) for e in refusals)


GRANITE = pathlib.Path(real_server.__file__).parent / "logs" / "real_server_h200" / "granite-3.1-8b"


def test_the_recorded_granite_runs_cover_the_matrix_identical():
    """Granite-3.1-8B's shape on the H200 (benchmarks/README.md, "Real servers"): every chunk x
    page x radix configuration ran, each identical in every pass of both workloads, with radix
    hits exactly where the radix cache was on; the rules off reported as they came out."""
    entries = [e for name in ("page1.json", "page16_radixoff.json", "page16_radixon.json")
               for e in json.loads((GRANITE / name).read_text())["servers"]]
    checked = {(e["chunk"], e["page"], e["radix"], e["rules"]): e for e in entries if "chunk" in e}
    matrix = {(c, p, r, True) for c in (128, 256, 1024) for p in (1, 16) for r in ("off", "on")}
    assert set(checked) == matrix | {(256, 1, "off", False)}
    for (chunk, page, radix, rules), entry in checked.items():
        passes = [p for w in entry["verify"]["workloads"].values() for p in w["passes"].values()]
        assert entry["ok"] and entry["verify_exit"] == 0 and len(passes) == 4, (chunk, page, radix)
        assert all(p["identical"] == p["requests"] == 12 for p in passes)
        assert all((p["cached_tokens_total"] > 0) == (radix == "on") for p in passes)
        said = "grid rules on" if rules else "grid rules off"
        assert any(said in line for line in entry["plugin_lines"]), (chunk, page, radix)
    refusals = [e for e in entries if "refusal" in e]
    assert len(refusals) == 3 and all(e["ok"] and not e["started"] for e in refusals)


def test_a_port_something_listens_on_is_skipped():
    """A server left over from an earlier run would answer the new server's /health: Run.port()
    hands out the next port nothing listens on."""
    with socket.socket() as leftover:
        leftover.bind(("127.0.0.1", 0))
        leftover.listen()
        taken = leftover.getsockname()[1]
        run = SimpleNamespace(next_port=taken - 1, lock=threading.Lock())
        port = real_server.Run.port(run)
        assert port > taken and run.next_port == port
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0


def _run_matrix(monkeypatch, tmp_path, *flags):
    """The matrix phase at chunks 128 and 256, one server at a time, with fake servers and a fake
    verify that records what each plugin server was checked against and whether its reference
    was still up then."""
    started, checked = [], []

    class FakeServer:
        """A server that comes up at once and records whether it was stopped."""

        def __init__(self, run, name, chunk, page, env=(), extra=()):
            self.name, self.url, self.stopped = name, f"http://{name}", False
            started.append(self)

        def wait_ready(self):
            return True

        def stop(self):
            self.stopped = True

        def describe(self):
            return {"name": self.name}

    def fake_verify(run, server, reference, cache, radix, expect_identical=True):
        if reference is not server:
            up = [s.name for s in started if s.name.startswith("reference") and not s.stopped]
            checked.append((server.name, reference and reference.name, cache, up))
        return {"name": server.name, "ok": True}

    monkeypatch.setattr(real_server, "Server", FakeServer)
    monkeypatch.setattr(real_server, "verify", fake_verify)
    monkeypatch.setattr(real_server, "_model_config", lambda path: {"model_path": path})
    monkeypatch.setattr(real_server, "stack", lambda: {})
    parser_args = ["--model-path", "m", "--phases", "matrix", "--chunks", "128,256", "--pages", "1", "--radix", "on",
                   "--parallel", "1", "--logs", str(tmp_path), "--out", str(tmp_path / "out.json"), *flags]
    assert real_server.main(parser_args) == 0
    return checked


def test_one_model_at_a_time_checks_against_the_recorded_answers_with_the_reference_stopped(monkeypatch, tmp_path):
    """A model the GPU cannot hold twice (Qwen3-30B-A3B's shape): with --one-model-at-a-time the
    reference is stopped once its answers are recorded, and each plugin server is checked against
    those answers alone; without it, against the running reference."""
    cache = str(tmp_path / "baseline-page1.json")
    alone = _run_matrix(monkeypatch, tmp_path, "--one-model-at-a-time")
    assert alone == [(f"plugin-chunk{c}-page1-radixon", None, cache, []) for c in (128, 256)]
    beside = _run_matrix(monkeypatch, tmp_path)
    assert beside == [(f"plugin-chunk{c}-page1-radixon", "reference-page1", cache, ["reference-page1"])
                      for c in (128, 256)]


def test_weights_that_cannot_be_written_are_a_usage_error(tmp_path, capsys):
    """--weights random for a folder without config.json: one line and exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit:
        real_server.main(["--model-path", str(tmp_path), "--weights", "random", "--checkpoints", str(tmp_path / "w"),
                          "--out", str(tmp_path / "out.json")])
    assert exit.value.code == 2 and f"error: {tmp_path} holds no config.json" in capsys.readouterr().err
