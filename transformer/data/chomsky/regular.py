"""The regular tasks of Delétang et al. 2023 (their Table 1, "R")."""

TASKS: dict = {}
