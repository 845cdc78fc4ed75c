"""Training code for the embedded default voice (issue 19): teacher data, then codec and LM.

Owns everything that only runs on a training machine: text sources, teacher synthesis, data shards.
It lives inside the ``breezert`` package (``runtime/breezert/train/``) so that it can reuse the
model modules and the loader's checkpoint layout when the codec and LM stages come, and it is
installed with the ``train`` extra (``pip install "./runtime[train]"``), which brings the teacher.
It must not be imported by the serving runtime (engine, worker, stages, server, CLI, plugin):
``tests/unit/test_train_teacher_data.py`` parses every other module and fails on such an
import, and nothing here is imported at ``breezert`` import time.
"""
