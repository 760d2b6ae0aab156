"""Training helpers above the integration layer: α schedules, layer tables, diagnostics."""

from hf_spanattn.training.callback import SpanAttentionCallback
from hf_spanattn.training.diagnostics import OrderRecorder
from hf_spanattn.training.schedule import Keyframe, Schedule

__all__ = ["Keyframe", "OrderRecorder", "Schedule", "SpanAttentionCallback"]
