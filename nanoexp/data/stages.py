"""Data stages (curriculum, annealing): from a given optimizer step on, training reads another dataset or mixture.

``data_stages`` lists ``{name, start_training_step, data}``; each stage's ``data`` overrides the ``data`` group's
fields (:func:`nanoexp.config.stage_data`). Without stages the ``data`` group is the one stage.

What makes a switch exact and resumable: stage ``k`` has its own sample order, fixed by its data seed (``seed`` of
its ``data``, by default ``general.seed``) and ``k``, and its own position in it (its consumed samples, kept per stage in checkpoints). Its global batch at a
step is the next ``G`` positions of that order, so it depends on the seed, the stage and the global batch only,
never on the layout or on when the run was interrupted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from nanoexp.config import stage_data

from .loader import Batch, TrainBatches
from .sources import build_datasets

log = logging.getLogger("nanoexp")


@dataclass
class Stage:
    name: Optional[str]   # None: no data_stages, the data group is the one stage
    start_step: int
    cfg: Any              # the run's config with `data` set to this stage's (what build_datasets and check_data read)
    seed: int             # orders this stage's samples
    key: str              # where this stage's data sits in the config, for messages: "data" | "data_stages[1].data"


def data_seed(cfg: Any, data: Any) -> int:
    """The seed of a data config's sample order: its `seed`, or general.seed when it is null."""
    return cfg.general.seed if data.get("seed") is None else data.seed


def stage_seed(seed: int, index: int) -> int:
    """The sample-order seed of stage `index`: a function of (its data seed, index), distinct per stage."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def training_stages(cfg: Any) -> list[Stage]:
    """The stages of a run, in the order they train; without data_stages one stage holding the data group."""
    if not cfg.data_stages:
        return [Stage(None, 1, cfg, data_seed(cfg, cfg.data), "data")]
    stages = []
    for i, stage in enumerate(cfg.data_stages):
        data = stage_data(cfg, stage)
        stages.append(Stage(stage.name, stage.start_training_step, OmegaConf.merge(cfg, {"data": data}),
                            stage_seed(data_seed(cfg, data), i), f"data_stages[{i}].data"))
    return stages


def stage_index(stages: list[Stage], step: int) -> int:
    """Which stage trains optimizer step `step` (the first step is 1)."""
    return max(i for i, stage in enumerate(stages) if stage.start_step <= step)


def stage_spans(stages: list[Stage], last_step: int) -> list[dict]:
    """{name, first_step, last_step} of each stage that ran in a run whose last completed step is `last_step`."""
    spans = []
    for i, stage in enumerate(stages):
        end = stages[i + 1].start_step - 1 if i + 1 < len(stages) else last_step
        if stage.start_step <= last_step:
            spans.append({"name": stage.name, "first_step": stage.start_step, "last_step": min(end, last_step)})
    return spans


class StagedBatches:
    """The training micro-batches of one dp rank across data stages, one optimizer step at a time.

    Holds the :class:`TrainBatches` of the stage being trained and replaces it when a step belongs to the next
    stage. ``consumed_samples`` counts all stages (what a run without stages records); ``stage_consumed_samples``
    is each named stage's own position, where it continues after a resume. A stage entered without a recorded
    position (at its start, or from a checkpoint of a run without stages) starts at (step - its start) * G.
    ``on_stage_start(stage)`` is called whenever a later stage takes over during the run.
    """

    def __init__(self, cfg: Any, global_batch_size: int, dp_rank: int, dp_size: int, first_step: int,
                 consumed_samples: int = 0, stage_consumed_samples: Optional[dict] = None,
                 on_stage_start: Optional[Callable[[Stage], None]] = None):
        self.stages = training_stages(cfg)
        self.named = bool(cfg.data_stages)
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.micro_batch_size = cfg.tokens.micro_batch_size
        self.step = first_step                 # the optimizer step the next next_step() serves
        self.consumed_samples = consumed_samples
        self.stage_consumed_samples = dict(stage_consumed_samples or {})
        self.on_stage_start = on_stage_start
        self.index, self.batches = -1, None
        self.enter(stage_index(self.stages, first_step))

    @property
    def stage(self) -> Stage:
        return self.stages[self.index]

    def start_position(self, index: int) -> int:
        stage = self.stages[index]
        if not self.named:
            return self.consumed_samples
        if stage.name in self.stage_consumed_samples:
            return self.stage_consumed_samples[stage.name]
        return (self.step - stage.start_step) * self.global_batch_size

    def enter(self, index: int) -> None:
        """Make stage `index` the one read from: its datasets, and a loader at its position."""
        if self.batches is not None:
            self.batches.close()
        self.index, stage = index, self.stages[index]
        self.train_set, self.val_set, tokenizer = build_datasets(stage.cfg)
        # model.attention_mask=document: samples carry their documents, cut at the tokenizer's end-of-document id.
        self.eod_id = tokenizer.eod_id if stage.cfg.model.attention_mask == "document" else None
        position = self.start_position(index)
        if self.named:
            self.stage_consumed_samples[stage.name] = position
        self.batches = TrainBatches(self.train_set, self.global_batch_size, self.micro_batch_size, self.dp_rank,
                                    self.dp_size, stage.seed, consumed_samples=position,
                                    prefetch=stage.cfg.data.prefetch, eod_id=self.eod_id,
                                    pin_memory=torch.cuda.is_available())   # asynchronous copies to the GPU

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step, from the stage that trains it."""
        index = stage_index(self.stages, self.step)
        if index != self.index:
            self.enter(index)
            if self.on_stage_start is not None:
                self.on_stage_start(self.stage)
        batches = self.batches.next_step()
        self.step += 1
        self.consumed_samples += self.global_batch_size
        if self.named:
            self.stage_consumed_samples[self.stage.name] = self.batches.consumed_samples
        return batches

    @property
    def last_wait_sec(self) -> float:
        return self.batches.last_wait_sec

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
