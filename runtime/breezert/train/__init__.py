"""Training code for the embedded default voice (issue 19): teacher data, codec, LM, export.

Owns everything that only runs on a training machine: text sources, teacher synthesis and data
shards (``teacher_data``), the codec training loop with its losses, quantizer updates and
resumable state (``codec_train``), the LM's codes cache and batches (``lm_data``), teacher-forced
forward (``lm_forward``) and training loop (``lm_train``), export in the released checkpoint
layout, the state split into parts for carrying between GPU calls (``state_shards``) and the
one-call ``pipeline``. It lives inside
the ``breezert`` package so that it reuses the model modules and the loader's layout, and it is
installed with the ``train`` extra (``pip install "./runtime[train]"``, which brings the teacher).
Must not: be imported by the serving runtime (engine, worker, stages, models, server, CLI, plugin;
``tests/unit/test_import_graph.py`` fails on such an import); nothing here is imported at
``breezert`` import time.
"""
