# What a decode step looks like on the wire, for LatentdClient and ShardedClient alike:
# the model's head dimensions, float arrays to and from the server's 16-bit dtype, a
# step's DecodeStep message and a result's StepOutput.
from dataclasses import dataclass

import numpy as np

from . import latentd_pb2

HEAD_DIM_QK = 576
HEAD_DIM_V = 512
# Inputs of these types are taken as bytes already in the server dtype.
_RAW = (bytes, bytearray, memoryview)


def to_wire(array, dtype):
    """float array -> raw little-endian bytes in the server dtype (latentd_pb2.BF16 or FP16)."""
    a = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == latentd_pb2.FP16:
        return a.astype("<f2").tobytes()
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype("<u2").tobytes()


def from_wire(data, dtype, shape=None):
    """Raw bytes in the server dtype -> float32 array (optionally reshaped)."""
    if dtype == latentd_pb2.FP16:
        a = np.frombuffer(data, dtype="<f2").astype(np.float32)
    else:
        a = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return a.reshape(shape) if shape is not None else a


@dataclass
class StepOutput:
    request_id: int
    out: np.ndarray  # [s_q, h_q, 512] float32 (empty when the step failed)
    lse: np.ndarray  # [h_q, s_q] float32
    code: int  # google.rpc.Code, 0 = OK
    message: str

    @property
    def ok(self):
        return self.code == 0


class ModelWire:
    """Shape and wire conversion of the model a client's daemons serve; the class that
    mixes it in sets self.info (their ServerInfo)."""

    @property
    def h_q(self):
        return self.info.num_heads_q

    @property
    def h_kv(self):
        return self.info.num_heads_kv

    @property
    def hidden_size(self):
        """The model's hidden size when the daemon serves the layer API (else 0)."""
        return self.info.hidden_size if self.info.layer_api else 0

    def wire(self, array):
        return to_wire(array, self.info.dtype)

    def unwire(self, data, shape):
        return from_wire(data, self.info.dtype, shape)

    def _raw(self, data):
        """data as bytes in the server dtype: raw bytes as they are, a float array converted."""
        return data if isinstance(data, _RAW) else self.wire(data)

    def _step_message(self, request_id, sequence_id, layer, q, kv, causal=False, timeout_ms=0):
        """The DecodeStep of a step with its tensors in the message, and its s_q."""
        step = latentd_pb2.DecodeStep(request_id=request_id, sequence_id=sequence_id, layer=layer,
                                      q=bytes(self._raw(q)), kv=bytes(self._raw(kv)), causal=causal,
                                      timeout_ms=timeout_ms)
        return step, len(step.q) // (self.h_q * HEAD_DIM_QK * 2)

    def _layer_step_message(self, request_id, sequence_id, layer, hidden, causal=False, position=None, timeout_ms=0):
        """The DecodeStep of a layer step (hidden [s_q, hidden_size] in the message), and
        its s_q as a negative number (its result is [s_q, hidden_size], no lse)."""
        if not self.hidden_size:
            raise ValueError("the daemon does not serve the layer API (ServerInfo.layer_api is false)")
        step = latentd_pb2.DecodeStep(request_id=request_id, sequence_id=sequence_id, layer=layer,
                                      hidden=bytes(self._raw(hidden)), causal=causal, timeout_ms=timeout_ms)
        if position is not None:
            step.position = position
        return step, -(len(step.hidden) // (self.hidden_size * 2))

    def _step_output(self, result, s_q):
        """A StepResult as a StepOutput: out and lse decoded, or empty for a failed step and
        for a region step (s_q 0: its results are in the region)."""
        if result.code == 0 and s_q < 0:  # a layer step: the layer's output, no lse
            out = self.unwire(result.out, (-s_q, self.hidden_size))
            lse = np.zeros((0,), np.float32)
        elif result.code == 0 and s_q > 0:
            out = self.unwire(result.out, (s_q, self.h_q, HEAD_DIM_V))
            lse = np.frombuffer(result.lse, dtype="<f4").reshape(self.h_q, s_q)
        else:
            out = np.zeros((0,), np.float32)
            lse = np.zeros((0,), np.float32)
        return StepOutput(result.request_id, out, lse, result.code, result.message)
