"""Generated tasks: the seam every task meets (problem.py: a problem drawn into splits by a
splits rule, splits.py, and presented to a model family by a cast, casts.py), the one task
registry (registry.py: TASKS, each task's problem), the problems themselves (chomsky/,
strings.py, listops.py) and the data sources that draw them (generated.py; synthetic.py,
labelled.py, algorithmic.py). The rest of the package enters here."""

from transformer.data.tasks.algorithmic import AlgorithmicSource
from transformer.data.tasks.chomsky import PROBLEMS as CHOMSKY_PROBLEMS
from transformer.data.tasks.labelled import LabelledSource
from transformer.data.tasks.registry import TASKS
from transformer.data.tasks.synthetic import SyntheticSource

__all__ = ["CHOMSKY_PROBLEMS", "TASKS", "AlgorithmicSource", "LabelledSource", "SyntheticSource"]
