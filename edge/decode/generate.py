"""Bundle + tokenizer + decoder: prompts in, streamed text out.

`Generator.stream` runs the one decode loop (edge.decode.scheduler) with a single row in the caller's thread:
the CLI, the REPL and the export's evaluation get their tokens from the very code the server batches.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

from edge.bundle import Bundle
from edge.backends.decoder import Decoder
from edge.decode.sampling import SamplingConfig
from edge.decode.scheduler import Scheduler
from edge.decode.text_stream import StreamEvent
from edge.decode.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from edge.decode.logits import RowLogits
    from edge.decode.speculative import RowSpeculator


class Generator:
    """What a chat needs to answer: the tokenizer, the decoder and the bundle's generation defaults."""

    def __init__(self, tokenizer: ChatTokenizer, decoder: Decoder, defaults: dict | None = None,
                 bundle: Bundle | None = None) -> None:
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.max_context = decoder.dims.max_context
        self.defaults = defaults or {}
        self.bundle = bundle
        self.choice = None  # edge.backends.choose.Choice: which backend runs, and why the others did not
        self.speculative = False  # speculative decoding for answers without a seed (edge.decode.speculative)
        self.drafter = None  # edge.decode.speculative.ModelDrafter (use_draft); None: prompt lookup drafts
        self.draft_name = ""  # the draft's model and engine, for the server's start line and logs
        self.draft_source = ""  # where the draft came from: "--draft", or the bundle's own with its acceptance
        self.speculator: "RowSpeculator | None" = None  # the latest answer's proposer (its stats)
        self.scheduler: Scheduler | None = None  # the latest answer's loop (its steps)

    @classmethod
    def from_bundle(cls, bundle: Bundle, engine: str | None = None, threads: int | None = None,
                    providers: list[str] | None = None, spin: bool = True) -> "Generator":
        """Load with the backend the fallback chain picks here (edge.backends.choose), unless `providers` forces
        ONNX Runtime execution providers."""
        from edge.backends.choose import load_decoder

        m = bundle.manifest
        dec, choice = load_decoder(bundle, engine, threads, providers, spin)
        gen = cls(ChatTokenizer(bundle.path(m.tokenizer.file), m.tokenizer), dec, m.generation, bundle)
        gen.choice = choice
        return gen

    def sampling(self, **overrides) -> SamplingConfig:
        base = {k: v for k, v in self.defaults.items() if k in SamplingConfig.__dataclass_fields__}
        base.update({k: v for k, v in overrides.items() if v is not None})
        if "stop" in base:
            base["stop"] = tuple([base["stop"]] if isinstance(base["stop"], str) else base["stop"])
        return SamplingConfig(**base)

    def stream(self, prompt_ids: list[int], cfg: SamplingConfig, cancel: threading.Event | None = None,
               speculator: "RowSpeculator | None" = None, logits: "RowLogits | None" = None) -> Iterator[StreamEvent]:
        """The answer's text as it is generated; the last event has finish_reason and stats. `speculator`: draft
        with this proposer instead of the generator's own (a measurement, e.g. `RowSpeculator.fixed`); the
        scheduler that ran is left in `self.scheduler` (its `steps`). `logits`: the row's processors (e.g. a
        reasoning budget, edge.decode.logits)."""
        self.scheduler = sched = Scheduler(self, max_batch=1, max_queue=1, prompt_cache_mb=0)
        sched.speculator = self.speculator = speculator if speculator is not None else self.make_speculator()
        yield from sched.generate(prompt_ids, cfg, cancel, logits)

    def use_draft(self, draft: "Generator", source: str = "--draft") -> None:
        """Draft with a smaller model of the same tokenizer (turns speculation on). `source`: where it came
        from, for the server's start line."""
        from edge.decode.speculative import ModelDrafter, same_vocabulary

        same_vocabulary(self.tokenizer, draft.tokenizer)
        self.drafter = ModelDrafter(draft.decoder, self.decoder.dims.vocab_size)
        self.speculative = True
        engine = getattr(draft.decoder, "engine", None)
        model = draft.bundle.manifest.model_name.split("/")[-1] if draft.bundle is not None else "draft"
        self.draft_name = f"{model} {engine.name if engine is not None else draft.decoder.name}"
        self.draft_source = source

    def make_speculator(self):
        """The scheduler's speculative step (edge.decode.speculative.RowSpeculator), or None when speculation is off."""
        if not self.speculative:
            return None
        from edge.decode.speculative import RowSpeculator, lookup_draft

        return RowSpeculator(self.drafter or lookup_draft)

    def tokens(self, prompt_ids: list[int], cfg: SamplingConfig) -> list[int]:
        """The answer's token ids (EOS not included)."""
        return self.complete(prompt_ids, cfg)[1].token_ids

    def complete(self, prompt_ids: list[int], cfg: SamplingConfig) -> tuple[str, StreamEvent]:
        parts = []
        last = None
        for ev in self.stream(prompt_ids, cfg):
            parts.append(ev.text)
            last = ev
        assert last is not None
        return "".join(parts), last
