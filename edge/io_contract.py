"""The ONNX decoder's input/output contract, declared once.

Export writes it into the manifest, the runtime binds by it, and the TensorRT
builder derives its optimization profiles from its dynamic axes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edge.errors import ManifestError


@dataclass(frozen=True)
class DecoderIO:
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str = "position_ids"
    past_key: str = "past_key_values.{i}.key"
    past_value: str = "past_key_values.{i}.value"
    logits: str = "logits"
    present_key: str = "present.{i}.key"
    present_value: str = "present.{i}.value"
    kv_layout: str = "batch,kv_heads,past_sequence_length,head_dim"
    # named dynamic axes, as they appear in the graph
    batch_axis: str = "batch_size"
    sequence_axis: str = "sequence_length"
    past_axis: str = "past_sequence_length"
    # the fused graph (GroupQueryAttention) takes per-row lengths instead of a mask and positions, and
    # writes each step's K/V in place into a max-length buffer that is bound as both past and present
    seqlens_k: str = ""  # int32 [batch]: tokens in the cache after this step, minus one
    total_sequence_length: str = ""  # int32 scalar: the longest row's length after this step
    # int64 [batch, k]: the input positions whose logits the graph returns ([batch, k, vocab]); the LM head
    # (a fifth of a prefill's compute, and [batch, seq, vocab] of memory) then runs on those rows only.
    # Empty in graphs written before it existed: they return logits at every position.
    logit_positions: str = ""
    # the most prompt tokens one plain-graph call takes: the runtime cuts longer prompts into pieces of this
    # size, a TensorRT engine's prefill profile is built for it and the planner sizes activations by it
    prefill_chunk: int = 512
    # a bundle file (.npy, int32) of the vocabulary ids the logits' columns are, when the LM head was cut to
    # those rows (a draft model's, export/draft.py); the runtime spreads them back over the whole vocabulary
    # (-inf elsewhere), so every caller sees [.., vocab] logits. Empty: one column per id.
    logit_ids: str = ""

    @property
    def fused(self) -> bool:
        """Shared in-place KV buffer and lengths, not a growing past and a mask."""
        return bool(self.seqlens_k)

    def past_names(self, num_layers: int) -> list[str]:
        return [n.format(i=i) for i in range(num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self, num_layers: int) -> list[str]:
        return [n.format(i=i) for i in range(num_layers) for n in (self.present_key, self.present_value)]

    def input_names(self, num_layers: int) -> list[str]:
        if self.fused:
            extra = [self.logit_positions] if self.logit_positions else []
            return [self.input_ids, self.seqlens_k, self.total_sequence_length, *extra, *self.past_names(num_layers)]
        return [self.input_ids, self.attention_mask, self.position_ids, *self.past_names(num_layers)]

    def output_names(self, num_layers: int) -> list[str]:
        return [self.logits, *self.present_names(num_layers)]

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["logit_ids"]:  # absent unless used: a schema-5 reader refuses keys it does not know
            del d["logit_ids"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderIO":
        """The contract a manifest records. A key this runtime does not know is refused, not dropped: it may name
        an input the graph needs (a newer exporter bumps the manifest's schema version for a new key, so a
        runtime that cannot bind it refuses the bundle by version, see edge/bundle.py)."""
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ManifestError(f"the engine's I/O contract (manifest 'io') has keys this edgechat does not know: "
                                f"{unknown}; upgrade edgechat or re-export the bundle")
        return cls(**d)


FUSED_IO = DecoderIO(attention_mask="", position_ids="", past_axis="max_sequence_length",
                     kv_layout="batch,kv_heads,max_sequence_length,head_dim", seqlens_k="seqlens_k",
                     total_sequence_length="total_sequence_length", logit_positions="logit_positions")


def io_for_variant(variant: str) -> DecoderIO:
    """The contract a graph variant follows: "plain" (optimum's trace, standard ops) or "fused"."""
    if variant not in ("plain", "fused"):
        raise ValueError(f"unknown graph variant {variant!r}: plain or fused")
    return FUSED_IO if variant == "fused" else DecoderIO()
