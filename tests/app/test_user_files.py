"""Every reader of a user's file (a replay trace, a prompt file, an access trace) checks what it opens: a
regular file only, a size cap read by stat, reads bounded; a line that cannot run is named with its line
number, when the file is read; a live replay streams its file and skips (and counts) the lines it cannot run.
Issue 18, items 2, 3, 4 and 6, on the tiny random-weight Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from engine import user_file
from engine.user_file import UserFileError, json_lines

GOOD = {"arrival_s": 0, "session": "a", "prompt_tokens": [5, 6, 7], "max_new_tokens": 2}


def jsonl(path, *rows) -> str:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else
                               (r if isinstance(r, str) else json.dumps(r)).encode()) + b"\n" for r in rows))
    return str(path)


def returns_within(fn, seconds: float = 20.0):
    """fn()'s result or exception; fails (instead of hanging the suite) if fn blocks, as an open of a FIFO would."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the reader blocked"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- what a reader opens --------------------------------------------------------------------------------

def _reader(name: str):
    """A reader of a user's file, as a call on a path, and the size cap it reads under."""
    if name == "bench --trace":
        from engine.workloads.requests import load_trace

        return load_trace, user_file.MAX_JSONL_BYTES
    if name == "--replay":
        from engine.workloads.trace_workload import check_trace_file

        return check_trace_file, user_file.MAX_JSONL_BYTES
    if name == "generate --prompt-file":
        from app.commands import _read_prompt_file

        return (lambda p: list(_read_prompt_file(p, 8))), user_file.MAX_JSONL_BYTES
    from engine.kv.access_trace import MAX_FILE_BYTES, AccessTrace

    return AccessTrace.load, MAX_FILE_BYTES


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("reader", ["bench --trace", "--replay", "generate --prompt-file", "policy-lab"])
@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "sparse"])
def test_every_reader_refuses_what_is_not_a_small_regular_file(tmp_path, reader, kind):
    # Guards against: a FIFO blocked in open until killed; /dev/zero (and a 10 GB sparse file) were read into memory,
    # 2-8.5 GB before a timeout. Here /dev/null stands for every device (a reader that took it would not
    # fill memory), and the sparse file is one byte over the reader's cap (a hole on disk: only stat can tell).
    fn, cap = _reader(reader)
    if kind == "fifo":
        path = str(tmp_path / "pipe")
        os.mkfifo(path)
        needle = "is a FIFO (named pipe), not a regular file"
    elif kind == "device":
        path, needle = "/dev/null", "is a device, not a regular file"
    elif kind == "directory":
        path, needle = str(tmp_path), "is a directory, not a regular file"
    else:
        path = str(tmp_path / "sparse")
        with open(path, "wb") as f:
            f.truncate(cap + 1)
        needle = f"the file is {user_file.size_text(cap + 1)}, more than the {user_file.size_text(cap)}"
    with pytest.raises(ValueError) as err:
        returns_within(lambda: fn(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and needle in msg and "\n" not in msg, msg


def test_a_file_that_grows_past_the_cap_is_never_read_past_it(tmp_path):
    path = tmp_path / "grows.jsonl"
    jsonl(path, GOOD, GOOD)
    lines = json_lines(path, "a trace", max_bytes=os.path.getsize(path) + 10)  # (small caps, as on huge files)
    assert next(lines).value == GOOD  # opened and checked: within the cap
    with open(path, "ab") as f:  # another process appends meanwhile
        f.write((json.dumps(GOOD) + "\n").encode() * 1000)
    with pytest.raises(UserFileError, match="grew past the"):
        list(lines)


def test_a_line_too_long_is_named_and_the_reading_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "long.jsonl"
    jsonl(path, GOOD, "[" + "1, " * 100 + "1]", GOOD)
    got = list(json_lines(path, "a trace", max_line=128))
    assert [(ln.number, ln.problem) for ln in got] == [
        (1, None), (2, "the line is longer than the 128 bytes a line may be"), (3, None)]
    assert got[2].value == GOOD


@pytest.mark.parametrize("raw, problem", [
    (b"[" * 100_000, "not readable JSON (nested too deeply)"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8 text (byte 0xe9 at byte 16 of the line)"),
    (b'{"prompt": "a\\ud800b"}', "a string holds a lone surrogate (\\ud800 at character 2), which is not a character"),
    (b'{"k\\udfff": 1}', "a string holds a lone surrogate (\\udfff at character 2)"),
    (b'{"n": ' + b"9" * 5000 + b"}", "not readable JSON (Exceeds the limit (4300 digits) for integer string"),
    (b'{"a": 1', "not valid JSON (Expecting ',' delimiter, column 8)"),
])
def test_json_lines_names_each_bad_line(tmp_path, raw, problem):
    path = tmp_path / "x.jsonl"
    jsonl(path, raw, GOOD)
    bad, good = list(json_lines(path, "a trace"))
    assert bad.number == 1 and bad.problem.startswith(problem), bad.problem
    assert good.number == 2 and good.value == GOOD


def test_a_valid_surrogate_pair_and_a_byte_order_mark_are_fine(tmp_path):
    path = tmp_path / "ok.jsonl"
    jsonl(path, b'\xef\xbb\xbf{"prompt": "\\ud83d\\ude00"}')
    (ln,) = json_lines(path, "a trace")
    assert ln.problem is None and ln.value == {"prompt": "\U0001F600"}


# -- a trace's lines: refused when read, with the line named ----------------------------------------------

@pytest.mark.parametrize("row, problem", [
    ("[" * 100_000, "not readable JSON (nested too deeply)"),
    ({**GOOD, "prompt_tokens": None, "prompt": "hi \ud800 there"}, "a lone surrogate (\\ud800 at character 4)"),
    ({**GOOD, "kind": "nbest", "n_forks": 10**9}, "n_forks must be from 0 to 1,024, got 1000000000"),
    ({**GOOD, "max_new_tokens": 10**12}, "max_new_tokens must be from 1 to 1,048,576, got 1000000000000"),
    ({**GOOD, "max_new_tokens": 10**300}, "got an integer of about 301 digits"),
    ({**GOOD, "arrival_s": 10**400}, "arrival_s must be a finite number from 0 to 10,000,000"),
    ({**GOOD, "arrival_s": 1e300}, "arrival_s must be a finite number from 0 to 10,000,000"),
    ({**GOOD, "session": "s" * 1000}, "session is 1,000 characters; at most 256"),
    ({**GOOD, "prompt_tokens": [[[1]]]}, "prompt_tokens must be a list of integer token ids"),
    ({**GOOD, "session": list(range(10**5))}, "session must be a string, got an array of 100,000 items"),
])
def test_bench_trace_refuses_a_line_that_cannot_run_by_its_number(tmp_path, row, problem):
    # Guards against: deep JSON was a RecursionError traceback (exit 1); a lone surrogate, n_forks 10^9 or a
    # 10^12 max_new_tokens passed, to loop, hang or never finish once replayed.
    from engine.workloads.requests import load_trace

    path = jsonl(tmp_path / "t.jsonl", GOOD, row)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: ") and problem in msg and len(msg) < 300, msg


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    from app.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_trace_with_deep_json_is_one_line_and_exit_2(tmp_path, capsys):
    path = jsonl(tmp_path / "deep.jsonl", GOOD, "[" * 100_000)
    rc, out, err = run_cli(capsys, "bench", "--trace", path, "--model", str(tmp_path / "no-model"))
    assert rc == 2 and not out
    assert err == f"kvscope: error: {path}:2: not readable JSON (nested too deeply)\n"  # before the model load


def test_generate_prompt_file_refuses_a_lone_surrogate_by_line(tiny_llama, tmp_path, capsys):
    # Guards against: the tokenizer's TypeError came out as a traceback.
    path = jsonl(tmp_path / "p.jsonl", {"prompt": "fine"}, b'{"prompt": "bad \\udc80 text", "chat": true}')
    rc, out, err = run_cli(capsys, "generate", "--prompt-file", path, "--model", tiny_llama)
    assert rc == 2 and not out and "Traceback" not in err
    assert err.startswith(f"kvscope: error: {path}:2: a string holds a lone surrogate (\\udc80")


def test_bench_trace_names_the_line_of_a_request_the_model_refuses(tiny_llama, tmp_path, capsys):
    # Guards against: a token id of 10^12 was refused with only the session named ("a at 0 s").
    path = jsonl(tmp_path / "t.jsonl", GOOD, {**GOOD, "session": "b", "prompt_tokens": [5, 10**12]})
    rc, out, err = run_cli(capsys, "bench", "--trace", path, "--model", tiny_llama, "--time-scale", "0")
    assert rc == 0, err
    assert ("1 request(s) refused, e.g. line 2 (session 'b' at 0 s): token 1 of the prompt is 1000000000000, "
            "outside the vocabulary (0..49151)") in err


def test_bench_trace_where_nothing_can_run_says_why_and_exits_2(tiny_llama, tmp_path, capsys):
    # Guards against: a 5,000-token prompt on a 512-position model: "0/1" in the table and exit 0.
    path = jsonl(tmp_path / "long.jsonl", {**GOOD, "prompt_tokens": [5] * 5000})
    rc, out, err = run_cli(capsys, "bench", "--trace", path, "--model", tiny_llama, "--time-scale", "0")
    assert rc == 2, err
    assert ("1 request(s) refused, e.g. line 1 (session 'a' at 0 s): prompt of 5000 tokens exceeds the context "
            "limit of 512") in err
    assert err.rstrip().endswith("kvscope: error: no request of long.jsonl finished in any config")


# -- --replay: skipped lines, streaming, what happened to each request ------------------------------------

@pytest.fixture
def engine(llama_model):
    from engine.config import CacheConfig, EngineOptions
    from engine.runtime.engine import Engine

    now = [0.0]
    eng = Engine(llama_model, CacheConfig(block_size=4), EngineOptions(), clock=lambda: now[0])
    eng.now = now
    return eng


def run_round(w, eng, steps: int = 2000) -> None:
    for _ in range(steps):
        w.tick(eng.clock())
        if eng.has_work():
            w.observe(eng.step())
        eng.now[0] += 0.05
        if w.rounds == 2:
            return
    raise AssertionError(f"the round did not end: {w.stats()}")


def test_replay_skips_and_counts_the_lines_that_cannot_run_and_replays_the_rest(engine, tmp_path):
    # Guards against: the first bad line refused the whole trace; a lone surrogate passed and then looped on the
    # tokenizer's TypeError (11 error events, exit 0); a token id of 10^12 vanished (no error, no sequence).
    from app.window.runner import open_trace_workload

    path = jsonl(tmp_path / "mixed.jsonl",
                 GOOD,
                 {**GOOD, "session": "s", "prompt_tokens": None, "prompt": "x\ud800"},
                 "[" * 100_000,
                 {**GOOD, "session": "v", "prompt_tokens": [5, 10**12]},
                 {**GOOD, "session": "f", "kind": "nbest", "n_forks": 10**9},
                 {**GOOD, "session": "long", "prompt_tokens": [5] * 5000},
                 {**GOOD, "session": "t", "arrival_s": 0.1, "prompt_tokens": None, "prompt": "hello there"})
    said: list[str] = []
    w = open_trace_workload(engine, path, say=said.append)
    assert w.n_requests == 2 and w.n_skipped == 5
    assert [s.split(": ", 1)[0] for s in w.skipped] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6)]
    assert "outside the vocabulary" in w.skipped[2] and "exceeds the context limit of 512" in w.skipped[4]
    assert said[-1] == f"kvscope: {path}: 5 of 7 lines skipped; replaying the other 2"
    assert all(s.endswith("(skipped)") for s in said[:-1]) and len(said) == 6
    run_round(w, engine)
    assert {s.label for s in engine.seqs.values()} == {"a", "t"}
    st = w.stats()
    assert st["finished"] >= 2 and st["refused"] == 0 and st["skipped_lines"] == 5
    events = [e.fields["message"] for e in engine.telemetry.events if e.kind == "error"]
    assert len(events) == 6 and events[-1] == f"{path}: 5 lines skipped, 2 replayed"
    assert not any("TypeError" in m for m in events)


def test_replay_with_no_line_that_can_run_is_refused_naming_it(engine, tmp_path):
    from engine.errors import RequestError
    from engine.workloads.trace_workload import TraceWorkload

    path = jsonl(tmp_path / "long.jsonl", {**GOOD, "prompt_tokens": [5] * 5000})
    with pytest.raises(RequestError) as err:
        TraceWorkload(engine, path)
    assert str(err.value) == f"{path}:1: prompt of 5000 tokens exceeds the context limit of 512; nothing to replay"


def test_a_replay_streams_its_file(engine, tmp_path, monkeypatch):
    # Guards against: the whole trace was read into a list, and every request that had arrived was handed to the
    # engine at once (200,000 lines: 15 s in the first tick before the first step).
    import engine.workloads.trace_workload as tw
    from engine.workloads import requests as workloads
    n = 3000
    path = jsonl(tmp_path / "many.jsonl", *({**GOOD, "session": f"s{i}", "arrival_s": 0,
                                             "prompt_tokens": [5, 6, 7 + i % 50], "max_new_tokens": 1}
                                            for i in range(n)))
    w = tw.TraceWorkload(engine, path)
    assert w.n_requests == n
    pulled = [0]
    real = workloads.read_trace

    def counting(p):
        for item in real(p):
            pulled[0] += 1
            yield item

    monkeypatch.setattr(tw, "read_trace", counting)
    w.tick(engine.clock())
    assert pulled[0] <= tw.WINDOW + 1  # the round reads only what it hands the engine
    assert len(engine.seqs) <= tw.WINDOW
    most = 0
    for _ in range(20_000):
        w.tick(engine.clock())
        most = max(most, len(w._replay.live) + len(w._replay.ready))
        if engine.has_work():
            w.observe(engine.step())
        if w.rounds == 2:
            break
    assert w.rounds == 2 and w.stats()["finished"] >= n and most <= tw.WINDOW


def test_a_request_refused_when_it_starts_is_an_event(engine, tmp_path):
    # A later turn carries the conversation so far, so it can outgrow the context limit only when it starts.
    from engine.workloads.trace_workload import TraceWorkload

    path = jsonl(tmp_path / "turns.jsonl", {**GOOD, "prompt_tokens": [5] * 300, "max_new_tokens": 4},
                 {**GOOD, "arrival_s": 0.1, "kind": "turn", "prompt_tokens": [6] * 300})
    w = TraceWorkload(engine, path)
    run_round(w, engine)
    events = [e.fields["message"] for e in engine.telemetry.events if e.kind == "error"]
    assert events == [f"refused: {path}:2 (session 'a' at 0.1 s): prompt of 604 tokens exceeds the context limit "
                      f"of 512"]


def test_a_replay_counts_a_request_the_engine_aborts(engine, tmp_path):
    # Guards against: an aborted sequence stayed "live" for ever, so the round never ended.
    from engine.workloads.trace_workload import TraceWorkload

    path = jsonl(tmp_path / "t.jsonl", {**GOOD, "max_new_tokens": 50}, {**GOOD, "session": "b", "max_new_tokens": 3})
    w = TraceWorkload(engine, path)
    w.tick(engine.clock())
    engine.cancel(min(engine.seqs))
    run_round(w, engine)
    st = w.stats()
    assert st["refused"] == 1 and st["finished"] == 1, st


def test_headless_replay_of_a_fifo_and_of_an_unrunnable_prompt_exit_2(tiny_llama, tmp_path, fifo):
    def kvscope(*args):
        return subprocess.run([sys.executable, "-m", "app.cli", "--headless", "--run-for", "1", *args],
                              capture_output=True, text=True, timeout=300)

    out = kvscope("--replay", fifo)
    assert out.returncode == 2 and out.stderr.strip() == (f"kvscope: error: {fifo}: is a FIFO (named pipe), not a "
                                                          f"regular file (a trace must be one)")
    # A 5,000-token prompt on a 512-position model: before, exit 0 and not a word about it.
    path = jsonl(tmp_path / "long.jsonl", {**GOOD, "prompt_tokens": [5] * 5000})
    out = kvscope("--replay", path, "--model", tiny_llama)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == (f"kvscope: error: {path}:1: prompt of 5000 tokens exceeds the context "
                                           f"limit of 512; nothing to replay")


# -- the other readers of a user's file: --model and a preset ---------------------------------------------

def test_a_model_path_or_a_model_file_that_is_a_fifo_is_refused(tiny_llama, tmp_path, fifo):
    # Guards against: --model FIFO, or a model directory whose tokenizer.json is one, blocked until killed.
    import shutil

    from engine.model.loader import load_model
    from engine.model.spec import ModelLoadError

    with pytest.raises(ModelLoadError, match="is not a regular file or a directory"):
        returns_within(lambda: load_model(fifo))
    with pytest.raises(ModelLoadError, match="is not a regular file or a directory"):
        returns_within(lambda: load_model("/dev/null"))
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    os.remove(model / "tokenizer.json")
    os.mkfifo(model / "tokenizer.json")
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: not a regular file"):
        returns_within(lambda: load_model(str(model)))


def test_record_trace_to_a_fifo_is_refused_before_the_model_loads(tmp_path, capsys):
    # Guards against: the writability probe opened the FIFO for appending and blocked until a reader came.
    fifo = tmp_path / "reads.npz"
    os.mkfifo(fifo)
    rc, out, err = returns_within(lambda: run_cli(capsys, "generate", "hi", "--model", str(tmp_path / "no-model"),
                                                  "--record-trace", str(fifo)))
    assert rc == 2 and err == f"kvscope: error: --record-trace {fifo}: not a regular file\n"


def test_a_preset_that_is_a_fifo_or_too_deep_is_refused_in_one_line(tmp_path, fifo):
    # Guards against: File > Load preset on a FIFO froze the window; on deeply nested TOML it raised RecursionError.
    from types import SimpleNamespace

    from ui.panels.controls import ControlsPanel

    said: list[str] = []
    fake = SimpleNamespace(show_error=said.append, refused=SimpleNamespace(emit=lambda kind, text: said.append(text)),
                           apply_many=lambda data: True)
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    for path, why in ((fifo, "is a FIFO (named pipe), not a regular file"), ("/dev/null", "is a device"),
                      (str(deep), "nested too deeply")):
        said.clear()
        assert returns_within(lambda: ControlsPanel.load_preset(fake, path)) is False
        assert said[0].startswith(f"{path}: ") and why in said[0] and said[0].count(path) == 1, said
