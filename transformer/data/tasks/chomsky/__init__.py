"""The 15 problems of Delétang et al. 2023 and Ruoss et al. 2023, by their level of the
Chomsky hierarchy (regular.py, context_free.py, context_sensitive.py; helpers: base.py), on
the interface of data/tasks/problem.py. PROBLEMS: the 15, by task name (each level's PROBLEMS
merged), which data/tasks/registry.py registers with every other task; strings.py builds its
problems on StringProblem."""

from transformer.data.tasks.chomsky import context_free, context_sensitive, regular
from transformer.data.tasks.chomsky.base import StringProblem, strings
from transformer.data.tasks.problem import Problem

PROBLEMS: dict[str, type[Problem]] = {**regular.PROBLEMS, **context_free.PROBLEMS,
                                      **context_sensitive.PROBLEMS}

__all__ = ["PROBLEMS", "StringProblem", "strings"]
