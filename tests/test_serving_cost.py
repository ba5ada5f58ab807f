"""The serving path's cost per token (issue 46): what the server adds to the decoder's step must stay small.

Timed assertions are not benchmarks (scripts/bench_serve.py measures the ratio, interleaved); these tests pin
the causes the profile found, each by a property that fails when the cause comes back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge.bundle import Bundle
from edge.decode.generate import Generator


@pytest.fixture(scope="module")
def serving_decoder(tiny_bundle):
    """The decoder as `edge-chat serve` loads it (spin=False), on two threads so ORT has workers."""
    return Generator.from_bundle(Bundle.open(tiny_bundle.root), engine="int8-dynamic", threads=2, spin=False).decoder


def _config(dec, key: str) -> str:
    try:
        return dec.session.get_session_options().get_session_config_entry(key)
    except Exception:  # onnxruntime raises when the key was never set
        return ""


def test_serving_session_spins_within_a_call_and_stops_after_it(serving_decoder):
    """`allow_spinning=0` made each operator wake ORT's workers: the server's step slower by ~15%
    (docs/speed.md). The server's session spins between operators and stops when the call returns."""
    assert _config(serving_decoder, "session.intra_op.allow_spinning") != "0"
    assert _config(serving_decoder, "session.force_spinning_stop") == "1"


def _idle_cpu_after_calls(spin: bool, tmp_path) -> float:
    """CPU seconds the process uses in 30 ms of idle after a call, median of 10, on a graph big enough that ONNX
    Runtime hands its work to its worker threads (the tiny test models are not)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edge.backends.onnxruntime import session_options

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 1024])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "mm.onnx")
    s = ort.InferenceSession(str(tmp_path / "mm.onnx"), session_options(2, spin), providers=["CPUExecutionProvider"])
    x = np.ones((64, 1024), np.float32)
    busy = []
    for _ in range(10):
        s.run(None, {"x": x})
        t = time.process_time()
        time.sleep(0.03)
        busy.append(time.process_time() - t)
    return float(np.median(busy))


def test_serving_session_leaves_the_cores_idle_between_calls(tmp_path):
    """Between two steps the HTTP side needs the cores: after a call, ORT's workers must not keep spinning
    (with spinning on and no stop, each call left a worker busy ~25 ms of every 30)."""
    assert _idle_cpu_after_calls(spin=False, tmp_path=tmp_path) < 0.005


def test_handoff_wakes_the_loop_once_for_a_steps_events_and_keeps_their_order():
    """A decode step of 8 rows hands 8 events over: one event-loop wake-up for all of them (each wake-up is a
    self-pipe write, a select return and a callback), none held back, each queue in its own order."""
    import asyncio
    import threading

    from edge.serve.service import Handoff

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        hand = Handoff(loop)
        drains = 0
        real = hand._drain

        def counted() -> None:
            nonlocal drains
            drains += 1
            real()

        hand._drain = counted
        qs = [asyncio.Queue() for _ in range(8)]
        busy = threading.Event()
        loop.call_soon(lambda: (busy.set(), time.sleep(0.2)))  # the loop is busy while a "step" hands over

        def step() -> None:
            busy.wait()
            for k in range(3):
                for i, q in enumerate(qs):
                    hand.put(q, 10 * i + k)

        t = threading.Thread(target=step)
        t.start()
        got = [[await q.get() for _ in range(3)] for q in qs]
        t.join()
        return got, drains

    got, drains = asyncio.run(main())
    assert got == [[10 * i + k for k in range(3)] for i in range(8)]
    assert drains == 1, f"{drains} loop wake-ups for one step's 24 events"


def test_handoff_to_a_closed_loop_raises_and_can_be_retried():
    """The scheduler cancels a request whose consumer's loop is gone (Request.emit catches the error); the
    hand-off must not stay 'armed' and swallow later events silently."""
    import asyncio

    from edge.serve.service import Handoff

    loop = asyncio.new_event_loop()
    hand = Handoff(loop)
    q: asyncio.Queue = asyncio.Queue()
    loop.close()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            hand.put(q, 1)


def test_bench_serve_reports_server_over_raw_decoder_per_round(tiny_bundle, tmp_path):
    """The overhead stays visible: bench_serve's interleaved mode times the raw decoder on the same prompts and
    reports "server / raw decoder" per round and level (the JSON a docs table is made from)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "scripts/bench_serve.py", str(tiny_bundle.root), "--engine", "int8-dynamic",
                        "--users", "1,2", "--rounds", "2", "--requests", "1", "--max-tokens", "6", "--threads", "1",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "server/raw" in r.stdout
    got = json.loads(out.read_text())
    for n in ("1", "2"):
        s = got["summary"][n]
        assert len(s["server_over_raw"]) == 2 and all(x > 0 for x in s["server_over_raw"])
        assert s["raw_prefill_ms"] > 0 and s["tok_s"]["raw decoder"] > 0
        assert len(got["rows"][n]["raw decoder"]) == 2 and got["rows"][n]["raw decoder"][0]["users"] == int(n)


