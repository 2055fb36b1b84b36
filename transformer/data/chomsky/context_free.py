"""The deterministic context-free tasks of Delétang et al. 2023 (their Table 1, "DCF")."""

import dataclasses

import numpy as np

from transformer.data.chomsky.base import Task, strings
from transformer.fields import Range, check_ranges


@dataclasses.dataclass(frozen=True)
class ReverseString(Task):
  """s_1 … s_n → s_n … s_1 (the papers: binary strings)."""

  name: str = "reverse_string"
  num_symbols: int = 2

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, num_symbols=Range(2))

  @property
  def input_size(self) -> int:
    return self.num_symbols

  @property
  def output_size(self) -> int:
    return self.num_symbols

  def output_length(self, n: int) -> int:
    return n

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    return s, s[::-1].copy()


TASKS = {"reverse_string": ReverseString}
