"""The 15 problems of Delétang et al. 2023 and Ruoss et al. 2023, by their level of the
Chomsky hierarchy (regular, deterministic context-free, context-sensitive), on the interface
of data/task.py (helpers: base.py). TASKS: the 15, by name; data/tasks.py registers them
with every other generated task."""

from transformer.data.chomsky import context_free, context_sensitive, regular
from transformer.data.task import Task

TASKS: dict[str, type[Task]] = {**regular.TASKS, **context_free.TASKS, **context_sensitive.TASKS}
