"""Load a model directory (CosyVoice 2 or 3) into our native modules, once per process.

The family seam of loading: the LM is the same kind of module in both families and is
stored as the plan says; the flow and the vocoder are the family's own."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from cosyserve.accel.flow_cache_mode import flow_prompt_whole_problem
from cosyserve.accel.lm_compile import compile_lm_
from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, DecodeCapture, Plan, Profile, choose_plan
from cosyserve.accel.precision import Dtype, FlowQuantization, Precision, Quantization
from cosyserve.accel.quantize import fp16_weights_, quantize_lm_
from cosyserve.engine.config import EngineConfig
from cosyserve.frontend.features import PromptFeatureExtractor
from cosyserve.frontend.text_tokenizer import TextTokenizer
from cosyserve.memory import PageReleaser, prefetch
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.layout import ModelDir
from cosyserve.models.dit import Flow3, flow3_checkpoint_table
from cosyserve.models.flow.blocks import pack_convs_
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.hift3 import CausalHiFTGenerator, causal_hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.models.lm3 import CosyVoice3LM, lm3_checkpoint_table
from cosyserve.models.packed_linear import pack_linears_
from cosyserve.models.speech_lm import AnySpeechLM
from cosyserve.parallelism import call_on_own_thread
from cosyserve.weights.checkpoint import CheckpointTable, load_checkpoint

logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=torch.nn.Module)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Everything shared between requests: weights, tokenizer, feature sessions, speakers.

    ``speakers``: ``spk2info.pt`` embeddings, name -> (192,) float32.
    ``plan``: how the modules are stored and run (:class:`~cosyserve.accel.plan.Plan`);
    an engine's KV cache must use ``precision.kv_cache_dtype`` on ``precision.device``.
    """

    model_dir: ModelDir
    hparams: ModelHParams | Model3HParams
    lm: AnySpeechLM
    flow: Flow | Flow3
    hift: HiFTGenerator | CausalHiFTGenerator
    tokenizer: TextTokenizer
    features: PromptFeatureExtractor
    speakers: dict[str, torch.Tensor]
    plan: Plan

    @property
    def precision(self) -> Precision:
        return self.plan.precision


def load_model(
    path: Path | str,
    plan: Plan | None = None,
    *,
    threads: int | None = None,
    dtype: Dtype | str | None = None,
    quantize: Quantization | str | None = None,
    flow_quantize: FlowQuantization | str | None = None,
    device: str | None = None,
    compile: bool = False,
) -> LoadedModel:
    """Validate and load the model directory at ``path`` in eval mode, as ``plan`` says.

    Without a plan: the ``exact`` profile on this machine with the given choices
    (:func:`~cosyserve.accel.plan.choose_plan`; no choices give the float32 parity model).
    Raises :class:`~cosyserve.accel.precision.PrecisionError` for a choice this machine
    cannot run, before reading any weights, and :class:`~cosyserve.errors.ModelDirError`
    (or its ``CheckpointError``) with a message naming what is wrong with the directory.

    The tensor work runs on a thread of its own with ``threads`` torch threads (None:
    the plan's count), which exits when loading ends: see :mod:`cosyserve.parallelism`
    for why the caller's thread must not keep a pool.
    """
    if plan is None:
        choices = Choices(dtype, quantize, flow_quantize, device, compile)
        plan = choose_plan(Machine.detect(), Profile.EXACT, choices)
    elif (dtype, quantize, flow_quantize, device, compile) != (None, None, None, None, False):
        raise TypeError("pass precision choices or a plan, not both")
    for line in plan.warnings:
        logger.warning(line)
    count = plan.threads if threads is None else threads
    resolved = plan
    return call_on_own_thread(lambda: _load_model(path, resolved), threads=count, name="cosyserve-load")


def _load_model(path: Path | str, plan: Plan) -> LoadedModel:
    start = time.perf_counter()
    model_dir = ModelDir.open(path)
    if model_dir.family is Family.COSYVOICE3:
        plan = plan.for_cosyvoice3()
    precision = plan.precision
    hp = model_dir.hparams()
    tokenizer = model_dir.text_tokenizer()
    flow: Flow | Flow3
    hift: HiFTGenerator | CausalHiFTGenerator
    lm: AnySpeechLM
    if isinstance(hp, Model3HParams):
        lm = _load_lm(model_dir, partial(CosyVoice3LM, hp.lm), lm3_checkpoint_table(hp.lm), plan)
        flow, hift = _load_flow3(model_dir, hp, plan)
    else:
        lm = _load_lm(model_dir, partial(CosyVoice2LM, hp.lm), lm_checkpoint_table(hp.lm), plan)
        flow, hift = _load_flow2(model_dir, hp, plan)
    for module in (lm, flow, hift):
        module.eval().requires_grad_(False)
    speakers = {name: emb.reshape(-1) for name, emb in model_dir.read_spk2info().items()}
    features = PromptFeatureExtractor.from_model_dir(
        model_dir.root, speech_tokenizer_file=model_dir.speech_tokenizer.name, mel_fmax=hp.mel.fmax
    )
    model = LoadedModel(
        model_dir=model_dir,
        hparams=hp,
        lm=lm,
        flow=flow,
        hift=hift,
        tokenizer=tokenizer,
        features=features,
        speakers=speakers,
        plan=plan,
    )
    logger.info(
        "loaded %s (%s), %s, in %.1f s",
        model_dir.root,
        model_dir.family,
        precision.describe(),
        time.perf_counter() - start,
    )
    return model


