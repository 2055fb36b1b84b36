"""The 15 problems of Delétang et al. 2023 and Ruoss et al. 2023, by their level of the
Chomsky hierarchy (regular, deterministic context-free, context-sensitive), on the interface
of data/tasks/problem.py (helpers: base.py). TASKS: the 15, by name; data/tasks/registry.py registers them
with every other generated task; strings.py builds its problems on StringTask."""

from transformer.data.tasks.chomsky import context_free, context_sensitive, regular
from transformer.data.tasks.chomsky.base import StringTask, strings
from transformer.data.tasks.problem import Task

TASKS: dict[str, type[Task]] = {**regular.TASKS, **context_free.TASKS, **context_sensitive.TASKS}

__all__ = ["TASKS", "StringTask", "strings"]
