"""Which pp rank runs which virtual stage. The layers are cut into pp·v contiguous virtual stages, v chunks per
rank, placed one of two ways (a schedule's `placement`, schedules.py):

- "loop" (1f1b, interleaved_1f1b, zb_h1): chunk c of rank r is stage c·pp + r, so a micro-batch goes round the
  ring of ranks v times; the last rank holds the last stage (the final norm, the LM head, the loss).
- "v" (zbv, two chunks): chunk 0 of rank r is stage r and chunk 1 is stage 2·pp − 1 − r: down the ranks and back
  up. Rank 0 holds the first stage and the last (embedding and head on one rank, tied or not), and the last
  rank's two chunks pass the activation and its gradient to each other in memory, without a message.

A message is named by its end on this rank: (verb, "F" | "B", chunk, micro-batch); activations go to the next
stage, gradients to the previous one."""
from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop", "v")


def towards_next(msg) -> bool:
    """Activations go to the next virtual stage, gradients to the previous one."""
    verb, kind = msg[0], msg[1]
    return (verb == "send") == (kind == "F")


@dataclass(frozen=True)
class StageMap:
    pp: int
    v: int = 1
    placement: str = "loop"

    def __post_init__(self):
        if self.placement not in PLACEMENTS or (self.placement == "v" and self.v != 2):
            raise ValueError(f"no {self.placement!r} placement of {self.v} chunks per rank")

    def stage(self, chunk: int, pp_rank: int) -> int:
        """The virtual stage that chunk `chunk` of pp rank `pp_rank` runs."""
        if self.placement == "v" and chunk == 1:
            return 2 * self.pp - 1 - pp_rank
        return chunk * self.pp + pp_rank

    def holder(self, stage: int) -> tuple[int, int]:
        """(pp rank, chunk) running virtual stage `stage`."""
        chunk, rank = divmod(stage, self.pp)
        return (self.pp - 1 - rank, 1) if self.placement == "v" and chunk == 1 else (rank, chunk)

    @property
    def head_rank(self) -> int:
        """The pp rank of the last virtual stage: the final norm, the LM head and the loss."""
        return self.holder(self.pp * self.v - 1)[0]

    def other_end(self, msg, pp_rank: int) -> tuple[int, int] | None:
        """(pp rank, chunk) at the other end of a message of `pp_rank`; None where that stage does not exist
        (nothing comes before the first stage or after the last)."""
        stage = self.stage(msg[2], pp_rank) + (1 if towards_next(msg) else -1)
        return self.holder(stage) if 0 <= stage < self.pp * self.v else None

    def peer(self, msg, pp_rank: int) -> int:
        """The pp rank a message goes to or comes from."""
        return self.other_end(msg, pp_rank)[0]

    def is_local(self, msg, pp_rank: int) -> bool:
        """Whether both ends of an existing message are on `pp_rank` (the tip of the V): handed over in memory."""
        return self.other_end(msg, pp_rank)[0] == pp_rank
