"""The 15 algorithmic tasks of Delétang et al. 2023 and Ruoss et al. 2023, by their level of
the Chomsky hierarchy (regular, deterministic context-free, context-sensitive); the
interface: base.Task. TASKS is config.task.name's registry for data.source "algorithmic"."""

from transformer.data.chomsky import context_free, context_sensitive, regular
from transformer.data.chomsky.base import Task

TASKS: dict[str, type[Task]] = {**regular.TASKS, **context_free.TASKS, **context_sensitive.TASKS}
