"""One module per stage: input preparation and the forward pass of that stage only.

Each stage exposes ``run(items, batch) -> StageOutput`` (``breezert.outputs``). Must not: decide
what runs (the scheduler does) or reach into another stage's state beyond the shared
``BatchState``.
"""
