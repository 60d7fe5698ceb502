"""Load a CosyVoice 2 model directory into our native modules, once per process."""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cosyserve.accel.lm_compile import compile_lm_
from cosyserve.accel.precision import Dtype, FlowQuantization, Precision, Quantization
from cosyserve.accel.quantize import fp16_weights_, quantize_lm_
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.flow_cache_mode import FlowCacheMode, default_flow_cache
from cosyserve.frontend.features import PromptFeatureExtractor
from cosyserve.frontend.text_tokenizer import TextTokenizer
from cosyserve.memory import prefetch
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.layout import ModelDir
from cosyserve.models.flow.blocks import pack_convs_
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.models.packed_linear import pack_linears_
from cosyserve.parallelism import call_on_own_thread
from cosyserve.weights.checkpoint import load_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Everything shared between requests: weights, tokenizer, feature sessions, speakers.

    ``speakers``: ``spk2info.pt`` embeddings, name -> (192,) float32.
    ``precision``: how the modules are stored and run; an engine's KV cache must use
    ``precision.kv_cache_dtype`` on ``precision.device``.
    """

    model_dir: ModelDir
    hparams: ModelHParams
    lm: CosyVoice2LM
    flow: Flow
    hift: HiFTGenerator
    tokenizer: TextTokenizer
    features: PromptFeatureExtractor
    speakers: dict[str, torch.Tensor]
    precision: Precision = field(default_factory=Precision)


def load_model(
    path: Path | str,
    *,
    dtype: Dtype | str = Dtype.FP32,
    quantize: Quantization | str = Quantization.NONE,
    device: str = "cpu",
    compile: bool = False,
    flow_quantize: FlowQuantization | str = FlowQuantization.NONE,
    threads: int | None = None,
) -> LoadedModel:
    """Validate and load the model directory at ``path`` in eval mode.

    ``dtype``, ``quantize``, ``device``, ``compile`` and ``flow_quantize`` select the precision (see
    :class:`~cosyserve.accel.precision.Precision`; the defaults give the float32 CPU
    model). Raises :class:`~cosyserve.accel.precision.PrecisionError` for a setting this
    machine cannot run, before reading any weights, and
    :class:`~cosyserve.errors.ModelDirError` (or its ``CheckpointError``) with a message
    naming what is wrong with the directory.

    The tensor work runs on a thread of its own with ``threads`` torch threads (None:
    the calling thread's count), which exits when loading ends: see
    :mod:`cosyserve.parallelism` for why the caller's thread must not keep a pool.
    """
    count = torch.get_num_threads() if threads is None else threads
    precision = Precision.resolve(dtype, quantize, device, compile, flow_quantize)
    for line in precision.advice():
        logger.warning(line)
    return call_on_own_thread(lambda: _load_model(path, precision), threads=count, name="cosyserve-load")


def _load_model(path: Path | str, precision: Precision) -> LoadedModel:
    start = time.perf_counter()
    model_dir = ModelDir.open(path)
    hp = model_dir.hparams()
    tokenizer = model_dir.text_tokenizer()
    lm = _load_lm(model_dir, hp, precision)
    # On the meta device, as the LM: no random initial weights (its fixed noise is made on
    # the CPU), and in its dtype, so that each weight is converted as it is read.
    with torch.device("meta"):
        flow = Flow(hp.flow)
    flow.to(dtype=precision.flow_dtype)
    load_checkpoint(flow, model_dir.flow, flow_checkpoint_table(hp.flow))
    flow.to(precision.torch_device)
    flow.fuse_projections_()
    if precision.flow_quantize is FlowQuantization.FP16:
        fp16_weights_(flow.cfm.estimator)
    elif precision.flow_dtype == torch.bfloat16 and not precision.on_cuda:
        pack_linears_(flow.cfm.estimator)
        pack_convs_(flow.cfm.estimator)
    hift = HiFTGenerator(hp.hift)
    load_checkpoint(hift, model_dir.hift, hift_checkpoint_table(hp.hift))
    hift.to(precision.torch_device, precision.hift_dtype)
    for module in (lm, flow, hift):
        module.eval().requires_grad_(False)
    speakers = {name: emb.reshape(-1) for name, emb in model_dir.read_spk2info().items()}
    model = LoadedModel(
        model_dir=model_dir,
        hparams=hp,
        lm=lm,
        flow=flow,
        hift=hift,
        tokenizer=tokenizer,
        features=PromptFeatureExtractor.from_model_dir(model_dir.root),
        speakers=speakers,
        precision=precision,
    )
    logger.info("loaded %s, %s, in %.1f s", model_dir.root, precision.describe(), time.perf_counter() - start)
    return model


def engine_config_for(
    model: LoadedModel, flow_cache: FlowCacheMode | None = None, **overrides: Any
) -> EngineConfig:
    """Engine options for ``model``: its KV cache in ``model.precision.kv_cache_dtype`` on
    ``model.precision.device``, so a bf16 model gets a bf16 cache; ``flow_cache`` None is
    the device's default (:func:`default_flow_cache`); ``overrides`` set the other
    :class:`EngineConfig` fields (``max_active``, ...), not dtype and device.

    A compiled LM's decode steps are not traced (``traced_decode`` is off whatever the
    overrides say): TorchScript cannot trace the compiled modules, and they already run
    their ops without Python in between."""
    precision = model.precision
    if precision.compile:
        overrides["traced_decode"] = False
    return EngineConfig(
        dtype=precision.kv_cache_dtype,
        device=precision.device,
        flow_cache=flow_cache or default_flow_cache(precision.device),
        **overrides,
    )


def _load_lm(model_dir: ModelDir, hp: ModelHParams, precision: Precision) -> CosyVoice2LM:
    """The LM in ``precision.lm_dtype`` on its device, quantized as asked.

    Built on the meta device, so no random initial weights are allocated: loading assigns
    the checkpoint's tensors, memory-mapped (float32) or converted once (other dtypes),
    and quantization then replaces the decoder Linears one by one. Compilation (if asked)
    comes last, on the final weights.
    """
    with torch.device("meta"):
        lm = CosyVoice2LM(hp.lm)
    lm.to(precision.lm_dtype)
    load_checkpoint(lm, model_dir.llm, lm_checkpoint_table(hp.lm))
    lm.to(precision.torch_device)
    quantize_lm_(lm, precision)
    lm.lay_out_head_for_decode_()
    lm.eval().requires_grad_(False)
    # Memory-mapped in float32 and read a few rows per request: have its file read now.
    prefetch(lm.qwen.embed_tokens.weight)
    if precision.compile:
        compile_lm_(lm, precision)
    return lm