def _load_on_meta(
    build: Callable[[], _M], path: Path, table: CheckpointTable, dtype: torch.dtype, device: torch.device
) -> _M:
    """``build()`` on the meta device, so that no random initial weights are allocated (a
    flow's fixed noise is made on the CPU all the same), in ``dtype``, so that loading
    assigns the checkpoint's tensors (memory-mapped in float32) or converts each once as it
    is read; then on ``device``."""
    with torch.device("meta"):
        module = build()
    module.to(dtype=dtype)
    load_checkpoint(module, path, table)
    module.to(device)
    return module


def _load_flow2(model_dir: ModelDir, hp: ModelHParams, plan: Plan) -> tuple[Flow, HiFTGenerator]:
    precision = plan.precision
    table = flow_checkpoint_table(hp.flow)
    flow = _load_on_meta(
        partial(Flow, hp.flow), model_dir.flow, table, precision.flow_dtype, precision.torch_device
    )
    flow.fuse_projections_()
    if precision.flow_quantize is FlowQuantization.FP16:
        fp16_weights_(flow.cfm.estimator)
    elif plan.packed_bf16:
        pack_linears_(flow.cfm.estimator)
        pack_convs_(flow.cfm.estimator)
    flow.use_fused_bf16_attention_(plan.fused_bf16_attention)
    hift = HiFTGenerator(hp.hift)
    load_checkpoint(hift, model_dir.hift, hift_checkpoint_table(hp.hift))
    hift.to(precision.torch_device, precision.hift_dtype)
    return flow, hift


def _load_flow3(model_dir: ModelDir, hp: Model3HParams, plan: Plan) -> tuple[Flow3, CausalHiFTGenerator]:
    """CosyVoice 3's DiT flow in the plan's flow dtype and its causal vocoder in float32 (its
    f0 predictor in float64, as upstream's), on the plan's device."""
    precision = plan.precision
    table = flow3_checkpoint_table(hp.flow)
    flow = _load_on_meta(
        partial(Flow3, hp.flow), model_dir.flow, table, precision.flow_dtype, precision.torch_device
    )
    # The Euler steps come at fixed times: their time conditioning is computed once, from
    # the checkpoint's weights, and the layers that make it are dropped.
    flow.cfm.fix_time_conditioning(precision.flow_dtype)
    PageReleaser()(flow.cfm.estimator.release_time_layers())
    if precision.flow_quantize is FlowQuantization.FP16:
        fp16_weights_(flow.cfm.estimator)
    hift = CausalHiFTGenerator(hp.hift)
    load_checkpoint(hift, model_dir.hift, causal_hift_checkpoint_table(hp.hift))
    hift.to(precision.torch_device)
    return flow, hift


def engine_config_for(model: LoadedModel, **overrides: Any) -> EngineConfig:
    """Engine options for ``model`` as its plan says: the KV cache in
    ``precision.kv_cache_dtype`` on ``precision.device`` (a bf16 model gets a bf16 cache),
    decode-step replay, flow traces, the streaming flow cache and chunk schedule.
    ``overrides`` set any other :class:`EngineConfig` field (``max_active``, ...) or
    replace a plan's choice (tests and benchmarks compare them), but not the KV cache's
    dtype and device, which must be the model's.

    A compiled LM's decode steps are never traced, whatever the overrides say: TorchScript
    cannot trace the compiled modules, and they already run without Python in between."""
    if {"dtype", "device"} & overrides.keys():
        raise TypeError("the KV cache's dtype and device follow the model's plan")
    plan = model.plan
    options: dict[str, Any] = {
        "dtype": plan.precision.kv_cache_dtype,
        "device": plan.precision.device,
        "cuda_graphs": plan.decode_capture is DecodeCapture.CUDA_GRAPHS,
        "traced_decode": plan.decode_capture is DecodeCapture.TRACE,
        "traced_flow": plan.traced_flow,
        "flow_cache": plan.flow_cache,
        "flow_cache_dtype": plan.flow_cache_dtype,
        "first_hop": plan.first_hop,
        "hop_growth": plan.hop_growth,
        **overrides,
    }
    # Priming whole prompts needs a prompt cache, which an operator may have set to none.
    whole_possible = not flow_prompt_whole_problem(
        True, options["flow_cache"], options.get("flow_prompt_cache_mb", EngineConfig.flow_prompt_cache_mb)
    )
    options.setdefault("flow_prompt_whole", plan.flow_prompt_whole and whole_possible)
    if plan.precision.compile:
        options["traced_decode"] = False
    return EngineConfig(**options)


def _load_lm(
    model_dir: ModelDir, build: Callable[[], AnySpeechLM], table: CheckpointTable, plan: Plan
) -> AnySpeechLM:
    """The LM ``build`` makes, loaded in ``precision.lm_dtype`` on its device (see
    :func:`_load_on_meta`), quantized as asked: quantization replaces the decoder Linears
    one by one. Compilation (if asked) comes last, on the final weights.
    """
    precision = plan.precision
    lm = _load_on_meta(build, model_dir.llm, table, precision.lm_dtype, precision.torch_device)
    quantize_lm_(
        lm, precision, native=plan.machine.cpu if plan.native_int8 else None, onednn=plan.onednn_int8
    )
    lm.lay_out_head_for_decode_()
    lm.eval().requires_grad_(False)
    # Memory-mapped in float32 and read a few rows per request: have its file read now.
    prefetch(lm.qwen.embed_tokens.weight)
    if precision.compile:
        compile_lm_(lm, precision)
    return lm
