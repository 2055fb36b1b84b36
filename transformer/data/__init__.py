"""Data sources. Every source yields batches as dicts of int32 numpy arrays:

  inputs, targets                          [batch, length] token ids (PAD_ID = 0 pads)
  inputs_positions, targets_positions      position within the segment, 0-based
  inputs_segmentation, targets_segmentation segment id, 0 on padding
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SourceArgs:
  """What every data source takes besides its own config section (sources.make_source)."""

  seed: int  # config.seed: the data's shuffles and generated examples
  batch_size: int  # config.train.batch_size: rows per training step over all processes
  eval_examples: int  # config.eval.num_examples: per held-out split (0: all, where allowed)
  workdir: str | None = None  # where a tokenizer trained by the run is kept
