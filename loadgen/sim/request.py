"""One request inside the simulator: its mutable state, from arrival through prefill,
the KV handover and decode to its finish (``loadgen.sim.worker`` runs it, the cluster
routes it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadgen.sim.worker import SimWorker

__all__ = ["SimRequest"]


class SimRequest:
    """Mutable state of one request inside the simulator."""

    __slots__ = (
        "arrival_s",
        "decode_worker",
        "encode_s",
        "finish_s",
        "generated",
        "hash_ids",
        "held",
        "image_tokens",
        "input_len",
        "max_tokens",
        "num_image_tokens",
        "output_len",
        "predicted_ttft_s",
        "prefill_left",
        "prefill_total",
        "prefill_worker",
        "rejected",
        "request_id",
        "resume",
        "transfer_s",
        "ttft_s",
    )

    def __init__(
        self,
        request_id: str,
        arrival_s: float,
        input_len: int,
        output_len: int,
        max_tokens: int,
        hash_ids: tuple[int, ...],
        image_tokens: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.image_tokens = image_tokens  # each image's placeholders, in prompt order
        self.num_image_tokens = sum(image_tokens)  # of input_len
        self.encode_s = 0.0  # an encode its prefill worker runs before its first chunk
        self.arrival_s = arrival_s
        self.input_len = input_len
        self.output_len = output_len
        self.max_tokens = max_tokens
        self.hash_ids = hash_ids
        self.decode_worker: SimWorker | None = None  # None: colocated
        self.prefill_worker: SimWorker | None = None
        self.transfer_s = 0.0  # the KV pull's duration, once it started
        self.prefill_left = input_len  # tokens still to compute
        self.prefill_total = input_len
        self.held = 0  # KV tokens held on the decode side
        self.generated = 0
        self.resume = False  # re-prefilling after preemption: TTFT already recorded
        self.ttft_s: float | None = None
        self.finish_s: float | None = None
        self.rejected = ""
        self.predicted_ttft_s: float | None = None  # the router's, from arrival
