"""The simulator's encode workers: no engine and no KV memory, only a FIFO queue each.

An encode worker is its own idea beside ``SimWorker``: it runs no steps and holds no
blocks, so when its queue empties is all the state it needs. A plan may split a
request's images over several encode workers (``Plan.encode_split``), which encode
their parts at once; each part waits for what its worker queued before it, then its
embeddings are pulled to the prefill worker (one link latency). The request joins its
prefill worker's queue once its last part has landed: the cluster schedules each
part's landing and asks here whether it was the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.sim.profile import Profile
from loadgen.sim.request import SimRequest
from router.types import Plan

__all__ = ["EncodeQueues", "Encoding"]


@dataclass(frozen=True, slots=True)
class Encoding:
    """One part of a request's images, encoded on one encode worker."""

    request: SimRequest
    encoder_id: str
    encode_s: float
    num_image_tokens: int  # this part's
    landed_s: float  # its embeddings are at the prefill worker


class EncodeQueues:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._free_s: dict[str, float] = {}  # encode worker -> when its queue empties
        self._parts_left: dict[str, int] = {}  # request id -> encode parts not landed yet

    def start(self, req: SimRequest, plan: Plan, now_s: float) -> list[Encoding]:
        """Each part FIFO on its encode worker, then its embeddings' pull (one link
        latency); the parts of one request run at once on their workers."""
        encode = self.profile.encode
        parts = plan.encode_split(len(req.image_tokens))
        self._parts_left[req.request_id] = len(parts)
        encodings = []
        for encoder_id, first, end in parts:
            num_tokens = sum(req.image_tokens[first:end])
            encode_s = encode.encode_s(num_tokens)
            start_s = max(now_s, self._free_s.get(encoder_id, 0.0))
            self._free_s[encoder_id] = start_s + encode_s
            landed_s = start_s + encode_s + self.profile.transfer.latency_s
            encodings.append(Encoding(req, encoder_id, encode_s, num_tokens, landed_s))
        return encodings

    def land(self, encoding: Encoding) -> bool:
        """Count the part landed; True when it was its request's last."""
        request_id = encoding.request.request_id
        left = self._parts_left.pop(request_id) - 1
        if left:
            self._parts_left[request_id] = left
            return False
        return True
