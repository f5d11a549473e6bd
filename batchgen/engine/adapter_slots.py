"""AdapterSlots: which LoRA adapter sits in which of the `max_loras` device slots, for the scheduler.

An adapter in use by a running request stays in its slot; a slot otherwise goes to a new adapter least
recently used first. The scheduler admits a request only once its adapter has a slot (see
Scheduler._admit); requests behind it may pass meanwhile, so resident adapters keep batching. Once
max_num_seqs newer requests have passed the oldest such request, it reserves the least recently used slot,
whose adapter then gets no new requests until its running ones finish and the slot passes on. Requests
never evict an adapter that running rows need, so slots do not thrash, and a waiting request is served
soon whatever else keeps arriving.
"""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self._free = list(reversed(range(num_slots)))
        self.num_loads = 0

    def slot_of(self, lora_id: int) -> int | None:
        return self._resident.get(lora_id)

    def acquire(self, lora_id: int, busy: set[int]) -> tuple[int, bool] | None:
        """A slot for `lora_id`: (slot, whether the adapter must be loaded into it), taking a free slot or the
        least recently used one whose adapter is not in `busy`; None when every slot is busy."""
        slot = self._resident.get(lora_id)
        if slot is not None:
            self._resident.move_to_end(lora_id)
            return slot, False
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((other for other in self._resident if other not in busy), None)
            if victim is None:
                return None
            slot = self._resident.pop(victim)
        self._resident[lora_id] = slot
        self.num_loads += 1
        return slot, True

    def eviction_candidate(self) -> int | None:
        """The adapter whose slot a waiting request reserves when all are busy: the least recently used."""
        return next(iter(self._resident), None)
