"""The ONNX decoder's input/output contract, declared once.

Export writes it into the manifest, the runtime binds by it, and the TensorRT
builder derives its optimization profiles from its dynamic axes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from edge.errors import ManifestError

KV_FLOAT, KV_INT8 = "float", "int8"
KV_CACHES = (KV_FLOAT, KV_INT8)  # what a graph's K/V buffers may hold (`DecoderIO.kv_cache`; "" reads as float)
KV_BYTES = {KV_INT8: 1}  # bytes per cached K/V element where the cache type fixes it (float: the graph's dtype)


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
    # what the K/V buffers hold: "" or "float" (the graph's float type), "int8" (export/kv_int8.py): past and
    # present are int8 and a value is int8 * scale, the scale a per-layer [1, kv_heads, 1, head_dim] float32
    # initializer of the graph named by kv_scale_key / kv_scale_value ({i}: the layer). Static scales
    # calibrated at export, so a backend (TensorRT later) can dequantize with them without measuring anything.
    kv_cache: str = ""
    kv_scale_key: str = ""
    kv_scale_value: str = ""

    @property
    def fused(self) -> bool:
        """Shared in-place KV buffer and lengths, not a growing past and a mask."""
        return bool(self.seqlens_k)

    @property
    def kv_int8(self) -> bool:
        """The K/V buffers hold int8 with per-channel scales (see `kv_cache`)."""
        return self.kv_cache == KV_INT8

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
        for key in ("logit_ids", "kv_cache", "kv_scale_key", "kv_scale_value"):
            if not d[key]:  # absent unless used: an older reader refuses keys it does not know
                del d[key]
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
        io = cls(**d)
        if io.kv_cache not in ("", *KV_CACHES):
            raise ManifestError(f"the engine's I/O contract names a KV cache {io.kv_cache!r} this edgechat does not "
                                f"know ({', '.join(KV_CACHES)}); upgrade edgechat or re-export the bundle")
        if io.kv_int8 and not (io.fused and io.kv_scale_key and io.kv_scale_value):
            raise ManifestError("the engine's I/O contract has an int8 KV cache without a fused graph and its scale "
                                "names (kv_scale_key, kv_scale_value): the manifest is damaged, rebuild the bundle")
        return io


FUSED_IO = DecoderIO(attention_mask="", position_ids="", past_axis="max_sequence_length",
                     kv_layout="batch,kv_heads,max_sequence_length,head_dim", seqlens_k="seqlens_k",
                     total_sequence_length="total_sequence_length", logit_positions="logit_positions")


def io_for_variant(variant: str, kv_cache: str = "") -> DecoderIO:
    """The contract a graph variant follows: "plain" (optimum's trace, standard ops) or "fused"; `kv_cache`
    "int8": the fused graph with an int8 cache (export/kv_int8.py writes the scale tensors these names say)."""
    if variant not in ("plain", "fused"):
        raise ValueError(f"unknown graph variant {variant!r}: plain or fused")
    if kv_cache == KV_INT8:
        if variant != "fused":
            raise ValueError("an int8 KV cache is written into the fused graph only")
        return replace(FUSED_IO, kv_cache=KV_INT8, kv_scale_key="kv_scale.{i}.key", kv_scale_value="kv_scale.{i}.value")
    return FUSED_IO if variant == "fused" else DecoderIO()
