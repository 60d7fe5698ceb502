"""The model families this server runs and the files that tell them apart.

Free of torch, so that the command line can offer the families without loading it.
"""

import enum

YAML_FILE = "cosyvoice2.yaml"
YAML3_FILE = "cosyvoice3.yaml"
LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPEECH_TOKENIZER3_FILE = "speech_tokenizer_v3.onnx"


class Family(enum.StrEnum):
    """A CosyVoice model generation this server runs."""

    COSYVOICE2 = "cosyvoice2"
    COSYVOICE3 = "cosyvoice3"

    @property
    def yaml_file(self) -> str:
        return YAML_FILE if self is Family.COSYVOICE2 else YAML3_FILE

    @property
    def speech_tokenizer_file(self) -> str:
        return SPEECH_TOKENIZER_FILE if self is Family.COSYVOICE2 else SPEECH_TOKENIZER3_FILE

    @property
    def official_name(self) -> str:
        return "CosyVoice2-0.5B" if self is Family.COSYVOICE2 else "Fun-CosyVoice3-0.5B-2512"

    @property
    def required_files(self) -> tuple[str, ...]:
        return (self.yaml_file, LLM_FILE, FLOW_FILE, HIFT_FILE, CAMPPLUS_FILE, self.speech_tokenizer_file)
