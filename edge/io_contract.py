"""The ONNX decoder's input/output contract, declared once.

Export writes it into the manifest, the runtime binds by it, and the TensorRT
builder derives its optimization profiles from its dynamic axes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def past_names(self, num_layers: int) -> list[str]:
        return [n.format(i=i) for i in range(num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self, num_layers: int) -> list[str]:
        return [n.format(i=i) for i in range(num_layers) for n in (self.present_key, self.present_value)]

    def input_names(self, num_layers: int) -> list[str]:
        return [self.input_ids, self.attention_mask, self.position_ids, *self.past_names(num_layers)]

    def output_names(self, num_layers: int) -> list[str]:
        return [self.logits, *self.present_names(num_layers)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderIO":
        return cls(**d)
