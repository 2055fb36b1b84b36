"""TASKS: every generated task's problem, one name each (the interface: data/tasks/problem.py). A
source of generated tasks offers each that its splits rule can draw (task.drawn_by); the
conformance test (tests/test_tasks.py) runs over every entry, under every source and cast
that takes it. A new task is a class and a line here.

reverse_string and bucket_sort are also the quick start's `reverse` and `sort` (data.source
"synthetic" reads those names as these): one problem each, drawn by another splits rule."""

from transformer.data.tasks import chomsky, strings
from transformer.data.tasks.listops import ListOps
from transformer.data.tasks.problem import Task

TASKS: dict[str, type[Task]] = {
    **chomsky.TASKS,  # the 15 of Delétang et al. 2023 (reverse_string, bucket_sort, ...)
    **strings.TASKS,  # copy, duplicates
    "listops": ListOps,  # LRA's ListOps
}
