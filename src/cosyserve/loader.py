"""Load a CosyVoice 2 model directory into our native modules, once per process."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cosyserve.frontend.features import PromptFeatureExtractor
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.layout import ModelDir
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.text_tokenizer import TextTokenizer
from cosyserve.weights.checkpoint import load_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Everything shared between requests: weights, tokenizer, feature sessions, speakers.

    ``speakers``: ``spk2info.pt`` embeddings, name -> (192,) float32.
    """

    model_dir: ModelDir
    hparams: ModelHParams
    lm: CosyVoice2LM
    flow: Flow
    hift: HiFTGenerator
    tokenizer: TextTokenizer
    features: PromptFeatureExtractor
    speakers: dict[str, torch.Tensor]


def load_model(path: Path | str) -> LoadedModel:
    """Validate and load the model directory at ``path`` (fp32, CPU, eval mode).

    Raises :class:`~cosyserve.errors.ModelDirError` (or its ``CheckpointError``) with a
    message naming what is wrong.
    """
    start = time.perf_counter()
    model_dir = ModelDir.open(path)
    hp = model_dir.hparams()
    tokenizer = model_dir.text_tokenizer()
    lm = CosyVoice2LM(hp.lm)
    load_checkpoint(lm, model_dir.llm, lm_checkpoint_table(hp.lm))
    flow = Flow(hp.flow)
    load_checkpoint(flow, model_dir.flow, flow_checkpoint_table(hp.flow))
    hift = HiFTGenerator(hp.hift)
    load_checkpoint(hift, model_dir.hift, hift_checkpoint_table(hp.hift))
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
    )
    logger.info("loaded %s in %.1f s", model_dir.root, time.perf_counter() - start)
    return model
