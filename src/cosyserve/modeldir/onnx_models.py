"""Small random stand-ins for the two ONNX models of the official directory.

The real ``campplus.onnx`` (CAM++ speaker encoder) and ``speech_tokenizer_v2.onnx`` /
``speech_tokenizer_v3.onnx`` (S3 tokenizers v2 and v3, the same signature: whisper
log-mel in, 25 Hz FSQ codes in [0, 6561) out) cannot be downloaded here. These graphs
have the official signatures, read by position as upstream does, and produce outputs of
the official shapes, dtypes and ranges from seeded random weights. The same seed gives byte-identical files.
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Old enough for every onnxruntime upstream's requirements allow (1.18 reads up to IR 10).
OPSET = 17
IR_VERSION = 8

FBANK_BINS = 80
SPEAKER_EMBED_DIM = 192
WHISPER_MELS = 128
# 100 Hz whisper frames -> 25 Hz tokens.
TOKEN_STRIDE = 4
# FSQ of the S3 tokenizer v2: 8 dimensions quantised to 3 levels -> 3**8 = 6561 codes.
FSQ_DIMS = 8
FSQ_LEVELS = 3
SPEECH_TOKEN_CODES = FSQ_LEVELS**FSQ_DIMS
_CAMPPLUS_HIDDEN = 256


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="cosyserve",
        producer_version="1",
        ir_version=IR_VERSION,
    )
    onnx.checker.check_model(model)
    return model


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name=name)


def campplus_model(seed: int) -> onnx.ModelProto:
    """fbank ``(B, T, 80)`` float32 -> speaker embedding ``(B, 192)`` float32.

    MatMul -> ReLU -> mean over time -> MatMul: a fixed-size embedding of any length input.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((FBANK_BINS, _CAMPPLUS_HIDDEN)) / np.sqrt(FBANK_BINS)).astype(np.float32)
    w2 = (rng.standard_normal((_CAMPPLUS_HIDDEN, SPEAKER_EMBED_DIM)) / np.sqrt(_CAMPPLUS_HIDDEN)).astype(
        np.float32
    )
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["hidden"]),
        helper.make_node("Relu", ["hidden"], ["act"]),
        helper.make_node("ReduceMean", ["act"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", FBANK_BINS])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", SPEAKER_EMBED_DIM])],
        initializer=[_init("w1", w1), _init("w2", w2)],
    )
    return _model(graph)


def speech_tokenizer_model(seed: int, name: str = "speech_tokenizer_v2") -> onnx.ModelProto:
    """whisper log-mel ``(B, 128, T)`` float32, lengths ``(B,)`` int32 -> tokens ``(B, T // 4)`` int32.

    A stride-4 convolution to 8 dimensions, tanh, rounding to {-1, 0, 1} (3-level FSQ) and
    a base-3 code in [0, 6561). Frames past ``lengths // 4`` get code 0, so padding does
    not produce content tokens.
    """
    rng = np.random.default_rng(seed)
    fan_in = WHISPER_MELS * TOKEN_STRIDE
    # Scaled so that tanh saturates often enough for all three levels to be common.
    weight = (2.0 * rng.standard_normal((FSQ_DIMS, WHISPER_MELS, TOKEN_STRIDE)) / np.sqrt(fan_in)).astype(
        np.float32
    )
    powers = (FSQ_LEVELS ** np.arange(FSQ_DIMS)).astype(np.float32)
    nodes = [
        helper.make_node(
            "Conv", ["feats", "conv_w"], ["proj"], kernel_shape=[TOKEN_STRIDE], strides=[TOKEN_STRIDE]
        ),
        helper.make_node("Tanh", ["proj"], ["bounded"]),
        helper.make_node("Round", ["bounded"], ["levels"]),  # (B, 8, T') in {-1, 0, 1}
        helper.make_node("Add", ["levels", "one"], ["digits"]),  # {0, 1, 2}
        helper.make_node("Transpose", ["digits"], ["digits_t"], perm=[0, 2, 1]),  # (B, T', 8)
        helper.make_node("MatMul", ["digits_t", "powers"], ["code"]),  # (B, T'), exact in float32
        # Valid-frame mask: arange(T') < lengths // 4.
        helper.make_node("Shape", ["code"], ["code_shape"]),
        helper.make_node("Gather", ["code_shape", "one_i"], ["n_frames"], axis=0),
        helper.make_node("Range", ["zero_i", "n_frames", "one_i"], ["frame_index"]),
        helper.make_node("Cast", ["feats_length"], ["lengths64"], to=TensorProto.INT64),
        helper.make_node("Div", ["lengths64", "stride_i"], ["valid"]),
        helper.make_node("Unsqueeze", ["valid", "one_axis"], ["valid_col"]),  # (B, 1)
        helper.make_node("Less", ["frame_index", "valid_col"], ["mask"]),  # (B, T')
        helper.make_node("Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["code", "mask_f"], ["masked"]),
        helper.make_node("Cast", ["masked"], ["indices"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        inputs=[
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", WHISPER_MELS, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"]),
        ],
        outputs=[helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "T_token"])],
        initializer=[
            _init("conv_w", weight),
            _init("powers", powers),
            _init("one", np.array(1.0, np.float32)),
            _init("zero_i", np.array(0, np.int64)),
            _init("one_i", np.array(1, np.int64)),
            _init("stride_i", np.array(TOKEN_STRIDE, np.int64)),
            _init("one_axis", np.array([1], np.int64)),
        ],
    )
    return _model(graph)


def save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(model, str(path))
