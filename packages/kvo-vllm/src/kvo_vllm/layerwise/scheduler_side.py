"""Scheduler half of the layerwise connector: store prefix hits and the per-step transfer plan.

Per scheduled request and step (``ctx`` tokens computed before the step, ``end`` after it):

- every block of ``[0, ctx)`` is listed for the shared-buffer layers to load again (their
  device copy was overwritten by later layers of the same slot);
- blocks of an external hit (found in the store, not in vLLM's local cache) are listed for
  every layer;
- blocks written by the step are listed to save. A block is saved under its hash once it is
  full and its hash is known; until then under the request's own name. ``stored_hashed``
  counts the leading blocks known to be in the store by hash; a block whose hash arrives
  late (async scheduling) is saved by hash in the next step, right after it was loaded.

vLLM's own prefix cache also depends on the store: the shared-buffer layers of a local hit are
reloaded from it. A store that lost them (a restarted, empty Mooncake master; an eviction; a
poisoned save) would fail such a request's load (``kv_load_failure_policy="fail"``) although a
recompute would do. So a new request's local hit is checked against the store too: from its
first block the store lacks, the blocks are dropped from vLLM's prefix cache (``evict_local``)
and the lookup answers "not yet" (None); vLLM asks again next step and finds the shorter local
hit, and the request recomputes the rest. Blocks whose save a recent step planned count as
present (their save may still be running). A request is deferred this way at most once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvo_vllm.layerwise.keys import (
    StoreKeys,
    hashed_block_name,
    request_block_name,
)
from kvo_vllm.layerwise.metadata import BlockRef, LayerwiseMetadata, RequestTransfers

logger = logging.getLogger(__name__)

_IN_FLIGHT_STEPS = 2
"""Steps whose planned saves may still run when the scheduler plans the next one (async
scheduling overlaps one step's forward with the next step's planning)."""

_UNKNOWN = 1 << 62
"""``stored_hashed`` before a request's first step: clamped to its context then."""


@attrs.define
class SchedulerStats:
    """Prefix lookups in the store since start-up."""

    lookups: int = 0
    hit_requests: int = 0
    hit_tokens: int = 0
    local_hits_dropped: int = 0
    """Requests whose local prefix hit the store could no longer back (module docstring)."""


@attrs.define
class _RequestState:
    request: Any
    stored_hashed: int = _UNKNOWN
    external_tokens: int = 0


