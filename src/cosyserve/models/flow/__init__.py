"""The CosyVoice 2 flow: speech tokens + voice prompt -> mel (upstream ``CausalMaskedDiffWithXvec``)."""

from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.table import flow_checkpoint_table

__all__ = ["Flow", "flow_checkpoint_table"]
