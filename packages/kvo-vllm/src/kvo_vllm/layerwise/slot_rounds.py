"""The worker's side of its buffers' slot gates: the rounds its saves open, and the wait for
a slot to be free before a layer writes it.

A save of a layer opens a round on its slot (``kvo_core.gates``) that ends when the save ends;
parts other consumers announced during the step (a composing connector's remote reads) join
it. Each round the worker opens is a ``SaveRound`` handle: whoever ends the save reports on
that handle, and the wait for a slot finds the worker's own save of the slot by its handle,
not by parsing part names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs

from kvo_core.errors import SlotFailedError, SlotTimeoutError
from kvo_core.gates import SlotGates, SlotKey
from kvo_vllm.layerwise.buffers import LayerBuffer

logger = logging.getLogger(__name__)


@attrs.frozen
class SaveRound:
    """The round a layer's save holds its slot with: its gate part is unique per step and
    layer, so a late report never matches a later round."""

    slot: SlotKey
    part: str


class SlotRounds:
    """Opens and ends the rounds of this worker's saves; waits for slots to be free."""

    def __init__(self, gates: SlotGates, deadline_s: float) -> None:
        self.gates = gates
        self.deadline_s = deadline_s
        self._step = 0
        self._latest_save: dict[SlotKey, SaveRound] = {}
        """Per slot, the last round a save of this worker opened (a slot has one round at a
        time, and every round on a slot is opened by this worker's save)."""

    def new_step(self) -> None:
        """A step begins: parts announced for an earlier step never join this one's rounds."""
        self._step += 1
        self.gates.new_epoch()

    def is_quiet(self, slot: SlotKey) -> bool:
        return self.gates.is_quiet(slot)

    def _round_for(self, buffer: LayerBuffer) -> SaveRound:
        save = SaveRound(slot=buffer.slot, part=f"store:{self._step}:{buffer.layer.index}")
        self._latest_save[buffer.slot] = save
        return save

    def open(self, buffer: LayerBuffer) -> SaveRound:
        """Start the slot's round for this layer's save, taking the parts announced on it in
        this step."""
        save = self._round_for(buffer)
        self.gates.close(save.slot, {save.part}, take_announced=True)
        return save

    def open_each(self, buffers: Sequence[LayerBuffer]) -> list[SaveRound]:
        """``open`` for several buffers, in one lock round trip."""
        saves = [self._round_for(buffer) for buffer in buffers]
        if saves:
            self.gates.close_each([(save.slot, save.part) for save in saves],
                                  take_announced=True)
        return saves

    def done(self, save: SaveRound) -> bool:
        """The save ended; False when the slot was given up on meanwhile (a deadline: the
        buffer may have been overwritten while the save read it)."""
        return self.gates.mark_done(save.slot, save.part)

    def failed(self, save: SaveRound, error: BaseException) -> None:
        self.gates.mark_failed(save.slot, save.part, error)

    def wait_free(self, buffer: LayerBuffer) -> None:
        """Wait until the previous occupant's consumers are done with the slot."""
        try:
            self.gates.wait(buffer.slot, self.deadline_s)
        except SlotFailedError as error:
            # The round is over; the failed consumer's data is poisoned by its own handler.
            logger.warning("kvo layerwise: %s", error)
            self._wait_own_save(buffer.slot)
        except SlotTimeoutError as error:
            logger.error("kvo layerwise: %s; giving up on it", error)
            for part in self.gates.pending(buffer.slot):
                self.gates.mark_failed(buffer.slot, part, error)

    def _wait_own_save(self, slot: SlotKey) -> None:
        """After another part failed the slot's round (a decode's read), let this worker's own
        store save of the slot finish before the slot is overwritten.

        A failed round wakes its waiters at once, but the save may still be reading the
        buffer: overwriting it then would tear the stored value, so the save would have to
        poison its keys, and the next chunk of the same request would find the layer missing
        from the store and fail the request (seen under load: a decode's failed pull turned
        into a prefill error). Bounded by the layer deadline; a save still running then is
        failed (and poisons its own keys) as on a timeout.
        """
        save = self._latest_save.get(slot)
        if save is None:
            return
        limit = time.monotonic() + self.deadline_s
        while save.part in self.gates.pending(slot):
            if time.monotonic() >= limit:
                self.failed(save, SlotTimeoutError(
                    f"store save of slot {slot} still running after {self.deadline_s:g} s"))
                return
            time.sleep(0.0005)