class LayerwiseScheduler:
    """Answers vLLM's scheduler-side connector calls for one engine."""

    def __init__(self, *, block_size: int, stored_parts: Sequence[tuple[int, str]],
                 keys: StoreKeys,
                 tp_size: int, engine_id: str, store_exists: Callable[[list[str]], list[bool]],
                 block_ids_of: Callable[[str], list[int]],
                 evict_local: Callable[[Sequence[Any]], int] | None = None) -> None:
        self._block_size = block_size
        self._parts = tuple(stored_parts)
        """(layer index, part) of every cache a block is stored as (``LayerLayout``)."""
        self._keys = keys
        self._tp_size = tp_size
        self._ranked = tuple(keys.for_rank(rank) for rank in range(tp_size))
        self._engine_id = engine_id
        self._exists = store_exists
        self._block_ids_of = block_ids_of
        self._evict_local = evict_local
        """Drops blocks (by vLLM block hash) from vLLM's prefix cache; returns how many."""
        self._requests: dict[str, _RequestState] = {}
        self._recent_saves: deque[set[str]] = deque(maxlen=_IN_FLIGHT_STEPS)
        """Block names saved by hash in the last steps planned (maybe still being saved)."""
        self._deferred: set[str] = set()
        """Requests whose local hit was already cut once (never deferred twice)."""
        self.stats = SchedulerStats()

    # -- prefix hits --------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = _RequestState(request=request)

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` whose every layer, part and rank is stored.

        Whole blocks only, and never the last prompt token: vLLM must compute at least one
        token to sample from. None when part of vLLM's local hit (``num_computed_tokens``) is
        gone from the store: those blocks left vLLM's prefix cache; ask again.
        """
        size = self._block_size
        first = num_computed_tokens // size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // size)
        if num_computed_tokens % size:
            return 0
        check_local = (first > 0 and self._evict_local is not None
                       and request.request_id not in self._deferred)
        local_names = ([hashed_block_name(h) for h in request.block_hashes[:first]]
                       if check_local else [])
        hashes = request.block_hashes[first:last]
        if not local_names and not hashes:
            return 0
        per_block = len(self._parts) * self._tp_size
        try:
            if local_names or len(hashes) == 1:
                present = self._exists(self._keys_of(
                    local_names + [hashed_block_name(h) for h in hashes]))
            else:
                # A fresh prompt misses at its first block: ask for that block's keys alone
                # (a short request; no names or keys made for the rest), then for the rest
                # on a hit.
                present = self._exists(self._keys_of([hashed_block_name(hashes[0])]))
                if all(present):
                    present += self._exists(self._keys_of(
                        [hashed_block_name(h) for h in hashes[1:]]))
        except Exception as error:  # a store outage is a cache miss, not a failed request
            logger.warning("kvo layerwise: store lookup failed, treating as a miss: %s", error)
            return 0

        def stored(position: int) -> bool:
            return all(present[position * per_block:(position + 1) * per_block])

        in_flight = set().union(*self._recent_saves) if local_names else set()
        lost = next((i for i, name in enumerate(local_names)
                     if name not in in_flight and not stored(i)), None)
        if lost is not None:
            assert self._evict_local is not None
            self._deferred.add(request.request_id)
            evicted = self._evict_local(request.block_hashes[lost:first])
            if evicted:
                self.stats.local_hits_dropped += 1
                logger.warning(
                    "kvo layerwise: request %s: %d of its %d locally cached prefix blocks are "
                    "no longer in the store (restarted or evicted); %d dropped from the prefix "
                    "cache, the request recomputes them", request.request_id, first - lost,
                    first, evicted)
                return None
        found = 0
        for position in range(len(local_names), len(local_names) + len(hashes)):
            if (position + 1) * per_block > len(present) or not stored(position):
                break
            found += 1
        self.stats.lookups += 1
        return found * size

    def _keys_of(self, names: Sequence[str]) -> list[str]:
        """Every rank's, layer's and part's key of each block, block by block."""
        return [ranked.key(name, layer, part) for name in names for ranked in self._ranked
                for layer, part in self._parts]

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _RequestState(request=request))
        state.request = request
        state.external_tokens = num_external_tokens
        if num_external_tokens:
            self.stats.hit_requests += 1
            self.stats.hit_tokens += num_external_tokens

    def request_finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._deferred.discard(request_id)

    # -- per-step plan ------------------------------------------------------------------

    def build_metadata(self, scheduler_output: Any) -> LayerwiseMetadata:
        size = self._block_size
        steps = []
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(request_id)
            if state is None:
                raise RuntimeError(
                    f"kvo layerwise: request {request_id!r} was scheduled but never announced "
                    f"to the connector (on_new_request / update_state_after_alloc)")
            ctx = state.request.num_computed_tokens
            steps.append((request_id, state, ctx, ctx + scheduled,
                          self._block_ids_of(request_id)))
        # Blocks this step writes whole. Another request of the same step may already count
        # them as computed (vLLM caches a block when it is allocated); the step's own cache
        # write fills them before attention reads them, and the store has nothing yet.
        written_whole = {block_ids[i] for _, _, ctx, end, block_ids in steps
                         for i in range(-(-ctx // size), end // size)}
        self._recent_saves.append(set())
        plans = [self._plan_request(request_id, state, ctx, end, block_ids, written_whole)
                 for request_id, state, ctx, end, block_ids in steps]
        if plans:
            # Loads and slot waits must happen before the first layer writes its cache, so
            # start_load_kv has to run before the forward on every step with work (vLLM only
            # orders it so for steps it knows have synchronous loads).
            scheduler_output.has_sync_kv_loads = True
        return LayerwiseMetadata(requests=tuple(plans))

    def _plan_request(self, request_id: str, state: _RequestState, ctx: int, end: int,
                      block_ids: list[int], written_whole: set[int]) -> RequestTransfers:
        size = self._block_size
        hashes = state.request.block_hashes
        # Leading blocks in the store by hash. A rollback (preemption, failed load) can only
        # lower it; the first step sets it to the prefix hit, which vLLM only takes by hash.
        stored = min(state.stored_hashed, ctx // size)
        hashable = min(end // size, len(hashes))

        def name(position: int) -> str:
            if position < stored:
                return hashed_block_name(hashes[position])
            return request_block_name(self._engine_id, request_id, position)

        context_blocks = -(-ctx // size)
        shared = tuple(BlockRef(block_ids[i], name(i)) for i in range(context_blocks)
                       if block_ids[i] not in written_whole)
        external: tuple[BlockRef, ...] = ()
        if state.external_tokens:
            begin = (ctx - state.external_tokens) // size
            external = tuple(BlockRef(block_ids[i], hashed_block_name(hashes[i]))
                             for i in range(begin, ctx // size))
            state.external_tokens = 0
        saves = [BlockRef(block_ids[i], hashed_block_name(hashes[i]))
                 for i in range(stored, hashable)]
        self._recent_saves[-1].update(ref.name for ref in saves)
        written = range(max(ctx // size, stored, hashable), -(-end // size))
        saves.extend(BlockRef(block_ids[i], request_block_name(self._engine_id, request_id, i))
                     for i in written)
        state.stored_hashed = max(stored, hashable)
        return RequestTransfers(request_id=request_id, load_every_layer=external,
                                load_shared_layers=shared, save=tuple(saves))
