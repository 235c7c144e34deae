"""What the scheduler tells the workers each step: which blocks to load and save.

Plain frozen dataclasses of tuples, strings and ints: vLLM may pickle the metadata to send it to
worker processes, and nothing here holds a reference to scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockRef:
    """One device block and the store name of its content."""

    block_id: int
    name: str


@dataclass(frozen=True)
class RequestTransfers:
    """One scheduled request's transfers for this step.

    ``load_every_layer``: blocks the scheduler took from the store (an external prefix hit);
    every layer loads them. ``load_shared_layers``: the request's whole context before this
    step; layers whose buffer is shared with other layers lost it and load it again.
    ``save``: blocks this step writes (or whose hash became known), saved after each layer.
    """

    request_id: str
    load_every_layer: tuple[BlockRef, ...] = ()
    load_shared_layers: tuple[BlockRef, ...] = ()
    save: tuple[BlockRef, ...] = ()


@dataclass(frozen=True)
class LayerwiseMetadata(KVConnectorMetadata):
    """All scheduled requests' transfers for one engine step."""

    requests: tuple[RequestTransfers, ...] = ()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def loads(self, shared_layer: bool) -> list[BlockRef]:
        """The blocks one layer loads, each device block once."""
        chosen: dict[int, BlockRef] = {}
        for request in self.requests:
            for ref in request.load_every_layer:
                chosen.setdefault(ref.block_id, ref)
            if shared_layer:
                for ref in request.load_shared_layers:
                    chosen.setdefault(ref.block_id, ref)
        return list(chosen.values())

    def saves(self) -> list[BlockRef]:
        """The blocks every layer saves, each name once.

        Two requests with the same prefix scheduled in one step compute the same hashed block
        into different device blocks; either copy is right, the store needs one.
        """
        chosen: dict[str, BlockRef] = {}
        for request in self.requests:
            for ref in request.save:
                chosen.setdefault(ref.name, ref)
        return list(chosen.values())
