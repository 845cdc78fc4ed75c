"""One module per stage: input preparation and the forward pass of that stage only.

Each stage is built by the model runner with a ``StageWorker`` (``stages/interface.py``: the
device, the slot table, the KV cache) and its graph runners, and exposes ``run(items) ->
StageOutput`` (``breezert.outputs``). Must not: decide what runs (the scheduler does), import
``breezert.worker``, or reach into another stage's state beyond the shared slot table.
"""