def test_profile_buckets_put_each_stack_where_its_time_goes():
    """scripts/profile_serve.py's table is only as good as its rules: the decoder call is counted as the
    decoder's even when scheduler frames sit above it, idle only at the leaf, the SSE path on the loop."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    from profile_serve import bucket

    sched = "thread (1): edgechat-scheduler"
    assert bucket(sched, ["Scheduler._loop (s.py:1)", "Scheduler._step (s.py:2)", "SharedBatchCache.step (c.py:3)",
                          "Session.run_with_iobinding (ort.py:4)"]) == ("scheduler", "decoder call (ONNX Runtime run)")
    assert bucket(sched, ["Scheduler._accept (s.py:5)", "TextStream.push (t.py:1)", "ChatTokenizer.decode (k.py:1)"]) \
        == ("scheduler", "detokenize + stop strings")
    assert bucket(sched, ["Scheduler._accept (s.py:5)", "Request.emit (r.py:9)", "Handoff.put (v.py:1)"]) \
        == ("scheduler", "hand-off to the event loop")
    assert bucket(sched, ["Scheduler._loop (s.py:1)", "Condition.wait (threading.py:331)"]) == ("scheduler",
                                                                                                "waiting for work")
    main = "thread (2): MainThread"
    assert bucket(main, ["BaseEventLoop._run_once (a.py:1)", "EpollSelector.select (selectors.py:468)"]) == \
        ("event loop", "waiting in select (idle)")
    assert bucket(main, ["chat_sse (edge/serve/openai_writer.py:124)", "dumps (json/__init__.py:234)"]) == \
        ("event loop", "SSE: answer shapes + JSON")
    assert bucket(main, ["StreamingResponse.stream_response (r.py:1)", "RequestResponseCycle.send (h.py:2)",
                         "_SelectorSocketTransport.write (asyncio/selector_events.py:1057)"]) == \
        ("event loop", "SSE: socket writes")


def test_served_connections_send_small_writes_at_once():
    """Every connection the server accepts has TCP_NODELAY: the listening socket was made with proto 0, so
    asyncio never set it, and each answer's first chunk waited ~40 ms for the client's delayed ACK (Nagle)."""
    import socket

    from edge.serve.app import bind_socket

    listener = bind_socket("127.0.0.1", 0)
    try:
        listener.listen(1)
        client = socket.create_connection(listener.getsockname()[:2])
        conn, _ = listener.accept()
        try:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert listener.proto == socket.IPPROTO_TCP  # so asyncio's transport sets it too (base_events._set_nodelay)
        finally:
            conn.close()
            client.close()
    finally:
        listener.close()


def test_a_short_chat_request_costs_no_thread_hop_and_no_vocabulary_scan(tiny_generator, monkeypatch):
    """Before the prefill a request ran a max over every token's bytes (its length bound: ~1 ms of the event
    loop per request on a 49k vocabulary) and rendered its prompt in a worker thread (a hop there and back:
    more than the rendering of a short chat): both in the TTFT. The bound is computed once per tokenizer, a
    short chat is rendered on the loop, and a long one still goes to a thread (seconds of work for 4 MB)."""
    import asyncio

    from fastapi.testclient import TestClient

    import edge.serve.openai_answers as answers
    from edge.serve.service import Service, create_app

    scans, hops = [], []
    table = answers.token_table
    monkeypatch.setattr(answers, "token_table", lambda *a: scans.append(1) or table(*a))
    to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda fn, *a, **k: hops.append(getattr(fn, "__name__", "")) or
                        to_thread(fn, *a, **k))
    service = Service(tiny_generator, max_users=2)
    service.scheduler.start()
    try:
        client = TestClient(create_app(service, ui=False), raise_server_exceptions=False)
        ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(2):  # the first may meet the table unbuilt: it is built once, then kept
            assert client.post("/v1/chat/completions", json=ask).status_code == 200
        scans.clear(), hops.clear()
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=ask).status_code == 200
        assert scans == [] and "prompt" not in hops
        turns = answers.INLINE_PROMPT_CHARS // 300 + 1  # a long chat (the oldest turns shift out of the context)
        long = [{"role": ("user", "assistant")[i % 2], "content": "word " * 60} for i in range(2 * turns)]
        r = client.post("/v1/chat/completions", json={"messages": long + ask["messages"], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert "prompt" in hops
    finally:
        service.scheduler.stop()
