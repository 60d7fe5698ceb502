"""How streaming chunks reach the flow (torch-free, so settings and the CLI can name it);
see :class:`cosyserve.engine.token2wav.Token2Wav`."""

from typing import Literal, get_args

FlowCacheMode = Literal["exact", "cached", "incremental"]
FLOW_CACHE_MODES: tuple[FlowCacheMode, ...] = get_args(FlowCacheMode)
