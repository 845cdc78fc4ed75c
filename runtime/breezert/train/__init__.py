"""Training code for the project's own small checkpoints (issue 19): data, codec, LM, export.

Owns: offline training loops, their losses and their resumable state. Must not: be imported by
the serving engine (``breezert.engine``, ``worker``, ``stages``, ``models``, ``server``).
"""
