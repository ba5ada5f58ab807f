"""One decode loop (docs/design.md): the CLI, the page and the API answer the same request with the same
tokens, and every one of them gets its tokens from `Scheduler._accept` (the one place a token is taken); the
numbers the build ships (the draft's acceptance, the evaluate stage's speed) come from the scheduler's steps;
scoring a prompt runs the calls of its prefill."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from edge.decode.scheduler import Scheduler

PROMPT = "Hello! Tell me about the ocean."


@pytest.fixture
def taken(monkeypatch):
    """Every token the scheduler takes, with the thread that took it."""
    log: list[tuple[str, int]] = []
    real = Scheduler._accept

    def spy(self, row, logits, length):
        before = len(row.text.ids)
        ok = real(self, row, logits, length)
        if len(row.text.ids) > before:
            log.append((threading.current_thread().name, row.text.ids[-1]))
        return ok

    monkeypatch.setattr(Scheduler, "_accept", spy)
    return log


def test_cli_page_and_api_answer_through_the_same_loop(tiny_bundle, taken, capsys):
    from fastapi.testclient import TestClient

    from edge.decode import conversation
    from edge.cli import main
    from edge.decode.generate import Generator
    from edge.serve.service import Service, create_app

    n = 12
    # the CLI: `edge-chat run`, in this process so the spy sees it
    assert main(["run", str(tiny_bundle.root), PROMPT, "--max-new-tokens", str(n), "--temperature", "0"]) == 0
    cli_text = capsys.readouterr().out[:-1]  # the CLI ends the answer with one newline
    cli_tokens = [t for _, t in taken]
    assert len(cli_tokens) == n and {who for who, _ in taken} == {threading.current_thread().name}
    taken.clear()

    gen = Generator.from_bundle(tiny_bundle)
    service = Service(gen, max_users=2)
    service.scheduler.start()
    try:
        # the API, through the real ASGI app (its shutdown stops the scheduler: the page goes first)
        async def page() -> str:
            """What edge/serve/webui.py's answer() does with a typed message: fit the chat, service.generate."""
            cfg = gen.sampling(max_new_tokens=n, temperature=0.0)
            ids = conversation.prompt(gen.tokenizer, [{"role": "user", "content": PROMPT}],
                                      fit=(gen.max_context, cfg.max_new_tokens)).ids
            _, events = await service.generate(ids, cfg)
            return "".join([ev.text async for ev in events])

        def settled() -> None:
            """The answer's last event reaches its consumer from inside _accept, before the spy above records
            the token: wait until the row has left the batch (after _accept returned)."""
            deadline = time.monotonic() + 30
            while service.scheduler.active and time.monotonic() < deadline:
                time.sleep(0.005)

        with TestClient(create_app(service, ui=False)) as client:
            page_text = asyncio.run(page())
            settled()
            page_tokens = [t for _, t in taken]
            assert {who for who, _ in taken} == {"edgechat-scheduler"}
            taken.clear()
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0})
            assert r.status_code == 200, r.text
            api_text = r.json()["choices"][0]["message"]["content"]
            settled()
        api_tokens = [t for _, t in taken]
        assert {who for who, _ in taken} == {"edgechat-scheduler"}
    finally:
        service.scheduler.stop()
    assert cli_tokens == api_tokens == page_tokens
    assert cli_text == api_text == page_text


@pytest.fixture
def steps(monkeypatch) -> list[int]:
    """How many decode steps (plain or speculative) the scheduler runs, counted at `Scheduler._step`."""
    count = [0]
    real = Scheduler._step

    def spy(self) -> None:
        count[0] += 1
        real(self)

    monkeypatch.setattr(Scheduler, "_step", spy)
    return count


def test_the_builds_draft_acceptance_is_measured_in_the_scheduler_loop(tiny_bundle, tmp_path, steps, taken):
    """`export/draft.py measure` (the acceptance and speedup the manifest ships): both answers to every chat, the
    plain one and the drafted one, are the scheduler's steps and every token is taken by `_accept`, and the
    drafted answer's steps checked the draft's tokens."""
    from export.draft import DraftOptions, measure

    engine = tiny_bundle.manifest.engine("int8-dynamic")
    loaded = tiny_bundle.root.with_name(tiny_bundle.root.name + ".work") / "load"  # the build's load stage
    opts = DraftOptions(precision="int4-weight", acceptance_chats=2, acceptance_tokens=12, k=3)  # its own int4 drafts
    out = measure(tiny_bundle.path(engine.file), "fused", loaded, tiny_bundle.root, tmp_path, opts, 256, threads=1)
    assert out["chats"] == 2 and out["drafted"] > 0 and out["identical_answers"] == "2/2"
    assert len(taken) == 2 * out["tokens"]  # the plain answers and the drafted ones, token by token
    assert out["tokens"] - out["chats"] < steps[0] < 2 * out["tokens"]  # drafted steps yield more than one token


def test_the_evaluate_stages_speed_is_timed_in_the_scheduler_loop(fused_generator, steps, taken):
    """`export/evaluate.py speed` (the manifest's decode tok/s and TTFT): every run is an answer of the
    scheduler's, EOS ignored, one step per token after the first."""
    from export.evaluate import speed

    ids = fused_generator.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    out = speed(fused_generator, ids, new_tokens=6, runs=2)
    assert set(out) == {"ttft_ms", "decode_tok_s"} and out["ttft_ms"] > 0 and out["decode_tok_s"] > 0
    assert steps[0] == 3 * 5 and len(taken) == 3 * 6  # a warm-up and two timed runs


def test_scoring_a_prompt_runs_the_calls_of_its_prefill(fused_generator, monkeypatch):
    """/v1/completions' echo + logprobs scores the prompt with the very calls a prefill of it runs (fixed
    boundaries, edge.backends.decoder.next_boundary), and the last position's logits are the prefill's."""
    import numpy as np

    from edge.serve.openai_answers import score_steps

    dec = fused_generator.decoder
    ids = (fused_generator.tokenizer.encode_chat([{"role": "user", "content": PROMPT}]) * 8)[:150]  # past 64 and 128
    calls: list[tuple[int, int]] = []
    real = dec.forward

    def spy(x, cache, last_only=True):
        calls.append((cache.length, np.asarray(x).shape[-1]))
        return real(x, cache, last_only)

    monkeypatch.setattr(dec, "forward", spy)
    last = dec.prefill(ids, dec.new_cache(capacity=len(ids) + 1))
    prefill_calls, calls[:] = list(calls), []
    steps = score_steps(fused_generator, [ids], top=2)  # one call per scheduler step (Scheduler.call_steps)
    taken = 0
    try:
        while True:
            next(steps)
            taken += 1
    except StopIteration as done:
        scored = done.value[0]
    assert prefill_calls == [(0, 64), (64, 64), (128, 22)] and calls == prefill_calls and taken == len(calls)
    assert len(scored) == len(ids) and [s.token for s in scored] == ids
    every = dec.prefill(ids, dec.new_cache(capacity=len(ids) + 1), last_only=False)
    assert every.shape[:2] == (1, len(ids))
    np.testing.assert_array_equal(every[0, -1], last[0])
