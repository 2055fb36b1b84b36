"""TASKS: every generated task, by its `task.name`: the problem it poses (the interface:
data/tasks/problem.py). A source of generated tasks offers each problem its splits rule can
draw (problem.drawn_by); the conformance test (tests/test_tasks.py) runs over every entry,
under every source and cast that takes it. A new task is a problem class and its line in its
module's PROBLEMS (a module of its own: a line here).

reverse_string and bucket_sort are also the quick start's `reverse` and `sort` (data.source
"synthetic" reads those names as these): one problem each, drawn by another splits rule."""

from transformer.data.tasks import chomsky, strings
from transformer.data.tasks.listops import ListOps
from transformer.data.tasks.problem import Problem

TASKS: dict[str, type[Problem]] = {
    **chomsky.PROBLEMS,  # the 15 of Delétang et al. 2023 (reverse_string, bucket_sort, ...)
    **strings.PROBLEMS,  # copy, duplicates
    "listops": ListOps,  # LRA's ListOps
}
