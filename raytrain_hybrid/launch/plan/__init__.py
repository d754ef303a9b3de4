"""The run's plan, derived without starting anything: which cluster a run joins, the nodes it may
reach, the layout and placement, the worker counts, the input checked, the checks before start,
and the RunPlan that holds them. Imports neither launch.runtime nor launch.records."""
