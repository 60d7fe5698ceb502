"""``embedding``: a table built on the meta device gets no initial values (torch's Python
meta kernel for them imports ``torch._dynamo``, seconds of a server's start); one built
elsewhere gets ``nn.Embedding``'s."""

import subprocess
import sys

import torch
from torch import nn

from cosyserve.models.embedding import embedding

_BUILD_ON_META = """
import sys, torch
from cosyserve.modeldir.presets import TINY
from cosyserve.models.flow import Flow
from cosyserve.models.lm import CosyVoice2LM
with torch.device("meta"):
    CosyVoice2LM(TINY.lm), Flow(TINY.flow)
assert "torch._dynamo" not in sys.modules
"""


def test_models_built_on_the_meta_device_import_no_dynamo() -> None:
    subprocess.run([sys.executable, "-c", _BUILD_ON_META], check=True, timeout=120)


def test_a_table_built_elsewhere_starts_as_nn_embeddings() -> None:
    torch.manual_seed(0)
    want = nn.Embedding(50, 8).weight
    torch.manual_seed(0)
    got = embedding(50, 8).weight
    assert torch.equal(got, want) and got.requires_grad
