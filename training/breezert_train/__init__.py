"""Training code for the embedded default voice (issue 19): teacher data, codec, LM, export.

Owns everything that only training and its evaluation run: text sources, teacher synthesis and
data shards (``teacher_data``), the codec training loop with its losses, quantizer updates and
resumable state (``codec_train``), the LM's codes cache and batches (``lm_data``), teacher-forced
forward (``lm_forward``) and training loop (``lm_train``), export in the released checkpoint
layout, the state split into parts for carrying between GPU calls (``state_shards``), the
one-call ``pipeline``, the ASR quality gate (``asr_gate``: pocketsphinx transcripts of a
voice offline, streamed and over Opus, scored by ``wer``) and the codec runs' report
(``codec_report``). It is its own distribution,
``breezert-train`` (``training/pyproject.toml``: ``pip install -e ./training``, which brings the
teacher and the ASR; ``make test`` installs it, ``make run`` does not), and reuses the runtime's
model modules and the loader's layout through ``breezert[engine]``.
Must not: be imported by the runtime or the plugin (``tests/unit/test_import_graph.py`` fails on
such an import).
"""
