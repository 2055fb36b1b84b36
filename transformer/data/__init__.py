"""Data sources. Every source yields batches as dicts of int32 numpy arrays:

  inputs, targets                          [batch, length] token ids (PAD_ID = 0 pads)
  inputs_positions, targets_positions      position within the segment, 0-based
  inputs_segmentation, targets_segmentation segment id, 0 on padding
"""
